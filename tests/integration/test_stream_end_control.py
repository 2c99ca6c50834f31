"""Only the operator ends a job's stream, over the shipped secure config; what is left after the end is reported.

The attacker is ``publisher``, the weakest user that may publish on the stream at all. The test prints its
figures (``pytest -s``): the stream's message and byte counts and the RSS of the nats-server and of this
process (the data loader), before and after.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import msgpack
import nats
import pytest
from nats.errors import TimeoutError as NatsTimeout
from persia_nats.common.config import DataLoaderConfig
from persia_nats.common.dead import DEAD_REASON_HEADER
from persia_nats.common.subjects import Subjects
from persia_nats.services.data_loader.sender import BatchSender
from persia_nats.services.data_loader.stream import StreamLoader, ensure_streams
from persia_nats.services.nn_worker.account import StreamMark, stream_account

from tests.integration.test_access_control import S, connect_as, publisher_client, run_secure_server
from tests.natsserver import NatsServer
from tests.rss import rss_bytes

END = msgpack.packb({"v": 1, "end": True})


@pytest.fixture(scope="module")
def secure_server() -> Iterator[NatsServer]:
    yield from run_secure_server()


async def handle_next(loader: StreamLoader, nc: nats.NATS, subjects: Subjects) -> None:
    """Hand the loader the stream's next message, as its pull loop would."""
    sub = await nc.jetstream().pull_subscribe_bind(durable=subjects.stream_consumer, stream=subjects.stream)
    (msg,) = await sub.fetch(1, timeout=10)
    await loader._handle(msg)
    await sub.unsubscribe()


async def counts(admin: nats.NATS, subjects: Subjects) -> dict[str, tuple[int, int]]:
    js = admin.jetstream()
    return {name: ((s := (await js.stream_info(name)).state).messages, s.bytes)
            for name in (subjects.stream, subjects.dead_stream)}


async def test_a_publisher_cannot_end_the_stream_and_batches_left_after_the_end_are_reported(
        secure_server: NatsServer) -> None:
    admin = await connect_as(secure_server, "admin")
    loader_nc = await connect_as(secure_server, "data-loader")
    nn_nc = await connect_as(secure_server, "nn-worker")
    errors: list[Exception] = []
    pub = await publisher_client(secure_server, errors)
    try:
        await ensure_streams(loader_nc, S)
        loader = StreamLoader(loader_nc, S, BatchSender(loader_nc, S), DataLoaderConfig(), slots=("a",))
        before = await counts(admin, S)
        rss_before = rss_bytes(secure_server.proc.pid), rss_bytes(os.getpid())
        js = pub.jetstream()
        # 1. the old way: a marker on the batches subject is stored, and dead-lettered, not obeyed
        assert (await js.publish(S.batches(), END, timeout=10)).seq == 1
        await handle_next(loader, loader_nc, S)
        assert loader.stats()["end_marker"] is None and loader.counters["end_markers_refused"] == 1
        reason = (await admin.jetstream().get_msg(S.dead_stream, 1)).headers[DEAD_REASON_HEADER]
        assert reason.startswith("end marker refused: end: on persia.persia.batches") and "stream_end" in reason
        # 2. the end's own subject is the operator's: the server refuses the publisher, and nothing is stored
        with pytest.raises(NatsTimeout):
            await js.publish(S.stream_end(), END, timeout=2)
        assert any('permissions violation for publish to "persia.persia.stream_end"' in str(e).lower()
                   for e in errors), errors
        assert (await counts(admin, S))[S.stream][0] == 0
        # 3. the operator's marker ends it; batches the publisher sends after it are left, and said so
        assert (await admin.jetstream().publish(S.stream_end(), END, timeout=10)).seq == 2  # nothing in between
        await handle_next(loader, loader_nc, S)
        assert loader.stats()["end_marker"] == 2
        for i in range(3):
            await js.publish(S.batches(), msgpack.packb({"v": 1, "late": i}), timeout=10)
        await loader._count_left(2)
        assert loader.counters["left_at_end"] == 3
        account = await stream_account(nn_nc, S, StreamMark(1, 0), ended=True)
        assert account is not None and account["left"] == 3 and account["published"] == 4
        assert account["dead_lettered_by_reason"] == {"end marker refused": 1}
        after = await counts(admin, S)
        rss_after = rss_bytes(secure_server.proc.pid), rss_bytes(os.getpid())
        print(f"\nattack: end marker from `publisher` on batches and on stream_end\n"
              f"  stream {before[S.stream]} -> {after[S.stream]} (messages, bytes: the operator's marker and "
              f"3 late batches), dead letters {before[S.dead_stream]} -> {after[S.dead_stream]}\n"
              f"  nats-server RSS {rss_before[0] / 2**20:.1f} -> {rss_after[0] / 2**20:.1f} MiB, loader (this "
              f"process) {rss_before[1] / 2**20:.1f} -> {rss_after[1] / 2**20:.1f} MiB\n"
              f"  loader counters {dict(loader.counters)}; account {account}")
    finally:
        await pub.close()
        for name in (S.stream, S.dead_stream):
            await admin.jetstream().delete_stream(name)
        for nc in (nn_nc, loader_nc, admin):
            await nc.close()


async def test_end_marker_from_batches_keeps_the_older_protocol(secure_server: NatsServer) -> None:
    subjects = Subjects("compat")
    admin = await connect_as(secure_server, "admin")
    loader_nc = await connect_as(secure_server, "data-loader")
    pub = await publisher_client(secure_server, [])
    settings = DataLoaderConfig(end_marker_from="batches")
    try:
        await ensure_streams(loader_nc, subjects, settings)
        loader = StreamLoader(loader_nc, subjects, BatchSender(loader_nc, subjects), settings, slots=("a",))
        await pub.jetstream().publish(subjects.batches(), END, timeout=10)
        await handle_next(loader, loader_nc, subjects)
        assert loader.stats()["end_marker"] == 1 and loader.counters["dead_lettered"] == 0
    finally:
        await pub.close()
        for name in (subjects.stream, subjects.dead_stream):
            await admin.jetstream().delete_stream(name)
        for nc in (loader_nc, admin):
            await nc.close()
