"""An NN rank's incoming queue hands the room each taken batch leaves to one waiting sender, in arrival order."""

from __future__ import annotations

import asyncio

import pytest
from persia_nats.services.nn_worker.inbox import Incoming


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def full_queue(limit: int) -> Incoming:
    q = Incoming()
    for i in range(limit):
        q.put_nowait(i)  # type: ignore[arg-type]
    return q


async def sender(q: Incoming, limit: int, name: str, admitted: list[str]) -> None:
    """A sender as the inbox runs one: wait for room, then queue its batch (``name``), noted in ``admitted``."""
    await q.wait_for_room(limit, 5.0)
    admitted.append(name)
    q.put_nowait(name)  # type: ignore[arg-type]


async def test_each_taken_batch_wakes_only_the_first_waiting_sender():
    q = full_queue(2)
    done: list[str] = []
    tasks = [asyncio.create_task(sender(q, 2, n, done)) for n in "abc"]
    await settle()
    assert done == []
    q.get_nowait()
    await settle()
    assert done == ["a"]  # b and c were not woken: the room went to a, which filled it
    q.get_nowait()
    await settle()
    assert done == ["a", "b"]
    q.get_nowait()
    await asyncio.gather(*tasks)
    assert done == ["a", "b", "c"]


async def test_a_sender_waits_its_timeout_and_leaves_no_waiter_behind():
    q = full_queue(1)
    started = asyncio.get_running_loop().time()
    await q.wait_for_room(1, 0.1)
    assert asyncio.get_running_loop().time() - started >= 0.09
    assert q.qsize() == 1 and not q._room_waiters


async def test_a_woken_sender_beaten_to_the_room_keeps_its_place_at_the_front():
    q = full_queue(1)
    order: list[str] = []
    a = asyncio.create_task(sender(q, 1, "a", order))
    await settle()
    b = asyncio.create_task(sender(q, 1, "b", order))
    await settle()
    q.get_nowait()  # wakes a ...
    q.put_nowait("newcomer")  # type: ignore[arg-type]  # ... but a sender that found room first takes it
    await settle()
    assert order == []
    q.get_nowait()
    await settle()
    assert order == ["a"]  # a again, ahead of b
    q.get_nowait()
    await asyncio.gather(a, b)
    assert order == ["a", "b"]


async def test_a_wake_up_given_to_a_cancelled_sender_goes_to_the_next():
    q = full_queue(1)
    a = asyncio.create_task(q.wait_for_room(1, 5.0))
    await settle()
    b = asyncio.create_task(q.wait_for_room(1, 5.0))
    await settle()
    q.get_nowait()  # a is woken: its future holds the room ...
    a.cancel()  # ... but it is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await a
    await asyncio.wait_for(b, 1.0)  # b got the room, not its timeout


async def test_waking_every_sender_with_stop_set_ends_their_waits_at_once():
    """What the inbox does when its stream ends: the senders still waiting for room are refused now."""
    q = full_queue(1)
    stopped = [False]
    tasks = [asyncio.create_task(q.wait_for_room(1, 30.0, lambda: stopped[0])) for _ in range(3)]
    await settle()
    q.wake_for_room()  # woken without stop: each finds the queue still full and waits again
    await settle()
    assert not any(t.done() for t in tasks) and len(q._room_waiters) == 3
    stopped[0] = True
    q.wake_for_room()
    await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
    assert q.qsize() == 1 and not q._room_waiters
