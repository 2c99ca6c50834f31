"""Services of a job run in the test's own event loop, against a real nats-server."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import nats
from persia_nats.common.config import embedding_config_from_dict, global_config_from_dict
from persia_nats.services.embedding_ps.service import EmbeddingParameterServer
from persia_nats.services.embedding_worker.service import EmbeddingWorkerService

EMBEDDING = {"feature_index_prefix_bit": 8, "slots_config": {
    "a": {"dim": 4},
    "r": {"dim": 2, "embedding_summation": False, "sample_fixed_size": 3}}}


def global_config(job: str, loader: dict | None = None, ps: dict | None = None, **ew: object) -> object:
    return global_config_from_dict({
        "common_config": {"job_name": job},
        "embedding_worker_config": {"forward_buffer_size": 4, **ew},
        "embedding_parameter_server_config": ps or {},
        "nn_worker_config": {"request_timeout_sec": 5},
        "data_loader_config": loader or {},
    })


@contextlib.asynccontextmanager
async def running_job(url: str, job: str, replicas: int = 2, embedding: dict | None = None,
                      loader: dict | None = None, ps: dict | None = None, checkpoint_dir: str | None = None,
                      **ew: object) -> AsyncIterator[tuple]:
    """PS replicas and an embedding worker of ``job``; ``ps``: their ``embedding_parameter_server_config``,
    ``checkpoint_dir``: the PS replicas' checkpoint root (None: none); ``ew``: ``embedding_worker_config``."""
    gcfg = global_config(job, loader, ps, **ew)
    ecfg = embedding_config_from_dict(EMBEDDING if embedding is None else embedding)
    conns, services = [], []
    try:
        for i in range(replicas):
            nc = await nats.connect(url)
            conns.append(nc)
            replica = EmbeddingParameterServer(nc, gcfg, i, replicas, checkpoint_dir=checkpoint_dir)
            await replica.start()
            services.append(replica)
        nc = await nats.connect(url)
        conns.append(nc)
        ew_service = EmbeddingWorkerService(nc, gcfg, ecfg, 0, ps_wait_s=10)
        await ew_service.start()
        services.append(ew_service)
        client = await nats.connect(url)
        conns.append(client)
        yield client, services[:replicas], ew_service
    finally:
        for s in services:
            await s.stop(drain_timeout=5)
        for nc in conns:
            await nc.close()


async def settle(*conns: nats.NATS) -> None:
    """Make sure the server has processed every command sent so far (subscriptions above all).

    nats-py's ``flush`` writes its PING straight to the socket, so it can overtake commands still
    queued for the flusher task; by the time its PONG is back that task has written them, so a
    second PING comes after them.
    """
    for nc in conns:
        await nc.flush()
        await nc.flush()
