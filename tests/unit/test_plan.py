"""Pooling and its adjoint, checked against torch autograd on hand-made batches."""

import numpy as np
import pytest
import torch
from persia_nats.common.config import embedding_config_from_dict
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import IdFeature
from persia_nats.core.plan import (
    BatchPlan,
    PooledDim,
    SlotPlan,
    _slot_occurrences,
    accumulate_grad,
    make_plan,
    pool,
    spread_rows,
    unique_inverse,
)
from persia_nats.core.sharding import splitmix64


def cfg(**slots):
    return embedding_config_from_dict({"feature_index_prefix_bit": 8, "slots_config": slots})


def feat(name, rows):
    lengths = np.array([len(r) for r in rows], np.int32)
    values = np.array([x for r in rows for x in r], np.uint64)
    return IdFeature(name, values, lengths)


def table_for(plan, dim, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((plan.distinct[dim].shape[0], dim)).astype(np.float32)


def lookup_rows(plan, dim, table, ids):
    """Rows of ``table`` (aligned with plan.distinct[dim]) for prefixed signs ``ids``."""
    pos = np.searchsorted(plan.distinct[dim], ids)
    return table[pos]


def test_sum_mean_and_sqrt_pooling_by_hand():
    c = cfg(a={"dim": 2}, b={"dim": 2, "pooling": "mean"}, s={"dim": 2, "sqrt_scaling": True})
    rows = [[1, 2], [], [2, 2, 3]]
    plan = make_plan([feat("a", rows), feat("b", rows), feat("s", rows)], c)
    t = table_for(plan, 2)
    for slot in plan.slots:
        prefix = np.uint64(c.prefix_of(slot.name))
        r = {x: lookup_rows(plan, 2, t, np.array([x], np.uint64) | prefix)[0] for x in (1, 2, 3)}
        out = pool(slot, t)
        expect = np.stack([r[1] + r[2], np.zeros(2), 2 * r[2] + r[3]])
        if slot.name == "b":
            expect = expect / np.array([[2], [1], [3]])
        if slot.name == "s":
            expect = expect / np.sqrt([[2], [1], [3]])
        np.testing.assert_allclose(out, expect, rtol=1e-6, atol=1e-7)


def test_ids_are_deduplicated_across_the_batch_per_dim():
    c = embedding_config_from_dict({"slots_config": {"a": {"dim": 4}, "b": {"dim": 4}, "c": {"dim": 8}},
                                    "feature_groups": {"ab": ["a", "b"]}})
    plan = make_plan([feat("a", [[5, 5], [6]]), feat("b", [[5], [7]]), feat("c", [[5]])], c)
    assert plan.distinct[4].shape[0] == 3  # a and b share a prefix: 5, 6, 7
    assert plan.distinct[8].shape[0] == 1


def test_prefix_separates_slots_and_keeps_low_bits():
    c = cfg(a={"dim": 2}, b={"dim": 2})
    plan = make_plan([feat("a", [[7]]), feat("b", [[7]])], c)
    d = plan.distinct[2]
    assert d.shape[0] == 2
    assert set((d >> np.uint64(56)).tolist()) == {1, 2}
    assert set((d & np.uint64((1 << 56) - 1)).tolist()) == {7}
    big = np.uint64(0xFFFF_0000_0000_0007)
    plan = make_plan([IdFeature("a", np.array([big], np.uint64), np.array([1], np.int32))], c)
    assert int(plan.distinct[2][0]) == (1 << 56) | (0x00FF_0000_0000_0007)


def torch_reference(c, features, table_by_dim, plan):
    """Pool with torch ops, independently of the kernels, so autograd gives the true adjoint."""
    leaves = {d: torch.tensor(t, dtype=torch.float64, requires_grad=True) for d, t in table_by_dim.items()}
    outs = []
    for f in features:
        slot = c.slots_config[f.name]
        dim = slot.dim
        prefix = np.uint64(c.prefix_of(f.name))
        mask = np.uint64((1 << 56) - 1)
        rounds = slot.hash_stack_config.hash_stack_rounds
        size = slot.hash_stack_config.embedding_size

        def rows_of(x):
            x = np.array([x], np.uint64)
            if rounds:
                signs, h = [], x
                for r in range(rounds):
                    h = splitmix64(h)
                    signs.append((h % np.uint64(size) + np.uint64(r * size)) & mask | prefix)
                pos = [int(np.searchsorted(plan.distinct[dim], s)[0]) for s in signs]
            else:
                pos = [int(np.searchsorted(plan.distinct[dim], (x & mask) | prefix)[0])]
            return sum(leaves[dim][p] for p in pos)

        starts = np.concatenate([[0], np.cumsum(f.lengths)])
        if slot.embedding_summation:
            per = []
            for b in range(f.batch_size):
                ids = f.values[starts[b]:starts[b + 1]]
                v = sum((rows_of(x) for x in ids), torch.zeros(dim, dtype=torch.float64))
                n = max(len(ids), 1)
                if slot.pooling == "mean":
                    v = v / n
                if slot.sqrt_scaling:
                    v = v / np.sqrt(n)
                per.append(v)
            outs.append(torch.stack(per))
        else:
            kept = [f.values[starts[b]:starts[b + 1]][: slot.sample_fixed_size] for b in range(f.batch_size)]
            distinct = np.unique(np.concatenate(kept)) if kept else np.empty(0, np.uint64)
            scale = 1 / np.sqrt(rounds) if (slot.sqrt_scaling and rounds) else 1.0
            outs.append(torch.stack([rows_of(x) * scale for x in distinct]) if len(distinct)
                        else torch.zeros(0, dim, dtype=torch.float64))
    return leaves, outs


@pytest.mark.parametrize("slots", [
    {"a": {"dim": 3}},
    {"a": {"dim": 3, "pooling": "mean"}},
    {"a": {"dim": 3, "sqrt_scaling": True}},
    {"a": {"dim": 3, "hash_stack_config": {"hash_stack_rounds": 2, "embedding_size": 5}}},
    {"a": {"dim": 3, "embedding_summation": False, "sample_fixed_size": 2}},
    {"a": {"dim": 3, "embedding_summation": False, "sample_fixed_size": 3, "sqrt_scaling": True,
           "hash_stack_config": {"hash_stack_rounds": 3, "embedding_size": 4}}},
    {"a": {"dim": 3}, "b": {"dim": 2, "pooling": "mean"}, "c": {"dim": 3, "embedding_summation": False}},
])
def test_pooling_and_adjoint_match_torch_autograd(slots):
    c = cfg(**slots)
    rng = np.random.default_rng(1)
    features = []
    for name in slots:
        rows = [list(rng.integers(0, 6, rng.integers(0, 5))) for _ in range(5)]
        features.append(feat(name, rows))
    plan = make_plan(features, c)
    tables = {d: table_for(plan, d, seed=d) for d in plan.distinct}
    leaves, outs = torch_reference(c, features, tables, plan)
    upstream = []
    for slot, ref in zip(plan.slots, outs, strict=True):
        got = pool(slot, tables[slot.dim])
        np.testing.assert_allclose(got, ref.detach().numpy(), rtol=1e-5, atol=1e-6)
        upstream.append(rng.standard_normal(ref.shape))
    total = sum((o * torch.tensor(u)).sum() for o, u in zip(outs, upstream, strict=True))
    total.backward()
    grads = {d: np.zeros_like(t) for d, t in tables.items()}
    for slot, u in zip(plan.slots, upstream, strict=True):
        accumulate_grad(slot, u.astype(np.float32), grads[slot.dim])
    for d in tables:
        np.testing.assert_allclose(grads[d], leaves[d].grad.numpy(), rtol=1e-5, atol=1e-6)


def test_raw_slot_index_truncates_and_pads():
    c = cfg(r={"dim": 2, "embedding_summation": False, "sample_fixed_size": 2})
    plan = make_plan([feat("r", [[9, 8, 7], [], [8]])], c)
    (slot,) = plan.slots
    # distinct raw ids of the slot, kept ones only (7 was truncated): [8, 9]
    np.testing.assert_array_equal(slot.index, [[1, 0], [-1, -1], [0, -1]])
    assert slot.n_targets == 2


def test_slots_are_planned_in_the_configs_order_whatever_order_they_come_in():
    c = cfg(b={"dim": 2}, a={"dim": 4}, r={"dim": 2, "embedding_summation": False})
    feats = [feat("a", [[1], [2]]), feat("r", [[3], []]), feat("b", [[5], [6]])]
    in_order = make_plan(feats, c)
    shuffled = make_plan(feats[::-1], c)
    assert [s.name for s in in_order.slots] == [s.name for s in shuffled.slots] == ["b", "a", "r"]
    for dim in in_order.distinct:
        np.testing.assert_array_equal(in_order.distinct[dim], shuffled.distinct[dim])


def test_unknown_slot_and_wrong_gradient_shape_are_refused():
    c = cfg(a={"dim": 2})
    with pytest.raises(BadRequest, match="unknown slot 'zz'"):
        make_plan([feat("zz", [[1]])], c)
    plan = make_plan([feat("a", [[1], [2]])], c)
    with pytest.raises(BadRequest, match="shape"):
        accumulate_grad(plan.slots[0], np.zeros((3, 2), np.float32), np.zeros((2, 2), np.float32))


def test_the_warm_up_compiles_what_a_worker_runs_on_wire_arrays():
    from persia_nats.common.codec import array_from_wire, array_to_wire, pack, unpack

    def wire(arr):  # through msgpack, as a message brings it: a read-only view of the bytes
        return unpack(pack({"a": array_to_wire(arr)}))["a"]
    from persia_nats.core import half
    from persia_nats.core import plan as p

    kernels = (p._pool, p.add_adjoint, half._to_half, half._to_float)
    p.warm_up()
    compiled = [len(k.signatures) for k in kernels]
    assert all(compiled)
    index, scale = np.arange(3, dtype=np.int64), np.ones(3, np.float32)
    rows = array_from_wire(wire(np.ones((3, 4), np.float32)), "rows", dtype="<f4", ndim=2)
    pooled = p._pool(np.ascontiguousarray(rows, dtype=np.float32), index, index, scale, 3)
    p.to_wire_dtype(pooled, np.dtype(np.float16))
    for grad in (np.ones((3, 4), np.float16), np.ones((3, 4), np.float32)):  # float16 on the wire, or not
        got = array_from_wire(wire(grad), "grad", dtype=("<f2", "<f4"), ndim=2)
        if got.dtype == np.float16:
            got, _ = half.to_float(got, 2.0)
        p.add_adjoint(np.ascontiguousarray(got, dtype=np.float32), index, index, scale, np.zeros((3, 4), np.float32))
    assert [len(k.signatures) for k in kernels] == compiled


def plan_slot_by_slot(features, c):
    """The plan as made one slot at a time (``_slot_occurrences`` for every slot, then per dim a sort
    and copies): what make_plan's batched path must equal, bit for bit."""
    order = {name: i for i, name in enumerate(c.slots_config)}
    features = sorted(features, key=lambda f: order[f.name])
    partial = [_slot_occurrences(f, c) for f in features]
    by_dim = {}
    for i, (p, _) in enumerate(partial):
        by_dim.setdefault(p.dim, []).append(i)
    slots, distinct = [None] * len(partial), {}
    for dim, members in by_dim.items():
        uniq, inv = np.unique(np.concatenate([partial[i][1] for i in members]), return_inverse=True)
        distinct[dim] = uniq
        start = 0
        for i in members:
            p, s = partial[i]
            slots[i] = SlotPlan(p.name, dim, p.raw, inv[start:start + s.shape[0]].astype(np.int64), p.target,
                                p.scale, p.n_targets, p.index)
            start += s.shape[0]
    bs = features[0].batch_size
    pooled = {}
    for dim in distinct:
        members = [i for i, s in enumerate(slots) if s.dim == dim and not s.raw]
        if members:
            pooled[dim] = PooledDim(
                tuple(members), np.concatenate([slots[i].inv for i in members]),
                np.concatenate([slots[i].target + k * bs for k, i in enumerate(members)]),
                np.concatenate([slots[i].scale for i in members]),
                np.array([slots[i].inv.shape[0] for i in members], np.int64))
    return BatchPlan(bs, tuple(slots), distinct, pooled)


def assert_same_plan(got, want):
    def same(a, b):
        if a is None or b is None:
            assert a is None and b is None
            return
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)

    assert got.batch_size == want.batch_size and list(got.distinct) == list(want.distinct)
    for dim in want.distinct:
        same(got.distinct[dim], want.distinct[dim])
    assert len(got.slots) == len(want.slots)
    for g, w in zip(got.slots, want.slots, strict=True):
        assert (g.name, g.dim, g.raw, g.n_targets) == (w.name, w.dim, w.raw, w.n_targets)
        for a, b in ((g.inv, w.inv), (g.target, w.target), (g.scale, w.scale), (g.index, w.index)):
            same(a, b)
    assert list(got.pooled) == list(want.pooled)
    for dim, w in want.pooled.items():
        g = got.pooled[dim]
        assert g.slots == w.slots
        for a, b in ((g.inv, w.inv), (g.target, w.target), (g.scale, w.scale), (g.sizes, w.sizes)):
            same(a, b)


@pytest.mark.parametrize("seed", range(12))
def test_the_batched_plan_equals_planning_slot_by_slot(seed):
    rng = np.random.default_rng(seed)
    slots = {}
    for i in range(int(rng.integers(1, 9))):
        kind = rng.choice(["sum", "mean", "sqrt", "raw", "stacked"])
        s = {"dim": int(rng.choice([2, 4]))}
        if kind == "mean":
            s["pooling"] = "mean"
        if kind == "sqrt":
            s["sqrt_scaling"] = True
        if kind == "raw":
            s.update(embedding_summation=False, sample_fixed_size=3)
        if kind == "stacked":
            s["hash_stack_config"] = {"hash_stack_rounds": 2, "embedding_size": 50}
        slots[f"s{i}"] = s
    names = list(slots)
    groups = {"g": names[: len(names) // 2]} if seed % 2 and len(names) > 3 else {}
    c = embedding_config_from_dict({"feature_index_prefix_bit": 8, "slots_config": slots, "feature_groups": groups})
    bs = int(rng.integers(1, 40))
    big = np.uint64(2**64 - 1)
    features = []
    for name in rng.permutation(names):  # the batch's own order is not the config's
        rows = [[int(x) for x in rng.zipf(1.5, int(rng.integers(0, 4)))] for _ in range(bs)]
        if rows[0]:
            rows[0][0] = int(big)  # the prefix replaces the top bits, whatever they were
        features.append(feat(str(name), rows))
    assert_same_plan(make_plan(features, c), plan_slot_by_slot(features, c))


def test_the_batched_plan_equals_planning_slot_by_slot_on_a_large_single_id_batch():
    c = cfg(**{f"s{i}": {"dim": 4} for i in range(26)})
    rng = np.random.default_rng(9)
    features = [IdFeature(f"s{i}", rng.zipf(1.2, 4096).astype(np.uint64), np.ones(4096, np.int32)) for i in range(26)]
    got = make_plan(features, c)
    assert_same_plan(got, plan_slot_by_slot(features, c))
    # every pooled array is the whole dim's, not a copy laid end to end
    assert got.pooled[4].inv is got.slots[0].inv.base or got.pooled[4].inv.base is got.slots[0].inv.base


@pytest.mark.parametrize("values", [
    [], [7], [5] * 100, [0, 2**64 - 1, 0, 2**64 - 1, 1, 2**63], [2**64 - 1] * 3 + [0] * 3,
    list(range(1000, 0, -1)),
], ids=["empty", "one", "all-equal", "extremes", "extremes-runs", "descending"])
def test_unique_inverse_is_np_unique(values):
    a = np.array(values, np.uint64)
    uniq, inv = unique_inverse(a)
    want_uniq, want_inv = np.unique(a, return_inverse=True)
    assert uniq.dtype == np.uint64 and inv.dtype == np.int64 and inv.shape == a.shape
    np.testing.assert_array_equal(uniq, want_uniq)
    np.testing.assert_array_equal(inv, want_inv)


def test_unique_inverse_is_np_unique_on_large_random_sets():
    rng = np.random.default_rng(11)
    for a in (rng.integers(0, 2**64 - 1, 200_000, dtype=np.uint64, endpoint=True),  # nearly all distinct
              rng.zipf(1.2, 200_000).astype(np.uint64) | np.uint64(3 << 60)):  # heavy repeats, a prefix
        uniq, inv = unique_inverse(a)
        want_uniq, want_inv = np.unique(a, return_inverse=True)
        np.testing.assert_array_equal(uniq, want_uniq)
        np.testing.assert_array_equal(inv, want_inv)
        np.testing.assert_array_equal(uniq[inv], a)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_spread_rows_is_the_masked_assignment(dtype) -> None:
    """Bit for bit what ``out[where] = rows`` writes (NaNs and negative zeros too), from read-only rows;
    float64 (no kernel) and rows that do not fit the mask take numpy's own way."""
    rng = np.random.default_rng(4)
    for n, dim in ((0, 3), (1, 1), (7, 2), (5000, 16)):
        where = rng.random(n) < 0.9
        rows = rng.standard_normal((int(where.sum()), dim)).astype(dtype)
        if rows.size:
            rows.flat[0], rows.flat[-1] = -0.0, np.nan
        rows.flags.writeable = False
        want, got = np.full((n, dim), 7, dtype), np.full((n, dim), 7, dtype)
        want[where] = rows
        spread_rows(got, where, rows)
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    with pytest.raises(ValueError):  # one row too many for the mask: numpy's error, nothing read past the end
        spread_rows(np.zeros((3, 2), np.float16), np.array([True, False, True]), np.zeros((3, 2), np.float16))
