"""An NN rank's inbox: the batches its data loaders send (``nn.<rank>.batch``) and their ends
(``nn.<rank>.end``), queued until the training pipeline takes them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from persia_nats.common.batch import BatchSchema
from persia_nats.common.errors import BadRequest, Busy
from persia_nats.common.messages import NamedArray, NNBatch, NNEnd, Ok
from persia_nats.common.rpc import RpcServer
from persia_nats.common.subjects import Subjects
from persia_nats.services.nn_worker.embedding_client import EmbeddingClient
from persia_nats.services.nn_worker.stream_acks import StreamAcks

log = logging.getLogger(__name__)

#: how long a batch that finds the rank's incoming buffer full waits for room before it is refused
#: (Busy), when its sender says nothing (``NNBatch.wait``, which older senders leave out). A sender
#: that gives a wait has its batch held that long instead, so the batch crosses the wire once: it is
#: answered as soon as the training loop takes a batch, with no polling and no resend.
BATCH_HOLD_S = 0.25
#: batches held at once waiting for room; each holds one of the rank's request slots (64), and
#: nn.end, nn.info and checkpoint requests need the others. Beyond it a batch waits BATCH_HOLD_S.
MAX_BATCHES_WAITING = 32


class EndOfStream:
    """Sentinel: every loader has finished and every batch it sent was handed out."""


END = EndOfStream()


class Incoming(asyncio.Queue):  # type: ignore[type-arg]
    """The batches received and not yet looked up; hands the room a batch leaves to one waiting sender.

    Senders wait in arrival order, and each batch taken wakes only the first of them: waking them all
    (up to :data:`MAX_BATCHES_WAITING`) at every take cost each batch one wake-up per waiting sender on the
    rank's event loop, all but one of them for nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self._room_waiters: deque[asyncio.Future[bool]] = deque()

    def _get(self) -> NNBatch | EndOfStream:
        self.wake_for_room(1)
        return super()._get()  # type: ignore[no-any-return]

    def wake_for_room(self, n: int | None = None) -> None:
        """Wake the first ``n`` senders waiting for room (every one of them: None)."""
        n = len(self._room_waiters) if n is None else n
        while n > 0 and self._room_waiters:
            fut = self._room_waiters.popleft()
            if not fut.done():
                fut.set_result(True)
                n -= 1

    async def wait_for_room(self, limit: int, timeout: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Return once fewer than ``limit`` batches are queued, after ``timeout`` seconds, or once woken
        with ``stop()`` true."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        first = False  # a sender woken but beaten to the room keeps its place at the front
        while self.qsize() >= limit and loop.time() < end and not stop():
            fut: asyncio.Future[bool] = loop.create_future()
            if first:
                self._room_waiters.appendleft(fut)
            else:
                self._room_waiters.append(fut)
            timer = loop.call_at(end, lambda f=fut: f.done() or f.set_result(False))
            try:
                woken = await fut
            except BaseException:
                # a wake-up this sender cannot take any more goes to the next one
                if fut.done() and not fut.cancelled() and fut.result():
                    self.wake_for_room(1)
                raise
            finally:
                timer.cancel()
                if fut in self._room_waiters:  # timed out or cancelled: not woken, still queued
                    self._room_waiters.remove(fut)
            if not woken:
                return
            first = True


class Inbox:
    """Admits the batches sent to one rank into :attr:`incoming` (at most ``incoming_limit`` waiting,
    each checked against ``schema``, which the first batch that trains completes where the configuration
    leaves it open: :meth:`confirm_schema`), and queues :data:`END` once every data loader has ended and every
    batch it announced has arrived, or the ingestion stream has ended.

    A refused batch's ids are let go through ``embeddings``; a stream batch is held through ``acks``
    until it is acknowledged.
    """

    def __init__(self, subjects: Subjects, *, rank: int, counters: Counter[str], embeddings: EmbeddingClient,
                 acks: StreamAcks, schema: BatchSchema | None = None, incoming_limit: int = 10) -> None:
        """``schema``: what every batch carries (its dense features and labels; the slots are the embedding
        worker's)."""
        self.subjects = subjects
        self.rank = rank
        self.counters = counters
        self.schema = schema if schema is not None else BatchSchema()
        self.incoming_limit = incoming_limit
        self.incoming: Incoming = Incoming()
        self._embeddings = embeddings
        self._acks = acks
        self._received = 0
        self._batches_waiting = 0
        self._loader_ends: dict[int, int] = {}
        self._loader_size: int | None = None
        self._ended = False
        #: the ingestion stream's end marker ended this rank's batches
        self.stream_ended = False

    async def start(self, rpc: RpcServer) -> None:
        # concurrent: each batch waiting for room counts its wait from its own arrival, not from the
        # end of the wait of the batch before it (one at a time, a queue of them would outlast timeouts)
        await rpc.add(self.subjects.nn_batch(self.rank), self._on_batch, request=NNBatch)
        await rpc.add(self.subjects.nn_end(self.rank), self._on_end, concurrent=False, request=NNEnd)

    def set_limit(self, incoming_limit: int) -> None:
        """How many batches may wait (a DataLoader's buffer size, as it starts iterating)."""
        self.incoming_limit = incoming_limit

    def stats(self) -> dict[str, Any]:
        return {"received": self._received, "queued": self.incoming.qsize(), "incoming_limit": self.incoming_limit,
                "ended": self._ended}

    async def _on_batch(self, batch: NNBatch) -> Ok:
        if self._ended:
            raise BadRequest("this NN worker's stream has ended; no more batches are accepted")
        if await self._answered_as_duplicate(batch):
            return Ok()
        if self.incoming.qsize() >= self.incoming_limit:
            hold = batch.wait if batch.wait and self._batches_waiting < MAX_BATCHES_WAITING else BATCH_HOLD_S
            self._batches_waiting += 1
            self.counters["batches_waited"] += 1
            try:
                await self.incoming.wait_for_room(self.incoming_limit, hold, lambda: self._ended)
            finally:
                self._batches_waiting -= 1
            if self._ended:
                raise BadRequest("this NN worker's stream has ended; no more batches are accepted")
            if self.incoming.qsize() >= self.incoming_limit:
                self.counters["batches_refused_busy"] += 1
                raise Busy(f"NN worker rank {self.rank} buffer is full ({self.incoming_limit} batches)")
            if await self._answered_as_duplicate(batch):  # another delivery of it was admitted meanwhile
                return Ok()
        batch = self._admit(batch)
        self.incoming.put_nowait(batch)
        if batch.ack is not None:
            self._acks.hold(batch.ack)
        self._received += 1
        self._check_end()
        return Ok()

    async def _answered_as_duplicate(self, batch: NNBatch) -> bool:
        """A stream batch this rank trained already, or holds in another delivery: answered without training
        it again (which would apply its update twice), its looked-up ids let go."""
        ack = batch.ack
        if ack is None or not (self._acks.trained_before(ack) or self._acks.held(ack)):
            return False
        self._embeddings.let_go(batch.ref)
        if self._acks.held(ack):
            self._acks.join(ack)
        else:
            await self._acks.acknowledge_again(ack, batch.batch_id)
        self._received += 1
        self._check_end()
        return True

    def _admit(self, batch: NNBatch) -> NNBatch:
        """``batch`` with its dense features and labels in the schema's order; a batch that does not fit is
        refused (BadRequest naming the field), and its ids, buffered by the embedding worker, are let go."""
        try:
            non_id, labels = self.schema.admit(batch.non_id, batch.labels, batch.requires_grad)
        except BadRequest:
            self.counters["batches_refused_schema"] += 1
            self._embeddings.let_go(batch.ref)
            raise
        return dataclasses.replace(batch, non_id=non_id, labels=labels)

    def confirm_schema(self, batch_id: int, non_id: tuple[NamedArray, ...], labels: tuple[NamedArray, ...]) -> None:
        """Batch ``batch_id`` trained: its dense features and labels fix what the job's schema leaves open.

        Only a trained batch may: one the model failed on (published first by mistake, say) would
        otherwise make every real batch after it "not the job's schema"."""
        if self.schema.fixed or not self.schema.confirm(non_id, labels):
            return
        log.info("rank %d: batch schema confirmed by batch %d, the first that trained (%s)", self.rank, batch_id,
                 self.schema.describe())

    async def _on_end(self, end: NNEnd) -> Ok:
        if end.final:
            # the ingestion stream ended: every batch published before the end marker is trained,
            # so nothing is in flight towards this rank any more
            self.stream_ended = True
            if not self._ended:
                self._ended = True
                self.incoming.wake_for_room()  # the senders waiting for room are refused now, not at their timeout
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
            self.incoming.wake_for_room()
            self.incoming.put_nowait(END)
            log.info("rank %d: stream ended after %d batches", self.rank, self._received)


__all__ = ["BATCH_HOLD_S", "END", "MAX_BATCHES_WAITING", "EndOfStream", "Inbox", "Incoming"]
