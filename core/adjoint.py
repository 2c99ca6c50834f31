"""The exact adjoint of :mod:`persia_nats.core.lookup`: a batch's gradient on its way back to the rows.

Every step of the forward transform is a sum of rows times scales, so its adjoint adds each output's
gradient, times the same scale, into the row it read. Per shape of the reply::

    NN worker: per-slot leaf gradients                 the gradient request (GradRequest)
    ──────────────────────────────────────             ───────────────────────────────────────────────
    pooled / raw slot grad (batch|n, d)  ──pack──────▶ grads: SlotGradient per slot, float16 times one
                                                        power of two per batch (loss_scale carries it)
    gathered width's slots (k, batch, d) ──pack──────▶ rows: RowGradient per width: Σ_k, at index[k]
       Σ over slot k's reads of each row (add_rows)     float16 times its own power of two (scale)
    hot occurrences + gathered hot rows  ──pack──────▶ hot grads {dim: (ids, float32 grads)}, published
                                                        on hot.grads.<rank> for the other ranks' mirrors

    embedding worker: gradient parts                   per-row gradients for the PSs
    ────────────────────────────────                   ─────────────────────────────
    grads  ──fold: accumulate_grad (plan's adjoint)──▶ {dim: (n_d, d)} float32, then float16 times a
    rows   ──fold: passed on as they came────────────▶ power of two per width (the PS divides it out)

    forward (persia_nats.core.lookup)                 adjoint (this module)
    assemble: PS rows -> reply parts  (EW)            fold: gradient parts -> per-row gradients (EW)
    expand:   reply parts -> slot arrays (NN)         pack: slot gradients -> gradient parts (NN)

A slot whose gradient is not finite is left out (named in ``skipped``), as is every slot of a gathered
width whose row gradient is not finite. ``tests/unit/test_lookup.py`` checks ``<expand(x), y> ==
<x, pack(y)>`` and ``<assemble(r), g> == <r, fold(g)>``, and both against torch autograd.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from persia_nats.common.codec import all_finite
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import (
    GatheredSlots,
    GradRequest,
    HotPart,
    RowGradient,
    SlotEmbedding,
    SlotGradient,
    slot_order,
)
from persia_nats.core.half import pow2_scale, to_float, to_half
from persia_nats.core.lookup import by_stack_and_group, float32_copy, frozen, occurrences
from persia_nats.core.plan import BatchPlan, accumulate_grad, add_adjoint_slots, add_rows


def row_gradient(g: GatheredSlots, slot_grads: np.ndarray, finite: Sequence[bool], loss_scale: float,
                 half: bool) -> tuple[RowGradient, np.ndarray | None]:
    """The gradient of each of ``g``'s rows: ``slot_grads`` (slots, batch, dim) float32, the gradient of the
    loss times ``loss_scale`` at each slot's output, summed into the rows the slots read. Slots whose
    ``finite`` is False are left out and named, as the embedding worker skips a slot whose gradient is not
    finite. ``half``: float16 on the wire, times the power of two that keeps the small ones' digits.
    With the hot rows ``g.hot_at``, also their gradients, float32 and unscaled (for ``hot.grads``)."""
    out = np.zeros((g.rows.shape[0], g.dim), np.float32)
    keep = [k for k, ok in enumerate(finite) if ok]
    grads = np.ascontiguousarray(slot_grads if len(keep) == len(finite) else slot_grads[keep], dtype=np.float32)
    index = g.index if len(keep) == len(finite) else g.index[keep]
    add_rows(grads.reshape(-1, g.dim), np.ascontiguousarray(index).reshape(-1), out)
    if loss_scale != 1.0:
        out /= np.float32(loss_scale)
    skipped = tuple(name for name, ok in zip(g.slots, finite, strict=True) if not ok)
    return _wire_rows(g, out, skipped, half)


def _rows_leaf_gradient(g: GatheredSlots, grad: np.ndarray, peak: float, loss_scale: float, half: bool
                        ) -> tuple[RowGradient, np.ndarray | None]:
    """:func:`row_gradient` from ``grad``, the gradient of ``g``'s rows as autograd summed it over every read
    (the device gathered the slots). Their slots' own gradients are gone, so a width with any value not
    finite is skipped whole: every slot named, no row changed."""
    if not math.isfinite(peak):
        return _wire_rows(g, np.zeros((g.rows.shape[0], g.dim), np.float32), g.slots, half)
    out = grad / np.float32(loss_scale) if loss_scale != 1.0 else np.ascontiguousarray(grad, np.float32)
    return _wire_rows(g, out, (), half)


def _wire_rows(g: GatheredSlots, out: np.ndarray, skipped: tuple[str, ...], half: bool
               ) -> tuple[RowGradient, np.ndarray | None]:
    """``out`` (float32, unscaled) as the wire's row gradient of ``g``, and its hot rows' (float32)."""
    hot = out[g.hot_at] if g.hot_at is not None else None
    if not half:
        return RowGradient(g.dim, out, 1.0, skipped), hot
    scale = pow2_scale(float(np.abs(out).max()) if out.size else 0.0)
    wire = to_half(out * np.float32(scale)) if scale != 1.0 else to_half(out)
    if wire is None:  # beyond float16 even scaled (a peak past 2**114): float32, as the embedding worker sends then
        return RowGradient(g.dim, out, 1.0, skipped), hot
    return RowGradient(g.dim, wire, scale, skipped), hot


def hot_row_grads(hot: HotPart, grads: Mapping[str, np.ndarray | tuple[np.ndarray, int]], loss_scale: float,
                  check_finite: bool = True) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """A batch's gradient of each hot row, ``{dim: (ids, grads)}``, as the embedding worker computes it.

    ``grads``: each slot's gradient of the loss scaled by ``loss_scale``, an array (batch, dim), or
    ``(stack, j)`` where it is ``stack[j]`` of an array (slots, batch, dim) that several slots share
    (as the training context's leaves are): the slots of one stack and dim are then summed in one
    compiled call. A slot missing from it adds nothing; so does one whose gradient is not finite (the
    embedding worker skips such a slot) unless ``check_finite`` is False because the caller left
    those out already.
    """
    out = [np.zeros((g.ids.shape[0], g.dim), np.float32) for g in hot.groups]
    given = {name: grads.get(name) for name in hot.slots}
    # separate arrays of one shape are stacked, so they too are summed in one call
    alone: dict[tuple[int, ...], list[str]] = {}
    arrays = {name: a for name, a in given.items() if a is not None and not isinstance(a, tuple)}
    for name, a in arrays.items():
        alone.setdefault(a.shape, []).append(name)
    for names in alone.values():
        stacked = np.stack([arrays[n] for n in names])
        given.update({n: (stacked, j) for j, n in enumerate(names)})
    stacks: list[np.ndarray] = []
    finite: list[np.ndarray | None] = []
    seen: dict[int, int] = {}  # id of a stack as given -> its index in stacks
    where = np.full((len(hot.slots), 2), -1, np.int64)  # per slot: (stack, row), -1 when left out
    for k, name in enumerate(hot.slots):
        grad = given[name]
        if grad is None:
            continue
        stack, j = grad
        s = seen.get(id(stack))
        if s is None:
            s = seen[id(stack)] = len(stacks)
            stack = np.ascontiguousarray(stack) if stack.dtype == np.float32 else float32_copy(stack)
            stacks.append(stack)
            finite.append(np.isfinite(stack).reshape(stack.shape[0], -1).all(axis=1) if check_finite else None)
        ok = finite[s]
        if ok is None or ok[j]:
            where[k] = s, j
    reads = occurrences(hot)
    for stack, group, offsets in by_stack_and_group(hot, where, stacks):
        add_adjoint_slots(frozen(stack.reshape(-1, stack.shape[2]), np.float32), *reads, offsets,
                           np.float32(1.0 / loss_scale), out[group])
    return {g.dim: (g.ids, o) for g, o in zip(hot.groups, out, strict=True)}


@functools.cache
def warm_up() -> float:
    """Compile or load the gather's adjoint for the index kinds a reply may carry; the seconds it took."""
    started = time.perf_counter()
    for kind in (np.uint16, np.int32):
        for writable in (True, False):
            grads = np.zeros((1, 2), np.float32)
            grads.flags.writeable = writable
            add_rows(grads, np.zeros(1, kind), np.zeros((1, 2), np.float32))
    return time.perf_counter() - started


# -- fold: the embedding worker's side -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RowGrads:
    """A batch's gradient per distinct row, on its way to the PSs (:meth:`PsClient.update`)."""

    #: per dim, over ``plan.distinct[dim]``: float32, or float16 times ``scales[dim]``
    grads: dict[int, np.ndarray]
    #: per dim, the power of two ``grads[dim]`` is multiplied by (None: 1 for every dim)
    scales: dict[int, float] | None
    #: slots left out: their gradient was not finite
    skipped: tuple[str, ...]


def fold(plan: BatchPlan, req: GradRequest, gathered: frozenset[int], wire_dtype: np.dtype) -> RowGrads:
    """``req``'s gradients (per slot, and per row for the widths ``gathered``) mapped back to the rows of
    ``plan.distinct``, as the PSs take them: the adjoint of :func:`~persia_nats.core.lookup.assemble`.
    Checks ``req`` against the batch first (BadRequest, nothing folded); skips a slot whose gradient is
    not finite, and every slot of a width whose row gradients are not."""
    grads, skipped = _row_grads(plan, req, gathered)
    scales: dict[int, float] | None = None
    if wire_dtype == np.float16:
        grads, scales = scaled_half(grads)
    # gathered widths' row gradients go on to the PSs as they came, scale and all
    passed, skipped_rows = _passed_rows(plan, req, gathered, wire_dtype)
    skipped += skipped_rows
    if passed:
        scales = scales if scales is not None else {}
        for dim, (grad, scale) in passed.items():
            grads[dim], scales[dim] = grad, scale
    return RowGrads(grads, scales, tuple(skipped))


def scaled_half(grads: Mapping[int, np.ndarray]) -> tuple[dict[int, np.ndarray], dict[int, float]]:
    """Per dim, the row gradients as float16 times a power of two that lifts the largest near float16's
    top (:func:`~persia_nats.core.half.pow2_scale`; the PS divides it out exactly), so even a batch's smallest
    gradients keep their digits where unscaled float16 would flush them to zero; half the bytes of float32
    on the way to the PSs."""
    out: dict[int, np.ndarray] = {}
    scales: dict[int, float] = {}
    for dim, g in grads.items():
        peak = float(np.abs(g).max()) if g.size else 0.0
        if peak == 0.0:
            out[dim], scales[dim] = g, 1.0
            continue
        scale = pow2_scale(peak)
        half = to_half(g * np.float32(scale))
        out[dim], scales[dim] = (g, 1.0) if half is None else (half, scale)
    return out, scales


def _passed_rows(plan: BatchPlan, req: GradRequest, gathered: frozenset[int], wire_dtype: np.dtype
                 ) -> tuple[dict[int, tuple[np.ndarray, float]], list[str]]:
    """The row gradients of the widths sent gathered, ``{dim: (grad, scale)}``, checked (and already
    checked against the batch by :func:`_row_grads`), and the slots left out: those the NN worker
    found not finite, and every slot of a width whose row gradients are not finite."""
    out: dict[int, tuple[np.ndarray, float]] = {}
    skipped: list[str] = []
    names = {dim: [plan.slots[i].name for i in plan.pooled[dim].slots] for dim in gathered}
    for r in req.rows:
        skipped += r.skipped
        if not all_finite(r.grad):
            skipped += [n for n in names[r.dim] if n not in r.skipped]
            continue
        if r.grad.dtype == np.float16:
            out[r.dim] = (r.grad, r.scale)
        else:  # float32 rows (a width beyond float16's range): as the per-slot gradients are
            grad = r.grad / np.float32(r.scale)
            if wire_dtype == np.float16:
                halves, scales = scaled_half({r.dim: grad})
                out[r.dim] = (halves[r.dim], scales[r.dim])
            else:
                out[r.dim] = (grad, 1.0)
    return out, skipped

def _row_grads(plan: BatchPlan, req: GradRequest, gathered: frozenset[int] = frozenset()
               ) -> tuple[dict[int, np.ndarray], list[str]]:
    """Map slot gradients back to per-row gradients per dim; skip (and count) non-finite slots. Checks
    ``req.rows`` against the batch too (the widths ``gathered``), changing nothing when either is wrong."""
    by_name = {s.name: s for s in plan.slots}
    dims: set[int] = set()
    for r in req.rows:
        if r.dim not in gathered:
            raise BadRequest(f"row gradients of dim {r.dim}, whose rows this batch did not send gathered")
        if r.dim in dims:
            raise BadRequest(f"two row gradients of dim {r.dim}")
        dims.add(r.dim)
        n = plan.distinct[r.dim].shape[0]
        if r.grad.shape != (n, r.dim):
            raise BadRequest(f"row gradients of dim {r.dim} have shape {list(r.grad.shape)}, expected {[n, r.dim]}")
        if any(name not in by_name or by_name[name].dim != r.dim for name in r.skipped):
            raise BadRequest(f"row gradients of dim {r.dim} skip slots {list(r.skipped)}, not all of that dim")
    seen = set()
    for g in req.grads:
        if g.name not in by_name:
            raise BadRequest(f"gradient for slot {g.name!r}, which this batch does not have")
        if g.name in seen:
            raise BadRequest(f"two gradients for slot {g.name!r}")
        seen.add(g.name)
        slot = by_name[g.name]
        if slot.dim in gathered:
            raise BadRequest(f"gradient for slot {g.name!r}, whose dim {slot.dim} came gathered: "
                             "its gradients go per row ('rows')")
        if g.grad.shape != (slot.n_targets, slot.dim):
            raise BadRequest(f"gradient of slot {g.name!r} has shape {list(g.grad.shape)}, "
                             f"expected {[slot.n_targets, slot.dim]}")
    out: dict[int, np.ndarray] = {}
    skipped = []
    for g in req.grads:
        slot = by_name[g.name]
        if g.grad.dtype == np.float16:
            grad, finite = to_float(g.grad, req.loss_scale)
        else:
            grad = g.grad.astype(np.float32)
            if req.loss_scale != 1.0:
                grad /= np.float32(req.loss_scale)
            finite = bool(np.isfinite(grad).all())
        if not finite:
            skipped.append(g.name)
            continue
        acc = out.get(slot.dim)
        if acc is None:
            acc = out[slot.dim] = np.zeros((plan.distinct[slot.dim].shape[0], slot.dim), dtype=np.float32)
        accumulate_grad(slot, grad, acc)
    return out, skipped


# -- pack: the NN worker's side --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeafGrads:
    """The gradients of a batch's autograd leaves (:class:`persia_nats.dense.tensors.EmbeddingLeaves`), as
    float32 arrays on the CPU: the loss's gradient times the loss scale."""

    arrays: Sequence[np.ndarray]
    #: per leaf, its largest magnitude: not finite when any of its values is not
    peaks: Sequence[float]
    #: per slot, in the batch's order: (index into ``arrays``, row of a shared leaf or None)
    where: Sequence[tuple[int, int | None]]
    #: ``(k, scale)`` -> leaf k's gradient times ``scale`` as float16, by the dense side (on the CPU torch
    #: converts several times faster than :func:`~persia_nats.core.half.to_half`), bit for bit what
    #: :func:`_scaled_to_half` gives; None: that (a GPU rank's, see ``leaf_gradients``)
    scaled_half: Callable[[int, float], np.ndarray] | None = None
    #: the leaves that hold a gathered width's distinct rows (the model's device gathered its slots from them):
    #: their gradients are the rows' own
    rows: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class GradParts:
    """A batch's gradient as the NN worker sends it (a :class:`~persia_nats.common.messages.GradRequest`'s
    parts, and what the hot rows' gradients are computed from)."""

    grads: tuple[SlotGradient, ...]
    #: what ``grads`` were multiplied by: the loss scale times the float16 wire scale
    loss_scale: float
    #: per width that came gathered, the gradient of each row (each with its own scale)
    rows: tuple[RowGradient, ...] = ()
    #: per gathered width with hot rows, those rows' gradients (float32, unscaled), in their group's order
    gathered_hot: dict[int, np.ndarray] | None = None
    #: per hot slot, its float32 gradient (or its row of a shared one) for :func:`hot_row_grads`
    hot_grads: dict[str, np.ndarray | tuple[np.ndarray, int]] | None = None


def pack(embeddings: Sequence[SlotEmbedding], gathered: Sequence[GatheredSlots], hot: HotPart | None,
         leaves: LeafGrads, loss_scale: float, wire_dtype: np.dtype) -> GradParts:
    """The gradient parts of a batch whose slots were ``embeddings`` (every slot, in order, as
    :func:`~persia_nats.core.lookup.expand` gave them), ``gathered`` and ``hot`` as its reply had them: the
    adjoint of :func:`~persia_nats.core.lookup.expand`. ``wire_dtype`` float16: the per-slot gradients
    times one power of two for the batch that keeps float16 from flushing small ones to zero."""
    half = wire_dtype == np.float16
    in_rows = {name for g in gathered for name in g.slots}
    # with the gathered widths' slots built on the device (their rows' leaves), ``embeddings`` holds the others only
    names = list(slot_order(embeddings, gathered)) if leaves.rows else [e.name for e in embeddings]
    per_slot = [(name, kj) for name, kj in zip(names, leaves.where, strict=True) if name not in in_rows]
    used = sorted({k for _, (k, _) in per_slot})
    wire_scale = 1.0
    if not half:
        wire = {k: leaves.arrays[k] for k in used}
    else:
        wire_scale = pow2_scale(max((leaves.peaks[k] for k in used), default=0.0))
        convert = leaves.scaled_half or (lambda k, scale: _scaled_to_half(leaves.arrays[k], scale))
        wire = {k: convert(k, wire_scale) for k in used}  # a shared leaf in one call
    msgs = tuple(SlotGradient(name, wire[k] if j is None else wire[k][j]) for name, (k, j) in per_slot)
    per_row = [_row_gradient(names, g, leaves, loss_scale, half) for g in gathered]
    gathered_hot = {g.dim: h for g, (_, h) in zip(gathered, per_row, strict=True) if h is not None} \
        if hot is not None else None
    return GradParts(msgs, loss_scale * wire_scale, tuple(r for r, _ in per_row), gathered_hot,
                     _hot_grads(names, hot, leaves) if hot is not None else None)


def _scaled_to_half(values: np.ndarray, scale: float) -> np.ndarray:
    """``values * scale`` as float16, rounded to nearest even; a non-finite value, or one beyond float16's
    range, becomes inf or NaN there (the embedding worker skips the slot)."""
    scaled = values * np.float32(scale) if scale != 1.0 else values
    half = to_half(scaled)
    if half is None:
        with np.errstate(over="ignore", invalid="ignore"):
            half = np.asarray(scaled, np.float32).astype(np.float16)
    return half


def _row_gradient(names: Sequence[str], g: GatheredSlots, leaves: LeafGrads, loss_scale: float,
                  half: bool) -> tuple[RowGradient, np.ndarray | None]:
    """The gradient of each row of a width that came gathered, from its slots' gradients (one leaf's, as
    :func:`~persia_nats.dense.tensors.embedding_tensors` stacks them, without a copy), and its hot rows'
    (:func:`row_gradient`); or, where the device gathered them, its rows' leaf's own gradient."""
    position = {name: i for i, name in enumerate(names)}
    where = [leaves.where[position[name]] for name in g.slots]
    k0 = where[0][0]
    if k0 in leaves.rows:
        return _rows_leaf_gradient(g, leaves.arrays[k0], leaves.peaks[k0], loss_scale, half)
    if all(k == k0 for k, _ in where) and [j for _, j in where] == list(range(len(where))) \
            and leaves.arrays[k0].shape[0] == len(where):
        stacked, peak = leaves.arrays[k0], leaves.peaks[k0]
    else:
        stacked = np.stack([leaves.arrays[k][j if j is not None else slice(None)] for k, j in where])
        peak = max(leaves.peaks[k] for k, _ in where)
    finite = [True] * len(where) if math.isfinite(peak) else \
        np.isfinite(stacked.reshape(len(where), -1)).all(axis=1).tolist()
    return row_gradient(g, stacked, finite, loss_scale, half=half)


def _hot_grads(names: Sequence[str], hot: HotPart, leaves: LeafGrads
               ) -> dict[str, np.ndarray | tuple[np.ndarray, int]]:
    """The hot slots' float32 gradients, unrounded, for the gradients of the hot rows (:func:`hot_row_grads`):
    a slot of a shared leaf as (the leaf's gradient, its row), so they are summed per leaf. A slot whose
    gradient is not finite is left out, as the embedding worker skips it."""
    finite = [None if math.isfinite(p) else np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)
              for a, p in zip(leaves.arrays, leaves.peaks, strict=True)]
    hot_names = set(hot.slots)
    out: dict[str, np.ndarray | tuple[np.ndarray, int]] = {}
    for name, (k, j) in zip(names, leaves.where, strict=True):
        if name not in hot_names or k in leaves.rows:
            continue
        rows_ok = finite[k]
        ok = rows_ok is None or bool(rows_ok.all() if j is None else rows_ok[j])
        if not ok:
            continue
        out[name] = leaves.arrays[k] if j is None else (leaves.arrays[k], j)
    return out
