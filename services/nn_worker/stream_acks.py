"""The NN rank's side of the ingestion stream: acknowledging each batch it was sent once trained."""

from __future__ import annotations

import logging
from collections import Counter

from nats.aio.client import Client as NATS
from persia_nats.common.acks import AckKeeper, nak_payload
from persia_nats.common.codec import pack
from persia_nats.common.dead import dead_letter_from_stream
from persia_nats.common.messages import StreamAck, TrainedNotice
from persia_nats.common.subjects import Subjects

log = logging.getLogger(__name__)


class StreamAcks:
    """Tells the ingestion stream which batches this rank trained (``+ACK``), must see again (``-NAK``)
    or dead-letters; holds the ones it has received until then, so that the stream does not deliver
    them again meanwhile (see :mod:`persia_nats.common.acks`)."""

    def __init__(self, nc: NATS, subjects: Subjects, *, rank: int, counters: Counter[str],
                 max_deliveries: int = 10) -> None:
        """``max_deliveries`` (``data_loader_config``): a stream batch whose step failed this often is
        dead-lettered. ``counters``: where the outcomes are counted (the runtime's)."""
        self.nc = nc
        self.subjects = subjects
        self.rank = rank
        self.counters = counters
        self.max_deliveries = max_deliveries
        self.ack_keeper = AckKeeper(nc)
        #: how often each stream sequence was trained on this rank (a redelivery comes back to the same rank)
        self.trained_seqs: Counter[int] = Counter()
        #: stream sequence -> the other deliveries of it that reached this rank while it was held here: they
        #: get its verdict (trained, given back or dead-lettered) instead of a training of their own
        self._held: dict[int, list[StreamAck]] = {}

    def hold(self, ack: StreamAck) -> None:
        """A stream batch has arrived: keep it from being redelivered while this rank has it."""
        if ack.wait is not None:
            self.ack_keeper.hold(ack.subject, ack.wait)
        self._held.setdefault(ack.seq, [])

    def held(self, ack: StreamAck) -> bool:
        """Another delivery of the stream batch ``ack`` delivers is waiting or training on this rank."""
        return ack.seq in self._held

    def join(self, ack: StreamAck) -> None:
        """A second delivery of a batch held here (the stream gave it up for lost while a node was paused or
        cut off, and its first delivery is still queued, or still on its way through an embedding worker):
        kept alive, and answered with the held one's verdict, not trained a second time. Counted as
        ``stream_redelivered_not_retrained``."""
        if ack.wait is not None:
            self.ack_keeper.hold(ack.subject, ack.wait)
        self._held[ack.seq].append(ack)
        self.counters["stream_redelivered_not_retrained"] += 1
        log.info("rank %d: stream batch %d delivered again (delivery %d) while delivery %s is held here; "
                 "it will share that one's outcome", self.rank, ack.seq, ack.delivered,
                 "an earlier" if ack.delivered > 1 else "a later")

    async def _answer_others(self, ack: StreamAck, verdict: bytes) -> None:
        """Send ``verdict`` for every other delivery of ``ack``'s batch that joined it here."""
        for other in self._held.pop(ack.seq, ()):
            self.ack_keeper.release(other.subject)
            try:
                await self.nc.publish(other.subject, verdict)
            except Exception as exc:  # its ack wait lapses and it comes back: trained_before answers it then
                log.debug("verdict for stream batch %d (delivery %d) not sent: %s", other.seq, other.delivered, exc)

    async def acknowledge(self, ack: StreamAck, batch_id: int, *, trained: bool) -> None:
        """Tell the ingestion stream a batch is trained (``+ACK``) or must be redelivered (``-NAK``)."""
        self.ack_keeper.release(ack.subject)
        verdict = b"+ACK" if trained else nak_payload(ack.delivered)
        try:
            await self.nc.publish(ack.subject, verdict)
            await self._answer_others(ack, verdict)
            await self._notify_trained(ack, batch_id, trained)
        except Exception as exc:  # the stream redelivers after its ack wait: late, never lost
            self.counters["stream_ack_failures"] += 1
            log.warning("could not acknowledge stream batch %d: %s", ack.seq, exc)
            return
        self.counters["stream_acked" if trained else "stream_nacked"] += 1
        if trained and ack.delivered > 1:
            self.counters["stream_redelivered_trained"] += 1
        if trained:
            self.trained_seqs[ack.seq] += 1

    def trained_before(self, ack: StreamAck) -> bool:
        """This rank has trained the stream batch ``ack`` delivers: ``ack`` is a redelivery of it, or its
        first delivery arriving after a redelivery that overtook it through another embedding worker."""
        return self.trained_seqs[ack.seq] > 0

    async def acknowledge_again(self, ack: StreamAck, batch_id: int) -> None:
        """A redelivery of a batch this rank trained already (the stream did not see its ``+ACK`` in time:
        a paused or partitioned node): acknowledged instead of trained again, and counted
        (``stream_redelivered_not_retrained``). An acknowledgement that fails to go out brings it back."""
        self.ack_keeper.release(ack.subject)
        try:
            await self.nc.publish(ack.subject, b"+ACK")
            await self._notify_trained(ack, batch_id, True)
        except Exception as exc:
            self.counters["stream_ack_failures"] += 1
            log.warning("could not acknowledge stream batch %d (trained before): %s", ack.seq, exc)
            return
        self.counters["stream_redelivered_not_retrained"] += 1
        log.info("rank %d: stream batch %d redelivered (delivery %d) after it trained here; acknowledged, "
                 "not trained again", self.rank, ack.seq, ack.delivered)

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
            await self._answer_others(ack, b"+TERM")
            await self._notify_trained(ack, batch_id, False, dead=reason)
        except Exception as exc:  # kept in the stream: it comes back, fails, and is dead-lettered then
            self.counters["dead_letter_failures"] += 1
            log.error("could not dead-letter stream batch %d: %s", ack.seq, exc)
            await self.acknowledge(ack, batch_id, trained=False)
            return
        self.counters["stream_dead_lettered"] += 1
        log.warning("stream batch %d dead-lettered: %s", ack.seq, reason)

    async def close(self) -> None:
        self._held.clear()
        await self.ack_keeper.close()


__all__ = ["StreamAcks"]
