"""The PS replica over a real nats-server: lookups, updates, configuration and refusals."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
from persia_nats.common.codec import WIRE_VERSION, array_from_wire, array_to_wire, pack
from persia_nats.common.errors import BadRequest, Conflict, PayloadTooLarge
from persia_nats.common.messages import PsConfigure, PsLookup, PsLookupGroup
from persia_nats.common.optim_config import SGDConfig
from persia_nats.common.rpc import request
from persia_nats.common.subjects import Subjects

from tests.integration.helpers import running_job, settle
from tests.rss import rss_bytes


def lookup_msg(ids, dim=4, train=True):
    return PsLookup((PsLookupGroup(dim, np.asarray(ids, np.uint64)),), train)


async def test_ps_lookup_update_and_eval_never_inserts(nats_server, job_name):
    async with running_job(nats_server.url, job_name, replicas=1) as (nc, (ps,), _):
        s = Subjects(job_name)
        # eval lookups of unseen ids are zeros and insert nothing
        r = await request(nc, s.ps(0, "lookup"), lookup_msg([1, 2], train=False), 5)
        assert np.all(array_from_wire(r["groups"][0], "g") == 0)
        assert len(ps.store) == 0
        r = await request(nc, s.ps(0, "lookup"), lookup_msg([1, 2]), 5)
        assert len(ps.store) == 2
        rows = array_from_wire(r["groups"][0], "g")
        assert rows.shape == (2, 4) and np.all(np.abs(rows) <= 0.01) and np.any(rows != 0)
        # an update before any optimizer was registered is refused, not ignored
        upd = {"v": WIRE_VERSION, "groups": [{"ids": array_to_wire(np.array([1], np.uint64)),
                                              "grads": array_to_wire(np.ones((1, 4), np.float32))}]}
        with pytest.raises(Conflict):
            await request(nc, s.ps(0, "update"), upd, 5)
        await request(nc, s.ps(0, "configure"), PsConfigure(SGDConfig(lr=0.5)), 5)
        r2 = await request(nc, s.ps(0, "update"), upd, 5)
        assert r2["missing"] == 0
        after = array_from_wire((await request(nc, s.ps(0, "lookup"), lookup_msg([1]), 5))["groups"][0], "g")
        np.testing.assert_allclose(after[0], rows[0] - 0.5, rtol=1e-6)


@pytest.mark.parametrize("payload, error", [
    (b"\xc1garbage", BadRequest),
    (pack([1, 2, 3]), BadRequest),
    (pack({"v": 2}), BadRequest),
    (pack({"v": WIRE_VERSION, "train": "yes", "groups": []}), BadRequest),
    (pack({"v": WIRE_VERSION, "groups": [{"dim": 0, "ids": array_to_wire(np.zeros(1, np.uint64))}]}), BadRequest),
    (pack({"v": WIRE_VERSION, "groups": [{"dim": 4, "ids": array_to_wire(np.zeros(1, np.int64))}]}), BadRequest),
    (pack({"v": WIRE_VERSION, "groups": [{"dim": 4, "ids": {"dtype": "<u8", "shape": [9], "data": b"x"}}]}),
     BadRequest),
    (pack({"v": WIRE_VERSION, "groups": "all"}), BadRequest),
])
async def test_ps_refuses_bad_lookups_and_keeps_serving(nats_server, job_name, payload, error):
    async with running_job(nats_server.url, job_name, replicas=1) as (nc, (ps,), _):
        s = Subjects(job_name)
        with pytest.raises(error):
            await request(nc, s.ps(0, "lookup"), payload, 5)
        assert len(ps.store) == 0
        r = await request(nc, s.ps(0, "lookup"), lookup_msg([5]), 5)
        assert len(r["groups"]) == 1


async def test_ps_refuses_a_bad_group_without_inserting_earlier_ones(nats_server, job_name):
    async with running_job(nats_server.url, job_name, replicas=1) as (nc, (ps,), _):
        s = Subjects(job_name)
        msg = lookup_msg([1, 2, 3]).to_wire()
        msg["groups"].append({"dim": -1, "ids": array_to_wire(np.zeros(1, np.uint64))})
        with pytest.raises(BadRequest):
            await request(nc, s.ps(0, "lookup"), msg, 5)
        assert len(ps.store) == 0


async def test_ps_refuses_non_finite_and_misshapen_gradients(nats_server, job_name):
    async with running_job(nats_server.url, job_name, replicas=1) as (nc, (ps,), _):
        s = Subjects(job_name)
        await request(nc, s.ps(0, "configure"), PsConfigure(SGDConfig(lr=1.0)), 5)
        await request(nc, s.ps(0, "lookup"), lookup_msg([1]), 5)
        before = ps.store.lookup(np.array([1], np.uint64), 4, False).copy()
        for grads in (np.full((1, 4), np.nan, np.float32), np.ones((2, 4), np.float32)):
            upd = {"v": WIRE_VERSION, "groups": [{"ids": array_to_wire(np.array([1], np.uint64)),
                                                  "grads": array_to_wire(grads)}]}
            with pytest.raises(BadRequest):
                await request(nc, s.ps(0, "update"), upd, 5)
        np.testing.assert_array_equal(ps.store.lookup(np.array([1], np.uint64), 4, False), before)


async def test_ps_refuses_oversized_messages_before_decoding(nats_server, job_name):
    async with running_job(nats_server.url, job_name, replicas=1) as (nc, (ps,), _):
        ps.rpc._max_bytes = 1024
        with pytest.raises(PayloadTooLarge):
            await request(nc, Subjects(job_name).ps(0, "lookup"), lookup_msg(np.arange(1000)), 5)


async def test_ps_configure_refuses_unknown_optimizer(nats_server, job_name):
    async with running_job(nats_server.url, job_name, replicas=1) as (nc, (ps,), _):
        with pytest.raises(BadRequest, match="sgdx|type"):
            await request(nc, Subjects(job_name).ps(0, "configure"),
                          {"v": WIRE_VERSION, "optimizer": {"type": "sgdx", "lr": 1}}, 5)
        assert not ps.configured


async def test_a_retried_update_is_applied_once(nats_server, job_name):
    async with running_job(nats_server.url, job_name, replicas=1) as (nc, (ps,), _):
        s = Subjects(job_name)
        await request(nc, s.ps(0, "configure"), PsConfigure(SGDConfig(lr=1.0)), 5)
        before = array_from_wire((await request(nc, s.ps(0, "lookup"), lookup_msg([1]), 5))["groups"][0], "g")
        upd = {"v": WIRE_VERSION, "update_id": "w-1.42", "groups": [
            {"ids": array_to_wire(np.array([1], np.uint64)), "grads": array_to_wire(np.ones((1, 4), np.float32))}]}
        first = await request(nc, s.ps(0, "update"), upd, 5)
        again = await request(nc, s.ps(0, "update"), upd, 5)
        assert "duplicate" not in first and again["duplicate"] is True
        after = ps.store.lookup(np.array([1], np.uint64), 4, False)
        np.testing.assert_allclose(after[0], before[0] - 1.0, rtol=1e-6)
        assert ps.duplicate_updates == 1


async def test_an_update_publishes_the_rows_it_names_with_the_version_lookups_report(nats_server, job_name):
    from persia_nats.common.codec import unpack

    async with running_job(nats_server.url, job_name, replicas=1) as (nc, (ps,), _):
        s = Subjects(job_name)
        await request(nc, s.ps(0, "configure"), PsConfigure(SGDConfig(lr=1.0)), 5)
        before = await request(nc, s.ps(0, "lookup"), lookup_msg([1, 2, 3]), 5)
        published = []

        async def on_rows(msg):
            published.append(unpack(msg.data))

        await nc.subscribe(s.hot(), cb=on_rows)
        await settle(nc)

        def update(publish):
            return {"v": WIRE_VERSION, "groups": [{"ids": array_to_wire(np.array([1, 2, 3], np.uint64)),
                                                   "grads": array_to_wire(np.ones((3, 4), np.float32)),
                                                   "publish": array_to_wire(np.array(publish, np.int64))}]}

        # a position outside the group is refused before anything is applied
        with pytest.raises(BadRequest, match="publish"):
            await request(nc, s.ps(0, "update"), update([0, 3]), 5)
        unchanged = await request(nc, s.ps(0, "lookup"), lookup_msg([1, 2, 3]), 5)
        assert unchanged["version"] == before["version"] and not published
        np.testing.assert_array_equal(array_from_wire(unchanged["groups"][0], "g"),
                                      array_from_wire(before["groups"][0], "g"))
        await request(nc, s.ps(0, "update"), update([2]), 5)
        after = await request(nc, s.ps(0, "lookup"), lookup_msg([1, 2, 3]), 5)
        for _ in range(50):
            if published:
                break
            await asyncio.sleep(0.02)
        (msg,) = published
        # id 3 alone, at its value after the update, and at the version lookups now report
        assert array_from_wire(msg["groups"][0]["ids"], "ids").tolist() == [3]
        np.testing.assert_array_equal(array_from_wire(msg["groups"][0]["rows"], "rows")[0],
                                      array_from_wire(after["groups"][0], "g")[2])
        assert msg["version"] == after["version"] > before["version"] and ps.rows_published == 1
        assert "gone" not in msg["groups"][0]
        # an id the replica does not hold (never looked up, or evicted) is named apart, not published as zeros
        reply = await request(nc, s.ps(0, "update"), {"v": WIRE_VERSION, "groups": [
            {"ids": array_to_wire(np.array([3, 99], np.uint64)), "grads": array_to_wire(np.ones((2, 4), np.float32)),
             "publish": array_to_wire(np.array([0, 1], np.int64))}]}, 5)
        assert reply["missing"] == 1
        for _ in range(50):
            if len(published) == 2:
                break
            await asyncio.sleep(0.02)
        group = published[1]["groups"][0]
        assert array_from_wire(group["ids"], "ids").tolist() == [3]
        assert array_from_wire(group["rows"], "rows").shape == (1, 4)
        assert array_from_wire(group["gone"], "gone").tolist() == [99] and ps.rows_published == 2


async def test_a_configured_optimizer_cannot_be_changed_mid_run(nats_server, job_name):
    async with running_job(nats_server.url, job_name, replicas=1) as (nc, (ps,), _):
        s = Subjects(job_name)
        configure = PsConfigure(SGDConfig(lr=0.1))
        await request(nc, s.ps(0, "configure"), configure, 5)
        await request(nc, s.ps(0, "lookup"), lookup_msg([1]), 5)
        before = ps.store.lookup(np.array([1], np.uint64), 4, False).copy()
        with pytest.raises(Conflict, match="optimizer already configured"):
            await request(nc, s.ps(0, "configure"), PsConfigure(SGDConfig(lr=1e6)), 5)
        assert ps.configure_refused == 1 and ps.stats()["configure_refused"] == 1
        # a restarted NN worker sends the same configure again: accepted
        await request(nc, s.ps(0, "configure"), configure, 5)
        upd = {"v": WIRE_VERSION, "groups": [{"ids": array_to_wire(np.array([1], np.uint64)),
                                              "grads": array_to_wire(np.ones((1, 4), np.float32))}]}
        await request(nc, s.ps(0, "update"), upd, 5)
        np.testing.assert_allclose(ps.store.lookup(np.array([1], np.uint64), 4, False), before - 0.1, rtol=1e-5)


async def test_only_the_jobs_widths_are_served_and_oversized_lookups_refused_before_reading(nats_server, job_name):
    async with running_job(nats_server.url, job_name, replicas=1) as (nc, (ps,), ew):
        s = Subjects(job_name)  # the embedding worker told the PS the job's widths (2 and 4) at start
        await request(nc, s.ps(0, "configure"), PsConfigure(SGDConfig(lr=1.0)), 5)
        rss_before = rss_bytes(os.getpid())
        for dim in range(5, 205):  # once a table of 1,024 rows reserved per width: 200 messages, 3.2 GB
            with pytest.raises(BadRequest, match="none of the job's embedding widths"):
                await request(nc, s.ps(0, "lookup"), lookup_msg([1], dim=dim), 5)
        upd = {"v": WIRE_VERSION, "groups": [{"ids": array_to_wire(np.array([1], np.uint64)),
                                              "grads": array_to_wire(np.ones((1, 8), np.float32))}]}
        with pytest.raises(BadRequest, match="width 8"):
            await request(nc, s.ps(0, "update"), upd, 5)
        assert set(ps.store.tables) <= {2, 4} and ps.stats()["refused_unconfigured_dim"] == 201
        with pytest.raises(Conflict, match="dims"):
            await request(nc, s.ps(0, "configure"), PsConfigure(dims=(4, 4096)), 5)
        # an eval lookup asking for 640 KB of ids at width 4 wants 2.6 MB of rows: over a 1 MB limit, refused unread
        ps.max_reply_bytes = 1 << 20
        with pytest.raises(PayloadTooLarge, match="max_reply_bytes"):
            await request(nc, s.ps(0, "lookup"), lookup_msg(np.arange(1, 80_001), train=False), 5)
        assert ps.stats()["refused_lookup_too_large"] == 1
        assert rss_bytes(os.getpid()) - rss_before < 64 << 20


async def test_scaled_float16_gradients_apply_as_the_float32_gradients_they_stand_for(nats_server, job_name):
    from persia_nats.common.messages import PsUpdate, PsUpdateGroup

    async with running_job(nats_server.url, job_name, replicas=1) as (nc, (ps,), _):
        s = Subjects(job_name)
        await request(nc, s.ps(0, "configure"), PsConfigure(SGDConfig(lr=1.0)), 5)
        ids = np.array([1, 2], np.uint64)
        before = array_from_wire((await request(nc, s.ps(0, "lookup"), lookup_msg(ids), 5))["groups"][0], "g")
        # magnitudes from 1e-9 to 1e-3: unscaled float16 flushes the smallest to zero
        grads = np.array([[1e-9, -3e-7, 2e-5, 1e-3], [-7e-9, 5e-6, -4e-4, 3e-8]], np.float32)
        scale = 2.0 ** 23  # the largest, 1e-3, becomes 8389 (between 2**13 and 2**14)
        half = (grads * np.float32(scale)).astype(np.float16)
        await request(nc, s.ps(0, "update"), PsUpdate((PsUpdateGroup(ids, half, scale=scale),)), 5)
        after = array_from_wire((await request(nc, s.ps(0, "lookup"), lookup_msg(ids), 5))["groups"][0], "g")
        # as a float32 step would have left them: within float16's relative precision of each gradient
        # (and the rows' own float32 rounding, which quantises a 1e-9 step on a row of 0.01)
        exact = before - grads
        assert (np.abs(after - exact) <= 1e-3 * np.abs(grads) + 2 * np.spacing(np.abs(before))).all(), after - exact
        assert (grads.astype(np.float16) == 0).any()  # what plain float16 would have lost
        # a bad scale is refused and changes nothing
        bad = {"v": WIRE_VERSION, "groups": [{"ids": array_to_wire(ids), "scaled_grads": array_to_wire(half),
                                              "scale": 3.0}]}
        with pytest.raises(BadRequest, match="scale"):
            await request(nc, s.ps(0, "update"), bad, 5)
        again = array_from_wire((await request(nc, s.ps(0, "lookup"), lookup_msg(ids), 5))["groups"][0], "g")
        np.testing.assert_array_equal(again, after)
