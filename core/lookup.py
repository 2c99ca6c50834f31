"""A looked-up batch on its way to the model: the embedding worker's reply and its forward transform.

A batch's slots reach the NN worker in three shapes, each row-carrying array float16 or float32 on the
wire (float16 where every value fits: ``embedding_worker_config.wire_dtype``)::

    row_requests(plan)            one RowRequest per width: float16 rows where the width's outputs are its
        │                         rows (half_widths); there the hot rows a float32 request of their own
        ▼  PsClient.fetch         shards, sends, scatters: one RowAnswer (rows, versions) per request
    PS rows, per width (plan.distinct[d] order)         the reply (EwLookupReply), built by assemble
    ───────────────────────────────────────────         ──────────────────────────────────────────────
    rows[d]  (n_d, d)  ──pool (plan.pooled[d])──────▶   embeddings: SlotEmbedding per slot
       │                 hot rows left out               pooled  emb (batch, d)
       │                                                 raw     emb (n_distinct, d) + index (batch, L)
       ├─ gatherable width (one id a sample, scale 1) ─▶ gathered: GatheredSlots per width
       │    the rows themselves, once each               rows (n_d, d), hot rows zero at hot_at
       │                                                 index (k, batch): slot k's output = rows[index[k]]
       └─ hot rows (mask over rows[d]) ────────────────▶ hot: HotPart
            float32, as read, with their PS versions      groups[g]: HotGroup (ids, rows, versions) per width
                                                          per pooled slot with hot reads: its group, and
                                                          occurrences (inv, target, scale): add
                                                          scale * groups[group].rows[inv] at row target

    forward (this module)                               adjoint (persia_nats.core.adjoint)
    ─────────────────────                               ──────────────────────────────────
    assemble: PS rows + plan -> reply parts   (EW)      fold: gradient parts -> per-row gradients  (EW)
    expand:   reply parts -> per-slot arrays  (NN)      pack: per-slot gradients -> gradient parts (NN)

On the NN worker, :func:`expand` gives every slot's output as float32 arrays, in the batch's order:
a gathered width's slots are ``rows[index[k]]`` with the hot rows (at their newest value) put back
first; the pooled slots of one shape are consecutive rows of one (k, batch, dim) array, their hot
occurrences added in one compiled pass; raw slots pass as they came. The dense side turns those into
tensors (:func:`persia_nats.dense.tensors.embedding_tensors`). Every step is linear in the rows, so
the gradient of each is the adjoint of its sum: what :mod:`persia_nats.core.adjoint` computes, and
``tests/unit/test_lookup.py`` checks against the other and against torch autograd for every shape and
dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from persia_nats.common.messages import GatheredSlots, HotGroup, HotPart, SlotEmbedding, slot_order
from persia_nats.core.half import to_float
from persia_nats.core.plan import (
    BatchPlan,
    add_pooled_slots,
    gather_index,
    gatherable_dims,
    hot_occurrences,
    pool,
    pool_dim,
    spread_rows,
    to_wire_dtype,
)
from persia_nats.core.rows import stacked_rows


def frozen(arr: np.ndarray, dtype: Any) -> np.ndarray:
    """``arr`` as a contiguous, read-only array of ``dtype`` (a view where it already is one): wire
    arrays are read-only, and numba compiles a kernel once per kind of argument, so every caller
    passes the one kind the kernels were warmed up with."""
    arr = np.ascontiguousarray(arr, dtype)
    if arr.flags.writeable:
        arr = arr.view()
        arr.flags.writeable = False
    return arr


def widen(gathered: Sequence[GatheredSlots]) -> tuple[GatheredSlots, ...]:
    """``gathered`` with float32 rows, converted when the lookup's reply arrives: the hot-row merge
    (:func:`expand` with hot rows) runs when the training loop asks for the batch, and may keep it waiting, so it is
    left to add and gather only."""
    return tuple(g if g.rows.dtype == np.float32 else dataclasses.replace(g, rows=float32_copy(g.rows))
                 for g in gathered)


def float32_copy(arr: np.ndarray) -> np.ndarray:
    """A writable float32 copy of ``arr``, float16 widened by a compiled loop on the calling thread alone.

    torch converts 5x faster on two threads, but on an OpenMP team: called from the I/O thread, a team of
    the I/O thread's own, whose worker then spins for up to libgomp's ~3 ms after each conversion
    wherever a core is free. Converting 12k rows of dim 16 every 12 ms cost 8.3-9.2 ms of CPU a call that
    way, against 0.07-0.11 ms here; on an H100 host the I/O thread's name carried 10.1 us of CPU a sample
    at batch 1024. numpy's ``astype`` takes 7x as long as this loop."""
    if arr.dtype == np.float16:
        return to_float(arr)[0]
    return np.array(arr, dtype=np.float32)


def _gather(embeddings: Sequence[SlotEmbedding], gathered: Sequence[GatheredSlots], order: Sequence[str],
            hot: Mapping[int, np.ndarray] | None = None) -> tuple[SlotEmbedding, ...]:
    """Every slot's output, in ``order`` (the reply's :meth:`~persia_nats.common.messages.EwLookupReply.slot_names`).

    A gathered width's slots come back as consecutive rows of one new float32 array (slots, batch, dim),
    which the training context takes as one tensor as it is (:func:`persia_nats.dense.tensors.embedding_tensors`).
    ``hot``: per dim, float32 values added to the width's hot rows (``GatheredSlots.hot_at``, in that order)
    before the gather, so every read of a hot row reads them (the hot-row merge's newest copies).
    """
    by_name = {e.name: e for e in embeddings}
    for g in gathered:
        rows = _merged_rows(g, hot.get(g.dim) if hot is not None else None)
        out = np.take(rows, g.index, axis=0)  # (slots, batch, dim), owning its memory: one tensor as it is
        by_name.update({name: SlotEmbedding(name, out[k]) for k, name in enumerate(g.slots)})
    return tuple(by_name[name] for name in order)


def _merged_rows(g: GatheredSlots, add: np.ndarray | None) -> np.ndarray:
    """``g``'s rows as float32, with ``add`` (float32, one row per ``g.hot_at``) added at its hot rows."""
    rows = g.rows if g.rows.dtype == np.float32 else float32_copy(g.rows)  # the gather runs on float32 rows
    if add is not None and g.hot_at is not None and g.hot_at.size:
        rows = np.array(rows) if rows is g.rows else rows  # a wire array is read-only; widened ones stay as read
        # added, not written: a hot row is zero here, and 0 + x is what adding x at every read gave
        rows[g.hot_at] += add
    return rows


def expand_deferred(embeddings: Sequence[SlotEmbedding], gathered: Sequence[GatheredSlots] = (),
                    hot: HotPart | None = None, rows: Sequence[np.ndarray] | None = None
                    ) -> tuple[tuple[SlotEmbedding, ...], tuple[GatheredSlots, ...]]:
    """:func:`expand` with the gathered widths' slots left for the model's device to build: the reply's own
    slots (hot rows added, as :func:`expand` adds them) and the gathered widths with float32 rows, their hot
    rows at ``rows``' values. The dense side gathers ``rows[index[k]]`` there
    (:func:`persia_nats.dense.tensors.embedding_tensors` with ``gathered``), and autograd sums each row's
    gradient, so neither the gather nor its adjoint (:func:`~persia_nats.core.plan.add_rows`) runs on the
    host, and a GPU receives each distinct row once instead of once a read."""
    adds: dict[int, np.ndarray] = {}
    if hot is not None:
        assert rows is not None and len(rows) == len(hot.groups)
        groups = {g.dim: k for k, g in enumerate(hot.groups)}
        adds = {g.dim: rows[groups[g.dim]] for g in gathered if g.dim in groups}
    widths = tuple(dataclasses.replace(g, rows=_merged_rows(g, adds.get(g.dim))) for g in gathered)
    if hot is None:
        return tuple(embeddings), widths
    return _merge_hot(embeddings, hot, rows or ()), widths


def _float32_stack(arrs: Sequence[np.ndarray]) -> np.ndarray:
    """``arrs`` (equal shapes) as rows of one float32 array the merge may add into: one copy and one
    conversion for all, or none where they already are the rows of a writable float32 array that nothing
    else holds (the slots a rank built from gathered rows; a reply's own arrays are read-only)."""
    stacked = stacked_rows(arrs)
    return stacked if stacked.dtype == np.float32 else float32_copy(stacked)


def occurrences(hot: HotPart) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``hot``'s (inv, target, scale, counts) as the kinds the slot kernels are warmed up with."""
    return (frozen(hot.inv, np.int32), frozen(hot.target, np.int32), frozen(hot.scale, np.float32),
            frozen(hot.counts, np.int32))


def by_stack_and_group(hot: HotPart, where: np.ndarray, stacks: Sequence[np.ndarray]
                        ) -> Iterator[tuple[np.ndarray, int, np.ndarray]]:
    """(stack, group, per-slot offsets) for each stack and group that slots of ``hot`` share.

    ``where``: per slot of ``hot``, (its stack, its row there), -1 for a slot left out. Seen as
    (slots * batch, dim), a stack holds slot k's occurrence p at row ``offsets[k] + target[p]``; a
    slot of another stack or group gets offset -1, so one compiled pass walks every slot's occurrences
    and skips those.
    """
    combo = np.where(where[:, 0] >= 0, where[:, 0] * len(hot.groups) + hot.group, -1)
    for c in np.unique(combo[combo >= 0]):
        stack, group = stacks[int(c) // len(hot.groups)], int(c) % len(hot.groups)
        yield stack, group, frozen(np.where(combo == c, where[:, 1] * stack.shape[1], -1), np.int64)


def expand(embeddings: Sequence[SlotEmbedding], gathered: Sequence[GatheredSlots] = (), hot: HotPart | None = None,
           rows: Sequence[np.ndarray] | None = None) -> tuple[SlotEmbedding, ...]:
    """Every slot's output from a reply's parts, in the batch's order (the reply's
    :meth:`~persia_nats.common.messages.EwLookupReply.slot_names`): the NN worker's forward transform.

    Without ``hot``, the gathered widths' slots are built (``rows[index[k]]``, float32) and the reply's own
    slots pass as they came. With it, ``rows`` are the values of its groups' rows (the newest copies the NN
    worker holds, :meth:`~persia_nats.services.nn_worker.hot_rows.RowMirror.newest`): :func:`_merge_hot`."""
    if hot is not None:
        assert rows is not None and len(rows) == len(hot.groups)
        return _merge_hot(embeddings, hot, rows, gathered)
    if not gathered:
        return tuple(embeddings)
    return _gather(embeddings, gathered, slot_order(embeddings, gathered))


def _merge_hot(embeddings: Sequence[SlotEmbedding], hot: HotPart, rows: Sequence[np.ndarray],
               gathered: Sequence[GatheredSlots] = ()) -> tuple[SlotEmbedding, ...]:
    """The slot outputs with the hot rows added back, each at the values ``rows`` (per group of ``hot``).

    The pooled slots of one shape come back as consecutive rows of one new float32 array:
    converted in one call, and taken by the training context as one tensor as it is
    (:func:`persia_nats.dense.tensors.embedding_tensors`). ``embeddings``: the reply's own slots;
    ``gathered``: its gathered widths, whose slots are built here (in the reply's order of slots),
    their hot rows (``GatheredSlots.hot_at``) at the newest value before the gather: one pass over
    the rows rather than another over every slot's reads.
    """
    if gathered:
        groups = {g.dim: k for k, g in enumerate(hot.groups)}
        embeddings = _gather(embeddings, gathered, slot_order(embeddings, gathered),
                             {g.dim: rows[groups[g.dim]] for g in gathered if g.dim in groups})
    out = list(embeddings)
    shared: dict[tuple[int, ...], list[int]] = {}
    for i, e in enumerate(embeddings):
        if e.index is None:
            shared.setdefault(e.emb.shape, []).append(i)
    stacks: list[np.ndarray] = []
    place: dict[str, tuple[int, int]] = {}  # slot -> (its shared array, its row there)
    for members in shared.values():
        stacked = _float32_stack([embeddings[i].emb for i in members])
        for j, i in enumerate(members):
            out[i] = SlotEmbedding(embeddings[i].name, stacked[j], None)
            place[out[i].name] = (len(stacks), j)
        stacks.append(stacked)
    if hot.slots:
        where = np.array([place[name] for name in hot.slots], np.int64).reshape(-1, 2)
        # one compiled call adds every slot's hot rows of one shared array and dim
        reads = occurrences(hot)
        for arr, group, offsets in by_stack_and_group(hot, where, stacks):
            add_pooled_slots(arr.reshape(-1, arr.shape[2]), frozen(rows[group], np.float32), *reads,
                              offsets)
    return tuple(out)


# -- assemble: the embedding worker's side ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RowRequest:
    """Rows of one width asked of the PSs in one precision: the PS client shards, sends and scatters each
    (one group per request and replica), knowing nothing of what the rows are for."""

    dim: int
    ids: np.ndarray  # uint64 signs: ``plan.distinct[dim][where]``
    #: the rows may travel as float16 (a replica sends float32 where a row is beyond its range)
    half: bool
    #: which of ``plan.distinct[dim]``: a mask over them, None for all
    where: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class RowAnswer:
    """The PSs' answer to a :class:`RowRequest`: its rows in its order, float16 where every replica sent
    float16 (the reply's own read-only array where one replica sent them all), else float32."""

    rows: np.ndarray  # (n, dim)
    versions: np.ndarray  # int64 (n,): the PS version each row was read at


def row_requests(plan: BatchPlan, wire_dtype: np.dtype, hot: Mapping[int, np.ndarray] | None = None,
                 gather: frozenset[int] = frozenset()) -> list[RowRequest]:
    """What to ask the PSs for a batch: one request per width, its rows float16 where the width's outputs
    are its rows (:func:`half_widths`); in such a width the ``hot`` rows (float32, exact: they go to the NN
    worker's copies as they are) are a request of their own, first."""
    half = half_widths(plan, wire_dtype, gather)
    out = []
    for dim, ids in plan.distinct.items():
        mask = hot.get(dim) if hot and dim in half else None
        if mask is None or not mask.any():
            out.append(RowRequest(dim, ids, dim in half))
            continue
        rest = ~mask
        out.append(RowRequest(dim, ids[mask], False, mask))
        if rest.any():
            out.append(RowRequest(dim, ids[rest], True, rest))
    return out


@dataclass(frozen=True, slots=True)
class Fetched:
    """The PSs' answers to :func:`row_requests`, per width (:func:`fetched`)."""

    #: per dim, the rows of ``plan.distinct[dim]`` as they travelled: float32, or float16 (hot rows zero)
    rows: Mapping[int, np.ndarray]
    #: per dim, each row's PS version
    versions: Mapping[int, np.ndarray]
    #: per width whose hot rows were asked apart, those rows (float32, in the mask's order)
    apart: Mapping[int, np.ndarray]


def fetched(plan: BatchPlan, requests: Sequence[RowRequest], answers: Sequence[RowAnswer]) -> Fetched:
    """The answers put together per width: a width asked in one request is its answer as it is; one asked
    in two has its hot rows apart, and the rest in their places (in one pass: ``spread_rows``), the hot
    ones zero there."""
    by_dim: dict[int, list[tuple[RowRequest, RowAnswer]]] = {}
    for req, ans in zip(requests, answers, strict=True):
        by_dim.setdefault(req.dim, []).append((req, ans))
    rows: dict[int, np.ndarray] = {}
    versions: dict[int, np.ndarray] = {}
    apart: dict[int, np.ndarray] = {}
    for dim, ids in plan.distinct.items():
        (first, got), *rest = by_dim[dim]
        if not rest and first.where is None:
            rows[dim], versions[dim] = got.rows, got.versions
            continue
        apart[dim] = got.rows
        versions[dim] = np.empty(ids.shape[0], np.int64)
        versions[dim][first.where] = got.versions
        kind = rest[0][1].rows.dtype if rest else np.dtype(np.float16)
        rows[dim] = np.zeros((ids.shape[0], dim), kind)
        for req, ans in rest:
            assert req.where is not None  # the rest of a width asked in two
            spread_rows(rows[dim], req.where, ans.rows)
            versions[dim][req.where] = ans.versions
    return Fetched(rows, versions, apart)


@dataclass(frozen=True, slots=True)
class Fallback:
    """An array sent as float32 where float16 was asked for: a value beyond float16's range."""

    what: str  # "slot s has embeddings", "dim d has rows"
    peak: float


@dataclass(frozen=True, slots=True)
class ReplyParts:
    """A lookup reply's parts (:class:`~persia_nats.common.messages.EwLookupReply` less its ref)."""

    embeddings: tuple[SlotEmbedding, ...]
    hot: HotPart | None = None
    gathered: tuple[GatheredSlots, ...] = ()
    fallbacks: tuple[Fallback, ...] = ()


def half_widths(plan: BatchPlan, wire_dtype: np.dtype, gather: frozenset[int] = frozenset()) -> frozenset[int]:
    """The widths whose rows may come from the PSs as float16: with float16 on the wire, those whose every
    output is one row (:func:`~persia_nats.core.plan.gatherable_dims`), so float16 rows give bit for bit the
    float16 outputs; the widths sent gathered when some are."""
    if wire_dtype != np.float16:
        return frozenset()
    return gather or gatherable_dims(plan)


def assemble(plan: BatchPlan, requests: Sequence[RowRequest], answers: Sequence[RowAnswer], wire_dtype: np.dtype,
             hot: Mapping[int, np.ndarray] | None = None, gather: frozenset[int] = frozenset()) -> ReplyParts:
    """The reply's parts from the PSs' answers to :func:`row_requests` (asked with the same arguments): the
    slots' outputs as sent, with ``hot`` rows (per dim, a mask over ``plan.distinct[dim]``) left out of them
    and returned apart, and the slots of the widths ``gather`` names as their distinct rows
    (:func:`~persia_nats.core.plan.gatherable_dims`)."""
    got = fetched(plan, requests, answers)
    rows, apart = got.rows, got.apart
    fallbacks: list[Fallback] = []
    embs: list[np.ndarray | None] = [None] * len(plan.slots)
    gathered = []
    for dim, p in plan.pooled.items():
        if dim in gather:
            gathered.append(_gathered(plan, dim, rows[dim], hot, apart, wire_dtype, fallbacks))
            continue
        # the dim's pooled slots in one kernel call and, when all fit float16, one conversion
        stacked = to_wire_dtype(pool_dim(plan, dim, rows[dim], hot.get(dim) if hot else None), wire_dtype)
        for i, emb in zip(p.slots, stacked, strict=True):
            embs[i] = emb
    out = []
    for i, slot in enumerate(plan.slots):
        if slot.dim in gather:
            continue
        emb = embs[i]
        if emb is None:
            emb = pool(slot, rows[slot.dim])
        if wire_dtype == np.float16 and emb.dtype != np.float16:
            emb = _to_half(f"slot {slot.name} has embeddings", emb, fallbacks)
        out.append(SlotEmbedding(slot.name, emb, slot.index))
    part = _hot_part(plan, got, hot, gather) if hot else None
    return ReplyParts(tuple(out), part, tuple(gathered), tuple(fallbacks))


def _hot_part(plan: BatchPlan, got: Fetched, hot: Mapping[int, np.ndarray], gather: frozenset[int]) -> HotPart:
    """The hot rows as read (float32), with every pooled slot's reads of them. A gathered width's hot rows
    are named by their place in its rows (``GatheredSlots.hot_at``), not listed at every sample that reads
    them: the head ids of a Zipf slot are most of its reads."""
    rows, versions, apart = got.rows, got.versions, got.apart
    parts = hot_occurrences(plan, {dim: mask for dim, mask in hot.items() if dim not in gather})
    dims = [p.dim for p in parts] + [dim for dim in hot if dim in gather and dim in plan.pooled]
    groups = tuple(HotGroup(dim, plan.distinct[dim][hot[dim]],
                            apart[dim] if dim in apart else rows[dim][hot[dim]].astype(np.float32, copy=False),
                            versions[dim][hot[dim]])
                   for dim in dims)
    if not parts:
        empty = np.zeros(0, np.int32)
        return HotPart(groups=groups, slots=(), group=empty, counts=empty, inv=empty, target=empty,
                       scale=np.zeros(0, np.float32))
    return HotPart(groups=groups, slots=tuple(n for p in parts for n in p.slots),
                   group=np.concatenate([np.full(len(p.slots), k, np.int32) for k, p in enumerate(parts)]),
                   counts=np.concatenate([p.counts for p in parts]), inv=np.concatenate([p.inv for p in parts]),
                   target=np.concatenate([p.target for p in parts]), scale=np.concatenate([p.scale for p in parts]))


def _gathered(plan: BatchPlan, dim: int, rows: np.ndarray, hot: Mapping[int, np.ndarray] | None,
              apart: Mapping[int, np.ndarray], wire_dtype: np.dtype, fallbacks: list[Fallback]) -> GatheredSlots:
    """A gatherable width's slots as its rows, hot rows zero (the NN worker adds its newest copies)."""
    mask = hot.get(dim) if hot else None
    if mask is not None and dim not in apart:  # not zeroed by the lookup
        rows = np.where(mask[:, None], np.float32(0), rows)
    if wire_dtype == np.float16 and rows.dtype != np.float16:
        rows = _to_half(f"dim {dim} has rows", rows, fallbacks)
    p = plan.pooled[dim]
    return GatheredSlots(dim, rows, tuple(plan.slots[i].name for i in p.slots), np.array(p.slots, np.int32),
                         gather_index(plan, dim), None if mask is None else np.flatnonzero(mask).astype(np.int32))


def _to_half(what: str, values: np.ndarray, fallbacks: list[Fallback]) -> np.ndarray:
    """float16 for the wire, unless a value exceeds its range: ``values`` (a slot's outputs, a gathered
    width's rows; ``what`` names them) then travel as float32, noted in ``fallbacks``."""
    half = to_wire_dtype(values, np.dtype(np.float16))
    if half is not values:
        return half
    fallbacks.append(Fallback(what, float(np.abs(values).max()) if values.size else 0.0))
    return values
