"""Hot rows: the embedding worker's split of a lookup, its wire form, and the NN worker's mirror."""

from __future__ import annotations

import os

import numpy as np
import pytest
from persia_nats.common.codec import array_to_wire, pack, unpack
from persia_nats.common.config import embedding_config_from_dict
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import (
    HotGrads,
    HotGradsGroup,
    HotGroup,
    HotPart,
    HotRows,
    HotRowsGroup,
    IdFeature,
    SlotEmbedding,
)
from persia_nats.core.plan import hot_occurrences, hot_rows, make_plan, pool, pool_dim
from persia_nats.services.nn_worker.hot_rows import RowMirror, _row_bytes

from tests.rss import rss_bytes

CFG = embedding_config_from_dict({"slots_config": {
    "a": {"dim": 2}, "b": {"dim": 2, "pooling": "mean"}, "r": {"dim": 2, "embedding_summation": False,
                                                               "sample_fixed_size": 2}}})


def feature(name, rows):
    return IdFeature(name, np.array([x for r in rows for x in r], np.uint64),
                     np.array([len(r) for r in rows], np.int32))


def u64(*xs):
    return np.array(xs, np.uint64)


def test_cold_part_plus_hot_occurrences_is_the_plain_pooled_output():
    # id 5 is read by three samples of a and two of b (a row per slot), ids 1..4 once; the raw slot r
    # never takes part, however often it reads its id 5
    feats = [feature("a", ((5, 1), (5,), (5, 2))), feature("b", ((5, 3), (5,), (4,))),
             feature("r", ((5,), (5,), (5,)))]
    plan = make_plan(feats, CFG)
    rows = {2: np.random.default_rng(0).normal(size=(plan.distinct[2].shape[0], 2)).astype(np.float32)}
    hot = hot_rows(plan, 2)
    assert hot is not None and int(hot[2].sum()) == 2
    assert int(hot_rows(plan, 3)[2].sum()) == 1
    (h,) = hot_occurrences(plan, hot)
    dim, names, counts, inv, target, scale = h.dim, list(h.slots), h.counts, h.inv, h.target, h.scale
    assert dim == 2 and names == ["a", "b"] and counts.tolist() == [3, 2]  # the raw slot r never takes part
    ends = np.cumsum(counts)
    # the dim's pooled slots pooled at once, as the embedding worker does, with and without the hot rows
    plain_all, cold_all = pool_dim(plan, 2, rows[2]), pool_dim(plan, 2, rows[2], hot[2])
    for j, i in enumerate(plan.pooled[2].slots):
        slot = plan.slots[i]
        plain = pool(slot, rows[2])
        np.testing.assert_allclose(plain_all[j], plain, rtol=1e-6)
        k = names.index(slot.name)
        lo, hi = ends[k] - counts[k], ends[k]
        full = cold_all[j].copy()
        np.add.at(full, target[lo:hi], scale[lo:hi, None] * rows[2][hot[2]][inv[lo:hi]])
        np.testing.assert_allclose(full, plain, rtol=1e-6)
        assert not np.allclose(cold_all[j], plain)  # the hot row really was left out
    assert [plan.slots[i].name for i in plan.pooled[2].slots] == ["a", "b"]  # r is raw: never pooled here
    assert hot_rows(plan, 4) is None and hot_rows(plan, 0) is None


def part(ids=(7, 9), versions=(10, 10), slots=("a",), counts=(2,), inv=(0, 1), target=(0, 1), group=(0,), dim=2):
    groups = [HotGroup(dim, u64(*ids), np.ones((len(ids), dim), np.float32), np.array(versions, np.int64))]
    return unpack(pack({"groups": [g.to_wire() for g in groups], "slots": list(slots),
            "group": array_to_wire(np.array(group, np.int32)), "counts": array_to_wire(np.array(counts, np.int32)),
            "inv": array_to_wire(np.array(inv, np.int32)), "target": array_to_wire(np.array(target, np.int32)),
            "scale": array_to_wire(np.ones(len(inv), np.float32))}))


EMB = (SlotEmbedding("a", np.zeros((3, 2), np.float16)),
       SlotEmbedding("r", np.zeros((1, 2), np.float16), np.zeros((3, 1), np.int32)))


def test_hot_part_round_trips_and_refuses_indexes_outside_the_reply():
    parsed = HotPart.from_wire(part(), EMB)
    assert parsed.slots == ("a",) and parsed.inv.tolist() == [0, 1]
    # sent compact (uint16 indexes, no scale when all are 1) and read back the same
    wire = unpack(pack(parsed.to_wire()))
    assert wire["inv"]["dtype"] == "<u2" and "scale" not in wire
    again = HotPart.from_wire(wire, EMB)
    assert again.inv.tolist() == [0, 1] and again.target.tolist() == [0, 1] and again.scale.tolist() == [1, 1]
    bad = {
        "inv past the group's rows": part(inv=(0, 2)),
        "target past the slot's rows": part(target=(0, 3)),
        "a negative target": part(target=(-1, 0)),
        "a raw slot": part(slots=("r",)),
        "an unknown slot": part(slots=("zz",)),
        "counts that do not add up": part(counts=(1,)),
        "a group that does not exist": part(group=(1,)),
        "a group of another dim": part(dim=3),
    }
    for why, msg in bad.items():
        with pytest.raises(BadRequest):
            HotPart.from_wire(msg, EMB)
            pytest.fail(why)


def test_mirror_keeps_the_newest_copy_of_each_row():
    m = RowMirror()
    m.absorb(u64(3, 1), np.array([[3, 3], [1, 1]], np.float32), np.array([5, 5]))
    m.absorb(u64(1, 2), np.array([[10, 10], [2, 2]], np.float32), np.array([4, 6]))  # 1 is older: kept at 5
    got = m.newest(u64(1, 2, 3, 4), np.zeros((4, 2), np.float32), np.array([5, 5, 9, 1]))
    # 1: the mirror's (5) equals the lookup's version, 2: mirror newer, 3: lookup newer, 4: unknown
    assert got[:, 0].tolist() == [1, 2, 0, 0]
    assert m.counters["hot_rows_fresher"] == 1 and len(m) == 4


def test_mirror_holds_at_most_max_bytes_and_counts_the_rest():
    m = RowMirror(max_bytes=2 * _row_bytes(2, 0))
    m.absorb(u64(1, 2, 3), np.ones((3, 2), np.float32), np.array([1, 1, 1]))
    assert len(m) == 2 and m.counters["hot_rows_not_kept"] == 1
    # a row it could not keep is served from the lookup's copy
    assert m.newest(u64(3), np.full((1, 2), 7, np.float32), np.array([1]))[0, 0] == 7


def test_merge_adds_the_newest_rows_into_the_slot_outputs():
    m = RowMirror()
    m.absorb(u64(9), np.full((1, 2), 100, np.float32), np.array([50]))
    hot = HotPart.from_wire(part(inv=(0, 1), target=(0, 0)), EMB)
    a, r = m.merge(EMB, hot)
    # row 0 of a gets id 7 at the lookup's value (1) plus id 9 at the mirror's newer value (100)
    assert a.emb.dtype == np.float32 and a.emb[:, 0].tolist() == [101, 0, 0]
    assert r is EMB[1] and EMB[0].emb[0, 0] == 0  # the reply's arrays are not written to


def wire_group(ids, rows):
    return unpack(pack({"ids": array_to_wire(ids), "rows": array_to_wire(rows)}))


def test_published_rows_that_are_malformed_change_nothing():
    m = RowMirror()
    good = unpack(pack(HotRows(0, 3, None, (HotRowsGroup(u64(1), np.ones((1, 2), np.float32)),)).to_wire()))
    m.on_published(HotRows.from_wire(good))
    # hostile maps: each is refused whole as it is decoded, before the mirror sees any of it
    for bad in ({**good, "version": "3"}, {**good, "groups": {}},
                {**good, "groups": [  # a good group of a new row, then a bad one: neither is taken
                    wire_group(u64(7), np.ones((1, 2), np.float32)),
                    wire_group(u64(2, 3), np.ones((1, 2), np.float32))]}):
        with pytest.raises(BadRequest):
            m.on_published(HotRows.from_wire(bad))
    assert len(m) == 1 and m.counters["hot_publications"] == 1


def published_wire(version, ids, rows, state, update_id=None):
    return unpack(pack(HotRows(0, version, update_id, (HotRowsGroup(ids, rows, state),)).to_wire()))


def published(version, ids, rows, state, update_id=None):
    return HotRows.from_wire(published_wire(version, ids, rows, state, update_id))


def hot_grads_wire(update_id, ids, grads):
    return unpack(pack(HotGrads(update_id, 1, 1, (HotGradsGroup(grads.shape[1], ids, grads),)).to_wire()))


def hot_grads(update_id, ids, grads):
    return HotGrads.from_wire(hot_grads_wire(update_id, ids, grads))


def test_gradients_in_flight_are_applied_with_the_ps_optimizer_until_their_rows_are_published():
    from persia_nats.common.optim_config import AdagradConfig
    from persia_nats.core.optim import apply_update

    cfg = AdagradConfig(lr=0.1)
    m = RowMirror(optimizer=(cfg, 10.0))
    base, acc = np.array([[1.0, 1.0], [2.0, 2.0]], np.float32), np.full((2, 2), 0.5, np.float32)
    m.on_published(published(10, u64(1, 2), base, acc, "w.1"))
    # two updates in flight: row 1 in both, row 2 in the second only
    g_a, g_b = np.array([[1.0, -1.0]], np.float32), np.array([[0.5, 0.5], [2.0, 2.0]], np.float32)
    m.on_hot_grads(hot_grads("w.2", u64(1), g_a))
    m.on_hot_grads(hot_grads("w.3", u64(2, 1), g_b))  # sent in another order than the ids sort
    got = m.newest(u64(1, 2), np.zeros((2, 2), np.float32), np.array([5, 5]))
    want, state = base.copy(), acc.copy()
    apply_update(cfg, np.array([0]), g_a, want, state, 10.0)
    apply_update(cfg, np.array([1, 0]), g_b, want, state, 10.0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert m.pending == 2 and m.counters["hot_row_corrections"] == 3
    # the PS applies the first: its rows come with it, and only the second is still in flight
    after_a, acc_a = base.copy(), acc.copy()
    apply_update(cfg, np.array([0]), g_a, after_a, acc_a, 10.0)
    m.on_published(published(11, u64(1), after_a[:1], acc_a[:1], "w.2"))
    assert m.pending == 1
    np.testing.assert_allclose(m.newest(u64(1, 2), np.zeros((2, 2), np.float32), np.array([5, 5])), want, rtol=1e-6)
    # a gradient whose rows were already published is not applied a second time
    m.on_hot_grads(hot_grads("w.2", u64(1), g_a))
    assert m.counters["hot_grads_late"] == 1 and m.pending == 1


def test_rows_the_ps_no_longer_held_settle_their_gradient_and_are_not_taken_as_zeros():
    from persia_nats.common.optim_config import SGDConfig

    m = RowMirror(optimizer=(SGDConfig(lr=1.0), 0.0))
    m.on_published(published(10, u64(1, 2), np.ones((2, 2), np.float32), np.zeros((2, 0), np.float32), "w.1"))
    m.on_hot_grads(hot_grads("w.2", u64(1, 2), np.ones((2, 2), np.float32)))
    assert m.pending == 1
    # the PS applied w.2 to row 1; row 2 had been evicted, so it is named apart rather than sent as zeros
    m.on_published(HotRows.from_wire(unpack(pack(HotRows(0, 11, "w.2", (HotRowsGroup(
        u64(1), np.zeros((1, 2), np.float32), np.zeros((1, 0), np.float32), gone=u64(2)),)).to_wire()))))
    assert m.pending == 0  # nothing of w.2 is in flight any more
    got = m.newest(u64(1, 2), np.full((2, 2), 7, np.float32), np.array([5, 5]))
    assert got.tolist() == [[0, 0], [1, 1]]  # row 2 keeps its last published copy, uncorrected
    bad = published_wire(12, u64(1), np.zeros((1, 2), np.float32), np.zeros((1, 0), np.float32), "w.3")
    bad["groups"][0]["gone"] = array_to_wire(np.array([1.5], np.float32))
    with pytest.raises(BadRequest, match="gone"):
        m.on_published(HotRows.from_wire(unpack(pack(bad))))


def test_without_the_optimizer_or_a_published_state_nothing_in_flight_is_applied():
    m = RowMirror()
    # plain SGD keeps no state: the publication's state has no columns
    m.on_published(published(10, u64(1), np.ones((1, 2), np.float32), np.zeros((1, 0), np.float32), "w.1"))
    m.on_hot_grads(hot_grads("w.2", u64(1, 2), np.ones((2, 2), np.float32)))
    assert m.newest(u64(1), np.zeros((1, 2), np.float32), np.array([5]))[0, 0] == 1  # no optimizer known
    from persia_nats.common.optim_config import SGDConfig

    m.optimizer = (SGDConfig(lr=1.0), 0.0)
    # row 2 is known only from a lookup (no state): its copy stays as read
    got = m.newest(u64(1, 2), np.full((2, 2), 7, np.float32), np.array([5, 5]))
    assert got[:, 0].tolist() == [0, 7]


def test_pending_gradients_are_bounded_and_malformed_ones_refused():
    from persia_nats.services.nn_worker.hot_rows import MAX_PENDING_UPDATES

    m = RowMirror()
    for i in range(MAX_PENDING_UPDATES + 3):
        m.on_hot_grads(hot_grads(f"w.{i}", u64(1), np.ones((1, 2), np.float32)))
    assert m.pending == MAX_PENDING_UPDATES and m.counters["hot_grads_expired"] == 3
    m.forget(f"w.{MAX_PENDING_UPDATES + 2}")  # a push that failed is applied nowhere
    assert m.pending == MAX_PENDING_UPDATES - 1
    for bad in ({"update_id": 5, "rank": 1, "seq": 1, "groups": []}, {"update_id": "x", "groups": []},
                {"update_id": "x", "rank": 1, "seq": 1, "groups": [{"dim": 3, "ids": None}]},
                {**hot_grads_wire("y", u64(1), np.ones((1, 2), np.float32)), "groups": [
                    HotGradsGroup(2, u64(1, 2), np.ones((1, 2), np.float32)).to_wire()]}):
        with pytest.raises(BadRequest):
            m.on_hot_grads(HotGrads.from_wire(bad))
    assert m.pending == MAX_PENDING_UPDATES - 1


def test_merge_of_several_slots_and_dims_matches_the_slot_by_slot_sum():
    # slots a and b (dim 2) and c (dim 3) read hot rows of two groups; each pooled slot's output is
    # its emb plus scale * row for each of its occurrences, whatever the layout the merge uses
    rng = np.random.default_rng(1)
    embs = (SlotEmbedding("a", rng.normal(size=(4, 2)).astype(np.float16)),
            SlotEmbedding("r", np.zeros((1, 2), np.float16), np.zeros((4, 1), np.int32)),
            SlotEmbedding("c", rng.normal(size=(4, 3)).astype(np.float16)),
            SlotEmbedding("b", rng.normal(size=(4, 2)).astype(np.float16)))
    g2 = HotGroup(2, u64(7, 9), rng.normal(size=(2, 2)).astype(np.float32), np.array([1, 1], np.int64))
    g3 = HotGroup(3, u64(7), rng.normal(size=(1, 3)).astype(np.float32), np.array([1], np.int64))
    hot = HotPart((g2, g3), ("b", "c", "a"), np.array([0, 1, 0], np.int32), np.array([2, 1, 3], np.int32),
                  np.array([1, 0, 0, 0, 1, 1], np.int32), np.array([3, 3, 0, 2, 2, 0], np.int32),
                  np.array([1, 1, 0.5, 1, 2, 1], np.float32))
    got = {e.name: e for e in RowMirror().merge(embs, hot)}
    want = {e.name: e.emb.astype(np.float32) for e in embs}
    ends = np.cumsum(hot.counts)
    for k, name in enumerate(hot.slots):
        g = hot.groups[hot.group[k]]
        for p in range(ends[k] - hot.counts[k], ends[k]):
            want[name][hot.target[p]] += hot.scale[p] * g.rows[hot.inv[p]]
    for name in "abc":
        np.testing.assert_allclose(got[name].emb, want[name], rtol=1e-6)
    assert got["r"] is embs[1]
    # the pooled slots of one shape are consecutive rows of one float32 array, which the training
    # context takes as one tensor without a copy
    assert got["a"].emb.base is got["b"].emb.base and got["a"].emb.base.shape == (2, 4, 2)


def test_rows_of_any_width_stay_within_the_byte_bound():
    m = RowMirror(max_bytes=64 << 20)
    wide = np.ones((100, 10**6), np.float32)  # 100 rows of 10^6 floats: 400 MB, once kept whatever the width
    rss_before = rss_bytes(os.getpid())
    m.absorb(np.arange(1, 101, dtype=np.uint64), wide, np.ones(100, np.int64))
    assert rss_bytes(os.getpid()) - rss_before < (64 << 20) + (16 << 20)
    assert m.nbytes <= 64 << 20 and 0 < len(m) < 100
    assert m.counters["hot_rows_not_kept"] == 100 - len(m)
    m.absorb(u64(7), np.ones((1, 2), np.float32), np.ones(1, np.int64), np.ones((1, 2), np.float32))
    assert m.nbytes <= 64 << 20


def test_mirror_grows_past_its_first_allocation_and_stays_within_max_bytes_over_all_dims():
    m = RowMirror(max_bytes=2500 * _row_bytes(2, 0) + 500 * _row_bytes(3, 0))
    ids = np.arange(1, 2501, dtype=np.uint64)
    m.absorb(ids, np.repeat(ids[:, None].astype(np.float32), 2, axis=1), np.ones(2500, np.int64))
    got = m.newest(ids[::-1], np.zeros((2500, 2), np.float32), np.zeros(2500, np.int64))
    assert got[:, 1].tolist() == ids[::-1].astype(np.float32).tolist() and len(m) == 2500
    m.absorb(u64(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), np.ones((10, 3), np.float32), np.ones(10, np.int64))
    m.absorb(np.arange(5000, 5600, dtype=np.uint64), np.ones((600, 3), np.float32), np.ones(600, np.int64))
    # allocations count, not rows held: the dim-2 table grew into the room the others then lacked
    assert m.nbytes <= m.max_bytes and len(m) >= 2500 and len(m) + m.counters["hot_rows_not_kept"] == 3110


def test_hot_row_grads_sum_each_rows_occurrences_and_leave_out_what_the_worker_skips():
    from persia_nats.core.adjoint import hot_row_grads
    g2 = HotGroup(2, u64(7, 9), np.zeros((2, 2), np.float32), np.array([1, 1], np.int64))
    hot = HotPart((g2,), ("a", "b"), np.array([0, 0], np.int32), np.array([2, 1], np.int32),
                  np.array([0, 0, 1], np.int32), np.array([0, 2, 1], np.int32), np.array([1, 0.5, 1], np.float32))
    ga = np.arange(6, dtype=np.float32).reshape(3, 2)
    gb = np.full((3, 2), 4, np.float32)
    (ids, grads), = hot_row_grads(hot, {"a": ga, "b": gb}, 2.0).values()
    # id 7: a's rows 0 and 2 (the second at scale 0.5); id 9: b's row 1; all divided by the loss scale 2
    assert ids.tolist() == [7, 9] and grads.tolist() == [[(0 + 2) / 2, (1 + 2.5) / 2], [2, 2]]
    # float16 (as on the wire) is read as float32; a slot that is not finite is skipped, as the
    # embedding worker skips it, unless the caller says it left such slots out already
    gb_bad = gb.copy()
    gb_bad[0, 0] = np.inf
    (_, grads), = hot_row_grads(hot, {"a": ga.astype(np.float16), "b": gb_bad}, 2.0).values()
    assert grads.tolist() == [[1, 1.75], [0, 0]]
    (_, grads), = hot_row_grads(hot, {"a": ga}, 2.0, check_finite=False).values()
    assert grads[1].tolist() == [0, 0]  # no gradient given for b
    # slots given as rows of one shared (slots, batch, dim) gradient: the same sums, in one call
    stack = np.stack([gb, ga])
    (_, grads), = hot_row_grads(hot, {"a": (stack, 1), "b": (stack, 0)}, 2.0).values()
    assert grads.tolist() == [[(0 + 2) / 2, (1 + 2.5) / 2], [2, 2]]
    stack[0, 1, 1] = np.nan  # b's row is not finite: b is left out, a is not
    (_, grads), = hot_row_grads(hot, {"a": (stack, 1), "b": (stack, 0)}, 2.0).values()
    assert grads.tolist() == [[1, 1.75], [0, 0]]


def test_the_warm_up_compiles_what_merge_and_hot_row_grads_run_on_a_wire_reply():
    from persia_nats.core.adjoint import hot_row_grads
    from persia_nats.services.nn_worker import hot_rows as hr

    hr.RowMirror.warm_up()
    kernels = (hr.add_pooled_slots, hr.add_adjoint_slots, hr._absorb, hr._newest)
    compiled = [len(k.signatures) for k in kernels]
    assert all(compiled)
    # a lookup reply's embeddings and hot part as the NN worker decodes them: read-only views, with a
    # scale only where pooling is not a plain sum
    embs = (SlotEmbedding("a", np.ones((3, 2), np.float16)), SlotEmbedding("b", np.ones((3, 2), np.float16)))
    g2 = HotGroup(2, u64(7), np.ones((1, 2), np.float32), np.array([1], np.int64))
    for scale in (np.ones(3, np.float32), np.array([1, 0.5, 1], np.float32)):
        part = HotPart((g2,), ("a", "b"), np.array([0, 0], np.int32), np.array([2, 1], np.int32),
                       np.array([0, 0, 0], np.int32), np.array([0, 2, 1], np.int32), scale)
        wire = unpack(pack({"e": [e.to_wire() for e in embs], "h": part.to_wire()}))
        got = tuple(SlotEmbedding.from_wire(e, "emb") for e in wire["e"])
        hot = HotPart.from_wire(wire["h"], got)
        RowMirror().merge(got, hot)
        stack = np.ones((2, 3, 2), np.float32)
        hot_row_grads(hot, {"a": (stack, 0), "b": (stack, 1)}, 2.0, check_finite=False)
        hot_row_grads(hot, {"a": np.ones((3, 2), np.float16), "b": np.ones((3, 2), np.float16)}, 1.0)
    assert [len(k.signatures) for k in kernels] == compiled  # nothing left to compile on the I/O loop


def test_hot_occurrences_match_the_selection_they_stand_for():
    """Every occurrence of a hot row, in occurrence order, slot by slot: checked against the plain
    numpy selection on a larger random batch, slots without one left out."""
    rng = np.random.default_rng(5)
    bs = 64
    feats = [feature(name, [rng.integers(0, 12, rng.integers(0, 4)).tolist() for _ in range(bs)])
             for name in ("a", "b")] + [feature("r", [[1]] * bs)]
    plan = make_plan(feats, CFG)
    p = plan.pooled[2]
    mask = rng.random(plan.distinct[2].shape[0]) < 0.3
    (h,) = hot_occurrences(plan, {2: mask})
    dim, names, counts, inv, target, scale = h.dim, list(h.slots), h.counts, h.inv, h.target, h.scale
    sel = mask[p.inv]
    per_slot = np.bincount(np.repeat(np.arange(len(p.slots)), p.sizes)[sel], minlength=len(p.slots))
    assert dim == 2 and names == [plan.slots[i].name for i, c in zip(p.slots, per_slot, strict=True) if c]
    np.testing.assert_array_equal(counts, per_slot[per_slot > 0])
    np.testing.assert_array_equal(inv, (np.cumsum(mask) - 1)[p.inv[sel]])
    np.testing.assert_array_equal(target, p.target[sel] % bs)
    np.testing.assert_array_equal(scale, p.scale[sel])
    assert (counts.dtype, inv.dtype, target.dtype, scale.dtype) == (np.int32, np.int32, np.int32, np.float32)
