"""Which rows a training lookup should return as hot, found from the batches in flight.

A lookup reads each row as the PS holds it now; the batches looked up before it whose gradients the
PS has not applied yet (the worker's gradient buffer: the staleness window) will each change the
rows they read before this batch trains. The rows those batches read most are the ones a stale read
hurts, so :class:`InFlightReads` counts, per row, the reads of the pooled slots of every batch in
flight (the sum over those batches of how often each one reads the row), and a row is hot when the
batches in flight read it at least ``AUTO_READS_PER_BATCH`` times per batch on average, at most the
``AUTO_MAX_ROWS`` they read most. Nothing is hot while nothing is in flight, as in sync mode.

Memory is bounded by what the gradient buffer holds anyway: per batch in flight its rows (sorted) and
how often it reads each. A batch leaves the count when its gradients are applied, when its lookup
fails, or when it has been in flight longer than the buffer keeps a batch (the buffer expires it).

The counts are taken when a batch is looked up, for its rows only. On skewed ids the cap decides: the
``AUTO_MAX_ROWS`` most read rows are read many times in some batch in flight, so only rows some batch
reads at least ``t`` times are counted (a row that no batch reads ``t`` times has at most
``n * (t - 1)`` reads in ``n`` batches), which gives the same rows as counting all of them whenever at
least ``AUTO_MAX_ROWS`` of those reach ``n * (t - 1) + 1``. Otherwise every row is counted, by a merge
of the sorted rows of each batch in flight.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import numba
import numpy as np
from persia_nats.core.plan import BatchPlan

__all__ = ["AUTO_READS_PER_BATCH", "InFlightReads", "batch_reads", "warm_up"]

#: a row read this many times per batch in flight, on average, is hot. 2 left hybrid at the default
#: bound 0.13% below sync on the ratings case, 1 left it 0.03% below (benchmarks/RESULTS.md, "Accuracy")
AUTO_READS_PER_BATCH = 1
#: at most this many hot rows a lookup, those the batches in flight read most: each costs the NN
#: workers and the PSs work per batch (a publication, a merge), and past a few hundred that work ate
#: hybrid's lead on the synthetic stream (0.95x sync with 1,047 hot rows a batch, 1.41x with 411)
AUTO_MAX_ROWS = 512

#: per batch: dim -> (its rows, sorted; how many times it reads each)
_Reads = dict[int, tuple[np.ndarray, np.ndarray]]


@numba.njit(cache=True, nogil=True)
def _add_reads(keys, b_keys, b_reads, out):
    """``out[i] += b_reads[j]`` where ``b_keys[j] == keys[i]``; both key arrays sorted and distinct.

    One pass over both, comparisons turned into arithmetic: which side moves on depends on ids that
    look random, so branches on it are mispredicted half the time (this form measured 1.5x faster)."""
    i = 0
    j = 0
    n, m = keys.shape[0], b_keys.shape[0]
    while i < n and j < m:
        a, b = keys[i], b_keys[j]
        out[i] += b_reads[j] * (a == b)
        i += a <= b
        j += b <= a


@numba.njit(cache=True, nogil=True)
def _increasing(keys):
    for i in range(1, keys.shape[0]):
        if keys[i] <= keys[i - 1]:
            return False
    return True


def warm_up() -> float:
    """Load (or compile) the counting kernels now, before the worker serves; returns the seconds it took."""
    started = time.perf_counter()
    keys = np.ones(1, np.uint64)
    _add_reads(keys, keys, np.ones(1, np.int64), np.zeros(1, np.int64))
    _increasing(keys)
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


def _sorted_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """``keys`` sorted, and the order that sorts them (None where they were already: a plan's rows are)."""
    keys = np.ascontiguousarray(keys, np.uint64)
    if _increasing(keys):
        return keys, None
    order = np.argsort(keys, kind="stable")
    return keys[order], order


def batch_reads(plan: BatchPlan) -> _Reads:
    """Per dim with pooled slots: (the rows they read, sorted, how many times they read each); rows only
    raw slots read are left out."""
    out = {}
    for dim, p in plan.pooled.items():
        reads = np.bincount(p.inv, minlength=plan.distinct[dim].shape[0])
        read = reads > 0
        keys, order = _sorted_keys(plan.distinct[dim][read])
        reads = reads[read].astype(np.int64)
        out[dim] = (keys, reads if order is None else reads[order])
    return out


def _all_counts(keys: np.ndarray, parts: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The reads of each of ``keys`` (sorted) by the batches whose (rows, reads) are ``parts``."""
    out = np.zeros(keys.shape[0], np.int64)
    for b_keys, b_reads in parts:
        _add_reads(keys, b_keys, b_reads, out)
    return out


def _heavy_counts(keys: np.ndarray, parts: list[tuple[np.ndarray, np.ndarray]], t: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(positions in ``keys`` (sorted), their reads by ``parts``) of the keys some batch of ``parts``
    reads at least ``t`` times."""
    heavy = [b_keys[b_reads >= t] for b_keys, b_reads in parts]
    cand = heavy[0]
    if len(heavy) > 1:  # their union, sorted: np.unique's hashing measured 10x slower on these few thousand
        cand = np.sort(np.concatenate(heavy))
        cand = cand[np.concatenate(([True], cand[1:] != cand[:-1]))]
    at = np.minimum(np.searchsorted(keys, cand), max(keys.shape[0] - 1, 0))
    ours = keys[at] == cand if keys.shape[0] else np.zeros(cand.shape[0], np.bool_)
    cand, at = cand[ours], at[ours]
    counts = np.zeros(cand.shape[0], np.int64)
    for b_keys, b_reads in parts:
        p = np.minimum(np.searchsorted(b_keys, cand), b_keys.shape[0] - 1)
        hit = b_keys[p] == cand
        counts[hit] += b_reads[p[hit]]
    return at, counts


class InFlightReads:
    """Reads per row by the training batches in flight, and the hot rows of a batch about to be looked up."""

    def __init__(self, capacity: int, expire_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.expire_s = expire_s
        self._clock = clock
        #: ref -> (when it was added, its rows and reads per dim)
        self._batches: OrderedDict[int, tuple[float, _Reads]] = OrderedDict()
        #: the reads of the least read hot row at the last lookup the cap decided (0: it did not), which
        #: picks the ``t`` of the next lookup
        self._cut = 0

    def __len__(self) -> int:
        """Batches in flight."""
        return len(self._batches)

    @property
    def rows(self) -> int:
        """Distinct rows the batches in flight read."""
        dims: dict[int, list[np.ndarray]] = {}
        for _, reads in self._batches.values():
            for dim, (keys, _) in reads.items():
                dims.setdefault(dim, []).append(keys)
        return sum(np.unique(np.concatenate(keys)).shape[0] for keys in dims.values())

    def hot(self, plan: BatchPlan) -> dict[int, np.ndarray] | None:
        """Per dim, a mask over ``plan.distinct[dim]``: the rows the batches in flight read at least
        ``AUTO_READS_PER_BATCH`` times per batch, at most ``AUTO_MAX_ROWS``, the most read (None when
        there are none)."""
        self._expire()
        if not self._batches:
            return None
        n = len(self._batches)
        least = AUTO_READS_PER_BATCH * n
        dims = list(plan.pooled)
        parts = {dim: [reads[dim] for _, reads in self._batches.values() if dim in reads and reads[dim][0].size]
                 for dim in dims}
        keys = {dim: _sorted_keys(plan.distinct[dim]) for dim in dims}
        counts = None
        t = (self._cut // 2 - 1) // n + 1  # rows read at least half as often as the last cut are counted
        if t >= 2:
            floor = max(least, n * (t - 1) + 1)  # the rows that reach it are all among those counted
            counts = {}
            for dim in dims:
                c = counts[dim] = np.full(keys[dim][0].shape[0], -1, np.int64)
                if parts[dim]:
                    at, heavy = _heavy_counts(keys[dim][0], parts[dim], t)
                    c[at] = np.where(heavy >= floor, heavy, -1)
            if sum(int((c >= 0).sum()) for c in counts.values()) < AUTO_MAX_ROWS:
                counts = None  # the cap might not decide: every row is counted
        if counts is None:
            counts = {dim: _all_counts(keys[dim][0], parts[dim]) for dim in dims}
            counts = {dim: np.where(c >= least, c, -1) for dim, c in counts.items()}
        for dim in dims:
            order = keys[dim][1]
            if order is not None:  # back to the order of the plan's rows
                unsorted = np.empty_like(counts[dim])
                unsorted[order] = counts[dim]
                counts[dim] = unsorted
        # -1 for a row that is not hot, else its reads: all dims, in plan.pooled's order
        flat = np.concatenate([counts[dim] for dim in dims]) if dims else np.zeros(0, np.int64)
        if int((flat >= 0).sum()) > AUTO_MAX_ROWS:
            keep = _most_read(flat, AUTO_MAX_ROWS)
            self._cut = int(flat[keep].min())
        else:
            keep = flat >= 0
            self._cut = 0
        bounds = np.cumsum([0] + [counts[dim].shape[0] for dim in dims])
        masks = {dim: keep[bounds[k]:bounds[k + 1]] for k, dim in enumerate(dims)}
        masks = {dim: m for dim, m in masks.items() if m.any()}
        return masks or None

    def add(self, ref: int, plan: BatchPlan) -> None:
        """``plan``'s batch (``ref``) is in flight from now on."""
        self.remove(ref)
        reads = batch_reads(plan)
        while len(self._batches) >= self.capacity:
            self.remove(next(iter(self._batches)))
        self._batches[ref] = (self._clock(), reads)

    def remove(self, ref: int) -> None:
        """``ref`` is no longer in flight (its gradients were applied, or its lookup failed); a ref not
        held (expired here already) changes nothing."""
        self._batches.pop(ref, None)

    def _expire(self) -> None:
        deadline = self._clock() - self.expire_s
        while self._batches:
            ref, (born, _) = next(iter(self._batches.items()))
            if born >= deadline:
                break
            self.remove(ref)

