"""The stream loader as a Service: started, listed and stopped as the other roles are (real nats-server)."""

from __future__ import annotations

import asyncio

import nats
import pytest
from persia_nats.common.discovery import cluster_status
from persia_nats.common.service import Service, run_service
from persia_nats.services.data_loader.stream_service import StreamLoaderService

from tests.integration.helpers import global_config


async def test_a_stream_loader_service_is_listed_and_stops_when_asked(nats_server, job_name):
    nc = await nats.connect(nats_server.url)
    client = await nats.connect(nats_server.url)
    service = StreamLoaderService(nc, global_config(job_name), replica_index=0, replica_size=1)
    try:
        await service.start()
        for _ in range(100):  # it lists itself at once, then creates the stream and waits for an NN rank
            found = [r for r in await cluster_status(client, job_name, 0.2) if r["role"] == "data-loader"]
            if found:
                break
            await asyncio.sleep(0.05)
        assert [(r["instance"], r["replica"], r["source"]) for r in found] == [("loader-0", 0, "srv")]
        assert found[0]["stats"] == {"inflight": 0, "end_marker": None}  # nothing received yet
        await asyncio.wait_for(service.stop(), 10)  # ends the wait for an NN rank, drains nothing
        await asyncio.wait_for(service.wait_stopped(), 1)
        assert service.failure is None and service._forwarding.done()
        assert not [r for r in await cluster_status(client, job_name, 0.3) if r["role"] == "data-loader"]
    finally:
        await service.stop()
        await nc.close()
        await client.close()


class _FailsAtOnce(Service):
    role = "failing"

    async def start(self) -> None:
        async def fail() -> None:
            self.failure = RuntimeError("the stream is gone")
            await self.stop()

        asyncio.get_running_loop().create_task(fail())


async def test_run_service_raises_what_ended_a_service_that_stopped_by_itself(nats_server):
    async def make(nc):  # noqa: ANN001, ANN202
        return _FailsAtOnce(nc)

    with pytest.raises(RuntimeError, match="the stream is gone"):
        await asyncio.wait_for(run_service(make, [nats_server.url], "failing", stats_interval=60), 20)
