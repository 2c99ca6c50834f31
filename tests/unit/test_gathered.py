"""Gathered slots: the rows of a width sent once each, the outputs built from them, and the gradient
per row, the exact adjoint of that gather, against the pooling and the adjoint of core.plan."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest
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
)
from persia_nats.core.half import pow2_scale
from persia_nats.core.plan import accumulate_grad, gather_index, gatherable_dims, make_plan, pool
from persia_nats.services.nn_worker.gathered import expand, row_gradient, widen
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
    out = expand(reply.embeddings, reply.gathered, reply.slot_names())
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
    want = {e.name: e.emb.copy() for e in expand(reply.embeddings, reply.gathered, reply.slot_names())}
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
from persia_nats.services.nn_worker.gathered import float32_copy
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
    from persia_nats.services.nn_worker.gathered import float32_copy
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
