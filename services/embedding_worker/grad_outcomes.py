"""What became of the gradient pushes an embedding worker took: in flight, applied, or failed.

A push leaves the gradient buffer as its handler starts, so a resend of it (its sender's request timed
out while the PSs were slow: a replica paused past the timeout, resent by the PS client) would find
nothing there. "Not found" would then be ambiguous (applied? lost?), and an NN worker that took it for
"applied" released its staleness permit and acknowledged the batch before its update was applied, or
when it never was. The record answers a resend truthfully instead: it joins the push in flight, or
repeats its reply, or relays its error.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from persia_nats.common.errors import RemoteError
from persia_nats.common.messages import GradReply

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GradOutcome:
    """One push: ``reply`` once applied, ``error`` once failed, neither while in flight."""

    ended: asyncio.Event = field(default_factory=asyncio.Event)
    reply: GradReply | None = None
    error: RemoteError | None = None

    @property
    def in_flight(self) -> bool:
        return not self.ended.is_set()


class GradOutcomes:
    """The pushes in flight and the last ``capacity`` ended ones, by ref.

    Ended outcomes are forgotten oldest first beyond ``capacity`` (counted in ``counters`` as
    ``grad_outcomes_forgotten``); those in flight never are: there are at most as many as the worker
    handles requests at once. A ref forgotten is answered "not found", which an NN worker takes as "not
    applied": it trains the batch again rather than count an update that may not exist.
    """

    def __init__(self, capacity: int, counters: Counter[str]) -> None:
        self.capacity = capacity
        self.counters = counters
        self._outcomes: OrderedDict[int, GradOutcome] = OrderedDict()
        #: pushes taken and not ended: their batches are still stale, though out of the gradient buffer
        self.in_flight = 0

    def __len__(self) -> int:
        return len(self._outcomes)

    def get(self, ref: int) -> GradOutcome | None:
        return self._outcomes.get(ref)

    def begin(self, ref: int) -> GradOutcome:
        """A push of ``ref`` starts (a resend after a failure replaces the failure)."""
        outcome = self._outcomes[ref] = GradOutcome()
        self._outcomes.move_to_end(ref)
        self.in_flight += 1
        return outcome

    def applied(self, outcome: GradOutcome, reply: GradReply) -> None:
        outcome.reply = reply
        self._end(outcome)

    def failed(self, outcome: GradOutcome, error: RemoteError) -> None:
        outcome.error = error
        self._end(outcome)

    def _end(self, outcome: GradOutcome) -> None:
        outcome.ended.set()
        self.in_flight -= 1
        while len(self._outcomes) > self.capacity:
            oldest = next((r for r, o in self._outcomes.items() if not o.in_flight), None)
            if oldest is None:  # every one in flight: none may be forgotten
                return
            del self._outcomes[oldest]
            self.counters["grad_outcomes_forgotten"] += 1


__all__ = ["GradOutcome", "GradOutcomes"]
