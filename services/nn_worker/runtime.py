"""The NN worker's asyncio side: receives batches, looks embeddings up ahead, returns gradients.

The pipeline keeps the user's training thread busy: while batch i trains, batches i+1.. are
looked up, bounded by the staleness permits (PERSIA's ``embedding_staleness``): a permit is taken
before a batch's lookup and released only when the embedding worker confirms its gradients were
applied by the PS. ``staleness`` (looked up minus applied, for this rank) is tracked and exposed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from nats.aio.client import Client as NATS
from persia_nats.common.acks import AckKeeper, nak_payload
from persia_nats.common.batch import BatchSchema
from persia_nats.common.codec import pack, unpack_message
from persia_nats.common.dead import dead_letter_from_stream
from persia_nats.common.discovery import Registration, register
from persia_nats.common.errors import BadRequest, Busy, Conflict, NoResponders, NotFound, PersiaError, RequestTimeout
from persia_nats.common.messages import (
    BatchRef,
    Empty,
    EwLookup,
    EwLookupReply,
    GradReply,
    GradRequest,
    HotGrads,
    HotGradsGroup,
    HotPart,
    HotRows,
    IngestReply,
    IngestRequest,
    LookupDirectReply,
    NamedArray,
    NNBatch,
    NNCheckpointReply,
    NNEnd,
    NNInfoReply,
    Ok,
    RendezvousReply,
    RendezvousRequest,
    SlotEmbedding,
    SlotGradient,
    StatusReply,
    StreamAck,
    TrainedNotice,
)
from persia_nats.common.messages.batches import MAX_WAIT_S
from persia_nats.common.optim_config import OptimizerConfig
from persia_nats.common.rpc import RpcServer, request, request_with_retry
from persia_nats.common.service import close_connection
from persia_nats.common.subjects import EMBEDDING_WORKER_QUEUE, Subjects
from persia_nats.services.nn_worker.hot_rows import DEFAULT_MAX_BYTES, RowMirror, hot_row_grads

log = logging.getLogger(__name__)


class EndOfStream:
    """Sentinel: every loader has finished and every batch it sent was handed out."""


END = EndOfStream()


@dataclass(slots=True, kw_only=True)
class TrainingBatch:
    """A batch with its embeddings, ready for the dense model (PERSIA's PersiaTrainingBatch)."""

    batch_id: int
    non_id: tuple[NamedArray, ...]
    labels: tuple[NamedArray, ...]
    embeddings: tuple[SlotEmbedding, ...]
    requires_grad: bool
    meta: bytes | None = None
    ref: BatchRef | None = None
    #: the staleness permit its lookup took (training batches of a gated pipeline); released once its
    #: gradients are applied or it is given up, whichever path gets there
    permit: Permit | None = None
    batch_size: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    #: set for a batch from the ingestion stream: acknowledged once its gradients are applied
    ack: StreamAck | None = None
    #: hot rows returned apart from ``embeddings``, added by :meth:`Pipeline.next` just before training
    hot: HotPart | None = None

    def consume_all_meta_data(self) -> bytes | None:
        meta, self.meta = self.meta, None
        return meta


@dataclass(frozen=True, slots=True, kw_only=True)
class GradPush:
    """One batch's embedding gradients on their way back to the embedding worker (:meth:`NNRuntime.send_grads`).

    ``grads`` empty: a step that trained nothing (skipped, or ``failed`` with the error its training
    step raised), whose push only gives back what its lookup holds; a stream batch that failed then
    goes to :meth:`NNRuntime.give_up` instead of being acknowledged.

    ``hot``: the batch's hot rows; their gradients are published to every rank first. They are
    computed from ``hot_grads`` where given: per slot, the float32 gradient of the loss scaled by
    ``hot_loss_scale`` (or a row of a shared one, see :func:`hot_row_grads`), slots whose gradient is
    not finite left out; from ``grads`` otherwise.
    """

    ref: BatchRef
    grads: tuple[SlotGradient, ...] = ()
    #: what ``grads`` were multiplied by (the loss scale times the float16 wire scale)
    loss_scale: float = 1.0
    permit: Permit | None = None
    ack: StreamAck | None = None
    batch_id: int = -1
    hot: HotPart | None = None
    hot_grads: Mapping[str, np.ndarray | tuple[np.ndarray, int]] | None = None
    hot_loss_scale: float = 1.0
    failed: str | None = None


#: how long a batch that finds the rank's incoming buffer full waits for room before it is refused
#: (Busy), when its sender says nothing (``NNBatch.wait``, which older senders leave out). A sender
#: that gives a wait has its batch held that long instead, so the batch crosses the wire once: it is
#: answered as soon as the training loop takes a batch, with no polling and no resend.
BATCH_HOLD_S = 0.25
#: batches held at once waiting for room; each holds one of the rank's request slots (64), and
#: nn.end, nn.info and checkpoint requests need the others. Beyond it a batch waits BATCH_HOLD_S.
MAX_BATCHES_WAITING = 32
#: how long a batch readied ahead (:meth:`Pipeline.prefetch`) may wait for the other ranks' hot-row
#: gradients: until the training loop asks for it, then :data:`HOT_GRADS_WAIT_S` more at most
PREFETCH_HOT_WAIT_S = 10.0
#: checkpoint requests waiting at once; all are answered by the same checkpoint
MAX_CHECKPOINT_REQUESTS = 16
#: how long, at most, a batch's hand-off waits for the other ranks' hot-row gradients of the step just
#: finished (see :meth:`NNRuntime.hot_grads_caught_up`)
HOT_GRADS_WAIT_S = 0.05


class StalenessGate:
    """At most ``bound`` batches looked up but not yet applied (None = unbounded, async mode)."""

    def __init__(self, bound: int | None) -> None:
        if bound is not None and bound < 1:
            raise ValueError(f"embedding staleness must be >= 1 or None, got {bound}")
        self.bound = bound
        self._sem = asyncio.Semaphore(bound) if bound else None
        self.inflight = 0
        self.max_inflight = 0

    async def acquire(self) -> Permit:
        """A permit for one batch, once fewer than ``bound`` are out; the batch carries it until
        :meth:`Permit.release`."""
        if self._sem is not None:
            await self._sem.acquire()
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        return Permit(self)

    def _give_back(self) -> None:
        self.inflight -= 1
        if self._sem is not None:
            self._sem.release()


class Permit:
    """One batch's place under its gate's staleness bound.

    Several paths end a batch (its gradients applied or failed, an empty push for a skipped or failed
    step, a failed or cancelled lookup), and more than one can be reached for the same batch; a second
    release giving the place back again would let the bound drift upwards unnoticed, so only the first
    one counts.
    """

    __slots__ = ("_gate",)

    def __init__(self, gate: StalenessGate) -> None:
        self._gate: StalenessGate | None = gate

    @property
    def held(self) -> bool:
        return self._gate is not None

    def release(self) -> bool:
        """Give the place back; False, changing nothing, when it was already given back."""
        gate, self._gate = self._gate, None
        if gate is None:
            return False
        gate._give_back()
        return True


def release_permit(permit: Permit | None) -> None:
    if permit is not None:
        permit.release()


class _Incoming(asyncio.Queue):  # type: ignore[type-arg]
    """The batches received and not yet looked up; tells a waiting sender when one leaves."""

    def __init__(self) -> None:
        super().__init__()
        self._taken = asyncio.Event()

    def _get(self) -> NNBatch | EndOfStream:
        self._taken.set()
        return super()._get()  # type: ignore[no-any-return]

    async def wait_for_room(self, limit: int, timeout: float) -> None:
        """Return once fewer than ``limit`` batches are queued, or after ``timeout`` seconds."""
        end = asyncio.get_running_loop().time() + timeout
        await _wait_until(lambda: self.qsize() < limit, self._taken, lambda: end)


async def _wait_until(done: Callable[[], bool], changed: asyncio.Event, deadline: Callable[[], float]) -> bool:
    """Wait until ``done()``, checked again each time ``changed`` is set; False once the loop's clock
    passes ``deadline()`` (read again at each wake-up, so it may be moved meanwhile)."""
    loop = asyncio.get_running_loop()
    while not done():
        left = deadline() - loop.time()
        if left <= 0:
            return False
        changed.clear()
        try:
            await asyncio.wait_for(changed.wait(), left)
        except TimeoutError:
            pass
    return True


@dataclass(frozen=True, slots=True, kw_only=True)
class HotRowSettings:
    """A job with hot rows (``hot_row_min_count`` unset or > 0, not in sync mode): lookups ask for them,
    and every gradient push is announced, with or without hot rows in its batch, so the ranks'
    announcement counts stay their step counts."""

    #: ``nn_worker_config.hot_row_cache_bytes``
    max_bytes: int = DEFAULT_MAX_BYTES
    #: the job's embedding optimizer and weight bound, to apply the gradients still in flight to the
    #: copies; None (an evaluation context) applies none
    optimizer: tuple[OptimizerConfig, float] | None = None


class NNRuntime:
    """Subscriptions and pipeline of one NN rank.

    Quacks like a :class:`~persia_nats.common.service.Service` for :mod:`persia_nats.common.metrics` (``role``,
    ``stats()``, ``rpc``, ``replica_index``); ``observe_call(kind, seconds)``, set by
    :mod:`persia_nats.services.nn_worker.metrics`, times lookups (``lookup``) and gradient pushes (``grad``).
    """

    role = "nn-worker"

    def __init__(self, nc: NATS, subjects: Subjects, *, rank: int, world_size: int, timeout: float,
                 incoming_limit: int = 10, schema: BatchSchema | None = None, max_deliveries: int = 10,
                 hot_rows: HotRowSettings | None = None,
                 reconfigure: Callable[[], Awaitable[Any]] | None = None,
                 checkpoint_enabled: bool = False) -> None:
        """``schema``: what every batch carries (its dense features and labels; the slots are the embedding
        worker's). ``max_deliveries`` (``data_loader_config``): a stream batch whose step failed this
        often is dead-lettered. ``reconfigure`` registers the embedding optimizer on every PS again (a
        training context's), for a PS that restarted. ``checkpoint_enabled``: a training context with
        a checkpoint root; without one, checkpoint requests are refused."""
        self.nc = nc
        self.subjects = subjects
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.incoming_limit = incoming_limit
        self.incoming: _Incoming = _Incoming()
        #: called on the loop once a batch's gradients (and hot-row gradients) are on their way
        self.on_grads_handed_off: Callable[[], None] | None = None
        self._hot_give_up_at = 0.0  # when the wait for other ranks' hot-row gradients in progress ends
        self._received = 0
        self._batches_waiting = 0
        self._loader_ends: dict[int, int] = {}
        self._loader_size: int | None = None
        self._ended = False
        self._subs: list[Any] = []
        self.counters: Counter[str] = Counter()
        #: gauges the training script reports (EmbeddingCtx.report) or the DataLoader keeps (samples_per_second)
        self.figures: dict[str, float] = {}
        #: the loss of the latest backward(), a tensor read only when scraped (no device sync per step)
        self.last_loss: Any = None
        self._grad_tasks: set[asyncio.Task[None]] = set()
        #: the training DataLoader's staleness gate, for status replies (:meth:`serve_loader`)
        self.gate: StalenessGate | None = None
        self.reconfigure = reconfigure
        #: on-demand checkpoint requests waiting for the next step boundary (rank 0)
        self.checkpoint_requests: list[asyncio.Future[str]] = []
        self.checkpoint_enabled = checkpoint_enabled
        self._loop = asyncio.get_running_loop()
        #: keeps the stream from redelivering batches this rank holds (see persia_nats.common.acks)
        self.ack_keeper = AckKeeper(nc)
        self.observe_call: Callable[[str, float], None] | None = None
        self.registration: Registration | None = None
        #: newest copies of hot rows (``embedding_worker_config.hot_row_min_count``)
        self.mirror = RowMirror(hot_rows.max_bytes if hot_rows is not None else DEFAULT_MAX_BYTES,
                                counters=self.counters)
        if hot_rows is not None:
            self.mirror.optimizer = hot_rows.optimizer
        self.hot_rows = hot_rows is not None
        self._hot_sent = 0
        self._hot_arrived = asyncio.Event()
        self.schema = schema if schema is not None else BatchSchema()
        self.max_deliveries = max_deliveries

    def serve_loader(self, *, gate: StalenessGate | None, incoming_limit: int) -> None:
        """A DataLoader starts iterating: its incoming buffer size, and its staleness gate for status replies
        (the batches carry their own permits)."""
        self.gate = gate
        self.incoming_limit = incoming_limit

    @property
    def replica_index(self) -> int:
        return self.rank

    def _observe(self, kind: str, started: float) -> None:
        if self.observe_call is not None:
            try:
                self.observe_call(kind, time.perf_counter() - started)
            except Exception:  # a metrics bug must never break training
                log.exception("could not record the %s latency", kind)

    async def start(self) -> None:
        self.rpc = RpcServer(self.nc)
        # concurrent: each batch waiting for room counts its wait from its own arrival, not from the
        # end of the wait of the batch before it (one at a time, a queue of them would outlast timeouts)
        await self.rpc.add(self.subjects.nn_batch(self.rank), self._on_batch, request=NNBatch)
        await self.rpc.add(self.subjects.nn_end(self.rank), self._on_end, concurrent=False, request=NNEnd)
        await self.rpc.add(self.subjects.nn_info(), self._on_info, request=Empty)
        if self.rank == 0:
            await self.rpc.add(self.subjects.nn_checkpoint(), self._on_checkpoint, request=Empty)
        await self.rpc.add(self.subjects.status(), self._on_status, request=Empty)
        # the PSs' rows and every other rank's gradients; not this rank's own (added to the mirror as
        # they are sent), which a subscription to hot.> would echo back, a message per step
        # none at all without hot rows: a job that never reads the mirror must not fill it
        hot_subjects = (self.subjects.hot_rows_all(), *(self.subjects.hot_grads(r) for r in range(self.world_size)
                                                        if r != self.rank)) if self.hot_rows else ()
        for subject in hot_subjects:
            self._subs.append(await self.nc.subscribe(subject, cb=self._on_hot))
        # $SRV.PING/INFO/STATS list this rank (persia_nats.common.discovery)
        self.registration = await register(self.nc, job=self.subjects.job, role=self.role, replica_index=self.rank,
                                           replica_size=self.world_size, instance=f"nn-{self.rank}", rpc=self.rpc,
                                           status=self.status_map)

    def stats(self) -> dict[str, Any]:
        """Figures for status replies and metrics (``batches``/``samples``: handed to the training loop)."""
        stats: dict[str, Any] = {"world_size": self.world_size, "received": self._received,
                                 "queued": self.incoming.qsize(), "incoming_limit": self.incoming_limit,
                                 "ended": self._ended, **dict(self.counters), **self.figures}
        if self.last_loss is not None:
            stats["train_loss"] = float(self.last_loss)
        if len(self.mirror):
            stats["hot_rows_held"] = len(self.mirror)
        gate = self.gate
        if gate is not None:
            stats.update(staleness=gate.inflight, max_staleness=gate.max_inflight)
            if gate.bound is not None:
                stats["staleness_bound"] = gate.bound
        return stats

    def status_map(self) -> dict[str, Any]:
        return StatusReply(self.role, self.rank, f"nn-{self.rank}", {**self.stats(), **self.rpc.summary()}).to_wire()

    async def _on_status(self, _req: Empty) -> dict[str, Any]:
        return self.status_map()

    async def serve_rendezvous(self, answer: Callable[[RendezvousRequest], RendezvousReply]) -> None:
        async def handler(req: RendezvousRequest) -> RendezvousReply:
            return answer(req)

        await self.rpc.add(self.subjects.nn_rendezvous(), handler, request=RendezvousRequest)

    async def find_rendezvous(self, deadline: float) -> RendezvousReply:
        return RendezvousReply.from_wire(await request_with_retry(
            self.nc, self.subjects.nn_rendezvous(), RendezvousRequest(self.rank), self.timeout, deadline))

    async def _on_checkpoint(self, _req: Empty) -> NNCheckpointReply:
        """Answer once the checkpoint is written, at the training loop's next step boundary."""
        if not self.checkpoint_enabled:
            raise BadRequest("this job has no checkpoint root: set common_config.checkpointing_config."
                             "checkpoint_dir (or PERSIA_CHECKPOINT_DIR) and train with a TrainCtx")
        if len(self.checkpoint_requests) >= MAX_CHECKPOINT_REQUESTS:
            raise Busy(f"{len(self.checkpoint_requests)} checkpoint requests already wait for the next step")
        future: asyncio.Future[str] = self._loop.create_future()
        self.checkpoint_requests.append(future)
        path = await future
        return NNCheckpointReply(path)

    def checkpoint_done(self, path: Any, error: BaseException | None) -> None:
        """Called from the training thread once a checkpoint was attempted."""
        def settle() -> None:
            requests, self.checkpoint_requests = self.checkpoint_requests, []
            for f in requests:
                if f.done():
                    continue
                if path is not None:
                    f.set_result(str(path))
                else:
                    f.set_exception(PersiaError(f"checkpoint failed: {error}"))

        self._loop.call_soon_threadsafe(settle)

    async def _on_info(self, _req: Empty) -> NNInfoReply:
        return NNInfoReply(self.world_size, self.rank)

    async def _on_hot(self, msg: Any) -> None:
        """Rows a PS replica published after an update (``hot.rows.<i>``), or another rank's gradients of
        hot rows (``hot.grads.<rank>``). Either order of a batch's two is right: gradients that arrive
        after their update's rows are known as applied (:meth:`RowMirror.add_pending`)."""
        kind = msg.subject[len(self.subjects.hot()) - 1:].split(".", 1)[0]
        try:
            if kind == "rows":
                self.mirror.on_published(HotRows.from_wire(unpack_message(msg.data)))
            elif kind == "grads":
                self.mirror.on_hot_grads(HotGrads.from_wire(unpack_message(msg.data)))
                self._hot_arrived.set()
            else:
                raise BadRequest(f"unknown hot-row subject {msg.subject!r}")
        except Exception as exc:  # a cache refresh: counted and logged, the next lookup reads the row anyway
            # apart, since a bad publication points at a PS replica and bad gradients at another NN rank
            self.counters["hot_grads_bad" if kind == "grads" else "hot_publications_bad"] += 1
            log.warning("rank %d: ignored a message on %s: %s", self.rank, msg.subject, exc)

    async def _on_batch(self, batch: NNBatch) -> Ok:
        if self._ended:
            raise BadRequest("this NN worker's stream has ended; no more batches are accepted")
        if self.incoming.qsize() >= self.incoming_limit:
            hold = batch.wait if batch.wait and self._batches_waiting < MAX_BATCHES_WAITING else BATCH_HOLD_S
            self._batches_waiting += 1
            self.counters["batches_waited"] += 1
            try:
                await self.incoming.wait_for_room(self.incoming_limit, hold)
            finally:
                self._batches_waiting -= 1
            if self._ended:
                raise BadRequest("this NN worker's stream has ended; no more batches are accepted")
            if self.incoming.qsize() >= self.incoming_limit:
                self.counters["batches_refused_busy"] += 1
                raise Busy(f"NN worker rank {self.rank} buffer is full ({self.incoming_limit} batches)")
        batch = self._admit(batch)
        self.incoming.put_nowait(batch)
        if batch.ack is not None and batch.ack.wait is not None:
            self.ack_keeper.hold(batch.ack.subject, batch.ack.wait)
        self._received += 1
        self._check_end()
        return Ok()

    def _admit(self, batch: NNBatch) -> NNBatch:
        """``batch`` with its dense features and labels in the schema's order; a batch that does not fit is
        refused (BadRequest naming the field), and its ids, buffered by the embedding worker, are let go."""
        try:
            non_id, labels = self.schema.admit(batch.non_id, batch.labels, batch.requires_grad)
        except BadRequest:
            self.counters["batches_refused_schema"] += 1
            task = self._loop.create_task(self._let_go(batch.ref))
            self._grad_tasks.add(task)
            task.add_done_callback(self._grad_tasks.discard)
            raise
        return dataclasses.replace(batch, non_id=non_id, labels=labels)

    async def _let_go(self, ref: BatchRef) -> None:
        """Take a refused batch's ids out of the embedding worker's buffer: a lookup that trains nothing
        (no unseen id is inserted, no gradient is awaited) is the one request that removes them."""
        try:
            await request(self.nc, self.subjects.ew_lookup(ref.worker), EwLookup(ref.ref, train=False, hot=False),
                          self.timeout)
        except Exception as exc:  # they expire after buffered_data_expired_sec anyway
            log.warning("rank %d: ids of refused batch ref %d stay buffered until they expire: %s", self.rank,
                        ref.ref, exc)

    async def _on_end(self, end: NNEnd) -> Ok:
        if end.final:
            # the ingestion stream ended: every batch published before the end marker is trained,
            # so nothing is in flight towards this rank any more
            if not self._ended:
                self._ended = True
                self.incoming.put_nowait(END)
                log.info("rank %d: ingestion stream ended after %d batches", self.rank, self._received)
            return Ok()
        index, size, batches = end.loader_index, end.loader_size, end.batches
        if self._loader_size is not None and size != self._loader_size:
            raise BadRequest(f"end: loader_size {size} disagrees with an earlier {self._loader_size}")
        self._loader_size = size
        self._loader_ends[index] = batches
        self._check_end()
        return Ok()

    def _check_end(self) -> None:
        if self._ended or self._loader_size is None or len(self._loader_ends) < self._loader_size:
            return
        if self._received >= sum(self._loader_ends.values()):
            self._ended = True
            self.incoming.put_nowait(END)
            log.info("rank %d: stream ended after %d batches", self.rank, self._received)

    # -- lookups and gradients ----------------------------------------------------------------------

    async def lookup(self, batch: NNBatch, train: bool) -> tuple[tuple[SlotEmbedding, ...], HotPart | None]:
        """The batch's slot outputs, and the hot rows returned apart from them (None without any)."""
        started = time.perf_counter()
        try:
            raw = await request_with_retry(
                self.nc, self.subjects.ew_lookup(batch.ref.worker), EwLookup(batch.ref.ref, train, self.hot_rows),
                self.timeout, deadline=self.timeout * 4, retry_on=(Busy, RequestTimeout))
        finally:
            self._observe("lookup", started)
        reply = EwLookupReply.from_wire(raw)
        return reply.embeddings, reply.hot

    async def ingest_and_lookup(self, req: IngestRequest) -> tuple[BatchRef, tuple[SlotEmbedding, ...]]:
        """Training on batches that did not come from a data loader (an IterableDataset)."""
        # a full embedding worker holds the request up to half the timeout rather than have it sent again
        held = dataclasses.replace(req, wait=min(self.timeout / 2, MAX_WAIT_S))
        ref = IngestReply.from_wire(await request_with_retry(
            self.nc, self.subjects.ew_ingest(), held, self.timeout,
            deadline=self.timeout * 4, retry_on=(Busy, NoResponders, RequestTimeout))).batch_ref
        started = time.perf_counter()
        try:
            raw = await request(self.nc, self.subjects.ew_lookup(ref.worker), EwLookup(ref.ref, True, self.hot_rows),
                                self.timeout)
        finally:
            self._observe("lookup", started)
        self.counters["batches"] += 1
        self.counters["samples"] += req.batch_size
        reply = EwLookupReply.from_wire(raw)
        return ref, reply.embeddings if reply.hot is None else self.mirror.merge(reply.embeddings, reply.hot)

    async def lookup_direct(self, req: IngestRequest) -> tuple[SlotEmbedding, ...]:
        reply = await request_with_retry(
            self.nc, self.subjects.ew_lookup_direct(), IngestRequest(req.features),
            self.timeout, deadline=self.timeout * 4, retry_on=(Busy, NoResponders, RequestTimeout))
        return LookupDirectReply.from_wire(reply).embeddings

    async def acknowledge(self, ack: StreamAck, batch_id: int, *, trained: bool) -> None:
        """Tell the ingestion stream a batch is trained (``+ACK``) or must be redelivered (``-NAK``)."""
        self.ack_keeper.release(ack.subject)
        try:
            await self.nc.publish(ack.subject, b"+ACK" if trained else nak_payload(ack.delivered))
            await self._notify_trained(ack, batch_id, trained)
        except Exception as exc:  # the stream redelivers after its ack wait: late, never lost
            self.counters["stream_ack_failures"] += 1
            log.warning("could not acknowledge stream batch %d: %s", ack.seq, exc)
            return
        self.counters["stream_acked" if trained else "stream_nacked"] += 1
        if trained and ack.delivered > 1:
            self.counters["stream_redelivered_trained"] += 1

    async def _notify_trained(self, ack: StreamAck, batch_id: int, trained: bool, dead: str | None = None) -> None:
        notice = TrainedNotice(ack.seq, batch_id, self.rank, ack.delivered, trained, dead)
        await self.nc.publish(self.subjects.trained(), pack(notice.to_wire()))

    async def give_up(self, ack: StreamAck, batch_id: int, error: str) -> None:
        """A stream batch whose training step raised ``error``: delivered again, or, once it has failed
        ``max_deliveries`` times, dead-lettered with the error and terminated."""
        if ack.delivered < self.max_deliveries:
            await self.acknowledge(ack, batch_id, trained=False)
            return
        self.ack_keeper.release(ack.subject)
        reason = f"training step failed {ack.delivered} time(s): {error}"
        try:
            await dead_letter_from_stream(self.nc, self.subjects, ack.seq, reason)
            await self.nc.publish(ack.subject, b"+TERM")
            await self._notify_trained(ack, batch_id, False, dead=reason)
        except Exception as exc:  # kept in the stream: it comes back, fails, and is dead-lettered then
            self.counters["dead_letter_failures"] += 1
            log.error("could not dead-letter stream batch %d: %s", ack.seq, exc)
            await self.acknowledge(ack, batch_id, trained=False)
            return
        self.counters["stream_dead_lettered"] += 1
        log.warning("stream batch %d dead-lettered: %s", ack.seq, reason)

    def send_grads(self, push: GradPush) -> None:
        """Push a batch's gradients in the background; its permit is released once the PS has applied
        them (or they failed)."""
        task = asyncio.get_running_loop().create_task(self._send_grads(push))
        self._grad_tasks.add(task)
        task.add_done_callback(self._grad_tasks.discard)

    async def _send_grads(self, push: GradPush) -> None:
        ref, grads, loss_scale, hot = push.ref, push.grads, push.loss_scale, push.hot
        if hot is not None or self.hot_rows:
            entry = {}
            try:
                if hot is not None and push.hot_grads is not None:
                    entry = hot_row_grads(hot, push.hot_grads, push.hot_loss_scale, check_finite=False)
                elif hot is not None:
                    entry = hot_row_grads(hot, {g.name: g.grad for g in grads}, loss_scale)
            except Exception:
                # the gradients still go to the PS, which publishes the rows they update: the ranks
                # only miss the correction until then, where a lost push would stall the job on its permit
                self.counters["hot_grads_failed"] += 1
                log.exception("rank %d: gradients of the hot rows of batch ref %d not computed", self.rank, ref.ref)
                entry = {}
            await self._publish_hot_grads(ref, entry)
        if self.on_grads_handed_off is not None:
            self.on_grads_handed_off()
        subject = self.subjects.ew_grad(ref.worker)
        applied = False
        started = time.perf_counter()
        try:
            msg = GradRequest(ref.ref, grads, loss_scale)
            attempts = 0
            while True:
                attempts += 1
                try:
                    reply = GradReply.from_wire(await request(self.nc, subject, msg, self.timeout))
                    self.counters["grads_applied"] += 1
                    self.counters["grad_ids_missing"] += reply.missing
                    if reply.skipped:
                        self.counters["grad_slots_skipped"] += len(reply.skipped)
                    applied = True
                    return
                except (RequestTimeout, Busy) as exc:
                    if attempts >= 3:
                        raise
                    log.warning("gradient push for ref %d: %s; retrying", ref.ref, exc)
                except NotFound:
                    if attempts > 1:  # the first attempt was applied after all, its reply was lost
                        self.counters["grads_applied"] += 1
                        applied = True
                        return
                    raise
                except Conflict as exc:
                    # a PS that restarted has lost its optimizer: register it again, then retry
                    if attempts >= 3 or self.reconfigure is None:
                        raise
                    log.warning("gradient push for ref %d: %s; registering the optimizer again", ref.ref, exc)
                    self.counters["ps_reconfigured"] += 1
                    await self.reconfigure()
        except Exception as exc:  # nobody awaits this task: an error is reported here or nowhere
            self.counters["grad_failures"] += 1
            self.mirror.forget(f"{ref.worker}.{ref.ref}")  # never applied: it must not correct this rank's rows
            if isinstance(exc, PersiaError):  # an answer from a peer: its message says it all
                log.error("gradients of batch ref %d on worker %s were not applied: %s", ref.ref, ref.worker, exc)
            else:
                log.exception("gradients of batch ref %d on worker %s were not sent", ref.ref, ref.worker)
        finally:
            self._observe("grad", started)
            release_permit(push.permit)
            if push.ack is not None and push.failed is not None:
                await self.give_up(push.ack, push.batch_id, push.failed)
            elif push.ack is not None:
                await self.acknowledge(push.ack, push.batch_id, trained=applied)

    async def _publish_hot_grads(self, ref: BatchRef, entry: Mapping[int, tuple[np.ndarray, np.ndarray]]) -> None:
        """Every rank learns of a batch's hot-row gradients (``entry``: per dim, ids and gradients) before
        the PS publishes the rows they update: this rank at once, the others by a message that goes out
        on this connection ahead of the gradient request."""
        update_id = f"{ref.worker}.{ref.ref}"  # how the embedding worker names the batch's PS update
        self.mirror.add_pending(update_id, entry)
        self._hot_sent += 1
        groups = tuple(HotGradsGroup(dim, ids, g) for dim, (ids, g) in entry.items())
        try:
            await self.nc.publish(self.subjects.hot_grads(self.rank), pack(
                HotGrads(update_id, self.rank, self._hot_sent, groups).to_wire()))
        except Exception as exc:  # the rows then reach the other ranks when the PS publishes them, a little later
            self.counters["hot_grads_unsent"] += 1
            log.warning("rank %d: could not publish the gradients of hot rows: %s", self.rank, exc)

    async def hot_grads_caught_up(self, timeout: float = HOT_GRADS_WAIT_S) -> None:
        """Wait (briefly) until every other rank has announced as many batches' hot-row gradients as this one.

        Ranks step together, so the other ranks' gradients of the step just finished are on their way;
        a batch handed out before they arrive would miss them. A rank that has run out of batches sends
        none, hence the time limit (counted in ``hot_grads_wait_timeouts``).
        """
        if self.world_size < 2 or not self.hot_rows or not self._hot_sent:
            return
        started = self._loop.time()
        self._hot_give_up_at = started + timeout
        try:
            if not await _wait_until(lambda: all(self.mirror.sent_by.get(r, 0) >= self._hot_sent
                                                 for r in range(self.world_size) if r != self.rank),
                                     self._hot_arrived, lambda: self._hot_give_up_at):
                self.counters["hot_grads_wait_timeouts"] += 1
        finally:
            self.counters["hot_grads_wait_us"] += int((self._loop.time() - started) * 1e6)

    def hurry_hot_grads(self, timeout: float = HOT_GRADS_WAIT_S) -> None:
        """End the wait of :meth:`hot_grads_caught_up` in progress at most ``timeout`` seconds from now."""
        self._hot_give_up_at = min(self._hot_give_up_at, self._loop.time() + timeout)
        self._hot_arrived.set()  # the waiter reads its deadline again

    async def flush_grads(self) -> None:
        while self._grad_tasks:
            await asyncio.gather(*list(self._grad_tasks), return_exceptions=True)

    async def close(self) -> None:
        # a checkpoint asked for after the last training step would otherwise wait for a step that never comes
        for f in self.checkpoint_requests:
            if not f.done():
                f.set_exception(Conflict("training ended before the next step boundary: no checkpoint was taken"))
        self.checkpoint_requests = []
        await self.flush_grads()
        await self.ack_keeper.close()
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs = []
        if self.registration is not None:
            await self.registration.stop()
        await self.rpc.drain(5)
        await close_connection(self.nc)


class Pipeline:
    """Looks up ahead of the training thread; hands batches out in arrival order."""

    def __init__(self, runtime: NNRuntime, *, gate: StalenessGate | None, forward_buffer_size: int,
                 train: bool, on_demand: bool = False) -> None:
        self.runtime = runtime
        self.gate = gate
        self.train = train
        self.ready: asyncio.Queue[asyncio.Task[TrainingBatch | None] | EndOfStream] = asyncio.Queue()
        # a lookup starts only with room for its result: at most forward_buffer_size batches are
        # looked up ahead of the one the training loop holds, so none is read earlier than needed
        self._room = asyncio.Semaphore(forward_buffer_size)
        # sync mode: look a batch up only when the training loop asks for it, never ahead
        self._demand: asyncio.Queue[None] | None = asyncio.Queue() if on_demand else None
        self._fetcher = asyncio.get_running_loop().create_task(self._fetch_loop())
        # the next batch is readied while the training thread all-reduces and steps: once a batch's
        # gradients are handed off, everything the next one must include has been sent (sync mode
        # looks up on demand, after the step, so it gains nothing)
        self._prefetched: asyncio.Task[TrainingBatch | EndOfStream] | None = None  # not yet asked for
        self._taking: asyncio.Task[TrainingBatch | EndOfStream] | None = None  # the one next() awaits
        self._finished = False
        if train and not on_demand:
            runtime.on_grads_handed_off = self.prefetch

    def prefetch(self) -> None:
        """Start readying the next batch for the training loop (see :meth:`next`)."""
        # never beside a batch being taken: two at once would each wait as if the other were not there
        if self._prefetched is None and (self._taking is None or self._taking.done()) and not self._finished:
            self._prefetched = asyncio.get_running_loop().create_task(self._next())

    async def _fetch_loop(self) -> None:
        while True:
            if self._demand is not None:
                await self._demand.get()
            await self._room.acquire()
            item = await self.runtime.incoming.get()
            if isinstance(item, EndOfStream):
                self.ready.put_nowait(END)
                return
            permit = await self.gate.acquire() if self.train and item.requires_grad and self.gate is not None \
                else None
            task = asyncio.get_running_loop().create_task(self._lookup(item, permit))
            self.ready.put_nowait(task)

    async def _lookup(self, batch: NNBatch, permit: Permit | None) -> TrainingBatch | None:
        try:
            embeddings, hot = await self.runtime.lookup(batch, train=self.train)
        except PersiaError as exc:
            release_permit(permit)
            self.runtime.counters["lookup_failures"] += 1
            log.error("batch %d could not be looked up on worker %s: %s", batch.batch_id, batch.ref.worker, exc)
            if batch.ack is not None:  # the stream redelivers it now rather than after its ack wait
                await self.runtime.acknowledge(batch.ack, batch.batch_id, trained=False)
            return None
        except BaseException:  # cancelled, or a bug: no gradient push will ever give it back
            release_permit(permit)
            raise
        return TrainingBatch(batch_id=batch.batch_id, non_id=batch.non_id, labels=batch.labels, embeddings=embeddings,
                             requires_grad=batch.requires_grad, meta=batch.meta, ref=batch.ref, permit=permit,
                             batch_size=batch.batch_size, ack=batch.ack, hot=hot)

    async def next(self) -> TrainingBatch | EndOfStream:
        """The next looked-up batch, skipping (counted) batches whose lookup failed.

        Its hot rows are added now, as of the gradients sent so far by every rank, or as of the
        moment the previous batch's gradients were handed off when that readied it ahead (:meth:`prefetch`).
        """
        task, self._prefetched = self._prefetched, None
        if task is None:
            task = asyncio.get_running_loop().create_task(self._next())
        elif not task.done():
            self.runtime.hurry_hot_grads()
        self._taking = task
        started = time.perf_counter()
        try:
            return await task
        finally:
            self._taking = None
            # how long the training loop waited for its batch: what buffering and prefetching did not hide
            self.runtime.counters["train_wait_us"] += int((time.perf_counter() - started) * 1e6)

    async def _next(self) -> TrainingBatch | EndOfStream:
        while True:
            if self._demand is not None:
                self._demand.put_nowait(None)
            item = await self.ready.get()
            if isinstance(item, EndOfStream):
                self._finished = True
                return item
            result = await item
            self._room.release()
            if result is None:
                continue
            if result.hot is not None:
                # a batch readied ahead that the loop has not asked for yet waits for the other ranks'
                # hot-row gradients at no cost, so that wait is not cut short
                ahead = asyncio.current_task() is self._prefetched
                try:
                    await self.runtime.hot_grads_caught_up(PREFETCH_HOT_WAIT_S if ahead else HOT_GRADS_WAIT_S)
                except BaseException:  # cancelled: the batch never reaches the loop
                    release_permit(result.permit)
                    raise
                # now rather than at lookup: the rows every batch updates are read as of this step
                # (``hot`` stays: the batch's hot-row gradients are published from it)
                result.embeddings = self.runtime.mirror.merge(result.embeddings, result.hot)
            self.runtime.counters["batches"] += 1
            self.runtime.counters["samples"] += result.batch_size
            if result.ack is not None and not (self.train and result.requires_grad):
                # nothing will be applied for it: handing it to the loop is all there is to do
                await self.runtime.acknowledge(result.ack, result.batch_id, trained=True)
            return result

    async def cancel(self) -> None:
        if self.runtime.on_grads_handed_off == self.prefetch:
            self.runtime.on_grads_handed_off = None
        tasks: list[asyncio.Task[Any]] = [t for t in (self._fetcher, self._prefetched) if t is not None]
        while not self.ready.empty():
            item = self.ready.get_nowait()
            if isinstance(item, asyncio.Task):
                tasks.append(item)
        # looked up (or being looked up, or readied ahead) and never handed out: their permits go back
        # with them; one still running gives its own back as it is cancelled
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None \
                    and isinstance(task.result(), TrainingBatch):
                release_permit(task.result().permit)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["END", "EMBEDDING_WORKER_QUEUE", "EndOfStream", "GradPush", "HotRowSettings", "NNRuntime", "Permit",
           "Pipeline", "StalenessGate", "TrainingBatch"]
