"""Gathered slots through a real embedding worker and two PS replicas: what a lookup that asks for them
returns, and what their per-row gradients do to the PSs, against the pooled path on the same batch."""

from __future__ import annotations

import numpy as np
import pytest
from persia_nats.common.codec import pack, unpack
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import (
    EwLookup,
    EwLookupReply,
    GatheredSlots,
    GradRequest,
    IdFeature,
    IngestRequest,
    PsConfigure,
    RowGradient,
    SlotGradient,
)
from persia_nats.common.optim_config import SGDConfig
from persia_nats.common.rpc import request
from persia_nats.common.subjects import Subjects
from persia_nats.core.adjoint import row_gradient
from persia_nats.core.lookup import expand
from persia_nats.core.plan import add_pooled

from tests.integration.helpers import running_job

EMBEDDING = {"feature_index_prefix_bit": 8, "slots_config": {
    "a": {"dim": 4}, "m": {"dim": 8}, "b": {"dim": 4}}}
BS = 32


async def configure(nc, job, lr=1.0, replicas=2):
    for i in range(replicas):
        await request(nc, Subjects(job).ps(i, "configure"), PsConfigure(SGDConfig(lr=lr)), 5)


def features(seed: int = 0) -> tuple[IdFeature, ...]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4, BS).astype(np.int32)
    return (IdFeature("a", rng.zipf(1.5, BS).astype(np.uint64), np.ones(BS, np.int32)),
            IdFeature("b", rng.integers(0, 10, BS).astype(np.uint64), np.ones(BS, np.int32)),
            IdFeature("m", rng.integers(0, 40, int(lengths.sum())).astype(np.uint64), lengths))


async def ingest_twice(nc, s):
    return [(await request(nc, s.ew_ingest(), IngestRequest(features()), 5))["ref"] for _ in range(2)]


async def lookup(nc, s, ew, ref, gather, hot=False):
    raw = await request(nc, s.ew_lookup(ew.worker_id), EwLookup(ref, train=True, hot=hot, gather=gather), 5)
    return EwLookupReply.from_wire(raw)


def outputs(reply: EwLookupReply) -> dict[str, np.ndarray]:
    gathered = list(reply.gathered)
    for i, g in enumerate(gathered):
        if g.hot_at is not None:  # hot rows of a gathered width: put back at their place in its rows
            assert reply.hot is not None
            group = reply.hot.group_of(g.dim)
            rows = g.rows.astype(np.float32)
            rows[g.hot_at] = group.rows
            gathered[i] = GatheredSlots(g.dim, rows, g.slots, g.at, g.index)
    full = expand(reply.embeddings, gathered)
    out = {e.name: e.emb.astype(np.float32) for e in full}
    if reply.hot is not None:  # hot rows added back as the lookup read them
        p = 0
        for k, name in enumerate(reply.hot.slots):
            n = int(reply.hot.counts[k])
            group = reply.hot.groups[int(reply.hot.group[k])]
            add_pooled(out[name], group.rows, reply.hot.inv[p:p + n], reply.hot.target[p:p + n],
                       reply.hot.scale[p:p + n])
            p += n
    return out


@pytest.mark.parametrize(("wire", "replicas"), [("float16", 2), ("float32", 2), ("float16", 1)])
async def test_a_gathered_lookup_gives_the_pooled_outputs_bit_for_bit(nats_server, job_name, wire, replicas):
    """With one PS replica the float16 rows are the PS reply's own array, passed on untouched."""
    async with running_job(nats_server.url, job_name, embedding=EMBEDDING, wire_dtype=wire,
                           replicas=replicas) as (nc, _, ew):
        s = Subjects(job_name)
        await configure(nc, job_name, replicas=replicas)
        ref1, ref2 = await ingest_twice(nc, s)
        pooled = await lookup(nc, s, ew, ref1, gather=False)
        gathered = await lookup(nc, s, ew, ref2, gather=True)
        assert not pooled.gathered and [e.name for e in pooled.embeddings] == ["a", "m", "b"]
        (g,) = gathered.gathered
        assert g.dim == 4 and g.slots == ("a", "b") and g.at.tolist() == [0, 2] and g.index.dtype == np.uint16
        assert g.rows.dtype == (np.float16 if wire == "float16" else np.float32)
        assert [e.name for e in gathered.embeddings] == ["m"]
        distinct = {(k, int(i)) for k, f in enumerate(features()[:2]) for i in f.values}
        assert g.rows.shape == (len(distinct), 4)  # each row once
        want, got = outputs(pooled), outputs(gathered)
        for name in ("a", "m", "b"):
            np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.parametrize("replicas", [1, 2])
async def test_hot_rows_of_a_gathered_width_come_apart_as_zeros_and_add_back_to_the_same_outputs(
        nats_server, job_name, replicas):
    async with running_job(nats_server.url, job_name, embedding=EMBEDDING, hot_row_min_count=3,
                           replicas=replicas) as (nc, _, ew):
        s = Subjects(job_name)
        await configure(nc, job_name, replicas=replicas)
        ref1, ref2 = await ingest_twice(nc, s)
        pooled = await lookup(nc, s, ew, ref1, gather=False, hot=False)
        gathered = await lookup(nc, s, ew, ref2, gather=True, hot=True)
        assert gathered.hot is not None
        (g,) = gathered.gathered
        # a gathered width's hot rows are named by their place in its rows, not listed at every read
        assert not {"a", "b"} & set(gathered.hot.slots) and g.hot_at is not None and g.hot_at.size
        group = gathered.hot.group_of(4)
        assert group is not None and group.ids.shape == g.hot_at.shape
        assert not g.rows[g.hot_at].any()  # zero in the rows: the NN worker adds its newest copies
        want, got = outputs(pooled), outputs(gathered)
        for name in ("a", "b"):  # one row an output: the hot ones exactly as the lookup read them
            np.testing.assert_array_equal(got[name].astype(np.float16), want[name].astype(np.float16))
        # m's sum without its hot rows was rounded to float16 before they were added back
        np.testing.assert_allclose(got["m"], want["m"], atol=1e-4)


async def test_row_gradients_move_the_rows_as_per_slot_gradients_do(nats_server, job_name):
    async with running_job(nats_server.url, job_name, embedding=EMBEDDING, wire_dtype="float32") as (nc, pss, ew):
        s = Subjects(job_name)
        await configure(nc, job_name, lr=0.5)
        ref1, ref2 = await ingest_twice(nc, s)
        rng = np.random.default_rng(1)
        grads = {"a": rng.standard_normal((BS, 4)).astype(np.float32),
                 "b": rng.standard_normal((BS, 4)).astype(np.float32),
                 "m": rng.standard_normal((BS, 8)).astype(np.float32)}
        before = outputs(await lookup(nc, s, ew, ref1, gather=False))
        out = await request(nc, s.ew_grad(ew.worker_id),
                            GradRequest(ref1, tuple(SlotGradient(n, g) for n, g in grads.items())), 5)
        assert out["skipped"] == []
        reply = await lookup(nc, s, ew, ref2, gather=True)
        middle = outputs(reply)
        (g,) = reply.gathered
        rows, _ = row_gradient(g, np.stack([grads["a"], grads["b"]]), [True, True], 1.0, half=False)
        out = await request(nc, s.ew_grad(ew.worker_id), GradRequest(ref2, (SlotGradient("m", grads["m"]),),
                                                                     rows=(rows,)), 5)
        assert out["skipped"] == [] and ew.staleness == 0
        ref3 = (await request(nc, s.ew_ingest(), IngestRequest(features()), 5))["ref"]
        after = outputs(await lookup(nc, s, ew, ref3, gather=False))
        for name in ("a", "b", "m"):  # SGD: each step moves every output by the same amount
            np.testing.assert_allclose(after[name] - middle[name], middle[name] - before[name], atol=1e-5)
            assert np.abs(middle[name] - before[name]).max() > 0.1


async def test_wrong_row_gradients_are_refused_and_change_nothing(nats_server, job_name):
    async with running_job(nats_server.url, job_name, embedding=EMBEDDING) as (nc, pss, ew):
        s = Subjects(job_name)
        await configure(nc, job_name)
        ref1, ref2 = await ingest_twice(nc, s)
        reply = await lookup(nc, s, ew, ref1, gather=True)
        (g,) = reply.gathered
        n = g.rows.shape[0]
        bad = [
            (GradRequest(ref1, (SlotGradient("a", np.ones((BS, 4), np.float16)),)), "came gathered"),
            (GradRequest(ref1, (), rows=(RowGradient(4, np.ones((n + 1, 4), np.float16)),)), "shape"),
            (GradRequest(ref1, (), rows=(RowGradient(8, np.ones((n, 8), np.float16)),)), "did not send gathered"),
            (GradRequest(ref1, (), rows=(RowGradient(4, np.ones((n, 4), np.float16)),) * 2), "two row gradients"),
            (GradRequest(ref1, (), rows=(RowGradient(4, np.ones((n, 4), np.float16), skipped=("m",)),)), "skip"),
        ]
        for msg, words in bad:
            with pytest.raises(BadRequest, match=words):
                await request(nc, s.ew_grad(ew.worker_id), msg, 5)
            assert ew.staleness == 1  # the batch still waits for its gradients
        rows_before = [len(p.store) for p in pss]
        # not finite: the width's slots are skipped and named, the rest applies
        nan = np.ones((n, 4), np.float16)
        nan[0, 0] = np.nan
        out = await request(nc, s.ew_grad(ew.worker_id), GradRequest(ref1, (), rows=(RowGradient(4, nan),)), 5)
        assert sorted(out["skipped"]) == ["a", "b"] and ew.nan_skipped["a"] == 1
        assert [len(p.store) for p in pss] == rows_before and ew.staleness == 0
        # a lookup that did not ask for gathered slots takes gradients per slot, as before
        plain = await lookup(nc, s, ew, ref2, gather=False)
        assert not plain.gathered
        out = unpack(pack(await request(nc, s.ew_grad(ew.worker_id), GradRequest(
            ref2, (SlotGradient("a", np.ones((BS, 4), np.float16)),)), 5)))
        assert out["skipped"] == []


@pytest.mark.parametrize("replicas", [1, 2])
async def test_gathered_rows_beyond_float16_range_travel_as_float32(nats_server, job_name, replicas):
    from persia_nats.common.codec import WIRE_VERSION
    from persia_nats.common.optim_config import EmbeddingHyperparams, hyperparams_to_wire

    async with running_job(nats_server.url, job_name, embedding=EMBEDDING, hot_row_min_count=3,
                           replicas=replicas) as (nc, _, ew):
        s = Subjects(job_name)
        hyper = hyperparams_to_wire(EmbeddingHyperparams(init_lower=1e5, init_upper=2e5, weight_bound=0.0))
        for i in range(replicas):
            await request(nc, s.ps(i, "configure"), {"v": WIRE_VERSION, "hyper": hyper}, 5)
        ref1, ref2 = await ingest_twice(nc, s)
        pooled = await lookup(nc, s, ew, ref1, gather=False)  # inserts the rows
        gathered = await lookup(nc, s, ew, ref2, gather=True, hot=True)
        (g,) = gathered.gathered
        assert g.rows.dtype == np.float32 and np.abs(g.rows).max() >= 1e5 and ew.counters["float32_fallbacks"] >= 2
        assert g.hot_at is not None and not g.rows[g.hot_at].any()  # hot rows still zero, their values apart
        want, got = outputs(pooled), outputs(gathered)
        for name in ("a", "b"):
            np.testing.assert_array_equal(got[name], want[name])
