"""A looked-up batch's forward transform (core.lookup: assemble, expand) and its adjoint (core.adjoint: pack,
fold), for every combination of its three shapes (pooled slots, gathered widths, hot rows) in float16 and
float32: each against the other (the adjoint identities) and against torch autograd, with hand-written
arrays; and gathered slots in detail: the rows of a width sent once each, the outputs built from them, and
the gradient per row, the exact adjoint of that gather, against the pooling and the adjoint of core.plan."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from persia_nats.common.codec import all_finite, pack, unpack
from persia_nats.common.config import embedding_config_from_dict
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import (
    EwLookupReply,
    GatheredSlots,
    GradRequest,
    HotGroup,
    HotPart,
    IdFeature,
    RowGradient,
    SlotEmbedding,
    SlotGradient,
)
from persia_nats.core import adjoint, lookup
from persia_nats.core.adjoint import hot_row_grads, row_gradient
from persia_nats.core.half import pow2_scale
from persia_nats.core.lookup import expand, widen
from persia_nats.core.plan import accumulate_grad, gather_index, gatherable_dims, hot_rows, make_plan, pool
from persia_nats.dense.tensors import embedding_tensors, leaf_gradients
from persia_nats.services.nn_worker.hot_rows import RowMirror

CONFIG = embedding_config_from_dict({"feature_index_prefix_bit": 8, "slots_config": {
    "a": {"dim": 4}, "m": {"dim": 8}, "b": {"dim": 4}, "r": {"dim": 2, "embedding_summation": False,
                                                           "sample_fixed_size": 2}}})
BS = 64


def batch(rng: np.random.Generator) -> list[IdFeature]:
    def single(name: str) -> IdFeature:
        return IdFeature(name, rng.zipf(1.3, BS).astype(np.uint64), np.ones(BS, np.int32))

    lengths = rng.integers(0, 4, BS).astype(np.int32)
    multi = IdFeature("m", rng.integers(0, 50, int(lengths.sum())).astype(np.uint64), lengths)
    raw_lengths = rng.integers(0, 3, BS).astype(np.int32)
    raw = IdFeature("r", rng.integers(0, 9, int(raw_lengths.sum())).astype(np.uint64), raw_lengths)
    return [single("b"), multi, raw, single("a")]


def gathered_of(plan, rows: np.ndarray, dim: int) -> GatheredSlots:
    p = plan.pooled[dim]
    return GatheredSlots(dim, rows, tuple(plan.slots[i].name for i in p.slots), np.array(p.slots, np.int32),
                         gather_index(plan, dim))


def test_only_widths_of_single_unscaled_ids_are_gatherable() -> None:
    plan = make_plan(batch(np.random.default_rng(0)), CONFIG)
    assert gatherable_dims(plan) == {4}  # m sums several ids; r is raw
    index = gather_index(plan, 4)
    assert index.dtype == np.uint16 and index.shape == (2, BS)


@pytest.mark.parametrize("seed", range(5))
def test_the_gathered_outputs_are_the_pooled_ones_bit_for_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    plan = make_plan(batch(rng), CONFIG)
    rows = {dim: rng.standard_normal((ids.shape[0], dim)).astype(np.float32) for dim, ids in plan.distinct.items()}
    pooled = [SlotEmbedding(s.name, pool(s, rows[s.dim]).astype(np.float16), s.index) for s in plan.slots]
    g = gathered_of(plan, rows[4].astype(np.float16), 4)
    rest = tuple(e for e in pooled if e.name not in g.slots)
    reply = EwLookupReply.from_wire(unpack(pack(EwLookupReply(7, rest, None, (g,)).to_wire())))
    assert reply.slot_names() == ("a", "m", "b", "r")  # the configuration's order
    out = expand(reply.embeddings, reply.gathered)
    assert [e.name for e in out] == [e.name for e in pooled]
    for got, want in zip(out, pooled, strict=True):
        np.testing.assert_array_equal(got.emb, want.emb.astype(np.float32))
        assert (got.index is None) == (want.index is None)


@pytest.mark.parametrize("seed", range(3))
def test_hot_rows_at_their_newest_value_are_what_adding_it_at_every_read_gives(seed: int) -> None:
    """The merge puts a gathered width's hot rows in before the gather: bit for bit the outputs of adding
    each one's newest value at every read of it, negative zeros and all."""
    rng = np.random.default_rng(seed)
    plan = make_plan(batch(rng), CONFIG)
    n = plan.distinct[4].shape[0]
    hot_at = np.sort(rng.choice(n, size=max(1, n // 3), replace=False)).astype(np.int32)
    rows = rng.standard_normal((n, 4)).astype(np.float16)
    rows[hot_at] = 0  # as the embedding worker sends them
    newest = rng.standard_normal((hot_at.shape[0], 4)).astype(np.float32)
    newest[0, :2] = -0.0
    g = GatheredSlots(4, rows, *dataclasses.astuple(gathered_of(plan, rows, 4))[2:5], hot_at)
    group = HotGroup(4, plan.distinct[4][hot_at], newest, np.ones(hot_at.shape[0], np.int64))
    empty = np.zeros(0, np.int32)
    hot = HotPart((group,), (), empty, empty, empty, empty, np.zeros(0, np.float32))
    rest = tuple(SlotEmbedding(s.name, pool(s, np.zeros((plan.distinct[s.dim].shape[0], s.dim), np.float32))
                               .astype(np.float16), s.index) for s in plan.slots if s.name not in g.slots)
    reply = EwLookupReply.from_wire(unpack(pack(EwLookupReply(7, rest, hot, (g,)).to_wire())))
    got = {e.name: e.emb for e in RowMirror().merge(reply.embeddings, reply.hot, reply.gathered)}
    want = {e.name: e.emb.copy() for e in expand(reply.embeddings, reply.gathered)}
    hot_of = {int(r): h for h, r in enumerate(hot_at)}
    for k, name in enumerate(g.slots):
        for s, r in enumerate(g.index[k].tolist()):
            if r in hot_of:
                want[name][s] += newest[hot_of[r]]
    assert list(got) == list(reply.slot_names())
    for name in got:
        np.testing.assert_array_equal(got[name].view(np.uint32) if got[name].dtype == np.float32 else got[name],
                                      want[name].view(np.uint32) if want[name].dtype == np.float32 else want[name])
    # the rows widened when the reply arrives (EmbeddingClient.lookup) merge to the same bits
    widened = widen(reply.gathered)
    assert widened[0].rows.dtype == np.float32 and reply.gathered[0].rows.dtype == np.float16
    early = {e.name: e.emb for e in RowMirror().merge(reply.embeddings, reply.hot, widened)}
    for name in got:
        np.testing.assert_array_equal(early[name], got[name])
    # the merge adds the hot rows into a copy: the widened rows keep the reply's values
    np.testing.assert_array_equal(widened[0].rows, reply.gathered[0].rows.astype(np.float32))
    assert widen(widened)[0] is widened[0]


@pytest.mark.parametrize("half", [False, True])
def test_the_row_gradient_is_the_adjoint_of_the_pooling(half: bool) -> None:
    rng = np.random.default_rng(3)
    plan = make_plan(batch(rng), CONFIG)
    g = gathered_of(plan, np.zeros((plan.distinct[4].shape[0], 4), np.float16), 4)
    grads = rng.standard_normal((2, BS, 4)).astype(np.float32) * 1e-3
    want = np.zeros((plan.distinct[4].shape[0], 4), np.float32)
    for k, name in enumerate(g.slots):
        accumulate_grad(next(s for s in plan.slots if s.name == name), grads[k], want)
    got, hot = row_gradient(g, grads, [True, True], loss_scale=4.0, half=half)
    assert hot is None
    assert got.skipped == ()
    if not half:
        np.testing.assert_allclose(got.grad, want / 4, rtol=1e-6, atol=1e-12)
        return
    assert got.grad.dtype == np.float16 and math.frexp(got.scale)[0] == 0.5
    assert 2.0 ** 13 <= float(np.abs(got.grad.astype(np.float32)).max()) < 2.0 ** 14
    np.testing.assert_allclose(got.grad.astype(np.float32) / got.scale, want / 4, rtol=2 ** -10, atol=1e-9)


def test_the_hot_rows_gradients_are_their_rows_of_the_float32_row_gradient() -> None:
    rng = np.random.default_rng(7)
    plan = make_plan(batch(rng), CONFIG)
    g = gathered_of(plan, np.zeros((plan.distinct[4].shape[0], 4), np.float16), 4)
    hot = np.array([3, 0, 5], np.int32)
    g = GatheredSlots(g.dim, g.rows, g.slots, g.at, g.index, hot)
    grads = rng.standard_normal((2, BS, 4)).astype(np.float32)
    plain, _ = row_gradient(g, grads, [True, True], loss_scale=2.0, half=False)
    wire, hot_grads = row_gradient(g, grads, [True, True], loss_scale=2.0, half=True)
    assert hot_grads is not None and hot_grads.dtype == np.float32
    np.testing.assert_array_equal(hot_grads, plain.grad[hot])
    np.testing.assert_allclose(wire.grad.astype(np.float32)[hot] / wire.scale, hot_grads, rtol=2 ** -10)


def test_a_slot_whose_gradient_is_not_finite_is_left_out_and_named() -> None:
    rng = np.random.default_rng(4)
    plan = make_plan(batch(rng), CONFIG)
    g = gathered_of(plan, np.zeros((plan.distinct[4].shape[0], 4), np.float16), 4)
    grads = rng.standard_normal((2, BS, 4)).astype(np.float32)
    grads[0, 5, 1] = np.nan
    got, _ = row_gradient(g, grads, [False, True], 1.0, half=False)
    assert got.skipped == (g.slots[0],)
    alone = np.zeros((g.rows.shape[0], 4), np.float32)
    accumulate_grad(next(s for s in plan.slots if s.name == g.slots[1]), grads[1], alone)
    np.testing.assert_allclose(got.grad, alone, rtol=1e-6)
    assert all_finite(got.grad)


def test_pow2_scale_lifts_the_peak_into_float16s_top_octave_and_all_finite_sees_every_nan() -> None:
    for peak in (1e-7, 0.75, 1.0, 3.0, 8191.0, 2.0 ** 40):
        s = pow2_scale(peak)
        assert math.frexp(s)[0] == 0.5 and 2.0 ** 13 <= peak * s < 2.0 ** 14
    assert pow2_scale(0.0) == pow2_scale(float("inf")) == pow2_scale(float("nan")) == 1.0
    assert pow2_scale(1e-300) == 2.0 ** 100  # what a PS accepts at most
    h = np.ones((3, 5), np.float16)
    assert all_finite(h)
    for bad in (np.inf, -np.inf, np.nan):
        h[2, 4] = bad
        assert not all_finite(h)
        assert not all_finite(h.astype(np.float32))


def _wire(g: GatheredSlots) -> dict:
    return unpack(pack(g.to_wire()))


@pytest.mark.parametrize(("change", "words"), [
    (lambda w: w.update(index={**w["index"], "data": np.full(2 * BS, 60000, np.uint16).tobytes()}), "index"),
    (lambda w: w.update(slots=["a"]), "slots"),
    (lambda w: w.update(dim=3), "dim"),
    (lambda w: w.update(rows={**w["rows"], "dtype": "<i4"}), "rows"),
])
def test_a_malformed_gathered_width_is_refused_naming_the_field(change, words) -> None:
    plan = make_plan(batch(np.random.default_rng(5)), CONFIG)
    w = _wire(gathered_of(plan, np.zeros((plan.distinct[4].shape[0], 4), np.float16), 4))
    change(w)
    with pytest.raises(BadRequest, match=words):
        GatheredSlots.from_wire(w, "gathered[0]")


def test_a_reply_whose_gathered_positions_collide_is_refused() -> None:
    plan = make_plan(batch(np.random.default_rng(6)), CONFIG)
    g = gathered_of(plan, np.zeros((plan.distinct[4].shape[0], 4), np.float16), 4)
    m = SlotEmbedding("m", np.zeros((BS, 8), np.float16))
    clash = GatheredSlots(g.dim, g.rows, g.slots, np.array([0, 0], np.int32), g.index)
    with pytest.raises(BadRequest, match="position"):
        EwLookupReply.from_wire(unpack(pack(EwLookupReply(1, (m,), None, (clash,)).to_wire())))
    # hot rows may name gathered slots: their shape is the gather's
    hot = HotPart((), ("a",), np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(0, np.int32),
                  np.zeros(0, np.int32), np.zeros(0, np.float32))
    with pytest.raises(BadRequest, match="group"):  # no groups at all: group 0 is outside them
        HotPart.from_wire(unpack(pack(hot.to_wire())), (m,), gathered=(g,))


@pytest.mark.parametrize("scale", [3.0, 2.0 ** 101, 0.0, True])
def test_a_row_gradient_scale_must_be_a_power_of_two_a_ps_accepts(scale) -> None:
    wire = {"v": 1, "ref": 1, "grads": [], "rows": [
        {**RowGradient(4, np.zeros((2, 4), np.float16)).to_wire(), "scale": scale}]}
    with pytest.raises(BadRequest, match=r"rows\[0\]\.scale"):
        GradRequest.from_wire(unpack(pack(wire)))


# widens float16 rows on a thread other than the main one, as the I/O thread does, with torch set to
# two threads, and prints how many threads the process had before and while that thread, done with
# the rows, still runs (one more: itself)
WIDEN_ON_A_THREAD = """
import os, threading
import numpy as np, torch
from persia_nats.core.lookup import float32_copy
torch.set_num_threads(2)
rows = np.random.default_rng(0).standard_normal((12000, 16)).astype(np.float16)
float32_copy(rows)  # loading the compiled loop starts a thread of numba's, once
before = len(os.listdir("/proc/self/task"))
out = []
def widen():
    out.append(float32_copy(rows))
    out.append(len(os.listdir("/proc/self/task")))
t = threading.Thread(target=widen); t.start(); t.join()
assert np.array_equal(out[0], rows.astype(np.float32)) and out[0].dtype == np.float32
print(before, out[1])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_widening_on_the_io_thread_starts_no_openmp_team():
    """torch's conversion would start a team of the calling thread's own, whose worker spins after every
    batch on a core the I/O thread and the sparse roles need."""
    out = subprocess.run([sys.executable, "-c", WIDEN_ON_A_THREAD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, during = map(int, out.stdout.split())
    assert during == before + 1


def test_float32_copy_widens_every_float16_exactly_and_copies_other_types():
    from persia_nats.core.lookup import float32_copy
    bits = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(256, 256)
    wide = float32_copy(bits)
    assert wide.dtype == np.float32 and wide.shape == (256, 256) and wide.flags.writeable and wide.flags.owndata
    np.testing.assert_array_equal(wide, bits.astype(np.float32))  # NaNs compare equal here
    same = np.ones((3, 2), np.float32)
    copy = float32_copy(same)
    assert copy is not same and np.array_equal(copy, same)
    readonly = np.ones(4, np.float16)
    readonly.flags.writeable = False
    assert float32_copy(readonly).flags.writeable


# -- the transforms and their adjoints: every shape, both dtypes, hand-written arrays -------------

SHAPES = embedding_config_from_dict({"feature_index_prefix_bit": 8, "slots_config": {
    "a": {"dim": 4}, "b": {"dim": 4}, "m": {"dim": 8, "pooling": "mean"},
    "r": {"dim": 2, "embedding_summation": False, "sample_fixed_size": 2}}})
#: a batch of 3 samples (each slot's ids are rows of its own): a and b one id each (the gatherable width 4;
#: a reads its id 1 twice), m a mean of 2, 0 and 3 ids (5 read twice), r raw (4 twice, a sample with none)
FEATURES = {
    "a": IdFeature("a", np.array([1, 2, 1], np.uint64), np.array([1, 1, 1], np.int32)),
    "b": IdFeature("b", np.array([2, 3, 1], np.uint64), np.array([1, 1, 1], np.int32)),
    "m": IdFeature("m", np.array([5, 1, 6, 5, 7], np.uint64), np.array([2, 0, 3], np.int32)),
    "r": IdFeature("r", np.array([4, 4, 9], np.uint64), np.array([1, 2, 0], np.int32)),
}
#: (slots in the batch, gathered width, hot rows, wire dtype): every combination of the three shapes
CASES = [(slots, gather, hot, dtype)
         for slots in (("a", "b"), ("m", "r"), ("a", "b", "m", "r"))
         for gather in (False, True) for hot in (False, True) for dtype in ("float16", "float32")
         if not (gather and "a" not in slots)]


def _rows(plan) -> dict[int, np.ndarray]:
    """Hand-written PS rows, each value a multiple of 1/8 in [-1, 1): exact in float16."""
    return {dim: ((np.arange(ids.shape[0] * dim, dtype=np.float32).reshape(-1, dim) * 3) % 16 - 8) / 8
            for dim, ids in plan.distinct.items()}


def _weights(shape: tuple[int, ...], k: int) -> np.ndarray:
    """Hand-written weights of the loss, multiples of 1/4."""
    return (((np.arange(int(np.prod(shape)), dtype=np.float32) + k) * 5) % 7 - 3).reshape(shape) / 4


def _answer(requests: list[lookup.RowRequest], rows: dict[int, np.ndarray]) -> list[lookup.RowAnswer]:
    """The PSs' answers (:meth:`PsClient.fetch`): each request's rows, float16 where it allows them."""
    return [lookup.RowAnswer((rows[r.dim] if r.where is None else rows[r.dim][r.where]).astype(
                                 np.float16 if r.half else np.float32),
                             np.full(r.ids.shape[0], 3, np.int64)) for r in requests]


def _looked_up(slots, gather, hot, dtype):
    """(plan, PS rows, hot masks, widths gathered, wire dtype, the reply as the NN worker decodes it)."""
    plan = make_plan([FEATURES[s] for s in slots], SHAPES)
    wire = np.dtype(dtype)
    rows = _rows(plan)
    masks = hot_rows(plan, 2) if hot else None
    if hot:
        assert masks, "the hand-written batch reads some rows twice"
    widths = gatherable_dims(plan) if gather else frozenset()
    requests = lookup.row_requests(plan, wire, masks, widths)
    # float16 rows where the width's outputs are its rows; there, the hot rows apart as float32, first
    half = (widths or gatherable_dims(plan)) if wire == np.float16 else frozenset()
    assert [(r.dim, r.half) for r in requests] == [
        (dim, h) for dim in plan.distinct for h in ((False, True) if masks and dim in masks and dim in half
                                                    else (dim in half,))]
    parts = lookup.assemble(plan, requests, _answer(requests, rows), wire, masks, widths)
    assert parts.fallbacks == ()
    reply = EwLookupReply.from_wire(unpack(pack(EwLookupReply(1, parts.embeddings, parts.hot,
                                                              parts.gathered).to_wire())))
    return plan, rows, masks, widths, wire, reply


def _expand(reply: EwLookupReply) -> tuple[SlotEmbedding, ...]:
    """The NN worker's slot outputs: with hot rows, at the values the lookup read."""
    if reply.hot is None:
        return lookup.expand(reply.embeddings, reply.gathered)
    return lookup.expand(reply.embeddings, lookup.widen(reply.gathered), reply.hot,
                         [g.rows for g in reply.hot.groups])


def _hot_grads(reply: EwLookupReply, parts: adjoint.GradParts) -> dict[int, np.ndarray]:
    """Per hot group, its rows' gradients as a rank publishes them (:meth:`EmbeddingClient._send_grads`)."""
    assert reply.hot is not None and parts.hot_grads is not None
    out = {dim: g for dim, (_, g) in hot_row_grads(reply.hot, parts.hot_grads, 1.0, check_finite=False).items()}
    out.update(parts.gathered_hot or {})
    return out


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.dot(np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()))


@pytest.mark.parametrize(("slots", "gather", "hot", "dtype"), CASES)
def test_pack_is_the_adjoint_of_expand(slots, gather, hot, dtype) -> None:
    """<expand(x), y> == <x, pack(y)>: x the reply's parts (its slots, gathered rows, hot rows), y a gradient
    at every slot's output."""
    _, _, _, _, wire, reply = _looked_up(slots, gather, hot, dtype)
    out = _expand(reply)
    y = [_weights(e.emb.shape, k) for k, e in enumerate(out)]
    leaves = adjoint.LeafGrads(y, [float(np.abs(a).max()) for a in y], [(k, None) for k in range(len(y))])
    parts = adjoint.pack(out, reply.gathered, reply.hot, leaves, 1.0, wire)
    lhs = sum(_dot(e.emb, w) for e, w in zip(out, y, strict=True))
    by_name = {e.name: e.emb for e in reply.embeddings}
    rhs = sum(_dot(by_name[g.name], g.grad.astype(np.float32) / parts.loss_scale) for g in parts.grads)
    rows = {g.dim: g.rows for g in reply.gathered}
    rhs += sum(_dot(rows[r.dim], r.grad.astype(np.float32) / r.scale) for r in parts.rows)
    if reply.hot is not None:
        grads = _hot_grads(reply, parts)
        rhs += sum(_dot(g.rows, grads[g.dim]) for g in reply.hot.groups)
    assert [g.name for g in parts.grads] == [e.name for e in reply.embeddings]
    assert [r.dim for r in parts.rows] == [g.dim for g in reply.gathered]
    assert rhs == pytest.approx(lhs, rel=1e-6, abs=1e-6)  # the weights are exact in float16 too


@pytest.mark.parametrize(("slots", "gather", "hot", "dtype"), CASES)
def test_fold_is_the_adjoint_of_assemble(slots, gather, hot, dtype) -> None:
    """<assemble(r), g> == <r, fold(g)>: r the PS rows, g a gradient at every part of the reply (its hot rows'
    the adjoint of adding them back, what the NN worker publishes for them)."""
    plan, rows, _, widths, wire, reply = _looked_up(slots, gather, hot, dtype)
    g_slots = tuple(SlotGradient(e.name, _weights(e.emb.shape, k)) for k, e in enumerate(reply.embeddings))
    g_rows = tuple(RowGradient(g.dim, _weights(g.rows.shape, 9)) for g in reply.gathered)
    folded = adjoint.fold(plan, GradRequest(1, g_slots, 1.0, rows=g_rows), widths, wire)
    assert folded.skipped == ()
    scales = folded.scales or {}
    rhs = sum(_dot(rows[dim], g.astype(np.float32) / scales.get(dim, 1.0)) for dim, g in folded.grads.items())
    lhs = sum(_dot(e.emb.astype(np.float32), g.grad) for e, g in zip(reply.embeddings, g_slots, strict=True))
    lhs += sum(_dot(x.rows.astype(np.float32), g.grad) for x, g in zip(reply.gathered, g_rows, strict=True))
    if reply.hot is not None:
        hot_of = {dim: g for dim, (_, g) in hot_row_grads(reply.hot, {g.name: g.grad for g in g_slots}, 1.0).items()}
        for x, g in zip(reply.gathered, g_rows, strict=True):
            if x.hot_at is not None:
                hot_of[x.dim] = g.grad[x.hot_at]
        lhs += sum(_dot(h.rows, hot_of[h.dim]) for h in reply.hot.groups)
    # float16 rounds the mean-pooled outputs (thirds) and the scaled row gradients: within their precision
    assert rhs == pytest.approx(lhs, rel=1e-6 if dtype == "float32" else 2e-3, abs=1e-6)


@pytest.mark.parametrize("on_device", [False, True], ids=["gather-on-host", "gather-on-device"])
def test_a_gathered_width_with_a_gradient_not_finite_changes_no_row(on_device) -> None:
    """One slot of a gathered width reads an infinite gradient: on the host only that slot is left out (its
    rows move by the other slot's reads alone); on the device its slots' own gradients are gone, so the width
    is skipped whole. Either way nothing not finite reaches the wire, and the slots left out are named."""
    plan, _, _, _, wire, reply = _looked_up(("a", "b"), True, False, "float32")
    g = reply.gathered[0]
    if on_device:
        out, deferred = _expand_deferred(reply)
    else:
        out, deferred = _expand(reply), ()
    inputs, leaves = embedding_tensors(out, torch.device("cpu"), requires_grad=True, gathered=deferred)
    position = [s.name for s in plan.slots].index(g.slots[0])
    weights = [torch.from_numpy(_weights(tuple(t.shape), k)) for k, t in enumerate(inputs)]
    weights[position][0, 0] = float("inf")
    sum((t * w).sum() for t, w in zip(inputs, weights, strict=True)).backward()
    parts = adjoint.pack(out, reply.gathered, reply.hot, leaf_gradients(leaves), 1.0, wire)
    (rows,) = parts.rows
    assert np.isfinite(rows.grad).all()
    if on_device:
        assert rows.skipped == g.slots and not rows.grad.any()
    else:
        assert rows.skipped == (g.slots[0],) and rows.grad.any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("on_device", [False, True], ids=["gather-on-host", "gather-on-device"])
def test_a_gpu_ranks_leaf_gradients_pack_as_a_cpu_ranks_do(on_device) -> None:
    """A GPU rank's leaf gradients come to pinned host memory with their peaks, and no device conversion is
    left to the loop that packs them (``scaled_half`` None): the parts match a CPU rank's."""
    plan, _, _, _, wire, reply = _looked_up(("a", "b", "m", "r"), True, True, "float16")
    packed = []
    for device in (torch.device("cpu"), torch.device("cuda")):
        out, deferred = _expand_deferred(reply) if on_device else (_expand(reply), ())
        inputs, leaves = embedding_tensors(out, device, requires_grad=True, gathered=deferred)
        weights = [torch.from_numpy(_weights(tuple(t.shape), k)).to(device) for k, t in enumerate(inputs)]
        sum((t * w).sum() for t, w in zip(inputs, weights, strict=True)).backward()
        grads = leaf_gradients(leaves)
        assert (grads.scaled_half is None) == (device.type == "cuda")
        packed.append((grads, adjoint.pack(out, reply.gathered, reply.hot, grads, 1.0, wire)))
    (cpu, cpu_parts), (gpu, gpu_parts) = packed
    np.testing.assert_allclose(gpu.peaks, cpu.peaks, rtol=1e-6)
    for a, b in zip(gpu.arrays, cpu.arrays, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert gpu_parts.loss_scale == cpu_parts.loss_scale
    for a, b in zip(gpu_parts.grads, cpu_parts.grads, strict=True):
        np.testing.assert_array_equal(a.grad, b.grad)
    for a, b in zip(gpu_parts.rows, cpu_parts.rows, strict=True):
        np.testing.assert_allclose(a.grad.astype(np.float32), b.grad.astype(np.float32), rtol=2e-3, atol=1e-6)


def _reference(plan, rows: dict[int, np.ndarray], inputs_like: list) -> tuple[dict[int, torch.Tensor], list]:
    """The model's inputs straight from the PS rows, in torch: each slot's output ``out[target] += scale *
    row[inv]`` over its occurrences, a raw slot's then gathered by its index with a mask channel."""
    leaves = {dim: torch.tensor(r, requires_grad=True) for dim, r in rows.items()}
    inputs = []
    for slot in plan.slots:
        r = leaves[slot.dim]
        out = torch.zeros(slot.n_targets, slot.dim).index_add(
            0, torch.from_numpy(slot.target), torch.from_numpy(slot.scale)[:, None] * r[torch.from_numpy(slot.inv)])
        if slot.index is not None:
            index = torch.from_numpy(slot.index).long()
            padded = torch.cat([torch.zeros(1, slot.dim), out])
            out = torch.cat([padded[index + 1], (index >= 0).unsqueeze(-1).float()], dim=-1)
        inputs.append(out)
    return leaves, inputs


def _expand_deferred(reply: EwLookupReply) -> tuple[tuple[SlotEmbedding, ...], tuple[GatheredSlots, ...]]:
    """:func:`_expand` with the gathered widths left for the device (``embedding_gather: device``)."""
    if reply.hot is None:
        return lookup.expand_deferred(reply.embeddings, reply.gathered)
    return lookup.expand_deferred(reply.embeddings, lookup.widen(reply.gathered), reply.hot,
                                  [g.rows for g in reply.hot.groups])


@pytest.mark.parametrize("on_device", [False, True], ids=["gather-on-host", "gather-on-device"])
@pytest.mark.parametrize(("slots", "gather", "hot", "dtype"), CASES)
def test_the_whole_round_trip_is_what_autograd_gives(slots, gather, hot, dtype, on_device) -> None:
    """assemble, the wire, expand and the model's tensors forward; the tensors' backward, pack, the wire and
    fold back: the model's inputs and each PS row's gradient as torch autograd computes them from the rows,
    and the hot rows' gradients (published to the other ranks) those rows' part of it. ``on_device``: the
    gathered widths' slots built by the tensors' own gather (:func:`lookup.expand_deferred`), their rows'
    gradients autograd's."""
    plan, rows, masks, widths, wire, reply = _looked_up(slots, gather, hot, dtype)
    deferred: tuple[GatheredSlots, ...] = ()
    if on_device:
        out, deferred = _expand_deferred(reply)
        assert [e.name for e in out] == [s.name for s in plan.slots if s.name not in
                                         {n for g in reply.gathered for n in g.slots}]
    else:
        out = _expand(reply)
        assert [e.name for e in out] == [s.name for s in plan.slots]
    inputs, leaves = embedding_tensors(out, torch.device("cpu"), requires_grad=True, gathered=deferred)
    assert len(inputs) == len(plan.slots)
    weights = [torch.from_numpy(_weights(tuple(t.shape), k)) for k, t in enumerate(inputs)]
    sum((t * w).sum() for t, w in zip(inputs, weights, strict=True)).backward()
    leaf_grads = leaf_gradients(leaves)
    parts = adjoint.pack(out, reply.gathered, reply.hot, leaf_grads, 1.0, wire)
    # torch's float16 conversion (the dense side's) and core's give the same bits
    numpy_only = adjoint.pack(out, reply.gathered, reply.hot, dataclasses.replace(leaf_grads, scaled_half=None),
                              1.0, wire)
    assert numpy_only.loss_scale == parts.loss_scale
    for a, b in zip(parts.grads, numpy_only.grads, strict=True):
        assert a.grad.dtype == b.grad.dtype == wire and a.grad.tobytes() == b.grad.tobytes()
    req = GradRequest.from_wire(unpack(pack(GradRequest(1, parts.grads, parts.loss_scale, rows=parts.rows).to_wire())))
    folded = adjoint.fold(plan, req, widths, wire)

    ref_leaves, ref_inputs = _reference(plan, rows, inputs)
    sum((t * w).sum() for t, w in zip(ref_inputs, weights, strict=True)).backward()
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == "float32" else {"rtol": 2e-3, "atol": 2e-3}
    for got, want in zip(inputs, ref_inputs, strict=True):
        np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), **tol)
    scales = folded.scales or {}
    assert sorted(folded.grads) == sorted(plan.distinct)
    for dim, g in folded.grads.items():
        want = ref_leaves[dim].grad.numpy()
        np.testing.assert_allclose(g.astype(np.float32) / scales.get(dim, 1.0), want, **tol)
    if hot:
        assert masks is not None and reply.hot is not None
        grads = _hot_grads(reply, parts)
        for group in reply.hot.groups:  # float32 and unscaled: exact sums of the weights
            np.testing.assert_allclose(grads[group.dim], ref_leaves[group.dim].grad.numpy()[masks[group.dim]],
                                       rtol=1e-6, atol=1e-6)
