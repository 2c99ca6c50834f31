"""The embedding worker's PS client over a real nats-server: a PS paused past the request timeout costs a
resend (bounded, logged, counted), never a batch; one that stays silent fails the request by name."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from persia_nats.common.errors import RequestTimeout
from persia_nats.common.subjects import Subjects
from persia_nats.services.embedding_worker.ps_client import PsClient

from tests.integration.helpers import running_job, settle


async def pausing_replica(client, paused: Subjects, real: Subjects, pauses: int) -> list[int]:
    """Replica 0 of ``paused``: the first ``pauses`` requests go unanswered (a replica frozen past the
    timeout), later ones are answered by the real replica 0 of ``real``. Returns the requests seen, by kind."""
    seen = [0]

    async def on_request(msg) -> None:
        seen[0] += 1
        if seen[0] <= pauses:
            return
        kind = msg.subject.rsplit(".", 1)[1]
        reply = await client.request(real.ps(0, kind), msg.data, timeout=5)
        await msg.respond(reply.data)

    for kind in ("lookup", "update"):
        await client.subscribe(paused.ps(0, kind), cb=on_request)
    await settle(client)
    return seen


async def test_a_lookup_that_times_out_is_sent_again_and_answered(nats_server, job_name):
    async with running_job(nats_server.url, job_name, replicas=1) as (client, (ps,), _):
        paused = Subjects(f"{job_name}-paused")
        seen = await pausing_replica(client, paused, Subjects(job_name), pauses=2)
        ps_client = PsClient(client, paused, 1, timeout=0.3, timeout_retries=2)
        rows = await ps_client.lookup({4: np.array([1, 2, 3], np.uint64)}, train=True)
        assert rows[4].shape == (3, 4) and len(ps.store) == 3
        assert seen[0] == 3 and ps_client.counters["ps_timeouts_retried"] == 2, ps_client.counters
        assert not ps_client.counters["ps_timeouts_failed"]


async def test_a_replica_silent_past_every_resend_fails_the_request_and_is_counted(nats_server, job_name, caplog):
    async with running_job(nats_server.url, job_name, replicas=1) as (client, _, _):
        paused = Subjects(f"{job_name}-paused")
        seen = await pausing_replica(client, paused, Subjects(job_name), pauses=10)
        ps_client = PsClient(client, paused, 1, timeout=0.2, timeout_retries=1)
        started = asyncio.get_running_loop().time()
        with pytest.raises(RequestTimeout):
            await ps_client.lookup({4: np.array([1], np.uint64)}, train=True)
        assert asyncio.get_running_loop().time() - started < 2.0  # bounded: two tries of 0.2 s
        assert seen[0] == 2 and ps_client.counters["ps_timeouts_failed"] == 1
        assert "lookup timed out 2 time(s)" in caplog.text
