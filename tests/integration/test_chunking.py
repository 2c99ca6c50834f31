"""Messages above the server's max_payload travel in parts (persia_nats.common.chunking), on a real nats-server.

The server runs with ``max_payload: 256KB`` so that a few MB already need chunking.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import numpy as np
import pytest
from persia_nats.common.chunking import (
    CHUNK_BYTES_HEADER,
    CHUNK_FETCH_HEADER,
    CHUNK_HEADER,
    CHUNK_ID_HEADER,
    CHUNKED_HEADER,
    chunk_size,
    part_headers,
)
from persia_nats.common.codec import WIRE_VERSION, array_from_wire, array_to_wire, pack, unpack_message
from persia_nats.common.errors import BadRequest, Busy, NotFound, PayloadTooLarge, RemoteError
from persia_nats.common.rpc import RpcServer, decode_reply, request
from persia_nats.common.subjects import Subjects
from persia_nats.services.embedding_worker.ps_client import PsClient

from tests.integration.helpers import EMBEDDING, running_job, settle
from tests.natsserver import NatsServer, start_nats_server
from tests.rss import rss_bytes

MAX_PAYLOAD = 256 * 1024


@pytest.fixture(scope="module")
def small_server() -> Iterator[NatsServer]:
    server = start_nats_server(extra_conf="max_payload: 256KB")  # the later line wins over 64MB
    yield server
    server.stop()


async def echo(msg: Any) -> dict[str, Any]:
    await asyncio.sleep(0)  # let concurrent requests interleave
    return dict(msg)


def array_msg(n_bytes: int, seed: int = 0) -> tuple[np.ndarray, dict[str, Any]]:
    arr = np.random.default_rng(seed).standard_normal(n_bytes // 8)
    return arr, {"v": WIRE_VERSION, "x": array_to_wire(arr), "seed": seed}


@contextlib.asynccontextmanager
async def serving(url: str, handler: Any = echo, queue: str = "",
                  concurrent: bool = True) -> AsyncIterator[tuple[nats.NATS, RpcServer, str]]:
    server_nc = await nats.connect(url)
    client = await nats.connect(url)
    rpc = RpcServer(server_nc)
    subject = f"chunk.test.{id(rpc)}"
    try:
        await rpc.add(subject, handler, queue=queue, concurrent=concurrent, request=None)
        await settle(server_nc)  # the subscription is in place before anything is published
        yield client, rpc, subject
    finally:
        await rpc.drain(5)
        await client.close()
        await server_nc.close()


def assert_nothing_held(rpc: RpcServer) -> None:
    assert rpc._assembler.assembling == 0 and rpc._assembler.reserved_bytes == 0
    assert rpc._replies.kept == 0 and rpc._replies.kept_bytes == 0


async def wait_for(condition: Any, timeout: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < end, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_a_5mb_echo_round_trips_in_parts(small_server):
    async with serving(small_server.url) as (client, rpc, subject):
        assert client.max_payload == MAX_PAYLOAD
        arr, msg = array_msg(5 * 1024 * 1024)
        reply = await request(client, subject, msg, 10)
        np.testing.assert_array_equal(array_from_wire(reply["x"], "x"), arr)
        parts = -(-len(pack(msg)) // chunk_size(MAX_PAYLOAD))
        assert rpc.chunks["chunked_requests"] == 1 and rpc.chunks["chunked_replies"] == 1
        assert rpc.chunks["chunk_parts_received"] == parts and rpc.chunks["chunk_parts_sent"] >= parts
        assert rpc.summary() == {"requests": 1, "refused": 0, "bad_replies": 0, "chunked_requests": 1,
                                 "chunked_replies": 1}
        assert_nothing_held(rpc)


async def test_one_at_a_time_subjects_join_parts_too(small_server):
    async with serving(small_server.url, concurrent=False) as (client, rpc, subject):
        arr, msg = array_msg(1024 * 1024, seed=3)
        reply = await request(client, subject, msg, 10)
        np.testing.assert_array_equal(array_from_wire(reply["x"], "x"), arr)
        assert_nothing_held(rpc)


async def test_concurrent_large_requests_from_two_clients_stay_apart(small_server):
    async with serving(small_server.url) as (client, rpc, subject):
        other = await nats.connect(small_server.url)
        try:
            sent = [array_msg(1024 * 1024 + 4096 * k, seed=k) for k in range(8)]
            replies = await asyncio.gather(*(
                request(client if k % 2 else other, subject, msg, 20) for k, (_, msg) in enumerate(sent)))
        finally:
            await other.close()
        for (arr, msg), reply in zip(sent, replies, strict=True):
            assert reply["seed"] == msg["seed"]
            np.testing.assert_array_equal(array_from_wire(reply["x"], "x"), arr)
        assert rpc.chunks["chunked_requests"] == 8 and rpc.chunks["chunked_replies"] == 8
        assert_nothing_held(rpc)


async def test_queue_group_subjects_refuse_chunking(small_server):
    async def big(msg: Any) -> dict[str, Any]:
        return {"v": WIRE_VERSION, "x": array_to_wire(np.zeros(MAX_PAYLOAD, np.uint8))}

    async with serving(small_server.url, queue="q") as (client, rpc, subject):
        _, msg = array_msg(1024 * 1024)
        with pytest.raises(BadRequest, match="queue group"):
            await request(client, subject, msg, 10)
        assert rpc.chunks["chunked_requests"] == 0 and rpc.errors[(subject, 400)] == 1
        assert (await request(client, subject, {"v": WIRE_VERSION, "small": 1}, 5))["small"] == 1
        assert_nothing_held(rpc)
    async with serving(small_server.url, handler=big, queue="q") as (client, rpc, subject):
        with pytest.raises(PayloadTooLarge, match="queue group"):
            await request(client, subject, {"v": WIRE_VERSION}, 5)
        assert_nothing_held(rpc)


async def test_an_incomplete_sequence_expires_and_frees_its_memory(small_server):
    async with serving(small_server.url) as (client, rpc, subject):
        rpc.chunking.assembly_timeout_s = 0.3
        part = b"\0" * 100_000
        await client.publish(subject, part, headers=part_headers("lost", 1, 3, 300_000))
        await client.flush()
        await wait_for(lambda: rpc._assembler.assembling == 1)
        assert rpc._assembler.reserved_bytes == 100_000  # what arrived, not what part 1 declared
        await wait_for(lambda: rpc.chunks["chunk_expired"] == 1)
        assert_nothing_held(rpc)
        # the last part arriving after that is answered, not left hanging
        with pytest.raises(BadRequest, match="earlier parts never arrived"):
            decode_reply(await client.request(subject, part, 5, headers=part_headers("lost", 3, 3, 300_000)))
        assert rpc.requests[subject] == 1 and rpc.errors[(subject, 400)] == 1


async def test_malformed_or_out_of_order_parts_get_400(small_server):
    async with serving(small_server.url) as (client, rpc, subject):
        part = b"\0" * 1000
        bad = {CHUNK_ID_HEADER: "x", CHUNK_HEADER: "two/3", CHUNK_BYTES_HEADER: "3000"}
        with pytest.raises(BadRequest, match="Persia-Chunk"):
            decode_reply(await client.request(subject, part, 5, headers=bad))
        # part 2 skipped
        await client.publish(subject, part, headers=part_headers("skip", 1, 3, 3000))
        with pytest.raises(BadRequest, match="part 2/3"):
            decode_reply(await client.request(subject, part, 5, headers=part_headers("skip", 3, 3, 3000)))
        # parts holding more than the declared size
        await client.publish(subject, part * 2, headers=part_headers("long", 1, 2, 3000))
        with pytest.raises(BadRequest, match="3000"):
            decode_reply(await client.request(subject, part * 2, 5, headers=part_headers("long", 2, 2, 3000)))
        assert rpc.chunks["chunked_requests"] == 0
        assert_nothing_held(rpc)


async def test_declared_totals_cost_nothing_until_their_bytes_arrive(small_server):
    async with serving(small_server.url) as (client, rpc, subject):
        rss_before = rss_bytes(os.getpid())
        for k in range(8):  # 1 byte each, declaring 1 GiB: once 8 GiB allocated at the first part
            await client.publish(subject, b"\0", headers=part_headers(f"liar{k}", 1, 2, 1 << 30))
        await client.flush()
        await wait_for(lambda: rpc._assembler.assembling == 8)
        assert rpc._assembler.reserved_bytes == 8
        assert rss_bytes(os.getpid()) - rss_before < 64 << 20
        rpc._assembler.clear()


async def test_parts_beyond_the_byte_budget_are_refused_and_counted(small_server):
    async with serving(small_server.url) as (client, rpc, subject):
        rpc.chunking.max_assembling_bytes = 250_000
        part = b"\0" * 100_000
        for i in (1, 2):
            await client.publish(subject, part, headers=part_headers("big", i, 4, 400_000))
        await client.flush()
        await wait_for(lambda: rpc._assembler.reserved_bytes == 200_000)
        await client.publish(subject, part, headers=part_headers("big", 3, 4, 400_000))
        with pytest.raises(Busy, match="250000"):
            decode_reply(await client.request(subject, part, 5, headers=part_headers("big", 4, 4, 400_000)))
        assert rpc.chunks["chunk_refused_bytes"] == 1
        assert_nothing_held(rpc)
        # within the budget, the next request goes through
        arr, msg = array_msg(200_000)
        np.testing.assert_array_equal(array_from_wire((await request(client, subject, msg, 10))["x"], "x"), arr)


async def test_a_reply_announcing_1_gib_costs_only_the_bytes_that_come(small_server):
    responder = await nats.connect(small_server.url)
    client = await nats.connect(small_server.url)

    during: list[int] = []

    async def liar(msg: Any) -> None:  # announces a 1 GiB reply, then serves a byte per part
        if msg.headers and CHUNK_FETCH_HEADER in msg.headers:
            during.append(rss_bytes(os.getpid()))  # the requester holds what it allocated by now
            await msg.respond(b"\0")
        else:
            await responder.publish(msg.reply, b"", headers={CHUNKED_HEADER: "2", CHUNK_ID_HEADER: "big",
                                                             CHUNK_BYTES_HEADER: str(1 << 30)})

    try:
        await responder.subscribe("chunk.test.liar", cb=liar)
        await settle(responder)
        rss_before = rss_bytes(os.getpid())
        with pytest.raises(RemoteError, match="2 bytes of the announced 1073741824"):
            await request(client, "chunk.test.liar", {"v": WIRE_VERSION}, 5)
        assert len(during) == 2 and max(during) - rss_before < 64 << 20
    finally:
        await client.close()
        await responder.close()


async def test_too_many_assemblies_at_once_get_503(small_server):
    async with serving(small_server.url) as (client, rpc, subject):
        rpc.chunking.max_assembling = 1
        first = pack({"v": WIRE_VERSION, "k": "first"})
        await client.publish(subject, first[:5], headers=part_headers("first", 1, 2, len(first)))
        await client.flush()
        await wait_for(lambda: rpc._assembler.assembling == 1)
        with pytest.raises(Busy):
            await request(client, subject, array_msg(1024 * 1024)[1], 5)
        reply = await client.request(subject, first[5:], 5, headers=part_headers("first", 2, 2, len(first)))
        assert decode_reply(reply) == {"v": WIRE_VERSION, "k": "first"}
        assert rpc.errors[(subject, 503)] == 1
        assert_nothing_held(rpc)


async def test_an_oversized_request_gets_413_without_being_buffered(small_server):
    calls = []

    async def handler(msg: Any) -> dict[str, Any]:
        calls.append(msg)
        return {"v": WIRE_VERSION}

    async with serving(small_server.url, handler=handler) as (client, rpc, subject):
        rpc.chunking.max_message_bytes = 1_000_000
        part = b"\0" * 200_000
        for i in range(1, 15):
            await client.publish(subject, part, headers=part_headers("huge", i, 15, 3_000_000))
        await client.flush()
        await wait_for(lambda: rpc.chunks["chunk_parts_received"] == 14)
        assert rpc._assembler.assembling == 0 and rpc._assembler.reserved_bytes == 0
        with pytest.raises(PayloadTooLarge, match="1000000"):
            decode_reply(await client.request(subject, part, 5, headers=part_headers("huge", 15, 15, 3_000_000)))
        # and through request() itself
        with pytest.raises(PayloadTooLarge):
            await request(client, subject, array_msg(2 * 1024 * 1024)[1], 5)
        assert not calls and rpc.errors[(subject, 413)] == 2
        assert_nothing_held(rpc)


async def test_fetching_an_unknown_or_finished_reply_gets_404(small_server):
    async def big(msg: Any) -> dict[str, Any]:
        return {"v": WIRE_VERSION, "x": array_to_wire(np.arange(200_000, dtype=np.uint64))}

    async with serving(small_server.url, handler=big) as (client, rpc, subject):
        with pytest.raises(NotFound):
            decode_reply(await client.request(subject, b"", 5, headers={CHUNK_FETCH_HEADER: "nope", CHUNK_HEADER: "1"}))
        # a plain client fetches a chunked reply by hand, as docs/protocol.md describes
        announce = await client.request(subject, pack({"v": WIRE_VERSION}), 5)
        assert announce.data == b""
        n, chunk_id = int(announce.headers[CHUNKED_HEADER]), announce.headers[CHUNK_ID_HEADER]
        parts = [await client.request(subject, b"", 5, headers={CHUNK_FETCH_HEADER: chunk_id, CHUNK_HEADER: str(i)})
                 for i in range(1, n + 1)]
        joined = b"".join(p.data for p in parts)
        assert len(joined) == int(announce.headers[CHUNK_BYTES_HEADER])
        got = array_from_wire(unpack_message(joined)["x"], "x")
        np.testing.assert_array_equal(got, np.arange(200_000, dtype=np.uint64))
        assert_nothing_held(rpc)  # freed after the last part
        with pytest.raises(NotFound):
            decode_reply(await client.request(subject, b"", 5, headers={CHUNK_FETCH_HEADER: chunk_id,
                                                                         CHUNK_HEADER: str(n)}))
        # an unfetched reply expires
        rpc.chunking.reply_keep_s = 0.2
        await client.request(subject, pack({"v": WIRE_VERSION}), 5)
        assert rpc._replies.kept == 1
        await wait_for(lambda: rpc.chunks["chunk_replies_expired"] == 1)
        assert_nothing_held(rpc)


async def test_small_messages_carry_no_chunk_headers(small_server):
    async with serving(small_server.url) as (client, rpc, subject):
        seen = []

        async def answer(m: Any) -> None:
            seen.append(m)
            await m.respond(pack({"v": WIRE_VERSION}))

        raw = await client.subscribe(f"{subject}.raw", cb=answer)
        try:
            await request(client, f"{subject}.raw", {"v": WIRE_VERSION, "x": b"\0" * 1000}, 5)
        finally:
            await raw.unsubscribe()
        assert seen and seen[0].headers is None
        reply = await client.request(subject, pack({"v": WIRE_VERSION, "x": b"\0" * 1000}), 5)
        assert reply.headers is None
        assert not rpc.chunks


async def test_a_ps_lookup_above_max_payload_works(small_server, job_name):
    wide = {**EMBEDDING, "slots_config": {**EMBEDDING["slots_config"], "w": {"dim": 32}}}  # PSs serve job widths
    async with running_job(small_server.url, job_name, replicas=1, embedding=wide) as (client, (ps,), _):
        s = Subjects(job_name)
        ids = np.arange(1, 60_001, dtype=np.uint64) * 7919  # 480 KB of ids: the request is chunked too
        # 60,000 rows x 32 float32 = 7.7 MB, some 30 times max_payload
        ps_client = PsClient(client, s, replica_size=1, timeout=10)
        rows = (await ps_client.lookup({32: ids}, train=True))[32]
        assert rows.shape == (60_000, 32) and len(ps.store) == 60_000
        np.testing.assert_array_equal(rows, ps.store.lookup(ids, 32, False))
        # and with a plain request
        msg = {"v": WIRE_VERSION, "train": False, "groups": [{"dim": 32, "ids": array_to_wire(ids)}]}
        again = array_from_wire((await request(client, s.ps(0, "lookup"), msg, 10))["groups"][0], "g")
        np.testing.assert_array_equal(again, rows)
        assert ps.rpc.chunks["chunked_requests"] == 2 and ps.rpc.chunks["chunked_replies"] == 2
        assert_nothing_held(ps.rpc)
