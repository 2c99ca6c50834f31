"""Async core of the data loader: sends batches to embedding workers and NN workers.

Step 1 of the flow: id features go to any embedding worker (queue group), which buffers them and
answers a ref; step 2: the dense part goes, with that ref, to NN rank ``batch_id % world_size``.
Each request says how long a full receiver may hold it (``wait``, half the request timeout): a full
buffer on either side holds it until room frees, so a batch crosses the wire once. Busy (a receiver
that cannot hold it, an older one, or one stopping) and a missing responder are retried with backoff,
and counted in ``resent``: nothing is lost.
A batch that does not fit the job's schema (:class:`~persia_nats.common.batch.BatchSchema`) is refused before it
is sent, and one a role refuses (400) is given up: either is counted, logged and published with its
reason on ``persia.<job>.dead`` (kept where the job has a dead-letter stream), and sending goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter

from nats.aio.client import Client as NATS
from persia_nats.common.batch import BatchSchema, PersiaBatch
from persia_nats.common.codec import pack
from persia_nats.common.dead import dead_message
from persia_nats.common.errors import BadRequest, Busy, NoResponders, RemoteError, RequestTimeout
from persia_nats.common.messages import (
    Empty,
    IngestReply,
    IngestRequest,
    NamedArray,
    NNBatch,
    NNEnd,
    NNInfoReply,
    StreamAck,
    StreamBatch,
)
from persia_nats.common.messages.batches import MAX_WAIT_S
from persia_nats.common.rpc import request_with_retry
from persia_nats.common.service import close_connection
from persia_nats.common.subjects import Subjects

log = logging.getLogger(__name__)


class BatchSender:
    """Sends PersiaBatches with at most ``max_inflight`` batches on the wire at once."""

    def __init__(self, nc: NATS, subjects: Subjects, replica_index: int = 0, replica_size: int = 1,
                 timeout: float = 30.0, retry_deadline: float = 600.0, max_inflight: int = 8,
                 schema: BatchSchema | None = None) -> None:
        self._nc = nc
        self._subjects = subjects
        self.replica_index = replica_index
        self.replica_size = replica_size
        self._timeout = timeout
        self._deadline = retry_deadline
        self._window = asyncio.Semaphore(max_inflight)
        self._tasks: set[asyncio.Task[None]] = set()
        self._errors: list[BaseException] = []
        self._counter = 0
        self.world_size = 0
        self.sent_per_rank: Counter[int] = Counter()
        self.schema = schema or BatchSchema()
        #: batches refused (by the schema here, or by a role), each dead-lettered with its reason
        self.refused = 0
        #: requests sent again, by subject kind ("ingest", "batch") and the error retried: each one
        #: crossed the wire again, whole
        self.resent: Counter[str] = Counter()

    @property
    def timeout(self) -> float:
        return self._timeout

    async def wait_for_nn_workers(self) -> int:
        """Learn the NN world size from any rank, waiting until one is up."""
        raw = await request_with_retry(self._nc, self._subjects.nn_info(), Empty(), self._timeout, self._deadline)
        try:
            size = NNInfoReply.from_wire(raw).world_size
        except BadRequest as exc:
            raise RemoteError(f"NN worker answered a bad nn.info reply: {exc}") from None
        self.world_size = size
        return size

    async def send(self, batch: PersiaBatch) -> None:
        """Queue one batch; returns once it is on the wire window (raises an earlier send's error)."""
        self._raise_pending()
        if not self.world_size:
            await self.wait_for_nn_workers()
        batch_id = self._counter * self.replica_size + self.replica_index
        self._counter += 1
        await self._window.acquire()
        task = asyncio.create_task(self._send_one(batch_id, batch))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._window.release()
        if not task.cancelled() and task.exception() is not None:
            self._errors.append(task.exception())  # type: ignore[arg-type]

    def _raise_pending(self) -> None:
        if self._errors:
            raise self._errors.pop(0)

    async def _send_one(self, batch_id: int, batch: PersiaBatch) -> None:
        ingest = batch.ingest_request()
        try:
            self.schema.check_slots([f.name for f in ingest.features])
            non_id, labels = self.schema.admit(batch.non_id_wire(), batch.labels_wire(), batch.requires_grad)
            await self.deliver(batch_id, ingest, non_id, labels, batch.requires_grad, batch.meta)
        except BadRequest as exc:
            await self._refused(StreamBatch(ingest.features, batch.non_id_wire(), batch.labels_wire(),
                                            batch.requires_grad, batch.meta), exc)

    async def _refused(self, batch: StreamBatch, exc: BadRequest) -> None:
        self.refused += 1
        log.warning("batch refused (%d so far): %s", self.refused, exc)
        try:
            body, headers = dead_message(pack(batch.to_wire()), f"refused by the job: {exc.description}")
            await self._nc.publish(self._subjects.dead(), body, headers=headers)
        except Exception as err:  # logged above already: the reason is not lost
            log.error("could not dead-letter a refused batch: %s", err)

    async def deliver(self, batch_id: int, ingest: IngestRequest, non_id: tuple[NamedArray, ...],
                      labels: tuple[NamedArray, ...], requires_grad: bool, meta: bytes | None,
                      ack: StreamAck | None = None) -> int:
        """Both steps for one batch, retrying what is safe to retry; returns the NN rank it went to."""
        if not self.world_size:
            await self.wait_for_nn_workers()
        retry = (Busy, NoResponders, RequestTimeout)
        # a full receiver holds a request up to ``wait``, and the rest of the timeout is for the reply to come back
        wait = min(self._timeout / 2, MAX_WAIT_S)
        reply = await request_with_retry(self._nc, self._subjects.ew_ingest(), dataclasses.replace(ingest, wait=wait),
                                         self._timeout, self._deadline, retry_on=retry,
                                         on_retry=lambda exc: self._resent("ingest", exc))
        ref = IngestReply.from_wire(reply).batch_ref
        rank = batch_id % self.world_size
        msg = NNBatch(batch_id, ingest.batch_size, ref, non_id, labels, requires_grad, meta, ack, wait)
        # a timeout here could mean the NN worker got it; Busy/NoResponders mean it surely did not
        await request_with_retry(self._nc, self._subjects.nn_batch(rank), msg, self._timeout,
                                 self._deadline, retry_on=(Busy, NoResponders),
                                 on_retry=lambda exc: self._resent("batch", exc))
        self.sent_per_rank[rank] += 1
        return rank

    def _resent(self, kind: str, exc: BaseException) -> None:
        key = f"{kind}_{type(exc).__name__}"
        self.resent[key] += 1
        if isinstance(exc, Busy):  # flow control should make this rare: worth a line each time
            log.info("%s sent again after busy (%d so far): %s", kind, self.resent[key], exc)

    async def flush(self) -> None:
        """Wait until every queued batch is delivered; raise the first delivery error."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._raise_pending()

    async def finish(self) -> None:
        """Flush, then tell every NN rank how many batches this loader sent it."""
        await self.flush()
        if not self.world_size:
            await self.wait_for_nn_workers()
        for rank in range(self.world_size):
            msg = NNEnd(self.replica_index, self.replica_size, self.sent_per_rank[rank])
            await request_with_retry(self._nc, self._subjects.nn_end(rank), msg, self._timeout, self._deadline)
        log.info("data loader %d finished: %d batches sent, %d refused, resent %s", self.replica_index,
                 sum(self.sent_per_rank.values()), self.refused, dict(self.resent) or "none")

    async def close(self) -> None:
        await close_connection(self._nc)
