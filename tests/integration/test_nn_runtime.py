"""NN-worker subjects and the data loader's sender against a real nats-server."""

from __future__ import annotations

import asyncio

import nats
import numpy as np
import pytest
from persia_nats.common.batch import IDTypeFeature, Label, NonIDTypeFeature, PersiaBatch
from persia_nats.common.codec import WIRE_VERSION, array_to_wire, pack
from persia_nats.common.errors import BadRequest, Busy
from persia_nats.common.messages import BatchRef, Empty, NamedArray, NNBatch, NNEnd, PsConfigure
from persia_nats.common.rpc import request
from persia_nats.common.subjects import Subjects
from persia_nats.services.data_loader.sender import BatchSender
from persia_nats.services.nn_worker.runtime import (
    BATCH_HOLD_S,
    END,
    GradPush,
    HotRowSettings,
    NNRuntime,
    Pipeline,
    StalenessGate,
)

from tests.integration.helpers import running_job, settle


def nn_batch(batch_id=0, batch_size=2, **kw):
    labels = (NamedArray("y", np.zeros((batch_size, 1), np.float32)),)
    return NNBatch(batch_id, batch_size, BatchRef("w", 1), labels=labels, **kw).to_wire()


@pytest.fixture
async def runtime(nats_server, job_name):
    nc = await nats.connect(nats_server.url)
    rt = NNRuntime.build(nc, Subjects(job_name), rank=0, world_size=1, timeout=5, incoming_limit=2)
    await rt.start()
    client = await nats.connect(nats_server.url)
    yield rt, client
    await client.close()
    await rt.close()


BAD_BATCHES = [
    b"\x00\x01\x02",
    pack({"v": WIRE_VERSION}),
    pack({**nn_batch(), "batch_id": "one"}),
    pack({**nn_batch(), "ref": {"worker": 1, "ref": 1}}),
    pack({**nn_batch(), "labels": []}),  # training batch without labels
    pack({**nn_batch(), "labels": [{"name": "y", "data": np.zeros((3, 1), np.float32)}]}),  # wrong batch dim
    pack({**nn_batch(), "non_id": [{"name": "x", "data": {"dtype": "<f4", "shape": [2], "data": b"short"}}]}),
    pack({**nn_batch(), "meta": 5}),
]


@pytest.mark.parametrize("payload", BAD_BATCHES)
async def test_bad_batches_are_refused_and_nothing_is_queued(runtime, job_name, payload):
    rt, client = runtime
    with pytest.raises(BadRequest):
        await request(client, Subjects(job_name).nn_batch(0), payload, 5)
    assert rt.inbox.incoming.qsize() == 0
    await request(client, Subjects(job_name).nn_batch(0), nn_batch(), 5)
    assert rt.inbox.incoming.qsize() == 1


async def test_full_buffer_answers_busy(runtime, job_name):
    rt, client = runtime
    s = Subjects(job_name)
    for i in range(2):
        await request(client, s.nn_batch(0), nn_batch(i), 5)
    started = asyncio.get_running_loop().time()
    with pytest.raises(Busy):
        await request(client, s.nn_batch(0), nn_batch(2), 5)
    # refused only after waiting for room a while, so a loader does not poll a busy rank
    assert asyncio.get_running_loop().time() - started >= BATCH_HOLD_S * 0.9
    assert rt.inbox.incoming.qsize() == 2 and rt.counters["batches_refused_busy"] == 1


async def test_a_batch_sent_to_a_full_buffer_is_taken_as_soon_as_there_is_room(runtime, job_name):
    rt, client = runtime
    s = Subjects(job_name)
    for i in range(2):
        await request(client, s.nn_batch(0), nn_batch(i), 5)
    # two more while the buffer is full: the first waits for room, the second behind it
    waiting = [asyncio.create_task(request(client, s.nn_batch(0), nn_batch(i), 5)) for i in (2, 3)]
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in waiting) and rt.inbox.incoming.qsize() == 2
    taken = [(await rt.inbox.incoming.get()).batch_id]
    assert (await asyncio.wait_for(waiting[0], 1))["ok"]  # accepted once the loop took a batch, not refused
    assert not waiting[1].done() and rt.inbox.incoming.qsize() == 2
    taken.append((await rt.inbox.incoming.get()).batch_id)
    assert (await asyncio.wait_for(waiting[1], 1))["ok"]
    taken += [(await rt.inbox.incoming.get()).batch_id for _ in range(2)]
    assert taken == [0, 1, 2, 3] and rt.counters["batches_refused_busy"] == 0


async def test_a_batch_with_a_wait_is_held_past_the_short_hold_until_there_is_room(runtime, job_name):
    rt, client = runtime
    s = Subjects(job_name)
    for i in range(2):
        await request(client, s.nn_batch(0), nn_batch(i), 5)
    # both held at once, each for its own wait from its own arrival: neither queues behind the other
    waiting = [asyncio.create_task(request(client, s.nn_batch(0), nn_batch(i, wait=3.0), 5)) for i in (2, 3)]
    await asyncio.sleep(BATCH_HOLD_S * 2)
    assert not any(t.done() for t in waiting) and rt.inbox._batches_waiting == 2
    for _ in range(2):
        await rt.inbox.incoming.get()
    assert all(r["ok"] for r in await asyncio.wait_for(asyncio.gather(*waiting), 1))
    assert rt.counters["batches_waited"] == 2 and rt.counters["batches_refused_busy"] == 0
    assert sorted(b.batch_id for b in (rt.inbox.incoming.get_nowait(), rt.inbox.incoming.get_nowait())) == [2, 3]
    # a wait that runs out is still a 503, counted
    await request(client, s.nn_batch(0), nn_batch(4), 5)
    await request(client, s.nn_batch(0), nn_batch(5), 5)
    with pytest.raises(Busy):
        await request(client, s.nn_batch(0), nn_batch(6, wait=0.5), 5)
    assert rt.counters["batches_refused_busy"] == 1 and rt.inbox.incoming.qsize() == 2


@pytest.mark.parametrize("msg", [
    Empty(),
    {"v": WIRE_VERSION, "loader_index": 1, "loader_size": 1, "batches": 0},
    {"v": WIRE_VERSION, "loader_index": 0, "loader_size": 1, "batches": -1},
    {"v": WIRE_VERSION, "loader_index": True, "loader_size": 1, "batches": 0},
])
async def test_bad_end_messages_are_refused(runtime, job_name, msg):
    rt, client = runtime
    with pytest.raises(BadRequest):
        await request(client, Subjects(job_name).nn_end(0), msg, 5)
    assert rt.inbox.incoming.qsize() == 0


async def test_stream_ends_only_after_every_announced_batch_arrived(runtime, job_name):
    rt, client = runtime
    s = Subjects(job_name)
    await request(client, s.nn_end(0), NNEnd(0, 2, 1), 5)
    await request(client, s.nn_end(0), NNEnd(1, 2, 1), 5)
    assert rt.inbox.incoming.qsize() == 0  # two batches announced, none arrived yet
    await request(client, s.nn_batch(0), nn_batch(0), 5)
    assert rt.inbox.incoming.qsize() == 1
    await request(client, s.nn_batch(0), nn_batch(1), 5)
    items = [rt.inbox.incoming.get_nowait() for _ in range(3)]
    assert items[-1] is END
    with pytest.raises(BadRequest, match="ended"):
        await request(client, s.nn_batch(0), nn_batch(2), 5)
    info = await request(client, s.nn_info(), Empty(), 5)
    assert info["world_size"] == 1


# the batches below carry slot a only, and a batch must carry every configured slot
A_ONLY = {"feature_index_prefix_bit": 8, "slots_config": {"a": {"dim": 4}}}


def persia_batch(i, bs=3):
    rng = np.random.default_rng(i)
    a = IDTypeFeature("a", [rng.integers(0, 50, rng.integers(0, 4)).astype(np.uint64) for _ in range(bs)])
    return PersiaBatch([a], [NonIDTypeFeature(np.full((bs, 2), i, np.float32))],
                       [Label(np.zeros((bs, 1), np.float32))])


async def _send_batches(sender, n):
    for i in range(n):
        await sender.send(persia_batch(i))
    await sender.finish()


async def _drain(pipe):
    """Each batch's id (its dense feature) until the end of stream, checking its embeddings' shape."""
    seen = []
    while True:
        item = await asyncio.wait_for(pipe.next(), 10)
        if item is END:
            return seen
        seen.append(int(item.non_id[0].data[0, 0]))
        assert item.embeddings[0].emb.shape == (3, 4)


async def test_loader_to_pipeline_delivers_every_batch_in_order_with_embeddings(nats_server, job_name):
    async with running_job(nats_server.url, job_name, embedding=A_ONLY) as (client, _, ew):
        nc = await nats.connect(nats_server.url)
        rt = NNRuntime.build(nc, Subjects(job_name), rank=0, world_size=1, timeout=5, incoming_limit=3)
        await rt.start()
        gate = StalenessGate(2)
        pipe = Pipeline(rt, gate=gate, forward_buffer_size=2, train=False)
        sender = BatchSender(client, Subjects(job_name), max_inflight=1)
        producer = asyncio.create_task(_send_batches(sender, 12))
        seen = await _drain(pipe)
        await producer
        assert seen == list(range(12))  # 12 batches through a 3-deep buffer: held until room, never lost
        await pipe.cancel()
        await rt.close()


async def test_a_loader_with_a_long_timeout_asks_for_no_more_wait_than_a_receiver_takes(nats_server, job_name):
    async with running_job(nats_server.url, job_name, embedding=A_ONLY) as (client, _, ew):
        nc = await nats.connect(nats_server.url)
        rt = NNRuntime.build(nc, Subjects(job_name), rank=0, world_size=1, timeout=5, incoming_limit=3)
        await rt.start()
        # half of 3000 s would be a wait beyond the 600 s a receiver takes: every batch would be a 400
        sender = BatchSender(client, Subjects(job_name), timeout=3000)
        await sender.send(persia_batch(0))
        await sender.flush()
        assert sender.refused == 0 and ew.counters["ingested"] == 1
        assert (await asyncio.wait_for(rt.inbox.incoming.get(), 5)).wait == 600.0
        await rt.close()


async def test_full_buffers_hold_the_loaders_batches_so_each_crosses_the_wire_once(nats_server, job_name):
    async with running_job(nats_server.url, job_name, embedding=A_ONLY) as (client, _, ew):
        nc = await nats.connect(nats_server.url)
        rt = NNRuntime.build(nc, Subjects(job_name), rank=0, world_size=1, timeout=5, incoming_limit=3)
        await rt.start()
        gate = StalenessGate(2)
        pipe = Pipeline(rt, gate=gate, forward_buffer_size=2, train=False)
        sender = BatchSender(client, Subjects(job_name), max_inflight=4)
        producer = asyncio.create_task(_send_batches(sender, 12))
        # nothing taken until both buffers are full (the embedding worker holds 4 batches, the rank 3):
        # the next batches must wait for room there
        for _ in range(100):
            if rt.counters["batches_waited"] and ew.counters["ingest_waited"]:
                break
            await asyncio.sleep(0.05)
        seen = await _drain(pipe)
        await producer
        # 4 on the wire at once may arrive in any order; none lost
        assert sorted(seen) == list(range(12))
        # every batch crossed the wire once: the full buffers held them instead of answering busy
        assert rt.counters["batches_waited"] >= 1 and ew.counters["ingest_waited"] >= 1
        assert not sender.resent and ew.counters["ingest_refused_busy"] == rt.counters["batches_refused_busy"] == 0
        await pipe.cancel()
        await rt.close()


async def test_the_time_the_training_loop_waits_for_a_batch_is_counted(nats_server, job_name):
    async with running_job(nats_server.url, job_name, embedding=A_ONLY) as (client, _, ew):
        nc = await nats.connect(nats_server.url)
        rt = NNRuntime.build(nc, Subjects(job_name), rank=0, world_size=1, timeout=5)
        await rt.start()
        pipe = Pipeline(rt, gate=StalenessGate(2), forward_buffer_size=2, train=False)
        sender = BatchSender(client, Subjects(job_name), max_inflight=1)
        waiting = asyncio.create_task(pipe.next())
        await asyncio.sleep(0.3)  # the loop asks before any batch exists
        await sender.send(persia_batch(0))
        assert int((await asyncio.wait_for(waiting, 10)).non_id[0].data[0, 0]) == 0
        assert 300_000 <= rt.counters["train_wait_us"] < 10_000_000, rt.counters
        await pipe.cancel()
        await rt.close()


async def test_a_restarted_unconfigured_ps_gets_the_optimizer_again(nats_server, job_name):
    from persia_nats.common.messages import IngestRequest, SlotGradient
    from persia_nats.common.optim_config import SGDConfig
    from persia_nats.services.embedding_ps.service import EmbeddingParameterServer

    from tests.integration.helpers import global_config

    async with running_job(nats_server.url, job_name, embedding=A_ONLY, replicas=1) as (client, (ps,), ew):
        s = Subjects(job_name)
        configure_msg = PsConfigure(SGDConfig(lr=0.1))

        async def reconfigure():
            await request(client, s.ps(0, "configure"), configure_msg, 5)

        await reconfigure()
        nc = await nats.connect(nats_server.url)
        rt = NNRuntime.build(nc, s, rank=0, world_size=1, timeout=5, reconfigure=reconfigure)
        await rt.start()
        batch = persia_batch(0)
        ref, emb, gathered = await rt.embeddings.ingest_and_lookup(
            IngestRequest(tuple(f.jagged for f in batch.id_type_features)))
        assert not gathered  # slot a has several ids a sample: its outputs came pooled
        # the replica restarts empty and unconfigured
        await ps.stop(drain_timeout=1)
        fresh = EmbeddingParameterServer(await nats.connect(nats_server.url), global_config(job_name), 0, 1)
        await fresh.start()
        try:
            gate = StalenessGate(1)
            permit = await gate.acquire()
            rt.embeddings.send_grads(GradPush(ref=ref, grads=(SlotGradient("a", np.ones((3, 4), np.float16)),),
                                              permit=permit))
            await rt.embeddings.flush_grads()
            assert rt.counters["ps_reconfigured"] == 1
            assert rt.counters["grads_applied"] == 1 and not rt.counters["grad_failures"]
            assert fresh.configured and gate.inflight == 0
        finally:
            await fresh.stop(drain_timeout=1)
            await fresh.nc.close()
            await rt.close()


async def test_the_pipeline_looks_up_exactly_forward_buffer_size_batches_ahead(nats_server, job_name):
    async with running_job(nats_server.url, job_name, embedding=A_ONLY) as (client, _, ew):
        nc = await nats.connect(nats_server.url)
        lookups: list[str] = []
        rt = NNRuntime.build(nc, Subjects(job_name), rank=0, world_size=1, timeout=5, incoming_limit=8,
                             observe_call=lambda kind, _s: lookups.append(kind))
        await rt.start()
        pipe = Pipeline(rt, gate=None, forward_buffer_size=2, train=False)
        sender = BatchSender(client, Subjects(job_name), max_inflight=1)
        for i in range(6):
            await sender.send(persia_batch(i))
        first = await asyncio.wait_for(pipe.next(), 10)
        assert int(first.non_id[0].data[0, 0]) == 0
        await asyncio.sleep(0.5)  # time for any lookup that would start early
        # the batch the loop holds, plus two ahead: an embedding is never read earlier than that
        assert lookups.count("lookup") == 3, lookups
        for i in range(1, 6):
            item = await asyncio.wait_for(pipe.next(), 10)
            assert int(item.non_id[0].data[0, 0]) == i
        await pipe.cancel()
        await rt.close()


def hot_batch(i):
    # id 5 is in every sample of slot a, so with hot_row_min_count 3 it comes back apart from the sums
    a = IDTypeFeature("a", [np.array([5, 10 + i], np.uint64), np.array([5], np.uint64), np.array([5], np.uint64)])
    return PersiaBatch([a], [NonIDTypeFeature(np.full((3, 2), i, np.float32))], [Label(np.zeros((3, 1), np.float32))])


async def hot_pipeline(url, client, s, observe_call=None):
    """A rank of one with hot rows, its PS replicas and mirror on SGD lr 1, subscribed before any update
    publishes, and a training pipeline over it (a staleness bound of 4, 2 batches looked up ahead)."""
    from persia_nats.common.optim_config import SGDConfig

    for i in range(2):
        await request(client, s.ps(i, "configure"), PsConfigure(SGDConfig(lr=1.0)), 5)
    nc = await nats.connect(url)
    # as a training context builds it for a job with hot rows, in hybrid or async mode
    rt = NNRuntime.build(nc, s, rank=0, world_size=1, timeout=5, incoming_limit=4,
                         hot_rows=HotRowSettings(optimizer=(SGDConfig(lr=1.0), 0.0)), observe_call=observe_call)
    await rt.start()
    await settle(nc)
    gate = StalenessGate(4)
    return rt, gate, Pipeline(rt, gate=gate, forward_buffer_size=2, train=True)


async def read_now(client, s, i):
    """Slot a of hot_batch(i) as the PS holds its rows now (float32)."""
    from persia_nats.common.messages import IngestRequest, embeddings_from_wire

    features = IngestRequest(tuple(f.jagged for f in hot_batch(i).id_type_features)).features
    msg = {"v": WIRE_VERSION, "features": [f.to_wire() for f in features]}
    direct = await request(client, s.ew_lookup_direct(), msg, 5)
    return embeddings_from_wire(direct["embeddings"])[0].emb.astype(np.float32)


async def test_the_next_batch_is_readied_once_the_gradients_are_handed_off(nats_server, job_name):
    from persia_nats.common.messages import SlotGradient

    async with running_job(nats_server.url, job_name, embedding=A_ONLY, hot_row_min_count=3) as (client, _, ew):
        s = Subjects(job_name)
        rt, gate, pipe = await hot_pipeline(nats_server.url, client, s)
        sender = BatchSender(client, s, max_inflight=1)
        for i in range(3):
            await sender.send(hot_batch(i))
        first = await asyncio.wait_for(pipe.next(), 10)
        await asyncio.sleep(0.2)  # the second batch is looked up meanwhile, and not readied early
        assert pipe._prefetched is None and rt.counters["hot_batches"] == 1
        # each batch's gradient moves id 5 by -3 (three samples, SGD lr 1); once the PS has published
        # the row, its optimizer state is known here and gradients still in flight can be applied to it
        grad = (SlotGradient("a", np.ones((3, 4), np.float16)),)
        rt.embeddings.send_grads(GradPush(ref=first.ref, grads=grad, permit=first.permit, hot=first.hot))
        await rt.embeddings.flush_grads()
        for _ in range(100):
            if rt.hot.mirror.counters["hot_publications"]:
                break
            await asyncio.sleep(0.02)
        second = await asyncio.wait_for(pipe.next(), 10)
        assert int(second.non_id[0].data[0, 0]) == 1 and rt.counters["hot_batches"] == 2
        rt.embeddings.send_grads(GradPush(ref=second.ref, grads=grad, permit=second.permit, hot=second.hot))
        for _ in range(100):  # readied as the gradients leave, before the PS can apply them
            if pipe._prefetched is not None:
                break
            await asyncio.sleep(0.01)
        readied = pipe._prefetched
        assert readied is not None
        third = await asyncio.wait_for(pipe.next(), 10)
        assert third is readied.result() and int(third.non_id[0].data[0, 0]) == 2
        await rt.embeddings.flush_grads()
        now = await read_now(client, s, 2)
        assert float(now[1, 0]) < -5.5  # both updates landed on the PS
        # yet the batch readied before the second one was applied trains on id 5 with it
        np.testing.assert_allclose(third.embeddings[0].emb, now, atol=1.6e-2)
        assert rt.hot.mirror.counters["hot_row_corrections"] >= 1
        third.permit.release()  # its gradients are never sent here
        await pipe.cancel()
        assert pipe._ahead is not None and pipe._ahead.cancelled()  # it waits for no hand-off any more
        await rt.close()


async def test_a_batch_looked_up_ahead_trains_on_hot_rows_updated_since(nats_server, job_name):
    from persia_nats.common.codec import array_to_wire
    from persia_nats.common.messages import SlotGradient

    async with running_job(nats_server.url, job_name, embedding=A_ONLY, hot_row_min_count=3) as (client, pss, ew):
        s = Subjects(job_name)
        lookups: list[str] = []
        rt, gate, pipe = await hot_pipeline(nats_server.url, client, s,
                                            observe_call=lambda kind, _s: lookups.append(kind))
        # the batch is handed out here when asked for, not readied when the first one's gradients leave
        # (test_the_next_batch_is_readied_once_the_gradients_are_handed_off)
        pipe.stop_readying_ahead()
        sender = BatchSender(client, s, max_inflight=1)
        for i in range(2):
            await sender.send(hot_batch(i))
        first = await asyncio.wait_for(pipe.next(), 10)
        for _ in range(50):  # the second batch is looked up while the first trains
            if lookups.count("lookup") == 2:
                break
            await asyncio.sleep(0.05)
        assert lookups.count("lookup") == 2
        # the first batch's gradient moves id 5 by -3 (three samples, SGD lr 1) after the second was read;
        # the rank publishes its hot rows' gradient first, and the PS's publication then settles it
        rt.embeddings.send_grads(GradPush(ref=first.ref, grads=(SlotGradient("a", np.ones((3, 4), np.float16)),),
                                          permit=first.permit, hot=first.hot))
        await rt.embeddings.flush_grads()
        for _ in range(50):
            if rt.hot.mirror.counters["hot_publications"] and rt.counters["hot_grads"]:
                break
            await asyncio.sleep(0.05)
        assert sum(p.rows_published for p in pss) == 1 and rt.hot.mirror.counters["hot_publications"] == 1
        assert rt.counters["hot_grads"] == 1 and rt.hot.mirror.pending == 0
        # another rank's gradient of id 5 (2 per element) is in flight: sent, not yet applied by the PS
        # (the test plays rank 1, so its announcements reach this runtime as in a world of two ranks)
        await rt.nc.subscribe(s.hot_grads(1), cb=rt.hot._on_hot)
        await settle(rt.nc)
        five = first.hot.groups[0].ids
        await client.publish(s.hot_grads(1), pack({
            "v": WIRE_VERSION, "update_id": "elsewhere.7", "rank": 1, "seq": 1, "groups": [
                {"dim": 4, "ids": array_to_wire(five), "grads": array_to_wire(np.full((1, 4), 2, np.float32))}]}))
        for _ in range(50):
            if rt.hot.mirror.pending:
                break
            await asyncio.sleep(0.05)
        assert rt.hot.mirror.pending == 1
        second = await asyncio.wait_for(pipe.next(), 10)
        now = await read_now(client, s, 1)
        assert float(now[1, 0]) < -2.5  # the first update did land (rows start within +-0.01)
        # trained on id 5 as it is now, and with the gradient in flight applied (SGD: -1 * 2)
        np.testing.assert_allclose(second.embeddings[0].emb, now - np.array([[2], [2], [2]], np.float32), atol=8e-3)
        assert rt.hot.mirror.counters["hot_rows_fresher"] == 1 and rt.hot.mirror.counters["hot_row_corrections"] == 1
        assert rt.stats()["hot_rows_held"] == 1 and ew.counters["hot_rows"] == 2
        second.permit.release()  # its gradients are never sent here
        await pipe.cancel()
        await rt.close()


async def test_a_hand_off_waits_for_the_other_ranks_hot_row_gradients_of_the_step(nats_server, job_name):
    s = Subjects(job_name)
    nc = await nats.connect(nats_server.url)
    rt = NNRuntime.build(nc, s, rank=0, world_size=2, timeout=5, hot_rows=HotRowSettings())
    await rt.start()
    client = await nats.connect(nats_server.url)
    try:
        await settle(nc)
        # this rank announced one batch (a batch without hot rows is announced too, with no groups)
        await rt.hot.publish_grads(BatchRef("w", 1), {})
        assert rt.hot.mirror.pending == 0  # nothing to apply, yet it counts

        async def other_rank_announces():
            await asyncio.sleep(0.2)
            await client.publish(s.hot_grads(1), pack({"v": WIRE_VERSION, "update_id": "w.2", "rank": 1, "seq": 1,
                                                       "groups": []}))

        started = asyncio.get_running_loop().time()
        announcing = asyncio.create_task(other_rank_announces())
        await rt.hot.caught_up(timeout=5)
        waited = asyncio.get_running_loop().time() - started
        await announcing
        assert 0.15 < waited < 4 and not rt.counters["hot_grads_wait_timeouts"]
        # a rank that has run out of batches announces nothing: the wait gives up, counted
        await rt.hot.publish_grads(BatchRef("w", 3), {})
        await rt.hot.caught_up(timeout=0.1)
        assert rt.counters["hot_grads_wait_timeouts"] == 1
        # a batch readied ahead waits long, until the training loop asks for it, then briefly
        await rt.hot.publish_grads(BatchRef("w", 4), {})
        waiting = asyncio.create_task(rt.hot.caught_up(timeout=30))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        started = asyncio.get_running_loop().time()
        rt.hot.hurry(0.1)
        await asyncio.wait_for(waiting, 5)
        assert 0.05 < asyncio.get_running_loop().time() - started < 4
        assert rt.counters["hot_grads_wait_timeouts"] == 2
    finally:
        await client.close()
        await rt.close()


async def test_a_fault_in_the_hot_row_gradients_still_sends_the_batchs_gradients(nats_server, job_name):
    from persia_nats.common.messages import SlotGradient

    async with running_job(nats_server.url, job_name, embedding=A_ONLY, hot_row_min_count=3) as (client, pss, ew):
        s = Subjects(job_name)
        rt, gate, pipe = await hot_pipeline(nats_server.url, client, s)
        await BatchSender(client, s, max_inflight=1).send(hot_batch(0))
        batch = await asyncio.wait_for(pipe.next(), 10)
        assert batch.hot is not None and gate.inflight == 1
        # a slot gradient of the wrong rank cannot give the hot rows' gradients
        rt.embeddings.send_grads(GradPush(ref=batch.ref, grads=(SlotGradient("a", np.ones((3, 4), np.float16)),),
                                          permit=batch.permit, hot=batch.hot, hot_grads={"a": np.ones(3, np.float32)}))
        await asyncio.wait_for(rt.embeddings.flush_grads(), 20)
        assert rt.counters["hot_grads_failed"] == 1
        # the batch's gradients were applied all the same, its permit given back, and the step announced
        assert rt.counters["grads_applied"] == 1 and not rt.counters["grad_failures"]
        assert gate.inflight == 0 and rt.hot.sent == 1
        assert float((await read_now(client, s, 0))[1, 0]) < -2.5
        await pipe.cancel()
        await rt.close()


async def test_without_hot_rows_a_rank_takes_no_published_rows(nats_server, job_name):
    s = Subjects(job_name)
    nc = await nats.connect(nats_server.url)
    rt = NNRuntime.build(nc, s, rank=0, world_size=2, timeout=5)
    await rt.start()
    client = await nats.connect(nats_server.url)
    try:
        await settle(nc)
        wide = {"v": WIRE_VERSION, "version": 1, "groups": [
            {"ids": array_to_wire(np.arange(1, 11, dtype=np.uint64)), "rows": array_to_wire(
                np.ones((10, 10**6), np.float32))}]}  # 40 MB a message: once kept, 100 rows gave +460 MB
        for _ in range(3):
            await client.publish(s.hot_rows(0), pack(wide))
        await settle(client, nc)
        assert len(rt.hot.mirror) == 0 and rt.hot.mirror.nbytes == 0 and not rt.counters["hot_publications"]
    finally:
        await client.close()
        await rt.close()


async def test_bad_hot_row_messages_are_counted_by_kind_and_change_nothing(nats_server, job_name):
    s = Subjects(job_name)
    nc = await nats.connect(nats_server.url)
    rt = NNRuntime.build(nc, s, rank=0, world_size=2, timeout=5, hot_rows=HotRowSettings())
    await rt.start()
    client = await nats.connect(nats_server.url)
    try:
        await settle(nc)
        await client.publish(s.hot_rows(0), b"\x00\x01")  # not msgpack
        await client.publish(s.hot_rows(0), pack({"v": WIRE_VERSION, "version": "7", "groups": []}))
        await client.publish(s.hot_grads(1), pack({"v": WIRE_VERSION, "update_id": "w.1", "rank": 1, "seq": 1,
                                                   "groups": [{"dim": 4, "ids": [1], "grads": "x"}]}))
        for _ in range(50):
            if rt.counters["hot_publications_bad"] + rt.counters["hot_grads_bad"] == 3:
                break
            await asyncio.sleep(0.05)
        assert rt.counters["hot_publications_bad"] == 2 and rt.counters["hot_grads_bad"] == 1
        assert len(rt.hot.mirror) == 0 and rt.hot.mirror.pending == 0 and rt.hot.mirror.sent_by == {}
        assert not rt.counters["hot_publications"] and not rt.counters["hot_grads"]
    finally:
        await client.close()
        await rt.close()


async def test_a_batch_that_does_not_fit_the_schema_is_refused_by_name_and_leaves_nothing_behind(nats_server,
                                                                                               job_name):
    from persia_nats.common.batch import BatchSchema
    from persia_nats.common.dead import DEAD_REASON_HEADER

    s = Subjects(job_name)
    async with running_job(nats_server.url, job_name) as (client, _, ew):
        nc = await nats.connect(nats_server.url)
        rt = NNRuntime.build(nc, s, rank=0, world_size=1, timeout=5)
        await rt.start()
        dead = await client.subscribe(s.dead())
        await settle(client)
        dense = {"non_id_type_feature_anonymous": (np.dtype("<f4"), (2,))}
        sender = BatchSender(client, s, max_inflight=1, schema=BatchSchema(("a", "r"), dense))
        first = persia_batch(0)
        first.id_type_features += [IDTypeFeature(n, [np.array([1], np.uint64)] * 3) for n in ("r",)]
        await sender.send(first)
        await sender.flush()
        # the rank's schema is open until a batch trains: this one did (TrainCtx.backward says so)
        taken = rt.inbox.incoming.get_nowait()
        rt.inbox.confirm_schema(taken.batch_id, taken.non_id, taken.labels)
        rt.inbox.incoming.put_nowait(taken)
        assert rt.inbox.schema.fixed
        wide = persia_batch(1)
        wide.id_type_features = first.id_type_features
        wide.non_id_type_features = [NonIDTypeFeature(np.zeros((3, 3), np.float32))]
        await sender.send(wide)  # the data loader's own check: refused before anything is sent
        await sender.flush()
        assert sender.refused == 1 and ew.counters["ingested"] == 1
        msg = await dead.next_msg(timeout=5)
        assert "non_id(non_id_type_feature_anonymous): <f4 [3]" in msg.headers[DEAD_REASON_HEADER]
        # a client without that check: the NN rank refuses it by name and lets its buffered ids go
        with pytest.raises(BadRequest, match=r"non_id\(non_id_type_feature_anonymous\): <f4 \[3\]"):
            await sender.deliver(2, wide.ingest_request(), wide.non_id_wire(), wide.labels_wire(), True, None)
        await rt.embeddings.flush_grads()
        assert rt.counters["batches_refused_schema"] == 1 and rt.inbox.incoming.qsize() == 1
        assert len(ew.ids) == 1 and ew.counters["ingested"] == 2  # the refused batch's ids are gone
        await rt.close()


async def test_every_way_a_batch_ends_gives_its_permit_back_exactly_once(nats_server, job_name):
    """Trained, skipped (the empty push TrainCtx._skip sends), failed (a step that raised, a push the
    embedding worker refuses, a lookup that fails) and cancelled (looked up ahead, never handed out)."""
    from persia_nats.common.messages import SlotGradient
    from persia_nats.common.optim_config import SGDConfig

    async with running_job(nats_server.url, job_name, embedding=A_ONLY) as (client, _, ew):
        s = Subjects(job_name)
        for i in range(2):
            await request(client, s.ps(i, "configure"), PsConfigure(SGDConfig(lr=0.1)), 5)
        nc = await nats.connect(nats_server.url)
        rt = NNRuntime.build(nc, s, rank=0, world_size=1, timeout=2, incoming_limit=8)
        await rt.start()
        gate = StalenessGate(8)
        pipe = Pipeline(rt, gate=gate, forward_buffer_size=8, train=True)
        sender = BatchSender(client, s, max_inflight=1)
        for i in range(5):
            await sender.send(persia_batch(i))
        lost = persia_batch(5)  # its ref names no embedding worker: the lookup fails
        await request(client, s.nn_batch(0), NNBatch(5, 3, BatchRef("gone", 1), lost.non_id_wire(),
                                                     lost.labels_wire()), 5)
        trained, skipped, failed, refused = [await asyncio.wait_for(pipe.next(), 10) for _ in range(4)]
        rt.embeddings.send_grads(GradPush(ref=trained.ref, grads=(SlotGradient("a", np.ones((3, 4), np.float16)),),
                                          permit=trained.permit))
        rt.embeddings.send_grads(GradPush(ref=skipped.ref, permit=skipped.permit))
        rt.embeddings.send_grads(GradPush(ref=failed.ref, permit=failed.permit,
                                          failed="forward raised ValueError: shapes"))
        rt.embeddings.send_grads(GradPush(ref=refused.ref, grads=(SlotGradient("a", np.ones((2, 9), np.float16)),),
                                          permit=refused.permit))
        await asyncio.wait_for(rt.embeddings.flush_grads(), 20)
        assert rt.counters["grads_applied"] == 3 and rt.counters["grad_failures"] == 1, rt.counters
        for _ in range(100):  # the fifth batch is looked up ahead, the sixth's lookup fails
            if rt.counters["lookup_failures"] and pipe.ready.qsize() == 1 and pipe.ready._queue[0].done():
                break
            await asyncio.sleep(0.05)
        assert rt.counters["lookup_failures"] == 1 and gate.inflight == 1
        ended = (trained, skipped, failed, refused)
        assert not any(b.permit.held for b in ended)
        assert not any(b.permit.release() for b in ended) and gate.inflight == 1
        await pipe.cancel()  # the training loop stops before the fifth batch
        assert gate.inflight == 0 and gate.max_inflight <= 6
        await rt.close()
