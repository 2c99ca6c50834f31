"""Embedding worker: buffers id features, looks embeddings up on the PS shards, returns gradients.

Handlers (see ``docs/protocol.md``): ``ew.ingest`` (queue group), ``ew.lookup_direct`` (queue
group), ``ew.<worker>.lookup``, ``ew.<worker>.grad``, ``ew.<worker>.info``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from nats.aio.client import Client as NATS
from persia_nats.common.batch import BatchSchema
from persia_nats.common.config import EmbeddingConfig, GlobalConfig
from persia_nats.common.discovery import discover_replica_size
from persia_nats.common.errors import BadRequest, Busy, InProgress, NotFound, RemoteError, describe
from persia_nats.common.messages import (
    BatchBounds,
    Empty,
    EwLookup,
    EwLookupReply,
    GradReply,
    GradRequest,
    InfoReply,
    IngestReply,
    IngestRequest,
    LookupDirectReply,
    PsConfigure,
)
from persia_nats.common.service import DEFAULT_DRAIN_TIMEOUT, Service
from persia_nats.common.subjects import EMBEDDING_WORKER_QUEUE, Subjects
from persia_nats.core.adjoint import fold
from persia_nats.core.lookup import ReplyParts, assemble, row_requests
from persia_nats.core.plan import (
    BatchPlan,
    gatherable_dims,
    hot_rows,
    make_plan,
    plan_nbytes,
    warm_up,
)
from persia_nats.services.embedding_worker.buffer import RefBuffer
from persia_nats.services.embedding_worker.grad_outcomes import GradOutcome, GradOutcomes
from persia_nats.services.embedding_worker.hot_window import InFlightReads
from persia_nats.services.embedding_worker.hot_window import warm_up as warm_up_hot_window
from persia_nats.services.embedding_worker.ps_client import PsClient

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    """A looked-up training batch waiting for its gradients."""

    plan: BatchPlan
    looked_up_at: float
    #: per dim, the rows returned apart from the pooled sums, whose new values the PS publishes
    hot: dict[int, np.ndarray] | None = None
    #: the widths whose rows were sent gathered: their gradients come per row
    gathered: frozenset[int] = frozenset()


#: how long a resent gradient push waits for the earlier one still in flight, as a share of the request
#: timeout: long enough to answer most with the true outcome, short enough to answer before its sender gives up
GRAD_JOIN_SHARE = 0.5
#: ended gradient pushes remembered, per batch the gradient buffer holds: a resend comes within a few
#: request timeouts of its push, while the buffer turns over at most once per batch
GRAD_OUTCOMES_PER_BATCH = 2

#: a batch's buffered bytes (ids and lookup plan) per byte of ids: 6 for a pooled slot (measured: 8 MB of ids
#: plan into 48 MB); an estimate for refusing early, the plan's real size is what counts
PLAN_BYTES_FACTOR = 6


#: ingest requests that wait for room at once, as a share of ``max_inflight``: each holds a handler slot,
#: and the lookups that free the room need the others
PARKED_SHARE = 0.5
#: ... and their ids' bytes, as a share of ``forward_buffer_bytes`` (they are held on top of the buffer)
PARKED_BYTES_SHARE = 0.125


def _request_nbytes(req: IngestRequest) -> int:
    return sum(f.values.nbytes + f.lengths.nbytes for f in req.features)


class EmbeddingWorkerService(Service):
    role = "embedding-worker"

    def __init__(self, nc: NATS, global_config: GlobalConfig, embedding_config: EmbeddingConfig,
                 replica_index: int = 0, ps_wait_s: float = 120.0) -> None:
        cfg = global_config.embedding_worker_config
        super().__init__(nc, max_inflight=cfg.max_inflight)
        self.gcfg = global_config
        self.ecfg = embedding_config
        # the slots only: any client may publish on ew.ingest, not just a DataCtx that checked them
        self.slot_schema = BatchSchema(embedding_config.slot_names)
        # the bounds the stream loader applies, again here for the batches that come by request
        loader = global_config.data_loader_config
        self.bounds = BatchBounds(loader.max_batch_bytes, loader.max_batch_samples, loader.max_batch_distinct_ids)
        self.subjects = Subjects(global_config.common_config.job_name)
        self.replica_index = replica_index
        self.worker_id = f"{replica_index}-{uuid.uuid4().hex[:8]}"
        self._update_key = secrets.token_bytes(16)
        self._timeout = global_config.nn_worker_config.request_timeout_sec
        self._ps_wait_s = ps_wait_s
        self._wire_dtype = np.dtype(cfg.wire_dtype)  # what the reply's rows and outputs, and gradients, travel as
        bounds = {"max_bytes": cfg.forward_buffer_bytes, "full_expire_s": cfg.buffered_data_full_expired_sec}
        self.ids = RefBuffer[tuple[IngestRequest, BatchPlan]](
            "forward buffer", cfg.forward_buffer_size, cfg.buffered_data_expired_sec,
            sizeof=lambda item: _request_nbytes(item[0]) + plan_nbytes(item[1]), **bounds)
        self.pending = RefBuffer[_Pending]("gradient buffer", cfg.forward_buffer_size, cfg.buffered_data_expired_sec,
                                           sizeof=lambda p: plan_nbytes(p.plan), **bounds)
        # flow control: an ingest that finds the buffer full waits for room (up to the wait its sender
        # allows), so its bytes cross the wire once; at most this many, holding at most these bytes
        self.max_parked = int(cfg.max_inflight * PARKED_SHARE)
        self.max_parked_bytes = int(cfg.forward_buffer_bytes * PARKED_BYTES_SHARE)
        self.parked = 0
        self.parked_bytes = 0
        self._closing = False
        self.ps: PsClient | None = None
        # figures for logs and metrics
        self.counters: Counter[str] = Counter()
        self.nan_skipped: Counter[str] = Counter()
        self.max_staleness = 0
        #: the gradient pushes in flight and recently ended, so that a resend learns the true outcome
        #: refs being looked up, so that a resend of the lookup waits for it rather than find the ref gone
        self._looking_up: dict[int, asyncio.Event] = {}
        self.grad_outcomes = GradOutcomes(max(GRAD_OUTCOMES_PER_BATCH * cfg.forward_buffer_size, 64), self.counters)
        self._hot_min_count = cfg.hot_row_min_count
        #: reads of the training batches in flight, which choose the hot rows unless a count is set
        self.in_flight = InFlightReads(cfg.forward_buffer_size, cfg.buffered_data_expired_sec) \
            if cfg.hot_row_min_count is None else None

    @property
    def staleness(self) -> int:
        """Batches looked up for training whose gradients have not been applied yet: waiting for them, or
        being applied (a push held up by a paused PS is as stale as one not sent)."""
        return len(self.pending) + self.grad_outcomes.in_flight

    async def start(self) -> None:
        took = await asyncio.to_thread(warm_up)
        if self.in_flight is not None:
            took += await asyncio.to_thread(warm_up_hot_window)
        log.info("embedding worker %s: pooling kernels ready in %.1f s", self.worker_id, took)
        size = await discover_replica_size(self.nc, self.subjects, self._timeout, self._ps_wait_s)
        self.ps = PsClient(self.nc, self.subjects, size, self._timeout, counters=self.counters)
        # the PSs then serve only these widths: a table for any other would reserve memory for nothing
        await self.ps.configure(PsConfigure(dims=tuple(sorted({s.dim for s in self.ecfg.slots_config.values()}))))
        s = self.subjects
        await self.rpc.add(s.ew_ingest(), self._on_ingest, queue=EMBEDDING_WORKER_QUEUE, request=IngestRequest)
        await self.rpc.add(s.ew_lookup_direct(), self._on_lookup_direct, queue=EMBEDDING_WORKER_QUEUE,
                           request=IngestRequest)
        await self.rpc.add(s.ew_lookup(self.worker_id), self._on_lookup, request=EwLookup)
        await self.rpc.add(s.ew_grad(self.worker_id), self._on_grad, request=GradRequest)
        await self.rpc.add(s.ew_info(self.worker_id), self._on_info, request=Empty)
        await self.rpc.add(s.ew_replica_info(self.replica_index), self._on_info, request=Empty)
        await self.serve_status(s.status(), self.replica_index, self.worker_id)
        log.info("embedding worker %s serving with %d PS replicas", self.worker_id, size)

    # -- handlers -------------------------------------------------------------------------------

    async def _on_ingest(self, req: IngestRequest) -> IngestReply:
        self.slot_schema.check_slots([f.name for f in req.features])
        try:
            # before anything is planned or buffered: each distinct id of the batch may become a PS row
            self.bounds.check_bytes(_request_nbytes(req), "features")
            self.bounds.check(req.features)
        except BadRequest:
            self.counters["ingest_refused_bounds"] += 1
            raise
        try:
            # before planning: a batch refused now is neither planned twice nor planned only to be refused
            await self._room_for(req, min(PLAN_BYTES_FACTOR * _request_nbytes(req), self.ids.max_bytes or 0))
            # planned now: unknown slots are refused at once, and the lookup finds the plan made
            ref = self.ids.put((req, make_plan(req.features, self.ecfg)))
        except Busy:
            self.counters["ingest_refused_busy"] += 1
            raise
        self.counters["ingested"] += 1
        return IngestReply(self.worker_id, ref)

    async def _room_for(self, req: IngestRequest, estimate: int) -> None:
        """Return once the forward buffer has room for ``req``, holding the request up to its ``wait``
        (instead of "busy", which would make the sender send the whole batch again); Busy when the
        sender allows no wait, too many requests wait already, the wait runs out, or the worker stops."""
        try:
            self.ids.ensure_room(estimate)
            return
        except Busy as exc:
            nbytes = _request_nbytes(req)
            if not req.wait or self._closing:
                raise
            if self.parked >= self.max_parked or self.parked_bytes + nbytes > self.max_parked_bytes:
                raise Busy(f"{exc.description}; {self.parked} requests ({self.parked_bytes} bytes) already wait "
                           "for room") from None
        self.parked += 1
        self.parked_bytes += nbytes
        self.counters["ingest_waited"] += 1
        try:
            await self.ids.wait_for_room(estimate, req.wait,
                                         give_up=lambda: "the worker is stopping" if self._closing else None)
        finally:
            self.parked -= 1
            self.parked_bytes -= nbytes

    async def stop(self, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT) -> None:
        # requests waiting for room are answered Busy now, so their senders try another worker at once
        self._closing = True
        self.ids.wake()
        await super().stop(drain_timeout)

    async def _on_lookup(self, msg: EwLookup) -> EwLookupReply:
        """Look a batch up. A resend (its sender timed out while a PS was paused) waits for the lookup in
        flight up to half the request timeout (425 past it), then is answered from the batch it left: the
        buffered one again when that lookup failed, the one awaiting gradients (looked up again) when it
        was for training. A 404 to it would make the NN rank give the batch up while the first lookup's
        reservation stayed behind, stale until it expired."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self._timeout * GRAD_JOIN_SHARE
        while msg.ref not in self.ids:
            looking = self._looking_up.get(msg.ref)
            if looking is None:
                if msg.train and msg.ref in self.pending:
                    return await self._lookup_again(msg)
                break  # the pop below answers 404
            left = end - loop.time()
            if left <= 0:
                self.counters["lookup_resends_in_progress"] += 1
                raise InProgress(f"batch ref {msg.ref}: an earlier lookup of it is still running; ask again")
            self.counters["lookup_resends_waited"] += 1
            try:
                await asyncio.wait_for(looking.wait(), left)
            except TimeoutError:
                pass
        ended = self._looking_up[msg.ref] = asyncio.Event()
        try:
            return await self._lookup_buffered(msg)
        finally:
            del self._looking_up[msg.ref]
            ended.set()

    async def _lookup_again(self, msg: EwLookup) -> EwLookupReply:
        """A training batch's lookup answered again (its first reply was lost to a timeout): it stays where it
        is, awaiting its gradients; a lookup is a read, and unseen ids were inserted the first time."""
        pending = self.pending.get(msg.ref)
        hot = pending.hot if msg.hot else None
        gather = pending.gathered if msg.gather else frozenset()
        parts = await self._lookup(pending.plan, train=True, hot=hot, gather=gather)
        self.counters["lookup_resends_repeated"] += 1
        return EwLookupReply(msg.ref, parts.embeddings, parts.hot, parts.gathered)

    async def _lookup_buffered(self, msg: EwLookup) -> EwLookupReply:
        ref, train, wants_hot = msg.ref, msg.train, msg.hot
        req, plan = item = self.ids.pop(ref)
        try:
            keep = train and req.requires_grad
            hot = self._hot_rows(plan) if keep and wants_hot else None
            gathered = gatherable_dims(plan) if msg.gather else frozenset()
            if keep:
                # reserve the gradient slot before the lookup so staleness counts this batch at once
                self.pending.put(_Pending(plan, time.monotonic(), hot, gathered), ref=ref)
                self.max_staleness = max(self.max_staleness, self.staleness)
                if self.in_flight is not None:
                    self.in_flight.add(ref, plan)
            try:
                parts = await self._lookup(plan, train=keep, hot=hot, gather=gathered)
            except BaseException:
                if keep:
                    self.pending.pop(ref)
                    self._landed(ref)
                raise
        except BaseException:
            self.ids.restore(ref, item)  # the batch stays claimable: a retry must find it
            raise
        self.counters["looked_up"] += 1
        if parts.gathered:
            self.counters["looked_up_gathered"] += 1
        if parts.hot is not None:
            self.counters["hot_rows"] += sum(g.ids.shape[0] for g in parts.hot.groups)
        return EwLookupReply(ref, parts.embeddings, parts.hot, parts.gathered)

    def _hot_rows(self, plan: BatchPlan) -> dict[int, np.ndarray] | None:
        """The rows of a training lookup to return as hot: by the set count, else from the batches in flight."""
        if self.in_flight is None:
            return hot_rows(plan, self._hot_min_count or 0)
        return self.in_flight.hot(plan)

    def _landed(self, ref: int) -> None:
        """Batch ``ref`` is no longer in flight: its gradients were applied, or its lookup failed."""
        if self.in_flight is not None:
            self.in_flight.remove(ref)

    async def _on_lookup_direct(self, req: IngestRequest) -> LookupDirectReply:
        self.slot_schema.check_slots([f.name for f in req.features])
        plan = make_plan(req.features, self.ecfg)
        self.counters["looked_up_direct"] += 1
        return LookupDirectReply((await self._lookup(plan, train=False)).embeddings)

    async def _lookup(self, plan: BatchPlan, train: bool, hot: Mapping[int, np.ndarray] | None = None,
                      gather: frozenset[int] = frozenset()) -> ReplyParts:
        """The reply's parts (:func:`~persia_nats.core.lookup.assemble`): the slots' outputs as sent, with
        ``hot`` rows apart, and the widths ``gather`` names as their distinct rows."""
        assert self.ps is not None
        requests = row_requests(plan, self._wire_dtype, hot, gather)
        answers = await self.ps.fetch(requests, train)
        parts = assemble(plan, requests, answers, self._wire_dtype, hot, gather)
        for fallback in parts.fallbacks:
            self.counters["float32_fallbacks"] += 1
            log.warning("%s up to %.3g, beyond float16; sent as float32", fallback.what, fallback.peak)
        return parts

    async def _on_grad(self, req: GradRequest) -> GradReply:
        """Apply ``req``. A resend of a push already taken (its sender timed out while the PSs were slow)
        waits for that push up to half the request timeout and answers its true outcome: its reply once
        applied, its error once failed, 425 while it is still in flight; 404 once it failed and the batch
        has left the gradient buffer since."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self._timeout * GRAD_JOIN_SHARE
        joined: GradOutcome | None = None
        while True:
            if joined is not None and joined.error is not None:
                raise type(joined.error)(joined.error.description, joined.error.code)
            if req.ref in self.pending:
                return await self._apply_grads(req)
            outcome = self.grad_outcomes.get(req.ref)
            if outcome is None:
                raise NotFound(f"gradient buffer: no batch with ref {req.ref} (never looked up for training, "
                               "expired, or applied too long ago to be remembered)")
            if outcome.reply is not None:
                self.counters["grad_resends_applied"] += 1
                return outcome.reply
            if outcome.error is not None:
                raise NotFound(f"gradients of batch ref {req.ref} were not applied ({outcome.error}) and the "
                               "batch has left the gradient buffer since")
            left = end - loop.time()
            if left <= 0:
                self.counters["grad_resends_in_progress"] += 1
                raise InProgress(f"gradients of batch ref {req.ref}: an earlier push of them is still being "
                                 "applied; ask again")
            if joined is None:
                self.counters["grad_resends_joined"] += 1
            joined = outcome
            try:
                await asyncio.wait_for(outcome.ended.wait(), left)
            except TimeoutError:
                pass

    async def _apply_grads(self, req: GradRequest) -> GradReply:
        pending = self.pending.pop(req.ref)
        outcome = self.grad_outcomes.begin(req.ref)
        assert self.ps is not None
        try:
            folded = fold(pending.plan, req, pending.gathered, self._wire_dtype)
            # the id lets a replica that already applied this batch's part skip it on a retry
            update_id = self._update_id(req.ref)
            missing = await self.ps.update(pending.plan.distinct, folded.grads, update_id, publish=pending.hot,
                                           batch=f"{self.worker_id}.{req.ref}",
                                           scales=folded.scales) if folded.grads else 0
        except BaseException as exc:
            self.pending.restore(req.ref, pending)  # the NN worker retries; nothing is dropped or doubled
            self.grad_outcomes.failed(outcome, exc if isinstance(exc, RemoteError) else RemoteError(
                f"gradients of batch ref {req.ref} were not applied: {describe(exc)}"))
            raise
        for name in folded.skipped:
            self.nan_skipped[name] += 1
            log.warning("skipped non-finite gradient of slot %s (batch ref %d)", name, req.ref)
        self._landed(req.ref)
        self.counters["grads_applied"] += 1
        self.counters["grad_ids_missing"] += missing
        reply = GradReply(req.ref, folded.skipped, missing)
        self.grad_outcomes.applied(outcome, reply)
        return reply

    def _update_id(self, ref: int) -> str:
        """The PS's idempotency key for ref's gradients: the same on a retry, unguessable by anyone else.

        Refs are public and sequential, so ``worker.ref`` alone could be claimed in advance, making every
        real update a "duplicate" the PS skips. A keyed hash of the ref (the key never leaves this
        process) also stays unguessable for a client that saw earlier ids on ``hot.rows``.
        """
        tag = hashlib.blake2b(str(ref).encode(), key=self._update_key, digest_size=12)
        return f"{self.worker_id}.{ref}.{tag.hexdigest()}"

    def stats(self) -> dict[str, Any]:
        return {"worker": self.worker_id, "staleness": self.staleness, "max_staleness": self.max_staleness,
                "buffered": len(self.ids), "buffered_bytes": self.ids.nbytes + self.pending.nbytes, **self.counters,
                "nan_skipped": sum(self.nan_skipped.values()), "expired": self.ids.expired + self.pending.expired}

    async def _on_info(self, _req: Empty) -> InfoReply:
        return InfoReply({**self.stats(), "nan_skipped_by_slot": dict(self.nan_skipped),
                          "counters": dict(self.counters)})
