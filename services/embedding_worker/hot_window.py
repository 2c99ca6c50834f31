"""Which rows a training lookup should return as hot, found from the batches in flight.

A lookup reads each row as the PS holds it now; the batches looked up before it whose gradients the
PS has not applied yet (the worker's gradient buffer: the staleness window) will each change the
rows they read before this batch trains. The rows those batches read most are the ones a stale read
hurts, so :class:`InFlightReads` counts, per row, the reads of the pooled slots of every batch in
flight (the sum over those batches of how often each one reads the row), and a row is hot when the
batches in flight read it at least ``AUTO_READS_PER_BATCH`` times per batch on average, at most the
``AUTO_MAX_ROWS`` they read most. Nothing is hot while nothing is in flight, as in sync mode.

Memory is bounded by what the gradient buffer holds anyway: per batch in flight its rows (sorted) and
how often it reads each, and, for a wide window, one count per distinct row of the batches in flight.
A batch leaves the count when its gradients are applied, when its lookup fails, or when it has been
in flight longer than the buffer keeps a batch (the buffer expires it).

The counts are taken when a batch is looked up, for its rows only. On skewed ids the cap decides: the
``AUTO_MAX_ROWS`` most read rows are read many times in some batch in flight, so only rows some batch
reads at least ``t`` times are counted (a row that no batch reads ``t`` times has at most
``n * (t - 1)`` reads in ``n`` batches), which gives the same rows as counting all of them whenever at
least ``AUTO_MAX_ROWS`` of those reach ``n * (t - 1) + 1``. Otherwise the rows counted are those some
batch reads more than ``AUTO_READS_PER_BATCH`` times and those every batch reads (a row that reaches
``AUTO_READS_PER_BATCH * n`` reads is one or the other), found by passes over each batch's sorted rows
that stop once no row is left. Either way a lookup's work grows with the batches in flight (a comparison
per row of each), so past ``WIDE_WINDOW`` of them every batch's reads are also counted in one shared
table, which a lookup probes once per row, as long as more than half that many are in flight. Up to
there, taking a batch off costs nothing and a lookup 2-4x less than with the table
(benchmarks/RESULTS.md, "The automatic hot rows' cost at batch 4096").
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

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

#: more batches in flight than this, and their reads are also counted in one shared table (kept until
#: half as many are left): a lookup then probes it once per row, where the passes over each batch's
#: rows grow with the batches (on ids spread evenly, 19 instead of 3.7 ms a lookup with 16 in flight)
WIDE_WINDOW = 8

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


#: per batch: dim -> (its rows, sorted; how many times it reads each)
_Reads = dict[int, tuple[np.ndarray, np.ndarray]]


@numba.njit(cache=True, nogil=True)
def _member(keys, b_keys, out):
    """``out[i]``: whether ``keys[i]`` is among ``b_keys``; both sorted and distinct, ``out`` all False.

    One pass over both, comparisons turned into arithmetic: which side moves on depends on ids that
    look random, so branches on it are mispredicted half the time (this form measured 1.5x faster)."""
    i = 0
    j = 0
    n, m = keys.shape[0], b_keys.shape[0]
    while i < n and j < m:
        a, b = keys[i], b_keys[j]
        out[i] = a == b  # the last comparison of keys[i] is the one that moves i on
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
    keys, reads = np.ones(1, np.uint64), np.ones(1, np.int64)
    _member(keys, keys, np.zeros(1, np.bool_))
    _increasing(keys)
    table = _SharedCounts()
    table.add(keys, reads)
    table.counts(keys)
    table.subtract(keys, reads)
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


def _in_all(keys: np.ndarray, parts: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Those of ``keys`` (sorted) that every batch of ``parts`` reads."""
    common = keys
    for b_keys, _ in parts:
        if not common.shape[0]:
            break
        if common.shape[0] * 16 < b_keys.shape[0]:  # a few left: a binary search each beats a pass over b_keys
            at = np.minimum(np.searchsorted(b_keys, common), b_keys.shape[0] - 1)
            common = common[b_keys[at] == common]
        else:
            found = np.zeros(common.shape[0], np.bool_)
            _member(common, b_keys, found)
            common = common[found]
    return common


def _counted(keys: np.ndarray, parts: list[tuple[np.ndarray, np.ndarray]], t: int, every: bool
             ) -> tuple[np.ndarray, np.ndarray]:
    """(positions in ``keys`` (sorted), their reads by ``parts``) of the keys some batch of ``parts``
    reads at least ``t`` times and, with ``every``, of the keys every batch of them reads."""
    chosen = [b_keys[b_reads >= t] for b_keys, b_reads in parts]
    if every:
        chosen.append(_in_all(keys, parts))
    cand = chosen[0]
    if len(chosen) > 1:  # their union, sorted: np.unique's hashing measured 10x slower on these few thousand
        cand = np.sort(np.concatenate(chosen))
        cand = cand[np.concatenate(([True], cand[1:] != cand[:-1]))] if cand.shape[0] else cand
    at = np.minimum(np.searchsorted(keys, cand), max(keys.shape[0] - 1, 0))
    ours = keys[at] == cand if keys.shape[0] else np.zeros(cand.shape[0], np.bool_)
    cand, at = cand[ours], at[ours]
    counts = np.zeros(cand.shape[0], np.int64)
    for b_keys, b_reads in parts:
        p = np.minimum(np.searchsorted(b_keys, cand), b_keys.shape[0] - 1)
        hit = b_keys[p] == cand
        counts[hit] += b_reads[p[hit]]
    return at, counts


class _SharedCounts:
    """Reads per row of every batch in flight in one open-addressing table (the PS index's probing): the
    key's index slot holds its count."""

    def __init__(self) -> None:
        self.n = 0
        self._allocate(1024)

    def _allocate(self, rows: int) -> None:
        self._skey = np.zeros(slot_count(rows), np.uint64)
        self._srow = np.full(slot_count(rows), -1, np.int64)
        self._sstamp = np.zeros(slot_count(rows), np.uint32)
        self._rows = rows

    def add(self, keys: np.ndarray, reads: np.ndarray) -> None:
        if self.n + keys.shape[0] > self._rows:
            skey, srow = self._skey, self._srow
            held = srow >= 0
            self._allocate(max(2 * self._rows, self.n + keys.shape[0]))
            self.n = _add(skey[held], srow[held], self._skey, self._srow, self._sstamp, 0)
        self.n = _add(keys, reads, self._skey, self._srow, self._sstamp, self.n)

    def subtract(self, keys: np.ndarray, reads: np.ndarray) -> None:
        self.n = _subtract(keys, reads, self._skey, self._srow, self._sstamp, self.n)

    def counts(self, keys: np.ndarray) -> np.ndarray:
        return _count(keys, self._skey, self._srow)


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
        #: every batch's reads in one table, while more than WIDE_WINDOW // 2 are in flight
        self._shared: _SharedCounts | None = None

    def __len__(self) -> int:
        """Batches in flight."""
        return len(self._batches)

    @property
    def rows(self) -> int:
        """Distinct rows the batches in flight read."""
        if self._shared is not None:
            return self._shared.n
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
        # -1 for a row that is not hot, else its reads, per dim over its rows sorted
        counts: dict[int, np.ndarray] | None = None
        t = (self._cut // 2 - 1) // n + 1  # rows read at least half as often as the last cut are counted
        if self._shared is not None:
            shared = self._shared
            counts = {dim: np.where((c := shared.counts(k)) >= least, c, -1) for dim, (k, _) in keys.items()}
        elif t > AUTO_READS_PER_BATCH + 1:
            floor = max(least, n * (t - 1) + 1)  # the rows that reach it are all among those counted
            counts = self._counts(keys, parts, t, False, floor)
            if sum(int((c >= 0).sum()) for c in counts.values()) < AUTO_MAX_ROWS:
                counts = None  # the cap might not decide: every row that may be hot is counted
        if counts is None:
            # a row read ``least`` times by n batches is read more than AUTO_READS_PER_BATCH times by one of
            # them, or exactly that often by each: by every batch
            counts = self._counts(keys, parts, AUTO_READS_PER_BATCH + 1, True, least)
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

    def _counts(self, keys: Mapping[int, tuple[np.ndarray, np.ndarray | None]],
                parts: Mapping[int, list[tuple[np.ndarray, np.ndarray]]], t: int, every: bool, floor: int
                ) -> dict[int, np.ndarray]:
        """Per dim, over its rows sorted: the reads of those :func:`_counted` finds that reach ``floor``,
        -1 for the others (a batch that reads none of a dim's rows leaves no row that every batch reads)."""
        out = {}
        for dim, (k, _) in keys.items():
            c = out[dim] = np.full(k.shape[0], -1, np.int64)
            if parts[dim]:
                at, counts = _counted(k, parts[dim], t, every and len(parts[dim]) == len(self._batches))
                c[at] = np.where(counts >= floor, counts, -1)
        return out

    def add(self, ref: int, plan: BatchPlan) -> None:
        """``plan``'s batch (``ref``) is in flight from now on."""
        self.remove(ref)
        reads = batch_reads(plan)
        while len(self._batches) >= self.capacity:
            self.remove(next(iter(self._batches)))
        self._batches[ref] = (self._clock(), reads)
        if self._shared is None and len(self._batches) > WIDE_WINDOW:
            self._shared = _SharedCounts()
            for _, each in self._batches.values():
                for keys, counts in each.values():
                    self._shared.add(keys, counts)
        elif self._shared is not None:
            for keys, counts in reads.values():
                self._shared.add(keys, counts)

    def remove(self, ref: int) -> None:
        """``ref`` is no longer in flight (its gradients were applied, or its lookup failed); a ref not
        held (expired here already) changes nothing."""
        entry = self._batches.pop(ref, None)
        if entry is None or self._shared is None:
            return
        if len(self._batches) <= WIDE_WINDOW // 2:
            self._shared = None  # few enough for the passes over each batch's rows again; the memory goes back
            return
        for keys, counts in entry[1].values():
            self._shared.subtract(keys, counts)

    def _expire(self) -> None:
        deadline = self._clock() - self.expire_s
        while self._batches:
            ref, (born, _) = next(iter(self._batches.items()))
            if born >= deadline:
                break
            self.remove(ref)

