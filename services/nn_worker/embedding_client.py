"""The NN rank's requests to the embedding workers: lookups, and gradient pushes in the background."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from nats.aio.client import Client as NATS
from persia_nats.common.errors import Busy, Conflict, InProgress, NoResponders, PersiaError, RequestTimeout
from persia_nats.common.messages import (
    BatchRef,
    EwLookup,
    EwLookupReply,
    GatheredSlots,
    GradReply,
    GradRequest,
    HotPart,
    IngestReply,
    IngestRequest,
    LookupDirectReply,
    NNBatch,
    RowGradient,
    SlotEmbedding,
    SlotGradient,
    StreamAck,
)
from persia_nats.common.messages.batches import MAX_WAIT_S
from persia_nats.common.rpc import request, request_with_retry
from persia_nats.common.subjects import Subjects
from persia_nats.core.adjoint import hot_row_grads
from persia_nats.core.lookup import expand, widen
from persia_nats.services.nn_worker.hot_sync import HotRowSync
from persia_nats.services.nn_worker.permits import Permit, release_permit
from persia_nats.services.nn_worker.stream_acks import StreamAcks

log = logging.getLogger(__name__)

#: how long a gradient push waits for the true outcome of an earlier copy still in flight on the embedding
#: worker: request timeouts, plus seconds. That copy ends within its PS requests' two resends after a
#: timeout and the 15 s it waits for a restarting replica; past it the push counts as not applied (logged,
#: ``grad_outcomes_unknown``) and its batch is trained again
GRAD_OUTCOME_WAIT_TIMEOUTS = 4
GRAD_OUTCOME_WAIT_EXTRA_S = 30.0

#: ``observe(kind, seconds)``: how long a lookup (``lookup``) or a gradient push (``grad``) took
CallObserver = Callable[[str, float], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class GradPush:
    """One batch's embedding gradients on their way back to the embedding worker (:meth:`EmbeddingClient.send_grads`).

    ``grads`` empty: a step that trained nothing (skipped, or ``failed`` with the error its training
    step raised), whose push only gives back what its lookup holds; a stream batch that failed then
    goes to :meth:`StreamAcks.give_up` instead of being acknowledged.

    ``hot``: the batch's hot rows; their gradients are published to every rank first. They are
    computed from ``hot_grads`` where given: per slot, the float32 gradient of the loss scaled by
    ``hot_loss_scale`` (or a row of a shared one, see :func:`hot_row_grads`), slots whose gradient is
    not finite left out; from ``grads`` otherwise.
    """

    ref: BatchRef
    grads: tuple[SlotGradient, ...] = ()
    #: what ``grads`` were multiplied by (the loss scale times the float16 wire scale)
    loss_scale: float = 1.0
    #: per width that came gathered, the gradient of each row (each with its own scale)
    rows: tuple[RowGradient, ...] = ()
    #: per gathered width with hot rows, those rows' gradients (float32, unscaled), in their group's order
    gathered_hot: Mapping[int, np.ndarray] | None = None
    permit: Permit | None = None
    ack: StreamAck | None = None
    batch_id: int = -1
    hot: HotPart | None = None
    hot_grads: Mapping[str, np.ndarray | tuple[np.ndarray, int]] | None = None
    hot_loss_scale: float = 1.0
    failed: str | None = None


class EmbeddingClient:
    """Looks batches up on the embedding workers and pushes their gradients back.

    A push runs in the background (:meth:`send_grads`); it publishes the batch's hot-row gradients
    through ``hot`` first, and once the PS has applied it (or it failed) gives the batch's staleness
    permit back and settles its stream acknowledgement through ``acks``.
    """

    def __init__(self, nc: NATS, subjects: Subjects, *, rank: int, timeout: float, counters: Counter[str],
                 hot: HotRowSync, acks: StreamAcks, reconfigure: Callable[[], Awaitable[Any]] | None = None,
                 observe_call: CallObserver | None = None, gather_on_device: bool = False) -> None:
        """``reconfigure`` registers the embedding optimizer on every PS again (a training context's), for
        a PS that restarted. ``observe_call`` times lookups and pushes (the rank's metrics endpoint).
        ``gather_on_device``: :meth:`lookup` leaves the gathered widths' slots to the model's device."""
        self.nc = nc
        self.subjects = subjects
        self.rank = rank
        self.timeout = timeout
        self.counters = counters
        self.reconfigure = reconfigure
        self._hot = hot
        self._acks = acks
        #: lookups ask for the batch's hot rows apart from its slot outputs
        self.hot_rows = hot.enabled
        self.gather_on_device = gather_on_device
        self._observe_call = observe_call
        self._grad_tasks: set[asyncio.Task[None]] = set()
        #: set (and replaced) each time a batch's gradients (and hot-row gradients) are on their way
        self._hand_off = asyncio.Event()

    async def handed_off(self) -> None:
        """Returns once the next batch's gradients (and hot-row gradients) are on their way: a training
        pipeline readies its next batch then."""
        await self._hand_off.wait()

    def _handed_off(self) -> None:
        event, self._hand_off = self._hand_off, asyncio.Event()
        event.set()

    def _observe(self, kind: str, started: float) -> None:
        if self._observe_call is not None:
            try:
                self._observe_call(kind, time.perf_counter() - started)
            except Exception:  # a metrics bug must never break training
                log.exception("could not record the %s latency", kind)

    # -- lookups ------------------------------------------------------------------------------------

    async def lookup(self, batch: NNBatch, train: bool
                     ) -> tuple[tuple[SlotEmbedding, ...], HotPart | None, tuple[GatheredSlots, ...]]:
        """The batch's slot outputs, the hot rows returned apart from them (None without any), and the widths
        that came gathered (their slots' outputs built here: :func:`~persia_nats.core.lookup.expand`),
        whose gradients go back per row. With hot rows, the gathered widths' slots are left to
        :meth:`~persia_nats.services.nn_worker.hot_rows.RowMirror.merge`, which builds them as it adds those rows;
        with ``gather_on_device``, to the model's device (the rows merged by ``RowMirror.merge_deferred``)."""
        started = time.perf_counter()
        try:
            raw = await request_with_retry(
                self.nc, self.subjects.ew_lookup(batch.ref.worker),
                EwLookup(batch.ref.ref, train, self.hot_rows, gather=True),
                self.timeout, deadline=self.timeout * 4, retry_on=(Busy, InProgress, RequestTimeout))
        finally:
            self._observe("lookup", started)
        reply = EwLookupReply.from_wire(raw)
        if not reply.gathered:
            return reply.embeddings, reply.hot, ()
        # on the device the slots are built by the model's gather; with hot rows, as they are added
        # (RowMirror.merge), with their newest values: either way only the rows are widened here
        if self.gather_on_device or reply.hot is not None:
            return reply.embeddings, reply.hot, widen(reply.gathered)
        return expand(reply.embeddings, reply.gathered), reply.hot, reply.gathered

    async def ingest_and_lookup(self, req: IngestRequest
                                ) -> tuple[BatchRef, tuple[SlotEmbedding, ...], tuple[GatheredSlots, ...]]:
        """Training on batches that did not come from a data loader (an IterableDataset): the ref, the slot
        outputs with the hot rows added, and the widths that came gathered (as :meth:`lookup`; with
        ``gather_on_device``, their slots not among the outputs and their rows merged)."""
        # a full embedding worker holds the request up to half the timeout rather than have it sent again
        held = dataclasses.replace(req, wait=min(self.timeout / 2, MAX_WAIT_S))
        ref = IngestReply.from_wire(await request_with_retry(
            self.nc, self.subjects.ew_ingest(), held, self.timeout, deadline=self.timeout * 4,
            retry_on=(Busy, NoResponders, RequestTimeout))).batch_ref
        started = time.perf_counter()
        try:
            raw = await request(self.nc, self.subjects.ew_lookup(ref.worker),
                                EwLookup(ref.ref, True, self.hot_rows, gather=True), self.timeout)
        finally:
            self._observe("lookup", started)
        self.counters["batches"] += 1
        self.counters["samples"] += req.batch_size
        reply = EwLookupReply.from_wire(raw)
        if self.gather_on_device:  # the gathered widths' rows, hot rows merged; their slots built on the device
            if reply.hot is not None:
                embeddings, gathered = self._hot.mirror.merge_deferred(reply.embeddings, reply.hot,
                                                                       widen(reply.gathered))
                return ref, embeddings, gathered
            return ref, reply.embeddings, widen(reply.gathered)
        if reply.hot is not None:
            return ref, self._hot.mirror.merge(reply.embeddings, reply.hot, reply.gathered), reply.gathered
        return ref, expand(reply.embeddings, reply.gathered), reply.gathered

    async def lookup_direct(self, req: IngestRequest) -> tuple[SlotEmbedding, ...]:
        reply = await request_with_retry(
            self.nc, self.subjects.ew_lookup_direct(), IngestRequest(req.features),
            self.timeout, deadline=self.timeout * 4, retry_on=(Busy, NoResponders, RequestTimeout))
        return LookupDirectReply.from_wire(reply).embeddings

    def let_go(self, ref: BatchRef) -> None:
        """Take a refused batch's ids out of the embedding worker's buffer, in the background
        (:meth:`flush_grads` waits for it too)."""
        task = asyncio.get_running_loop().create_task(self._let_go(ref))
        self._grad_tasks.add(task)
        task.add_done_callback(self._grad_tasks.discard)

    async def _let_go(self, ref: BatchRef) -> None:
        # a lookup that trains nothing (no unseen id is inserted, no gradient is awaited) is the one
        # request that removes them
        try:
            await request(self.nc, self.subjects.ew_lookup(ref.worker), EwLookup(ref.ref, train=False, hot=False),
                          self.timeout)
        except Exception as exc:  # they expire after buffered_data_expired_sec anyway
            log.warning("rank %d: ids of refused batch ref %d stay buffered until they expire: %s", self.rank,
                        ref.ref, exc)

    # -- gradients ----------------------------------------------------------------------------------

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
                if hot is not None and push.gathered_hot:
                    # a gathered width's hot rows have no occurrences in ``hot``: their gradients are rows
                    # of the row gradients, taken as the push was made
                    for dim, g in push.gathered_hot.items():
                        entry[dim] = (entry[dim][0], g)
            except Exception:
                # the gradients still go to the PS, which publishes the rows they update: the ranks
                # only miss the correction until then, where a lost push would stall the job on its permit
                self.counters["hot_grads_failed"] += 1
                log.exception("rank %d: gradients of the hot rows of batch ref %d not computed", self.rank, ref.ref)
                entry = {}
            await self._hot.publish_grads(ref, entry)
        self._handed_off()
        subject = self.subjects.ew_grad(ref.worker)
        applied = False
        started = time.perf_counter()
        try:
            msg = GradRequest(ref.ref, grads, loss_scale, rows=push.rows)
            attempts = 0
            # the embedding worker answers a resend with the first push's true outcome, or 425 while that
            # push is still in flight: it ends within the PS client's resends, which this bound outlasts
            give_up_at = time.monotonic() + self.timeout * GRAD_OUTCOME_WAIT_TIMEOUTS + GRAD_OUTCOME_WAIT_EXTRA_S
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
                    self.counters["grad_pushes_resent"] += 1
                    log.warning("gradient push for ref %d: %s; retrying", ref.ref, exc)
                except InProgress:
                    if time.monotonic() >= give_up_at:
                        self.counters["grad_outcomes_unknown"] += 1
                        log.error("gradients of batch ref %d on worker %s: still being applied after %.0fs; "
                                  "counted as not applied (the batch is trained again)", ref.ref, ref.worker,
                                  time.monotonic() - started)
                        raise
                    attempts -= 1  # a wait for the first push, not a failed try
                    self.counters["grad_outcome_waits"] += 1
                    log.info("gradient push for ref %d: the first one is still being applied; asking again", ref.ref)
                except Conflict as exc:
                    # a PS that restarted has lost its optimizer: register it again, then retry
                    if attempts >= 3 or self.reconfigure is None:
                        raise
                    log.warning("gradient push for ref %d: %s; registering the optimizer again", ref.ref, exc)
                    self.counters["ps_reconfigured"] += 1
                    await self.reconfigure()
        except Exception as exc:  # nobody awaits this task: an error is reported here or nowhere
            self.counters["grad_failures"] += 1
            self._hot.mirror.forget(f"{ref.worker}.{ref.ref}")  # never applied: it must not correct this rank's rows
            if isinstance(exc, PersiaError):  # an answer from a peer: its message says it all
                log.error("gradients of batch ref %d on worker %s were not applied: %s", ref.ref, ref.worker, exc)
            else:
                log.exception("gradients of batch ref %d on worker %s were not sent", ref.ref, ref.worker)
        finally:
            self._observe("grad", started)
            release_permit(push.permit)
            if push.ack is not None and push.failed is not None:
                await self._acks.give_up(push.ack, push.batch_id, push.failed)
            elif push.ack is not None:
                await self._acks.acknowledge(push.ack, push.batch_id, trained=applied)

    async def flush_grads(self) -> None:
        """Wait until every gradient push (and every refused batch's let-go) started so far has ended."""
        while self._grad_tasks:
            await asyncio.gather(*list(self._grad_tasks), return_exceptions=True)


__all__ = ["CallObserver", "EmbeddingClient", "GradPush"]
