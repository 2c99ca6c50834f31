"""A role whose NATS node freezes or is cut off finds out within seconds, not nats-py's two minutes.

A frozen (SIGSTOP) or partitioned node keeps its TCP connections open and silent: nothing fails until a
ping goes unanswered. With nats-py's default 120 s ping interval, a PS or embedding worker on such a node
waited 20-28 s for it in the cluster runs (benchmarks/cluster.py --scenario pause/partition) while the
stream had a new leader within seconds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from persia_nats.common.service import MAX_OUTSTANDING_PINGS, PING_INTERVAL_S, connect

from tests.natsserver import start_nats_server


async def test_a_frozen_server_is_found_stale_within_the_ping_bound():
    server = start_nats_server()
    lost = asyncio.Event()

    async def disconnected() -> None:
        lost.set()

    nc = await connect(server.url, "stale-check", disconnected_cb=disconnected)
    try:
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
    finally:
        await nc.close()
        server.stop()
