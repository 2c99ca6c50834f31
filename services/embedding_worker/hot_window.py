"""Which rows a training lookup should return as hot, found from the batches in flight.

A lookup reads each row as the PS holds it now; the batches looked up before it whose gradients the
PS has not applied yet (the worker's gradient buffer: the staleness window) will each change the
rows they read before this batch trains. The rows those batches read most are the ones a stale read
hurts, so :class:`InFlightReads` counts, per row, the reads of the pooled slots of every batch in
flight (the sum over those batches of how often each one reads the row), and a row is hot when the
batches in flight read it at least ``AUTO_READS_PER_BATCH`` times per batch on average, at most the
``AUTO_MAX_ROWS`` they read most. Nothing is hot while nothing is in flight, as in sync mode.

Memory is bounded by what the gradient buffer holds anyway: one count per distinct row of the batches
in flight, in an open-addressing table (the PS index's probing), and per batch its rows and reads.
A batch leaves the count when its gradients are applied, when its lookup fails, or when it has been
in flight longer than the buffer keeps a batch (the buffer expires it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import numba
import numpy as np
from persia_nats.core.optim import prefetch
from persia_nats.core.plan import BatchPlan
from persia_nats.core.table_kernels import delete_slot, home_slot, probe, slot_count

__all__ = ["AUTO_READS_PER_BATCH", "InFlightReads", "batch_reads", "warm_up"]

#: a row read this many times per batch in flight, on average, is hot. 2 left hybrid at the default
#: bound 0.13% below sync on the ratings case, 1 left it 0.03% below (benchmarks/RESULTS.md, "Accuracy")
AUTO_READS_PER_BATCH = 1
#: at most this many hot rows a lookup, those the batches in flight read most: each costs the NN
#: workers and the PSs work per batch (a publication, a merge), and past a few hundred that work ate
#: hybrid's lead on the synthetic stream (0.95x sync with 1,047 hot rows a batch, 1.41x with 411)
AUTO_MAX_ROWS = 512


# The table outgrows the caches (one entry per row the batches in flight read: a few hundred
# thousand), so every probe is a miss: the kernels hash and prefetch the home slots _AHEAD keys
# ahead, as the PS's lookups do, which measured the counting 1.5-2x cheaper a batch.
_AHEAD = 16
_RING = 32  # ring of home slots, a power of two > _AHEAD


@numba.njit(cache=True, inline="always")
def _prefetch_home(keys, a, skey, srow, homes):
    h = home_slot(keys[a], skey.shape[0])
    homes[a & (_RING - 1)] = h
    prefetch(skey, h, 0)
    prefetch(srow, h, 0)


@numba.njit(cache=True)
def _add(keys, reads, skey, srow, sstamp, n):
    """Add ``reads[i]`` to the count of ``keys[i]``; returns the number of keys held."""
    homes = np.empty(_RING, np.int64)
    for i in range(-_AHEAD, keys.shape[0]):
        if i + _AHEAD < keys.shape[0]:
            _prefetch_home(keys, i + _AHEAD, skey, srow, homes)
        if i < 0:
            continue
        r, s = probe(skey, srow, keys[i], homes[i & (_RING - 1)])
        if r < 0:
            skey[s], srow[s], sstamp[s] = keys[i], reads[i], 0
            n += 1
        else:
            srow[s] = r + reads[i]
    return n


@numba.njit(cache=True)
def _subtract(keys, reads, skey, srow, sstamp, n):
    """Take ``reads[i]`` off the count of ``keys[i]``, forgetting keys that reach 0; returns the keys held."""
    homes = np.empty(_RING, np.int64)
    for i in range(-_AHEAD, keys.shape[0]):
        if i + _AHEAD < keys.shape[0]:
            _prefetch_home(keys, i + _AHEAD, skey, srow, homes)
        if i < 0:
            continue
        r, s = probe(skey, srow, keys[i], homes[i & (_RING - 1)])
        if r < 0:
            continue
        if r <= reads[i]:
            delete_slot(skey, srow, sstamp, s)
            n -= 1
        else:
            srow[s] = r - reads[i]
    return n


@numba.njit(cache=True)
def _count(keys, skey, srow):
    """The count held for each key, 0 where none is (:func:`find_rows`, prefetched)."""
    homes = np.empty(_RING, np.int64)
    out = np.empty(keys.shape[0], np.int64)
    for i in range(-_AHEAD, keys.shape[0]):
        if i + _AHEAD < keys.shape[0]:
            _prefetch_home(keys, i + _AHEAD, skey, srow, homes)
        if i >= 0:
            out[i] = max(probe(skey, srow, keys[i], homes[i & (_RING - 1)])[0], 0)
    return out


def warm_up() -> float:
    """Load (or compile) the counting kernels now, before the worker serves; returns the seconds it took."""
    started = time.perf_counter()
    keys, reads = np.ones(1, np.uint64), np.ones(1, np.int64)
    table = InFlightReads(1, 1.0)
    n = _add(keys, reads, table._skey, table._srow, table._sstamp, 0)
    table._counts(keys)
    _subtract(keys, reads, table._skey, table._srow, table._sstamp, n)
    return time.perf_counter() - started


def _most_read(counts: np.ndarray, k: int) -> np.ndarray:
    """A mask of the ``k`` largest of the counts that are >= 0, ties taken by position: the first ``k``
    of a stable sort by count, descending, found by partitioning the candidates rather than sorting
    every row of the batch (partitioning all of them measured slower still: the -1s are most of them)."""
    candidates = counts[counts >= 0]
    if candidates.shape[0] <= k:
        return counts >= 0
    least = np.partition(candidates, candidates.shape[0] - k)[candidates.shape[0] - k]  # the k-th largest
    keep = counts > least
    keep[np.flatnonzero(counts == least)[:k - int(keep.sum())]] = True
    return keep


def batch_reads(plan: BatchPlan) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per dim with pooled slots: (the rows they read, how many times they read each); rows only raw
    slots read are left out."""
    out = {}
    for dim, p in plan.pooled.items():
        reads = np.bincount(p.inv, minlength=plan.distinct[dim].shape[0])
        read = reads > 0
        out[dim] = (plan.distinct[dim][read], reads[read].astype(np.int64))
    return out


class InFlightReads:
    """Reads per row by the training batches in flight, and the hot rows of a batch about to be looked up."""

    def __init__(self, capacity: int, expire_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.expire_s = expire_s
        self._clock = clock
        #: ref -> (when it was added, its rows and reads per dim)
        self._batches: OrderedDict[int, tuple[float, dict[int, tuple[np.ndarray, np.ndarray]]]] = OrderedDict()
        self._n = 0
        self._allocate(1024)

    def _allocate(self, rows: int) -> None:
        self._skey = np.zeros(slot_count(rows), np.uint64)
        self._srow = np.full(slot_count(rows), -1, np.int64)
        self._sstamp = np.zeros(slot_count(rows), np.uint32)
        self._rows = rows

    def __len__(self) -> int:
        """Batches in flight."""
        return len(self._batches)

    @property
    def rows(self) -> int:
        """Distinct rows the batches in flight read."""
        return self._n

    def hot(self, plan: BatchPlan) -> dict[int, np.ndarray] | None:
        """Per dim, a mask over ``plan.distinct[dim]``: the rows the batches in flight read at least
        ``AUTO_READS_PER_BATCH`` times per batch (None when there are none)."""
        self._expire()
        if not self._batches:
            return None
        least = AUTO_READS_PER_BATCH * len(self._batches)
        counts = {dim: self._counts(plan.distinct[dim]) for dim in plan.pooled}
        masks = {dim: c >= least for dim, c in counts.items()}
        flat = np.concatenate([np.where(m, c, -1) for m, c in zip(masks.values(), counts.values(), strict=True)])
        if int((flat >= 0).sum()) > AUTO_MAX_ROWS:
            keep = _most_read(flat, AUTO_MAX_ROWS)
            bounds = np.cumsum([0] + [c.shape[0] for c in counts.values()])
            masks = {dim: keep[bounds[k]:bounds[k + 1]] for k, dim in enumerate(counts)}
        masks = {dim: m for dim, m in masks.items() if m.any()}
        return masks or None

    def add(self, ref: int, plan: BatchPlan) -> None:
        """``plan``'s batch (``ref``) is in flight from now on."""
        self.remove(ref)
        reads = batch_reads(plan)
        while len(self._batches) >= self.capacity:
            self.remove(next(iter(self._batches)))
        need = self._n + sum(k.shape[0] for k, _ in reads.values())
        if need > self._rows:
            self._grow(max(2 * self._rows, need))
        for keys, counts in reads.values():
            self._n = _add(keys, counts, self._skey, self._srow, self._sstamp, self._n)
        self._batches[ref] = (self._clock(), reads)

    def remove(self, ref: int) -> None:
        """``ref`` is no longer in flight (its gradients were applied, or its lookup failed); a ref not
        held (expired here already) changes nothing."""
        entry = self._batches.pop(ref, None)
        if entry is None:
            return
        for keys, counts in entry[1].values():
            self._n = _subtract(keys, counts, self._skey, self._srow, self._sstamp, self._n)
        if not self._batches and self._rows > 1 << 16:
            self._allocate(1024)  # a burst grew the table: give the memory back once idle
            self._n = 0

    def _counts(self, keys: np.ndarray) -> np.ndarray:
        """The reads in flight of each key (the index keeps a key's count where the table keeps a row)."""
        return _count(keys, self._skey, self._srow)

    def _expire(self) -> None:
        deadline = self._clock() - self.expire_s
        while self._batches:
            ref, (born, _) = next(iter(self._batches.items()))
            if born >= deadline:
                break
            self.remove(ref)

    def _grow(self, rows: int) -> None:
        skey, srow = self._skey, self._srow
        held = srow >= 0
        self._allocate(rows)
        self._n = _add(skey[held], srow[held], self._skey, self._srow, self._sstamp, 0)
