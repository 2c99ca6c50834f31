"""Turning a batch's id features into distinct PS rows, and embeddings back into slot outputs.

Every slot is reduced to *occurrences*: one record per (id, hash-stack round) that says which
distinct PS row it reads (``inv``), which output row it adds into (``target``) and with what
weight (``scale``)::

    pooled slot:  out[target=sample] += scale * row[inv]      scale = 1, 1/n, or 1/sqrt(n)
    raw slot:     out[target=distinct id of the slot] += scale * row[inv]

The gradient is the exact adjoint of that sum: ``grad_row[inv] += scale * g[target]``. The same
two kernels serve sum, mean, sqrt-scaled, hash-stacked and raw slots, and no Python loop runs per
id anywhere.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numba
import numpy as np
from persia_nats.common.codec import all_finite
from persia_nats.common.config import EmbeddingConfig
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import IdFeature
from persia_nats.core.half import to_float, to_half
from persia_nats.core.sharding import splitmix64


@dataclass(frozen=True, slots=True)
class SlotPlan:
    name: str
    dim: int
    raw: bool
    inv: np.ndarray  # int64, into the distinct rows of this slot's dim class
    target: np.ndarray  # int64, output row
    scale: np.ndarray  # float32
    n_targets: int
    index: np.ndarray | None  # raw slots: (batch, sample_fixed_size) int32, -1 = padding


@dataclass(frozen=True, slots=True)
class PooledDim:
    """The pooled slots of one dim as one set of occurrences, output row ``k * batch + sample`` for the
    k-th of them: one kernel call pools them all into a (k, batch, dim) array."""

    slots: tuple[int, ...]  # positions in BatchPlan.slots
    inv: np.ndarray  # int64, into the dim's distinct rows
    target: np.ndarray  # int64, k * batch + sample
    scale: np.ndarray  # float32
    sizes: np.ndarray  # int64, occurrences per slot, in order


@dataclass(frozen=True, slots=True)
class BatchPlan:
    batch_size: int
    slots: tuple[SlotPlan, ...]
    #: distinct prefixed signs per embedding dim: what the PS shards are asked for
    distinct: dict[int, np.ndarray]
    #: per dim with pooled slots, their occurrences laid end to end
    pooled: dict[int, PooledDim] = field(default_factory=dict)


def _hash_stack(ids: np.ndarray, rounds: int, size: int) -> np.ndarray:
    """Each id becomes ``rounds`` buckets ``h_r % size + r * size`` with ``h_{r+1} = mix(h_r)``."""
    out = np.empty((ids.shape[0], rounds), dtype=np.uint64)
    h = ids
    for r in range(rounds):  # rounds is a small config constant, not a per-id loop
        h = splitmix64(h)
        out[:, r] = h % np.uint64(size) + np.uint64(r * size)
    return out.reshape(-1)


def _slot_occurrences(feat: IdFeature, cfg: EmbeddingConfig) -> tuple[SlotPlan, np.ndarray]:
    """Occurrences of one slot, returning its plan (``inv`` not yet set) and the prefixed signs."""
    slot = cfg.slots_config[feat.name]
    bs = feat.batch_size
    ids = np.asarray(feat.values, dtype=np.uint64)
    lengths = np.asarray(feat.lengths, dtype=np.int64)
    sample_of = np.repeat(np.arange(bs, dtype=np.int64), lengths)
    index = None
    hs = slot.hash_stack_config
    rounds = hs.hash_stack_rounds
    if slot.embedding_summation:
        n = np.maximum(lengths, 1).astype(np.float32)
        per_sample = np.ones(bs, dtype=np.float32)
        if slot.pooling == "mean":
            per_sample /= n
        if slot.sqrt_scaling:
            per_sample /= np.sqrt(n)
        target, scale = sample_of, per_sample[sample_of]
        n_targets = bs
    else:
        fixed = slot.sample_fixed_size
        starts = np.cumsum(lengths) - lengths
        pos = np.arange(ids.shape[0], dtype=np.int64) - np.repeat(starts, lengths)
        keep = pos < fixed
        ids, sample_of, pos = ids[keep], sample_of[keep], pos[keep]
        distinct, local = np.unique(ids, return_inverse=True)
        index = np.full((bs, fixed), -1, dtype=np.int32)
        index[sample_of, pos] = local
        target = local.astype(np.int64)
        scale = np.full(ids.shape[0], 1.0 / np.sqrt(rounds) if (slot.sqrt_scaling and rounds) else 1.0,
                        dtype=np.float32)
        # the raw output holds one row per distinct id, so each distinct id occurs once
        ids, target, scale = distinct, np.arange(distinct.shape[0], dtype=np.int64), scale[: distinct.shape[0]]
        n_targets = int(distinct.shape[0])
    if rounds:
        ids = _hash_stack(ids, rounds, hs.embedding_size)
        target = np.repeat(target, rounds)
        scale = np.repeat(scale, rounds)
    shift = 64 - cfg.feature_index_prefix_bit
    mask = np.uint64((1 << shift) - 1)
    signs = (ids & mask) | np.uint64(cfg.prefix_of(feat.name))
    plan = SlotPlan(feat.name, slot.dim, not slot.embedding_summation, np.empty(0, np.int64), target,
                    np.ascontiguousarray(scale, dtype=np.float32), n_targets, index)
    return plan, signs


@dataclass(frozen=True, slots=True)
class _Summed:
    """The occurrences of a batch's plainly summed slots (pooled, no hash stacking), laid end to end."""

    plans: list[SlotPlan]  # inv not yet set
    signs: np.ndarray  # prefixed
    rows: np.ndarray  # int64, j * batch + sample for the j-th of these slots
    scale: np.ndarray  # float32
    starts: list[int]  # slot j's occurrences are [starts[j], starts[j + 1])


def _summed_occurrences(features: Sequence[IdFeature], cfg: EmbeddingConfig) -> _Summed:
    """:func:`_slot_occurrences` of plainly summed slots, all at once (a batch has dozens of slots,
    each a handful of numpy calls when planned alone); a slot's arrays are views into the batch's."""
    bs = features[0].batch_size
    k = len(features)
    values = np.concatenate([np.asarray(f.values, dtype=np.uint64) for f in features])
    lengths = np.concatenate([np.asarray(f.lengths, dtype=np.int64) for f in features])
    slots = [cfg.slots_config[f.name] for f in features]
    counts = [f.values.shape[0] for f in features]
    # the same float32 operations in the same order as one slot at a time, so the scales are identical
    n = np.maximum(lengths, 1).astype(np.float32)
    per_sample = np.ones(k * bs, dtype=np.float32)
    if any(s.pooling == "mean" for s in slots):
        np.divide(per_sample, n, out=per_sample, where=np.repeat([s.pooling == "mean" for s in slots], bs))
    if any(s.sqrt_scaling for s in slots):
        np.divide(per_sample, np.sqrt(n), out=per_sample, where=np.repeat([s.sqrt_scaling for s in slots], bs))
    if values.shape[0] == k * bs and bool((lengths == 1).all()):  # single-id slots: one id a sample
        rows, sample, scale = np.arange(k * bs, dtype=np.int64), np.tile(np.arange(bs, dtype=np.int64), k), per_sample
    else:
        rows = np.repeat(np.arange(k * bs, dtype=np.int64), lengths)
        sample, scale = rows % bs, per_sample[rows]
    mask = np.uint64((1 << (64 - cfg.feature_index_prefix_bit)) - 1)
    prefixes = np.array([cfg.prefix_of(f.name) for f in features], np.uint64)
    signs = (values & mask) | np.repeat(prefixes, counts)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64).tolist()
    plans = [SlotPlan(f.name, slot.dim, False, np.empty(0, np.int64), sample[starts[j]:starts[j + 1]],
                      scale[starts[j]:starts[j + 1]], bs, None)
             for j, (f, slot) in enumerate(zip(features, slots, strict=True))]
    return _Summed(plans, signs, rows, scale, starts)


def unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` of 1-D uint64 signs (the inverse int64): the same sort
    numpy runs (its vectorized argsort), then the distinct values and the inverse in one pass, where
    numpy makes five (a gather, a comparison, a cumulative sum over the flags, a mask, a scatter).

    A hashed dedup (an open-addressing table keeping first-seen order, then a sort of the distinct
    values alone) measured no faster on the synthetic batches: numpy's argsort is vectorized, the
    table's probes miss the cache."""
    values = np.ascontiguousarray(values, dtype=np.uint64)
    return _distinct_sorted(values, np.argsort(values))


@numba.njit(cache=True, nogil=True)
def _distinct_sorted(values: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = order.shape[0]
    uniq = np.empty(n, np.uint64)
    inv = np.empty(n, np.int64)
    m = -1
    last = np.uint64(0)
    for q in range(n):
        i = order[q]
        v = values[i]
        if m < 0 or v != last:
            m += 1
            uniq[m] = v
            last = v
        inv[i] = m
    return uniq[:m + 1].copy(), inv


def make_plan(features: Sequence[IdFeature], cfg: EmbeddingConfig) -> BatchPlan:
    """Plan a batch: per-slot occurrences and the distinct signs to fetch, deduplicated per dim.

    The slots are planned, and so handed to the model, in ``embedding_config.yml``'s order, whatever
    order the batch lists them in.
    """
    for f in features:
        if f.name not in cfg.slots_config:
            raise BadRequest(f"unknown slot {f.name!r} (configured: {', '.join(cfg.slot_names)})")
    order = {name: i for i, name in enumerate(cfg.slots_config)}
    features = sorted(features, key=lambda f: order[f.name])
    bs = features[0].batch_size

    def summed(f: IdFeature) -> bool:  # a batch off the wire has one batch size; a hand-made one may not
        slot = cfg.slots_config[f.name]
        return slot.embedding_summation and not slot.hash_stack_config.hash_stack_rounds and f.batch_size == bs

    plain = [f for f in features if summed(f)]
    batch = _summed_occurrences(plain, cfg) if plain else None
    # per slot: its plan (inv not yet set), its signs and, for a plainly summed slot, its j among them
    partial: list[tuple[SlotPlan, np.ndarray, int]] = []
    j = 0
    for f in features:
        if batch is not None and summed(f):
            partial.append((batch.plans[j], batch.signs[batch.starts[j]:batch.starts[j + 1]], j))
            j += 1
        else:
            partial.append((*_slot_occurrences(f, cfg), -1))
    by_dim: dict[int, list[int]] = {}
    for i, (plan, _, _) in enumerate(partial):
        by_dim.setdefault(plan.dim, []).append(i)
    slots: list[SlotPlan | None] = [None] * len(partial)
    distinct: dict[int, np.ndarray] = {}
    pooled = {}
    for dim, members in by_dim.items():
        js = [partial[i][2] for i in members]
        # plainly summed slots j0, j0 + 1, ... only (the usual batch): the dim's arrays are slices of
        # the batch's, with no copy
        run = batch is not None and js[0] >= 0 and js == list(range(js[0], js[0] + len(js)))
        if run:
            assert batch is not None
            j0, a, b = js[0], batch.starts[js[0]], batch.starts[js[-1] + 1]
            signs = batch.signs[a:b]
        else:
            signs = np.concatenate([partial[i][1] for i in members])
        uniq, inv = unique_inverse(signs)
        distinct[dim] = uniq
        start = 0
        for i in members:
            plan, s, _ = partial[i]
            n = s.shape[0]
            slots[i] = SlotPlan(plan.name, dim, plan.raw, inv[start:start + n], plan.target, plan.scale,
                                plan.n_targets, plan.index)
            start += n
        summing = [i for i in members if not partial[i][0].raw]
        if run:
            assert batch is not None
            pooled[dim] = PooledDim(tuple(summing), inv, batch.rows[a:b] - j0 * bs if j0 else batch.rows[a:b],
                                    batch.scale[a:b], np.diff(batch.starts[j0:j0 + len(js) + 1]).astype(np.int64))
        elif summing:
            every = len(summing) == len(members)
            planned = [p for p in (slots[i] for i in summing) if p is not None]  # each set just above
            pooled[dim] = PooledDim(
                tuple(summing), inv if every else np.concatenate([p.inv for p in planned]),
                np.concatenate([p.target + k * bs for k, p in enumerate(planned)]),
                np.concatenate([p.scale for p in planned]),
                np.array([p.inv.shape[0] for p in planned], np.int64))
    # PooledDim.slots are positions in features, which every slot keeps: none is left out
    return BatchPlan(bs, tuple(s for s in slots if s is not None), distinct, pooled)


def gatherable_dims(plan: BatchPlan) -> frozenset[int]:
    """The widths whose every slot is pooled with exactly one id per sample and a scale of 1: each output
    row is one PS row as it is, so the slots' outputs are ``rows[gather_index(plan, dim)]`` and the
    rows may travel instead of the outputs, once each (:class:`~persia_nats.common.messages.GatheredSlots`),
    and float16 rows give bit for bit the float16 outputs. A slot with several ids or a raw slot keeps its
    width out."""
    dims = {dim for dim, p in plan.pooled.items()
            if p.target.shape[0] == len(p.slots) * plan.batch_size and bool((p.scale == 1).all())
            and bool((p.target == np.arange(p.target.shape[0])).all())}
    pooled = {i for p in plan.pooled.values() for i in p.slots}
    return frozenset(dims - {s.dim for i, s in enumerate(plan.slots) if i not in pooled})


def gather_index(plan: BatchPlan, dim: int) -> np.ndarray:
    """(slots, batch) positions in ``plan.distinct[dim]`` of a gatherable width's outputs (:func:`gatherable_dims`):
    uint16 where the width has fewer than 65536 distinct rows (half the bytes), else int32."""
    p = plan.pooled[dim]
    kind = np.uint16 if plan.distinct[dim].shape[0] <= 1 << 16 else np.int32
    return p.inv.astype(kind).reshape(len(p.slots), plan.batch_size)


@numba.njit(cache=True, nogil=True)
def add_rows(grad: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    """``out[index[p]] += grad[p]`` for every row p, in place: the adjoint of the gather ``rows[index]``."""
    for p in range(index.shape[0]):
        r = index[p]
        for j in range(grad.shape[1]):
            out[r, j] += grad[p, j]


def spread_rows(out: np.ndarray, where: np.ndarray, rows: np.ndarray) -> None:
    """``out[where] = rows`` for a boolean mask ``where`` over the rows of ``out``: ``rows`` in order into the
    rows it marks, in one pass (numpy's masked assignment of 48k float16 rows measured 8x slower)."""
    kind = _SAME_BITS.get(out.dtype.itemsize)
    if kind is None or rows.dtype != out.dtype or out.ndim != 2 or not out.flags.c_contiguous \
            or not rows.flags.c_contiguous or rows.shape != (int(where.sum()), out.shape[1]):
        out[where] = rows
        return
    _spread_rows(out.view(kind), np.ascontiguousarray(where, np.bool_), rows.view(kind))


#: an unsigned kind of each item size, to move float16 and float32 rows bit for bit alike
_SAME_BITS = {2: np.uint16, 4: np.uint32}


@numba.njit(cache=True, nogil=True)
def _spread_rows(out: np.ndarray, where: np.ndarray, rows: np.ndarray) -> None:
    j = 0
    for i in range(where.shape[0]):
        if where[i]:
            for c in range(out.shape[1]):  # not a slice assignment: a view per row costs more than the row
                out[i, c] = rows[j, c]
            j += 1


def pool_dim(plan: BatchPlan, dim: int, rows: np.ndarray, leave_out: np.ndarray | None = None) -> np.ndarray:
    """The outputs of the dim's pooled slots (:attr:`BatchPlan.pooled`) as one (k, batch, dim) array,
    in one kernel call. ``leave_out``: a mask over the dim's distinct rows whose occurrences are left
    out of the sums (hot rows, returned apart by :func:`hot_occurrences`)."""
    p = plan.pooled[dim]
    scale = p.scale if leave_out is None else np.where(leave_out[p.inv], np.float32(0), p.scale)
    out = _pool(np.ascontiguousarray(rows, dtype=np.float32), p.inv, p.target, scale, len(p.slots) * plan.batch_size)
    return out.reshape(len(p.slots), plan.batch_size, dim)


@numba.njit(cache=True, nogil=True)
def add_pooled(out: np.ndarray, rows: np.ndarray, inv: np.ndarray, target: np.ndarray, scale: np.ndarray) -> None:
    """``out[target[p]] += scale[p] * rows[inv[p]]`` for every occurrence p, in place (float32)."""
    for p in range(inv.shape[0]):
        s = scale[p]
        r = inv[p]
        t = target[p]
        for j in range(rows.shape[1]):
            out[t, j] += s * rows[r, j]


@numba.njit(cache=True, nogil=True)
def add_adjoint_slots(grad: np.ndarray, inv: np.ndarray, target: np.ndarray, scale: np.ndarray, counts: np.ndarray,
                      offsets: np.ndarray, mul: np.float32, out: np.ndarray) -> None:
    """``out[inv[p]] += scale[p] * mul * grad[offsets[k] + target[p]]`` for the occurrences p of every
    slot k with ``offsets[k] >= 0`` (the adjoint of :func:`add_pooled_slots`)."""
    p = 0
    for k in range(counts.shape[0]):
        off = offsets[k]
        if off < 0:
            p += counts[k]
            continue
        for _ in range(counts[k]):
            s = scale[p] * mul
            r = inv[p]
            t = target[p] + off
            for j in range(grad.shape[1]):
                out[r, j] += s * grad[t, j]
            p += 1


@numba.njit(cache=True, nogil=True)
def add_pooled_slots(out: np.ndarray, rows: np.ndarray, inv: np.ndarray, target: np.ndarray, scale: np.ndarray,
                     counts: np.ndarray, offsets: np.ndarray) -> None:
    """``out[offsets[k] + target[p]] += scale[p] * rows[inv[p]]`` for the occurrences p of every slot k
    with ``offsets[k] >= 0``: :func:`add_pooled` over several slots' occurrences (``counts[k]`` each, in
    slot order) at once, each slot's targets shifted into its own rows of ``out``, as the NN worker adds
    hot rows back into a stack of slot outputs."""
    p = 0
    for k in range(counts.shape[0]):
        off = offsets[k]
        if off < 0:
            p += counts[k]
            continue
        for _ in range(counts[k]):
            s = scale[p]
            r = inv[p]
            t = target[p] + off
            for j in range(rows.shape[1]):
                out[t, j] += s * rows[r, j]
            p += 1


@numba.njit(cache=True, nogil=True)
def _pool(rows: np.ndarray, inv: np.ndarray, target: np.ndarray, scale: np.ndarray, n_targets: int) -> np.ndarray:
    out = np.zeros((n_targets, rows.shape[1]), dtype=np.float32)
    add_pooled(out, rows, inv, target, scale)
    return out


@numba.njit(cache=True, nogil=True)
def add_adjoint(grad: np.ndarray, inv: np.ndarray, target: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    """The adjoint of :func:`add_pooled`: ``out[inv[p]] += scale[p] * grad[target[p]]``, in place."""
    for p in range(inv.shape[0]):
        s = scale[p]
        r = inv[p]
        t = target[p]
        for j in range(grad.shape[1]):
            out[r, j] += s * grad[t, j]


def pool(slot: SlotPlan, rows: np.ndarray) -> np.ndarray:
    """The slot's output: (batch, dim) for pooled slots, (n_distinct, dim) for raw slots."""
    return _pool(np.ascontiguousarray(rows, dtype=np.float32), slot.inv, slot.target, slot.scale, slot.n_targets)


def slot_outputs(plan: BatchPlan, rows: Mapping[int, np.ndarray]) -> list[np.ndarray]:
    """Every slot's output (:func:`pool`), in feature order, given the rows of ``plan.distinct[dim]`` per dim.

    What the rows come from is the caller's business: the PS replicas over NATS (the embedding
    worker), or a store in the same process (the inference service, ``persia_nats.services.serving``).
    """
    return [pool(slot, rows[slot.dim]) for slot in plan.slots]


@functools.cache
def warm_up() -> float:
    """Compile (the first run after an install) or load from numba's cache the pooling kernels, and
    return the seconds it took: a worker calls it before it serves, not inside a job's first steps.
    Rows from a PS reply are read-only, and gradients are read-only when they came as float32: numba
    compiles a kernel once per kind of argument, so each kind is run."""
    started = time.perf_counter()
    index, scale = np.zeros(1, np.int64), np.ones(1, np.float32)
    for writable in (True, False):
        rows = np.ones((1, 2), np.float32)
        rows.flags.writeable = writable
        _pool(rows, index, index, scale, 1)
        add_adjoint(rows, index, index, scale, np.zeros((1, 2), np.float32))
        _hot_occurrences(np.ones(1, np.bool_), index, index, scale, index, 1)
        unique_inverse(np.ones(1, np.uint64))
        to_half(rows)
        for kind in _SAME_BITS.values():  # spread_rows: rows of a reply (read-only) or of the worker's own
            spread = np.ones((1, 2), kind)
            spread.flags.writeable = writable
            _spread_rows(np.zeros((1, 2), kind), np.ones(1, np.bool_), spread)
        grad = np.ones((1, 2), np.float16)
        grad.flags.writeable = writable
        to_float(grad, 2.0)
        all_finite(grad)
    return time.perf_counter() - started


def to_wire_dtype(emb: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A slot output as the embedding worker sends it (``embedding_worker_config.wire_dtype``).

    float16 when asked for and every magnitude is below float16's largest (a NaN is not); otherwise
    ``emb`` itself, float32.
    """
    if dtype != np.float16:
        return emb
    half = to_half(emb)
    return emb if half is None else half


def accumulate_grad(slot: SlotPlan, grad: np.ndarray, out: np.ndarray) -> None:
    """Add the slot's gradient, mapped back to distinct rows, into ``out`` (n_distinct_of_dim, dim)."""
    if grad.shape != (slot.n_targets, slot.dim):
        raise BadRequest(f"gradient of slot {slot.name!r} has shape {list(grad.shape)}, "
                         f"expected {[slot.n_targets, slot.dim]}")
    add_adjoint(np.ascontiguousarray(grad, dtype=np.float32), slot.inv, slot.target, slot.scale, out)


# -- hot rows ------------------------------------------------------------------------------------
#
# A row that many samples of one batch read (a head id of a Zipf slot) is the row a stale read hurts:
# every batch in flight carries an update of it computed against the same old value. The embedding
# worker returns such rows apart from the pooled sums, and the NN worker adds the newest value it
# holds just before the batch trains. Sum pooling is linear, so the parts add up to the plain lookup,
# and the gradient of the batch, mapped back by :func:`accumulate_grad`, is unchanged.


def hot_rows(plan: BatchPlan, min_count: int) -> dict[int, np.ndarray] | None:
    """Per dim, a mask over ``plan.distinct[dim]``: rows read ``min_count`` or more times by pooled slots."""
    if min_count <= 0:
        return None
    masks: dict[int, np.ndarray] = {}
    for dim, p in plan.pooled.items():
        mask = np.bincount(p.inv, minlength=plan.distinct[dim].shape[0]) >= min_count
        if mask.any():
            masks[dim] = mask
    return masks or None


@dataclass(frozen=True, slots=True)
class HotOccurrences:
    """The reads of one dim's hot rows by its pooled slots (:func:`hot_occurrences`)."""

    dim: int
    slots: tuple[str, ...]  # the slots with any, in the plan's order
    counts: np.ndarray  # int32, occurrences per slot
    inv: np.ndarray  # int32, into the dim's hot rows
    target: np.ndarray  # int32, a row of the slot's output
    scale: np.ndarray  # float32


def hot_occurrences(plan: BatchPlan, hot: Mapping[int, np.ndarray]) -> list[HotOccurrences]:
    """Per dim with hot rows, the hot reads of its pooled slots.

    ``inv`` indexes the dim's hot rows (in the order of ``plan.distinct[dim][hot[dim]]``); a slot's
    occurrences come ``counts[k]`` at a time, slot after slot; slots without any are left out. One
    pass per dim over every slot's occurrences, not one per slot: a batch has many slots.
    """
    out = []
    for dim, mask in hot.items():
        p = plan.pooled.get(dim)
        if p is None:
            continue
        counts, inv, target, scale = _hot_occurrences(mask, p.inv, p.target, p.scale, p.sizes, plan.batch_size)
        keep = counts > 0
        out.append(HotOccurrences(dim, tuple(plan.slots[i].name for i, k in zip(p.slots, keep, strict=True) if k),
                                  counts[keep], inv, target, scale))
    return out


@numba.njit(cache=True, nogil=True)
def _hot_occurrences(mask: np.ndarray, inv: np.ndarray, target: np.ndarray, scale: np.ndarray, sizes: np.ndarray,
                     batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`hot_occurrences` of one dim in two passes over its occurrences (count, then copy), where
    the numpy version made a dozen: (occurrences per slot, hot-row index, sample, scale)."""
    position = np.empty(mask.shape[0], np.int32)  # a hot distinct row's index among the hot rows
    h = 0
    for r in range(mask.shape[0]):
        position[r] = h
        h += mask[r]
    counts = np.zeros(sizes.shape[0], np.int32)
    p = 0
    for k in range(sizes.shape[0]):
        for _ in range(sizes[k]):
            counts[k] += mask[inv[p]]
            p += 1
    n = counts.sum()
    out_inv = np.empty(n, np.int32)
    out_target = np.empty(n, np.int32)
    out_scale = np.empty(n, np.float32)
    q = 0
    for p in range(inv.shape[0]):
        if mask[inv[p]]:
            out_inv[q] = position[inv[p]]
            out_target[q] = target[p] % batch_size
            out_scale[q] = scale[p]
            q += 1
    return counts, out_inv, out_target, out_scale


def plan_nbytes(plan: BatchPlan) -> int:
    """The bytes a plan's arrays keep alive: what a buffered batch holds beyond its request.

    A slot's arrays are often views into one array of the whole dim; a view keeps all of it.
    """
    arrays = [*plan.distinct.values()]
    for s in plan.slots:
        arrays += [s.inv, s.target, s.scale] + ([s.index] if s.index is not None else [])
    for p in plan.pooled.values():
        arrays += [p.inv, p.target, p.scale, p.sizes]
    owners: dict[int, int] = {}
    for a in arrays:
        while isinstance(a.base, np.ndarray):
            a = a.base
        owners[id(a)] = a.nbytes
    return sum(owners.values())
