"""A role whose NATS node freezes or is cut off finds out within seconds, not nats-py's two minutes.

A frozen (SIGSTOP) or partitioned node keeps its TCP connections open and silent: nothing fails until a
ping goes unanswered. With nats-py's default 120 s ping interval, a PS or embedding worker on such a node
waited 20-28 s for it in the cluster runs (benchmarks/cluster.py --scenario pause/partition) while the
stream had a new leader within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

from persia_nats.common.service import MAX_OUTSTANDING_PINGS, PING_INTERVAL_S, connect

from tests.natsserver import start_nats_server


@contextlib.asynccontextmanager
async def watched(name: str):
    """A nats-server of its own, a role's connection to it, and an event set when that connection is lost."""
    server = start_nats_server()
    lost = asyncio.Event()

    async def disconnected() -> None:
        lost.set()

    nc = await connect(server.url, name, disconnected_cb=disconnected)
    try:
        yield server, nc, lost
    finally:
        await nc.close()
        server.stop()


async def test_a_frozen_server_is_found_stale_within_the_ping_bound():
    async with watched("stale-check") as (server, nc, lost):
        os.kill(server.proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        bound = PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 2)
        try:
            await asyncio.wait_for(lost.wait(), bound + 5)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert time.monotonic() - started <= bound + 5
        # and the client comes back once the server answers again
        for _ in range(100):
            if nc.is_connected:
                break
            await asyncio.sleep(0.1)
        assert nc.is_connected


async def test_a_loop_blocked_for_longer_than_the_ping_bound_raises_no_false_alarm():
    """A role whose event loop is held up (a long numpy call, a GC pause) by more than the stale bound keeps
    its connection: the count of unanswered pings only grows as the loop runs its timer, and the PONG
    waiting in the socket clears it as soon as the loop reads again."""
    async with watched("blocked-loop") as (_, nc, lost):
        for _ in range(2):
            time.sleep(PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 2))  # noqa: ASYNC251 (the point: the whole loop stands still)
            await asyncio.sleep(PING_INTERVAL_S * 1.5)  # runs: a timer tick, a ping, its PONG
        assert not lost.is_set() and nc.is_connected
