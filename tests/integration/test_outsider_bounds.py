"""Bounds in bytes on what an outsider can make the job store or hold, attacked over the shipped secure config.

Each attack comes from the weakest user that may try it: ``publisher`` (the batches subject) for the
stream, ``nn-worker`` (the only other user with ``ew.ingest`` besides the data loader) for the request
path. Each test prints its figures (``pytest -s``): the streams' message and byte counts, and the RSS
of the nats-server and of this process, which runs the roles attacked.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import nats
import numpy as np
import pytest
from nats.js.errors import APIError
from persia_nats.common.codec import pack
from persia_nats.common.config import DataLoaderConfig, embedding_config_from_dict, global_config_from_dict
from persia_nats.common.dead import DEAD_REASON_HEADER, DEAD_SIZE_HEADER
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import IdFeature, IngestRequest, NamedArray, StreamBatch
from persia_nats.common.rpc import request
from persia_nats.services.data_loader.sender import BatchSender
from persia_nats.services.data_loader.stream import StreamLoader, ensure_streams
from persia_nats.services.embedding_ps.service import EmbeddingParameterServer
from persia_nats.services.embedding_worker.service import EmbeddingWorkerService

from tests.integration.test_access_control import S, connect_as, publisher_client, run_secure_server
from tests.natsserver import NatsServer
from tests.rss import rss_bytes

MIB = 1024**2
# small bounds, so that the attack stays quick on a shared machine; the shipped ones scale it up
SETTINGS = DataLoaderConfig(max_batch_bytes=4 * MIB, max_batch_samples=4096, max_batch_distinct_ids=10_000,
                            dead_max_bytes=8 * MIB, dead_max_payload_bytes=64 * 1024)


@pytest.fixture(scope="module")
def secure_server() -> Iterator[NatsServer]:
    yield from run_secure_server()


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f} MiB"


def feature(ids: np.ndarray, samples: int) -> IdFeature:
    """Slot ``a`` of ``samples`` samples sharing ``ids`` evenly."""
    return IdFeature("a", ids, np.full(samples, ids.shape[0] // samples, np.int32))


def batch_bytes(ids: np.ndarray, samples: int) -> bytes:
    labels = NamedArray("y", np.zeros((samples, 1), np.float32))
    return pack(StreamBatch((feature(ids, samples),), labels=(labels,)).to_wire())


async def streams(admin: nats.NATS) -> dict[str, Any]:
    js = admin.jetstream()
    out: dict[str, Any] = {}
    for name in (S.stream, S.dead_stream):
        state = (await js.stream_info(name)).state
        out[name] = (state.messages, state.bytes)
    return out


async def drain_stream(loader: StreamLoader, loader_nc: nats.NATS, n: int) -> None:
    """Hand the loader every message it would fetch: all are refused before forwarding, so no NN rank is needed."""
    sub = await loader_nc.jetstream().pull_subscribe_bind(durable=S.stream_consumer, stream=S.stream)
    seen = 0
    while seen < n:
        for msg in await sub.fetch(8, timeout=10):
            await loader._handle(msg)
            seen += 1
    await sub.unsubscribe()
    # a terminated message leaves the work-queue stream once the server has processed the +TERM, which on
    # a loaded machine may come after the stream's state is read
    js = loader_nc.jetstream()
    for _ in range(100):
        if (await js.stream_info(S.stream)).state.messages == 0:
            return
        await asyncio.sleep(0.1)


async def test_a_publisher_cannot_fill_the_job_with_junk(secure_server: NatsServer) -> None:
    admin = await connect_as(secure_server, "admin")
    loader_nc = await connect_as(secure_server, "data-loader")
    errors: list[Exception] = []
    pub = await publisher_client(secure_server, errors)
    try:
        await ensure_streams(loader_nc, S, SETTINGS)
        loader = StreamLoader(loader_nc, S, BatchSender(loader_nc, S), SETTINGS, slots=("a",))
        before = await streams(admin)
        nats_before, self_before = rss_bytes(secure_server.proc.pid), rss_bytes(os.getpid())
        js = pub.jetstream()
        # 1. over max_batch_bytes: JetStream refuses the publish itself; nothing is stored
        refused = 0
        for _ in range(10):
            with pytest.raises(APIError, match="(?i)maximum"):
                await js.publish(S.batches(), os.urandom(6 * MIB), timeout=10)
            refused += 1
        # 2. junk under it but over what a dead letter keeps: dead-lettered with the reason, without the bytes
        for _ in range(40):
            await js.publish(S.batches(), b"\xc1" + os.urandom(2 * MIB), timeout=10)
        # 3. well formed but over the distinct ids, and over the samples
        await js.publish(S.batches(), batch_bytes(np.arange(20_000, dtype=np.uint64), 2000), timeout=10)
        await js.publish(S.batches(), batch_bytes(np.zeros(5000, np.uint64), 5000), timeout=10)
        await drain_stream(loader, loader_nc, 42)
        after = await streams(admin)
        nats_after, self_after = rss_bytes(secure_server.proc.pid), rss_bytes(os.getpid())
        print(f"\nattack: 10 x 6 MiB over max_batch_bytes, 40 x 2 MiB malformed, 1 x 20000 distinct ids, "
              f"1 x 5000 samples, as `publisher`\n"
              f"  batches stream {before[S.stream]} -> {after[S.stream]} (messages, bytes)\n"
              f"  dead letters   {before[S.dead_stream]} -> {after[S.dead_stream]}\n"
              f"  nats-server RSS {mib(nats_before)} -> {mib(nats_after)}; loader (this process) RSS "
              f"{mib(self_before)} -> {mib(self_after)}\n  loader counters {dict(loader.counters)}")
        assert refused == 10 and errors == []
        assert after[S.stream] == (0, 0)  # every stored one was terminated
        dead_msgs, dead_bytes = after[S.dead_stream]
        assert dead_msgs == 42
        assert dead_bytes < 42 * 4096 + 2 * 200_000, "the dead letters kept the junk's bytes"
        assert loader.counters["dead_lettered"] == 42 and loader.counters["over_bounds"] == 2
        # every reason is kept, the cut ones say so
        reasons = []
        for seq in range(1, 43):
            msg = await admin.jetstream().get_msg(S.dead_stream, seq)
            reasons.append((msg.headers or {})[DEAD_REASON_HEADER])
            assert int((msg.headers or {})[DEAD_SIZE_HEADER]) > 0
        assert sum("malformed batch" in r and "not kept" in r for r in reasons) == 40
        assert any("max_batch_distinct_ids (10000)" in r for r in reasons)
        assert any("max_batch_samples (4096)" in r for r in reasons)
        # the dead-letter stream itself is bounded in bytes and age, not just in messages
        cfg = (await admin.jetstream().stream_info(S.dead_stream)).config
        assert cfg.max_bytes == 8 * MIB and cfg.max_age == SETTINGS.dead_max_age_sec and cfg.max_msg_size
    finally:
        await pub.close()
        for name in (S.stream, S.dead_stream):
            await admin.jetstream().delete_stream(name)
        await loader_nc.close()
        await admin.close()


EMBEDDING = {"slots_config": {"a": {"dim": 4}}}


async def test_ew_ingest_refuses_a_batch_over_the_bounds_before_any_row_is_inserted(secure_server: NatsServer
                                                                                   ) -> None:
    gcfg = global_config_from_dict({"common_config": {"job_name": "persia"},
                                    "nn_worker_config": {"request_timeout_sec": 5},
                                    "data_loader_config": {"max_batch_distinct_ids": 10_000,
                                                           "max_batch_samples": 4096}})
    ps_nc = await connect_as(secure_server, "ps")
    ew_nc = await connect_as(secure_server, "embedding-worker")
    attacker = await connect_as(secure_server, "nn-worker")
    ps = EmbeddingParameterServer(ps_nc, gcfg, 0, 1)
    ew = EmbeddingWorkerService(ew_nc, gcfg, embedding_config_from_dict(EMBEDDING), 0, ps_wait_s=10)
    try:
        await ps.start()
        await ew.start()
        self_before = rss_bytes(os.getpid())
        refusals = []
        for ids, samples in ((np.arange(1_000_000, dtype=np.uint64), 1000), (np.zeros(5000, np.uint64), 5000)):
            with pytest.raises(BadRequest) as info:
                await request(attacker, S.ew_ingest(), IngestRequest((feature(ids, samples),)), 10)
            refusals.append(info.value)
        # the same path takes a batch within the bounds
        ok = await request(attacker, S.ew_ingest(), IngestRequest((feature(np.arange(100, dtype=np.uint64), 100),)),
                           10)
        self_after = rss_bytes(os.getpid())
        print(f"\nattack: ew.ingest of 1,000,000 distinct ids and of 5000 samples, as `nn-worker`: "
              f"{[str(e) for e in refusals]}\n  forward buffer {len(ew.ids)} batch(es), PS rows {len(ps.store)}, "
              f"EW+PS (this process) RSS {mib(self_before)} -> {mib(self_after)}")
        assert refusals[0].code == 400 and "1000000 distinct ids" in refusals[0].description
        assert "max_batch_samples" in refusals[1].description
        assert ew.counters["ingest_refused_bounds"] == 2
        assert ok["ref"] is not None and len(ew.ids) == 1 and len(ps.store) == 0
    finally:
        for service in (ew, ps):
            await service.stop(drain_timeout=5)
        for nc in (attacker, ew_nc, ps_nc):
            await nc.close()
        await asyncio.sleep(0)
