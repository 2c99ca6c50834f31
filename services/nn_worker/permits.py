"""The staleness bound of a training pipeline (PERSIA's ``embedding_staleness``): a batch takes a
:class:`Permit` before its lookup and carries it until its gradients are applied or it is given up."""

from __future__ import annotations

import asyncio


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


__all__ = ["Permit", "StalenessGate", "release_permit"]
