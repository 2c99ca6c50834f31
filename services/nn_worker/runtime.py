"""The NN worker's asyncio side: receives batches, looks embeddings up ahead, returns gradients.

The pipeline keeps the user's training thread busy: while batch i trains, batches i+1.. are
looked up, bounded by the staleness permits (PERSIA's ``embedding_staleness``): a permit is taken
before a batch's lookup and released only when the embedding worker confirms its gradients were
applied by the PS. ``staleness`` (looked up minus applied, for this rank) is tracked and exposed.

The runtime is composed of small owners, each built once and handed to the ones that need it
(:meth:`NNRuntime.build`): the :class:`~persia_nats.services.nn_worker.inbox.Inbox` (batches sent to
the rank), the :class:`~persia_nats.services.nn_worker.embedding_client.EmbeddingClient` (lookups and
gradient pushes), the :class:`~persia_nats.services.nn_worker.hot_sync.HotRowSync` (the hot-row
copies), the :class:`~persia_nats.services.nn_worker.stream_acks.StreamAcks` (the ingestion stream's
acknowledgements) and the :class:`~persia_nats.services.nn_worker.figures.TrainingFigures`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from persia_nats.common.batch import BatchSchema
from persia_nats.common.discovery import Registration, register
from persia_nats.common.errors import BadRequest, Busy, Conflict, PersiaError
from persia_nats.common.messages import (
    BatchRef,
    Empty,
    GatheredSlots,
    HotPart,
    NamedArray,
    NNBatch,
    NNCheckpointReply,
    NNInfoReply,
    RendezvousReply,
    RendezvousRequest,
    SlotEmbedding,
    StatusReply,
    StreamAck,
)
from persia_nats.common.rpc import RpcServer, request_with_retry
from persia_nats.common.service import close_connection
from persia_nats.common.subjects import EMBEDDING_WORKER_QUEUE, Subjects
from persia_nats.services.nn_worker.account import StreamMark, stream_mark
from persia_nats.services.nn_worker.embedding_client import CallObserver, EmbeddingClient, GradPush
from persia_nats.services.nn_worker.figures import TrainingFigures
from persia_nats.services.nn_worker.hot_sync import HOT_GRADS_WAIT_S, HotRowSettings, HotRowSync
from persia_nats.services.nn_worker.inbox import BATCH_HOLD_S, END, EndOfStream, Inbox
from persia_nats.services.nn_worker.permits import Permit, StalenessGate, release_permit
from persia_nats.services.nn_worker.stream_acks import StreamAcks

log = logging.getLogger(__name__)

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
    #: the widths whose slots came as their distinct rows: their gradients go back per row
    gathered: tuple[GatheredSlots, ...] = ()
    #: ``gathered``'s slots are not in ``embeddings``: the model's device gathers them from ``gathered``'s
    #: rows (float32, hot rows merged; ``nn_worker_config.embedding_gather``)
    gathered_on_device: bool = False

    def consume_all_meta_data(self) -> bytes | None:
        meta, self.meta = self.meta, None
        return meta


#: how long a batch readied ahead (:meth:`Pipeline.prefetch`) may wait for the other ranks' hot-row
#: gradients: until the training loop asks for it, then :data:`HOT_GRADS_WAIT_S` more at most
PREFETCH_HOT_WAIT_S = 10.0
#: checkpoint requests waiting at once; all are answered by the same checkpoint
MAX_CHECKPOINT_REQUESTS = 16

class NNRuntime:
    """Subscriptions and pipeline of one NN rank: the owners it is built with, and the subjects that are
    its own (``status``, ``info``, ``checkpoint``, ``rendezvous``).

    Quacks like a :class:`~persia_nats.common.service.Service` for :mod:`persia_nats.common.metrics` (``role``,
    ``stats()``, ``rpc``, ``replica_index``).
    """

    role = "nn-worker"

    def __init__(self, nc: NATS, subjects: Subjects, *, rank: int, world_size: int, timeout: float,
                 figures: TrainingFigures, acks: StreamAcks, hot: HotRowSync, embeddings: EmbeddingClient,
                 inbox: Inbox, checkpoint_enabled: bool = False) -> None:
        """The owners share ``figures.counters``; :meth:`build` makes them. ``checkpoint_enabled``: a
        training context with a checkpoint root; without one, checkpoint requests are refused."""
        self.nc = nc
        self.subjects = subjects
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.figures = figures
        self.acks = acks
        self.hot = hot
        self.embeddings = embeddings
        self.inbox = inbox
        #: the training DataLoader's staleness gate, for status replies (:meth:`serve_loader`)
        self.gate: StalenessGate | None = None
        #: on-demand checkpoint requests waiting for the next step boundary (rank 0)
        self.checkpoint_requests: list[asyncio.Future[str]] = []
        self.checkpoint_enabled = checkpoint_enabled
        self._loop = asyncio.get_running_loop()
        self.registration: Registration | None = None
        #: where the ingestion stream stood as the run started (rank 0; None without a stream)
        self.stream_mark: StreamMark | None = None
        #: the dense process group is up (see joined_dense_group): nn.info's readiness
        self.rendezvous_done = world_size == 1

    @classmethod
    def build(cls, nc: NATS, subjects: Subjects, *, rank: int, world_size: int, timeout: float,
              incoming_limit: int = 10, schema: BatchSchema | None = None, max_deliveries: int = 10,
              hot_rows: HotRowSettings | None = None, reconfigure: Callable[[], Awaitable[Any]] | None = None,
              checkpoint_enabled: bool = False, observe_call: CallObserver | None = None,
              gather_on_device: bool = False) -> NNRuntime:
        """A rank's runtime and its owners, on the running loop.

        ``schema``: what every batch carries (its dense features and labels; the slots are the embedding
        worker's). ``max_deliveries`` (``data_loader_config``): a stream batch whose step failed this
        often is dead-lettered. ``hot_rows``: the job has hot rows. ``reconfigure`` registers the
        embedding optimizer on every PS again (a training context's), for a PS that restarted.
        ``observe_call(kind, seconds)`` times lookups (``lookup``) and gradient pushes (``grad``)
        (:class:`~persia_nats.services.nn_worker.metrics.CallTimes`). ``checkpoint_enabled``: a
        training context with a checkpoint root. ``gather_on_device``: the pipeline's batches leave their
        gathered widths' slots to the model's device (``nn_worker_config.embedding_gather``).
        """
        figures = TrainingFigures()
        counters = figures.counters
        acks = StreamAcks(nc, subjects, rank=rank, counters=counters, max_deliveries=max_deliveries)
        hot = HotRowSync(nc, subjects, rank=rank, world_size=world_size, counters=counters, settings=hot_rows)
        embeddings = EmbeddingClient(nc, subjects, rank=rank, timeout=timeout, counters=counters, hot=hot, acks=acks,
                                     reconfigure=reconfigure, observe_call=observe_call,
                                     gather_on_device=gather_on_device)
        inbox = Inbox(subjects, rank=rank, counters=counters, embeddings=embeddings, acks=acks, schema=schema,
                      incoming_limit=incoming_limit)
        return cls(nc, subjects, rank=rank, world_size=world_size, timeout=timeout, figures=figures, acks=acks,
                   hot=hot, embeddings=embeddings, inbox=inbox, checkpoint_enabled=checkpoint_enabled)

    @property
    def counters(self) -> Counter[str]:
        """What the rank has counted so far (read it; the owners count)."""
        return self.figures.counters

    def serve_loader(self, *, gate: StalenessGate | None, incoming_limit: int) -> None:
        """A DataLoader starts iterating: its incoming buffer size, and its staleness gate for status replies
        (the batches carry their own permits)."""
        self.gate = gate
        self.inbox.set_limit(incoming_limit)

    @property
    def replica_index(self) -> int:
        return self.rank

    async def start(self) -> None:
        self.rpc = RpcServer(self.nc)
        await self.inbox.start(self.rpc)
        await self.rpc.add(self.subjects.nn_info(), self._on_info, request=Empty)
        if self.rank == 0:
            await self.rpc.add(self.subjects.nn_checkpoint(), self._on_checkpoint, request=Empty)
        await self.rpc.add(self.subjects.status(), self._on_status, request=Empty)
        await self.hot.start()
        if self.rank == 0:  # before registering: no data loader forwards a batch until a rank is listed
            self.stream_mark = await stream_mark(self.nc, self.subjects)
        # $SRV.PING/INFO/STATS list this rank (persia_nats.common.discovery)
        self.registration = await register(self.nc, job=self.subjects.job, role=self.role, replica_index=self.rank,
                                           replica_size=self.world_size, instance=f"nn-{self.rank}", rpc=self.rpc,
                                           status=self.status_map)

    def stats(self) -> dict[str, Any]:
        """Figures for status replies and metrics (``batches``/``samples``: handed to the training loop)."""
        stats: dict[str, Any] = {"world_size": self.world_size, **self.inbox.stats(), **dict(self.figures.counters),
                                 **self.figures.gauges()}
        loss = self.figures.loss()
        if loss is not None:
            stats["train_loss"] = loss
        if len(self.hot.mirror):
            stats["hot_rows_held"] = len(self.hot.mirror)
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
        """Answer once the checkpoint is written: at the training loop's next step boundary, or at once
        while the ranks wait for batches (:meth:`Checkpointer.when_idle
        <persia_nats.services.nn_worker.checkpoint.Checkpointer.when_idle>`)."""
        if not self.checkpoint_enabled:
            raise BadRequest("this job has no checkpoint root: set common_config.checkpointing_config."
                             "checkpoint_dir (or PERSIA_CHECKPOINT_DIR) and train with a TrainCtx")
        if len(self.checkpoint_requests) >= MAX_CHECKPOINT_REQUESTS:
            raise Busy(f"{len(self.checkpoint_requests)} checkpoint requests already wait for the next step")
        future: asyncio.Future[str] = self._loop.create_future()
        self.checkpoint_requests.append(future)
        log.info("checkpoint asked for: taken at the next step boundary, or at once while the ranks wait for "
                 "batches (%d request(s) waiting)", len(self.checkpoint_requests))
        path = await future
        return NNCheckpointReply(path)

    def settle_checkpoint_requests(self, path: Any, error: BaseException | None) -> None:
        """A checkpoint was attempted: answer the requests waiting for one (on the loop; the training thread
        calls :meth:`RankLoop.checkpoint_done <persia_nats.services.nn_worker.rank_loop.RankLoop.checkpoint_done>`)."""
        requests, self.checkpoint_requests = self.checkpoint_requests, []
        for f in requests:
            if f.done():
                continue
            if path is not None:
                f.set_result(str(path))
            else:
                f.set_exception(PersiaError(f"checkpoint failed: {error}"))

    def joined_dense_group(self) -> None:
        """The rendezvous is done and init_process_group returned: from now on nn.info says ready."""
        # a plain bool written once from the training thread: the loop reads it whole, no lock needed
        self.rendezvous_done = True

    async def _on_info(self, _req: Empty) -> NNInfoReply:
        return NNInfoReply(self.world_size, self.rank, self.rendezvous_done)

    async def close(self) -> None:
        # a checkpoint asked for after the last training step would otherwise wait for a step that never comes
        for f in self.checkpoint_requests:
            if not f.done():
                f.set_exception(Conflict("training ended before the next step boundary: no checkpoint was taken"))
        self.checkpoint_requests = []
        await self.embeddings.flush_grads()
        await self.acks.close()
        await self.hot.close()
        if self.registration is not None:
            await self.registration.stop()
        await self.rpc.drain(5)
        await close_connection(self.nc)


class Pipeline:
    """Looks up ahead of the training thread; hands batches out in arrival order."""

    def __init__(self, runtime: NNRuntime, *, gate: StalenessGate | None, forward_buffer_size: int,
                 train: bool, on_demand: bool = False) -> None:
        self._incoming = runtime.inbox.incoming
        self._embeddings = runtime.embeddings
        self._hot = runtime.hot
        self._acks = runtime.acks
        self._counters = runtime.figures.counters
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
        self._ahead: asyncio.Task[None] | None = None
        if train and not on_demand:
            self._ahead = asyncio.get_running_loop().create_task(self._ready_ahead())

    async def _ready_ahead(self) -> None:
        """Ready the next batch each time a batch's gradients are handed off (:meth:`prefetch`)."""
        while True:
            await self._embeddings.handed_off()
            self.prefetch()

    def stop_readying_ahead(self) -> None:
        """Ready no batch before the training loop asks for it (a test's view of the plain path)."""
        if self._ahead is not None:
            self._ahead.cancel()

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
            item = await self._incoming.get()
            if isinstance(item, EndOfStream):
                self.ready.put_nowait(END)
                return
            permit = await self.gate.acquire() if self.train and item.requires_grad and self.gate is not None \
                else None
            task = asyncio.get_running_loop().create_task(self._lookup(item, permit))
            self.ready.put_nowait(task)

    async def _lookup(self, batch: NNBatch, permit: Permit | None) -> TrainingBatch | None:
        try:
            embeddings, hot, gathered = await self._embeddings.lookup(batch, train=self.train)
        except PersiaError as exc:
            release_permit(permit)
            self._counters["lookup_failures"] += 1
            log.error("batch %d could not be looked up on worker %s: %s", batch.batch_id, batch.ref.worker, exc)
            if batch.ack is not None:  # the stream redelivers it now rather than after its ack wait
                await self._acks.acknowledge(batch.ack, batch.batch_id, trained=False)
            return None
        except BaseException:  # cancelled, or a bug: no gradient push will ever give it back
            release_permit(permit)
            raise
        return TrainingBatch(batch_id=batch.batch_id, non_id=batch.non_id, labels=batch.labels, embeddings=embeddings,
                             requires_grad=batch.requires_grad, meta=batch.meta, ref=batch.ref, permit=permit,
                             batch_size=batch.batch_size, ack=batch.ack, hot=hot, gathered=gathered,
                             gathered_on_device=self._embeddings.gather_on_device and bool(gathered))

    async def next(self) -> TrainingBatch | EndOfStream:
        """The next looked-up batch, skipping (counted) batches whose lookup failed.

        Its hot rows are added now, as of the gradients sent so far by every rank, or as of the
        moment the previous batch's gradients were handed off when that readied it ahead (:meth:`prefetch`).
        """
        task, self._prefetched = self._prefetched, None
        if task is None:
            task = asyncio.get_running_loop().create_task(self._next())
        elif not task.done():
            self._hot.hurry()
        self._taking = task
        started = time.perf_counter()
        try:
            return await task
        finally:
            self._taking = None
            # how long the training loop waited for its batch: what buffering and prefetching did not hide
            self._counters["train_wait_us"] += int((time.perf_counter() - started) * 1e6)

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
                    await self._hot.caught_up(PREFETCH_HOT_WAIT_S if ahead else HOT_GRADS_WAIT_S)
                except BaseException:  # cancelled: the batch never reaches the loop
                    release_permit(result.permit)
                    raise
                # now rather than at lookup: the rows every batch updates are read as of this step
                # (``hot`` stays: the batch's hot-row gradients are published from it)
                if result.gathered_on_device:
                    result.embeddings, result.gathered = self._hot.mirror.merge_deferred(
                        result.embeddings, result.hot, result.gathered)
                else:
                    result.embeddings = self._hot.mirror.merge(result.embeddings, result.hot, result.gathered)
            self._counters["batches"] += 1
            self._counters["samples"] += result.batch_size
            if result.ack is not None and not (self.train and result.requires_grad):
                # nothing will be applied for it: handing it to the loop is all there is to do
                await self._acks.acknowledge(result.ack, result.batch_id, trained=True)
            return result

    async def cancel(self) -> None:
        tasks: list[asyncio.Task[Any]] = [t for t in (self._ahead, self._fetcher, self._prefetched) if t is not None]
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


__all__ = ["BATCH_HOLD_S", "END", "EMBEDDING_WORKER_QUEUE", "HOT_GRADS_WAIT_S", "EndOfStream", "GradPush",
           "HotRowSettings", "NNRuntime", "Permit", "Pipeline", "StalenessGate", "TrainingBatch", "release_permit"]
