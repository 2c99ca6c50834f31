"""Keeps JetStream deliveries alive while a healthy process still works on them.

A stream batch is redelivered when nobody acknowledges it within the consumer's ``ack_wait``. That
is how a batch held by a crashed process comes back; but a batch that merely waits (behind the
staleness bound, in a full buffer, during a checkpoint) must not come back too, or it is trained
twice. Whoever holds a delivery therefore sends ``+WPI`` ("work in progress", which restarts the
ack timer) every third of ``ack_wait``: the data loader while it forwards the batch, then the NN
worker until it acknowledges it. A process that dies stops sending, and the batch is redelivered.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client as NATS

log = logging.getLogger(__name__)

IN_PROGRESS = b"+WPI"
#: redelivery delays back off up to this: a role that restarts takes seconds, not milliseconds
MAX_NAK_DELAY_S = 30.0


def nak_delay(delivered: int) -> float:
    """Seconds before a batch given back on its ``delivered``-th delivery comes again: 1, 2, 4, ... 30.

    Given back at once, a batch that failed because a peer is restarting would fail again at once,
    and burn every delivery it has within a second.
    """
    return min(MAX_NAK_DELAY_S, 2.0 ** max(0, delivered - 1))


def nak_payload(delivered: int) -> bytes:
    """``-NAK`` with JetStream's redelivery delay (in nanoseconds)."""
    return b'-NAK {"delay": %d}' % int(nak_delay(delivered) * 1e9)


class AckKeeper:
    """Sends ``+WPI`` for every held delivery, every ``interval`` seconds."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._held: dict[str, float] = {}  # ack subject -> interval
        self._task: asyncio.Task[None] | None = None
        self.sent = 0

    def hold(self, subject: str, ack_wait: float) -> None:
        self._held[subject] = max(0.2, ack_wait / 3)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._beat())

    def release(self, subject: str) -> None:
        self._held.pop(subject, None)

    def __len__(self) -> int:
        return len(self._held)

    async def _beat(self) -> None:
        while self._held:
            await asyncio.sleep(min(self._held.values()))
            for subject in list(self._held):
                try:
                    await self.nc.publish(subject, IN_PROGRESS)
                    self.sent += 1
                except Exception as exc:  # a reconnecting client: the next beat, or a redelivery, covers it
                    log.debug("in-progress for %s failed: %s", subject, exc)

    async def close(self) -> None:
        self._held.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
