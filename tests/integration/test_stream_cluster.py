"""The ingestion streams' replicas: 3 on a real 3-node NATS cluster, 1 on a lone server, and a clear
refusal (creating nothing) when the setting asks more copies than the servers can hold."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import nats
import pytest
from nats.js.errors import NotFoundError
from persia_nats.common.config import DataLoaderConfig
from persia_nats.common.errors import ConfigError
from persia_nats.common.subjects import Subjects
from persia_nats.services.data_loader.stream import ensure_streams

from tests.natsserver import NatsServer, free_ports, start_nats_server


@pytest.fixture
def nats_cluster() -> Iterator[list[NatsServer]]:
    """Three JetStream servers joined by routes, as docker-compose.yml runs them."""
    route_ports = free_ports(3)
    routes = ", ".join(f"nats://127.0.0.1:{p}" for p in route_ports)
    servers: list[NatsServer] = []
    try:
        for i, port in enumerate(route_ports):
            servers.append(start_nats_server(
                f"server_name: n{i}\ncluster {{ name: persia, listen: \"127.0.0.1:{port}\", routes: [{routes}] }}"))
        yield servers
    finally:
        for s in servers:
            s.stop()


async def _wait_for_jetstream(nc: nats.NATS, timeout: float = 60.0) -> None:
    """A new cluster answers JetStream requests only once it has elected a meta leader."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await nc.jetstream(timeout=1).account_info()
            return
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _replicas_after_ensure(urls: list[str], job: str, settings: DataLoaderConfig,
                                 wait_first: bool = True) -> list[int]:
    nc = await nats.connect(urls)
    try:
        if wait_first:
            await _wait_for_jetstream(nc)
        subjects = Subjects(job)
        await ensure_streams(nc, subjects, settings)
        js = nc.jetstream()
        return [(await js.stream_info(name)).config.num_replicas for name in (subjects.stream, subjects.dead_stream)]
    finally:
        await nc.close()


def test_a_three_node_cluster_gets_three_replicas_of_both_streams(nats_cluster, job_name):
    urls = [s.url for s in nats_cluster]
    assert asyncio.run(_replicas_after_ensure(urls, job_name, DataLoaderConfig())) == [3, 3]


def test_a_loader_started_with_a_new_cluster_waits_for_its_leader(nats_cluster, job_name):
    """Started at once, before the cluster has elected its JetStream leader (503s, then answers)."""
    urls = [s.url for s in nats_cluster]
    assert asyncio.run(_replicas_after_ensure(urls, job_name, DataLoaderConfig(), wait_first=False)) == [3, 3]


def test_a_lone_server_gets_one_replica(nats_server, job_name):
    assert asyncio.run(_replicas_after_ensure([nats_server.url], job_name, DataLoaderConfig())) == [1, 1]


def test_more_replicas_than_servers_is_refused_naming_the_setting_and_creates_nothing(nats_server, job_name):
    async def attempt() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            with pytest.raises(ConfigError, match="data_loader_config.stream_replicas") as info:
                await ensure_streams(nc, Subjects(job_name), DataLoaderConfig(stream_replicas=3))
            assert "3 replicas" in str(info.value)
            with pytest.raises(NotFoundError):
                await nc.jetstream().stream_info(Subjects(job_name).stream)
        finally:
            await nc.close()

    asyncio.run(attempt())
