"""The embedding worker's buffers: bounded in entries and bytes, and unclaimed entries cannot hold them."""

from __future__ import annotations

import asyncio

import pytest
from persia_nats.common.errors import Busy, NotFound, PayloadTooLarge
from persia_nats.services.embedding_worker.buffer import RefBuffer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def buffer(clock: Clock, **kw: object) -> RefBuffer[bytes]:
    return RefBuffer("test buffer", 10, 1000.0, clock, sizeof=len, **kw)


def test_bytes_bound_refuses_what_would_not_fit_and_frees_what_leaves():
    buf = buffer(Clock(), max_bytes=100)
    a = buf.put(b"x" * 60)
    with pytest.raises(Busy, match="60 \\+ 41 bytes of 100"):
        buf.put(b"y" * 41)
    b = buf.put(b"y" * 40)
    assert buf.nbytes == 100 and len(buf) == 2
    assert buf.pop(a) == b"x" * 60 and buf.nbytes == 40
    buf.restore(a, b"x" * 60)  # a failed request puts its batch back, even beyond the bound
    assert buf.nbytes == 100
    with pytest.raises(NotFound):
        buf.pop(12345)
    assert buf.nbytes == 100 and {buf.pop(a), buf.pop(b)} == {b"x" * 60, b"y" * 40} and buf.nbytes == 0


def test_while_full_unclaimed_entries_expire_after_the_short_limit():
    clock = Clock()
    buf = buffer(clock, max_bytes=1000, full_expire_s=5.0)
    kept = [buf.put(b"z") for _ in range(10)]
    clock.now += 4.9
    with pytest.raises(Busy):
        buf.put(b"new")
    assert buf.expired == 0
    clock.now += 0.2  # 5.1 s unclaimed, and the buffer is full: they give way
    ref = buf.put(b"new")
    assert buf.expired == 10 and len(buf) == 1 and buf.nbytes == 3
    with pytest.raises(NotFound):
        buf.pop(kept[0])
    assert buf.pop(ref) == b"new"


def test_below_the_bounds_entries_live_for_the_long_limit():
    clock = Clock()
    buf = buffer(clock, max_bytes=1000, full_expire_s=5.0)
    ref = buf.put(b"old")
    clock.now += 999.0
    buf.put(b"new")
    assert buf.pop(ref) == b"old" and buf.expired == 0
    clock.now += 1001.0
    buf.put(b"newer")
    assert buf.expired == 1


def test_an_entry_larger_than_the_whole_bound_is_too_large_not_busy():
    buf = buffer(Clock(), max_bytes=100)
    with pytest.raises(PayloadTooLarge, match="never fit"):
        buf.put(b"x" * 101)
    assert len(buf) == 0 and buf.nbytes == 0


async def test_a_wait_for_room_ends_when_an_entry_is_popped_or_expires_or_the_caller_gives_up():
    clock = Clock()
    buf = RefBuffer("test buffer", 2, 1000.0, clock, sizeof=len, full_expire_s=5.0)
    refs = [buf.put(b"a"), buf.put(b"b")]
    # a pop wakes the waiter at once
    waiting = asyncio.create_task(buf.wait_for_room(1, 5.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    buf.pop(refs[0])
    await asyncio.wait_for(waiting, 1)
    buf.put(b"c")
    # an expiry frees no entry by itself: the waiter finds it on its periodic check
    waiting = asyncio.create_task(buf.wait_for_room(1, 5.0, recheck_s=0.05))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    clock.now += 6.0
    await asyncio.wait_for(waiting, 1)
    assert buf.expired == 2 and len(buf) == 0
    buf.put(b"d")
    buf.put(b"e")
    # the wait runs out: Busy, as without one
    with pytest.raises(Busy, match="test buffer is full"):
        await buf.wait_for_room(1, 0.1, recheck_s=0.05)
    # give_up is asked on every wake-up
    stopping: list[str] = []
    waiting = asyncio.create_task(buf.wait_for_room(1, 30.0, give_up=lambda: stopping[0] if stopping else None))
    await asyncio.sleep(0.05)
    stopping.append("the worker is stopping")
    buf.wake()
    with pytest.raises(Busy, match="is full and the worker is stopping"):
        await asyncio.wait_for(waiting, 1)
    assert len(buf) == 2
