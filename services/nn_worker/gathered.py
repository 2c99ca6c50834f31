"""Slots that come gathered (:class:`~persia_nats.common.messages.GatheredSlots`): a width whose every output
is one PS row arrives as its distinct rows, once each, with where each slot reads them. The rank builds the
slots' outputs itself, and sends back one gradient per row, the adjoint of that gather, instead of one per
sample and slot: both directions then carry each row once, where a head id of a Zipf slot would otherwise
cross the wire once per sample that reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence

import numpy as np
from persia_nats.common.messages import GatheredSlots, RowGradient, SlotEmbedding
from persia_nats.core.half import pow2_scale, to_float, to_half
from persia_nats.core.plan import add_rows


def widen(gathered: Sequence[GatheredSlots]) -> tuple[GatheredSlots, ...]:
    """``gathered`` with float32 rows, converted when the lookup's reply arrives: the hot-row merge
    (:func:`expand`) runs when the training loop asks for the batch, and may keep it waiting, so it is
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


def expand(embeddings: Sequence[SlotEmbedding], gathered: Sequence[GatheredSlots], order: Sequence[str],
           hot: Mapping[int, np.ndarray] | None = None) -> tuple[SlotEmbedding, ...]:
    """Every slot's output, in ``order`` (the reply's :meth:`~persia_nats.common.messages.EwLookupReply.slot_names`).

    A gathered width's slots come back as consecutive rows of one new float32 array (slots, batch, dim),
    which the training context takes as one tensor as it is (:func:`persia_nats.dense.tensors.embedding_tensors`).
    ``hot``: per dim, float32 values added to the width's hot rows (``GatheredSlots.hot_at``, in that order)
    before the gather, so every read of a hot row reads them (the hot-row merge's newest copies).
    """
    by_name = {e.name: e for e in embeddings}
    for g in gathered:
        rows = g.rows if g.rows.dtype == np.float32 else float32_copy(g.rows)  # the gather runs on float32 rows
        add = hot.get(g.dim) if hot is not None and g.hot_at is not None and g.hot_at.size else None
        if add is not None:
            rows = np.array(rows) if rows is g.rows else rows  # a wire array is read-only
            # added, not written: a hot row is zero here, and 0 + x is what adding x at every read gave
            rows[g.hot_at] += add
        out = np.take(rows, g.index, axis=0)  # (slots, batch, dim), owning its memory: one tensor as it is
        by_name.update({name: SlotEmbedding(name, out[k]) for k, name in enumerate(g.slots)})
    return tuple(by_name[name] for name in order)


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
    hot = out[g.hot_at] if g.hot_at is not None else None
    if not half:
        return RowGradient(g.dim, out, 1.0, skipped), hot
    scale = pow2_scale(float(np.abs(out).max()) if out.size else 0.0)
    wire = to_half(out * np.float32(scale)) if scale != 1.0 else to_half(out)
    if wire is None:  # beyond float16 even scaled (a peak past 2**114): float32, as the embedding worker sends then
        return RowGradient(g.dim, out, 1.0, skipped), hot
    return RowGradient(g.dim, wire, scale, skipped), hot


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


__all__ = ["expand", "row_gradient", "warm_up"]
