"""The staleness permit: one place under the bound per batch, given back once whatever path ends it."""

from __future__ import annotations

import asyncio

import pytest
from persia_nats.services.nn_worker.runtime import StalenessGate


async def test_a_permit_is_given_back_once_however_often_it_is_released():
    gate = StalenessGate(1)
    permit = await gate.acquire()
    assert permit.held and gate.inflight == 1
    assert permit.release() is True
    assert permit.release() is False  # a second path reaching the same batch changes nothing
    assert not permit.held and gate.inflight == 0
    second = await asyncio.wait_for(gate.acquire(), 1)
    # had the second release counted, the bound of 1 would now let a third batch in
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(gate.acquire(), 0.1)
    second.release()
    assert gate.inflight == 0 and gate.max_inflight == 1


async def test_an_unbounded_gate_still_counts_what_is_out():
    gate = StalenessGate(None)
    permits = [await gate.acquire() for _ in range(3)]
    assert gate.inflight == 3
    for p in permits + permits:
        p.release()
    assert gate.inflight == 0 and gate.max_inflight == 3


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="embedding staleness must be >= 1"):
        StalenessGate(0)
