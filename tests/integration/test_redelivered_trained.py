"""A stream batch redelivered after this rank trained it (its +ACK reached the stream too late, after a
paused or partitioned node) is acknowledged, not trained again, and counted; so is a delivery that arrives
while another delivery of the same batch is still queued here, and a first delivery that a redelivery
overtook through another embedding worker. Over a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib

import nats
import numpy as np
import pytest
from persia_nats.common.codec import pack
from persia_nats.common.messages import BatchRef, NamedArray, NNBatch, StreamAck
from persia_nats.common.rpc import request
from persia_nats.common.subjects import Subjects
from persia_nats.services.nn_worker.runtime import NNRuntime

from tests.integration.helpers import settle


def stream_batch(seq: int, delivered: int, ref: int) -> dict:
    labels = (NamedArray("y", np.zeros((2, 1), np.float32)),)
    return NNBatch(seq, 2, BatchRef("w", ref), labels=labels,
                   ack=StreamAck(f"$JS.ACK.S.C.{delivered}.{seq}.{seq}", seq, delivered)).to_wire()


@contextlib.asynccontextmanager
async def rank_zero(url: str, job: str):
    """An NN rank's runtime, a client, and what the client sees: (subject, verdict) of every stream
    acknowledgement, and the refs the rank asked the embedding worker ``w`` to let go."""
    s = Subjects(job)
    nc = await nats.connect(url)
    rt = NNRuntime.build(nc, s, rank=0, world_size=1, timeout=5, incoming_limit=4)
    await rt.start()
    client = await nats.connect(url)
    acks: list[tuple[str, bytes]] = []
    let_go: list[int] = []

    async def on_ack(msg) -> None:
        acks.append((msg.subject, msg.data))

    async def on_lookup(msg) -> None:  # the embedding worker, asked to drop a batch's buffered ids
        from persia_nats.common.codec import unpack

        let_go.append(unpack(msg.data)["ref"])
        await msg.respond(pack({"v": 1}))

    try:
        await client.subscribe("$JS.ACK.S.C.>", cb=on_ack)
        await client.subscribe(s.ew_lookup("w"), cb=on_lookup)
        await settle(client)
        yield rt, client, acks, let_go
    finally:
        await client.close()
        await rt.close()


async def test_a_redelivery_of_a_trained_batch_is_acknowledged_not_retrained(nats_server, job_name):
    s = Subjects(job_name)
    async with rank_zero(nats_server.url, job_name) as (rt, client, acks, let_go):
        await request(client, s.nn_batch(0), stream_batch(5, 1, ref=11), 5)
        first = rt.inbox.incoming.get_nowait()
        assert first.ack.seq == 5
        await rt.acks.acknowledge(first.ack, first.batch_id, trained=True)  # what the training step ends with
        # the stream did not see that +ACK in time (a paused node) and delivers the batch again
        await request(client, s.nn_batch(0), stream_batch(5, 2, ref=12), 5)
        assert rt.inbox.incoming.qsize() == 0
        # a redelivery of a batch not trained yet trains as ever
        await request(client, s.nn_batch(0), stream_batch(6, 2, ref=13), 5)
        assert rt.inbox.incoming.qsize() == 1
        await rt.embeddings.flush_grads()
        await settle(client)
        await asyncio.sleep(0.1)
        assert ("$JS.ACK.S.C.2.5.5", b"+ACK") in acks and not any(".6.6" in a for a, _ in acks), acks
        assert let_go == [12], let_go
        assert rt.counters["stream_redelivered_not_retrained"] == 1, rt.counters
        assert rt.acks.trained_seqs[5] == 1 and rt.counters["stream_acked"] == 1, rt.counters


@pytest.mark.parametrize("verdict", [True, False])
async def test_a_delivery_arriving_while_another_is_queued_shares_its_outcome(nats_server, job_name, verdict):
    """The stream gave batch 5 up for lost while a node was cut off, though its first delivery had reached
    this rank: the second is not queued (it would train twice), is kept alive, and gets the first one's
    +ACK, or its -NAK when the step failed."""
    s = Subjects(job_name)
    async with rank_zero(nats_server.url, job_name) as (rt, client, acks, let_go):
        await request(client, s.nn_batch(0), stream_batch(5, 1, ref=11), 5)
        await request(client, s.nn_batch(0), stream_batch(5, 2, ref=12), 5)
        assert rt.inbox.incoming.qsize() == 1 and let_go == [12], let_go
        first = rt.inbox.incoming.get_nowait()
        await rt.acks.acknowledge(first.ack, first.batch_id, trained=verdict)
        await settle(client)
        await asyncio.sleep(0.1)
        said = dict(acks)
        expected = b"+ACK" if verdict else b"-NAK"
        assert said["$JS.ACK.S.C.1.5.5"].startswith(expected) and said["$JS.ACK.S.C.2.5.5"].startswith(expected), acks
        assert rt.counters["stream_redelivered_not_retrained"] == 1, rt.counters
        assert rt.acks.trained_seqs[5] == (1 if verdict else 0), rt.acks.trained_seqs
        # the verdict is given once: a later delivery is judged afresh
        assert not rt.acks.held(first.ack)


async def test_a_first_delivery_overtaken_by_its_redelivery_is_not_trained_again(nats_server, job_name):
    """Delivery 1 waited at an embedding worker behind a cut-off node; delivery 2 went through the other
    worker, reached this rank first and trained. Delivery 1 arriving now is acknowledged, not trained."""
    s = Subjects(job_name)
    async with rank_zero(nats_server.url, job_name) as (rt, client, acks, let_go):
        await request(client, s.nn_batch(0), stream_batch(5, 2, ref=12), 5)
        second = rt.inbox.incoming.get_nowait()
        await rt.acks.acknowledge(second.ack, second.batch_id, trained=True)
        await request(client, s.nn_batch(0), stream_batch(5, 1, ref=11), 5)
        assert rt.inbox.incoming.qsize() == 0 and let_go == [11], let_go
        await settle(client)
        await asyncio.sleep(0.1)
        assert ("$JS.ACK.S.C.1.5.5", b"+ACK") in acks, acks
        assert rt.acks.trained_seqs[5] == 1 and rt.counters["stream_redelivered_not_retrained"] == 1, rt.counters
