"""The PS's embedding storage: capacity-bounded (exact LRU) tables of float32 rows in flat arrays.

One :class:`EmbeddingTable` holds every row of one embedding width in a handful of numpy arrays, never
a Python object per row: ``emb`` (float32, ``dim`` wide) and ``state`` (the optimizer's float32
columns) by row number, rows always dense (``0..len-1``); and a hash index whose slots hold each key, its
row and its recency stamp, which orders the rows for LRU eviction. The row arrays start at
``initial_rows`` and double up to ``capacity``. The row arrays are views of address space reserved for
the whole capacity (:func:`.hugepages.reserve`), so a growth commits only the pages new rows write and
rebuilds only the index, which briefly holds the old and the new index (at 50M rows of dim 8: 4.35 GiB
peak for 4.3 GiB resident after, where copying the rows too peaked at 6.1 GiB; a platform without such
reservations still copies them). The first ``initial_rows`` rows are committed up front, by a thread
(:func:`.hugepages.commit_in_background`). Arrays of 4 MiB and more sit on 2 MiB pages (:mod:`.hugepages`). The
layout, the LRU scheme and the kernels are described in :mod:`.table_kernels`.

No whole-table work stops a lookup for a time that grows with the table:

- **Growth** is built ahead. From 3/4 of the allocated rows on (tables of 2^16 rows and more), each
  training lookup clears and copies a bounded number of index slots into the doubled index (its share
  of the work left, spread over the rows left to fill, twice as fast as needed); below capacity nothing
  is deleted, so entries never move, and the kernel mirrors into the copy every insert and touch behind
  its cursor; a thread commits the doubled index's memory meanwhile, so that its page faults fall outside
  the lookups (:func:`.hugepages.commit_in_background`). When the rows run out the doubled index is
  swapped in and the row arrays' views widened: O(1). Both indexes coexist for the last quarter of each
  doubling (the old rebuild held them too, briefly). Where the rows cannot grow in place it is rebuilt at
  once, as before.
- **Eviction candidates** are listed ahead: the next list (rows stamped between the current list's last
  stamp and a sampled threshold) is collected by a bounded scan after each lookup and radix-sorted in
  bounded steps while the current list still serves, then swapped in (:mod:`.table_kernels`). A table
  below 2^16 rows, a sample that misses, or a stamp renumbering falls back to one rescan.
- **A checkpoint dump** reads a table without stopping it: :meth:`EmbeddingTable.begin_snapshot` fixes
  its state at T0 as a :class:`.TableSnapshot`, read in bounded steps while lookups and updates go on,
  each keeping first what the snapshot has yet to read (:mod:`.store_snapshot`).

``_incremental = False`` on a table turns the first two off (the tests' and benchmarks' reference).

Each public call runs one numba kernel (a training lookup may stop to grow the arrays or to list
eviction candidates, then go on); an update runs two (gather-and-sum, then the optimizer kernel of
:mod:`.optim`), kept apart because numba's on-disk cache does not notice edits to a kernel in another
module.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
from persia_nats.common.errors import BadRequest, ConfigError, Conflict
from persia_nats.common.optim_config import AdagradConfig, AdamConfig, EmbeddingHyperparams, OptimizerConfig, SGDConfig
from persia_nats.core import optim
from persia_nats.core import table_kernels as tk
from persia_nats.core.hugepages import commit_in_background, huge_empty, reserve
from persia_nats.core.store_snapshot import Hooks, TableSnapshot

__all__ = ["EmbeddingStore", "EmbeddingTable"]

_STATE_KINDS = ("none", "sgd_momentum", "adagrad", "adagrad_shared", "adam")
_NO_CANDIDATES = np.empty(0, np.uint64)


def _state_kind(cfg: OptimizerConfig | None) -> str:
    if isinstance(cfg, SGDConfig) and cfg.momentum > 0:
        return "sgd_momentum"
    if isinstance(cfg, AdagradConfig):
        return "adagrad_shared" if cfg.vectorwise_shared else "adagrad"
    return "adam" if isinstance(cfg, AdamConfig) else "none"


def _kind_width(kind: str, dim: int) -> int:
    return {"none": 0, "sgd_momentum": dim, "adagrad": dim, "adagrad_shared": 1, "adam": 2 * dim + 1}[kind]


def _check_ids(ids: Any) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        what = f"{ids.dtype} array of shape {ids.shape}" if isinstance(ids, np.ndarray) else type(ids).__name__
        raise BadRequest(f"ids must be a 1-D uint64 array, got {what}")
    return np.ascontiguousarray(ids)


def _check_grads(grads: Any, n: int, dim: int | None) -> np.ndarray:
    if not isinstance(grads, np.ndarray) or grads.dtype.kind != "f" or grads.ndim != 2:
        what = f"{grads.dtype} array of shape {grads.shape}" if isinstance(grads, np.ndarray) else type(grads).__name__
        raise BadRequest(f"gradients must be a 2-D float array, got {what}")
    if grads.shape[0] != n or (dim is not None and grads.shape[1] != dim):
        raise BadRequest(f"gradients must have shape ({n}, {dim if dim is not None else 'dim'}), got {grads.shape}")
    if grads.dtype == np.float32:
        return np.ascontiguousarray(grads)
    with np.errstate(over="ignore"):  # float64 beyond float32 range becomes inf, refused as non-finite
        return grads.astype(np.float32, order="C")


def _check_optimizer(cfg: Any) -> OptimizerConfig:
    if not isinstance(cfg, (SGDConfig, AdagradConfig, AdamConfig)):
        raise ConfigError(f"not an embedding optimizer config: {type(cfg).__name__}")
    return cfg


def _check_hyper(hyper: Any) -> EmbeddingHyperparams:
    if not isinstance(hyper, EmbeddingHyperparams):
        raise ConfigError(f"hyper must be EmbeddingHyperparams, got {type(hyper).__name__}")
    return hyper


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


class EmbeddingTable:
    """All rows of one embedding width, with exact LRU eviction beyond ``capacity`` rows.

    Args:
        dim: Embedding width.
        capacity: Maximum number of rows; inserting beyond it evicts the least recently used row.
        optimizer: The embedding optimizer, or None until :meth:`set_optimizer` (updates refuse until then).
        hyper: Initialisation range, admission probability and weight bound.
        initial_rows: Rows allocated up front; the arrays double from here up to ``capacity``.

    Attributes:
        dim: Embedding width.
        capacity: Maximum number of rows.
    """

    def __init__(
        self,
        dim: int,
        capacity: int,
        optimizer: OptimizerConfig | None = None,
        hyper: EmbeddingHyperparams = EmbeddingHyperparams(),
        initial_rows: int = 1024,
    ) -> None:
        self.dim = _int("dim", dim, 1)
        self.capacity = _int("capacity", capacity, 1)
        self._initial_rows = min(_int("initial_rows", initial_rows, 1), self.capacity)
        self._slot_dtype = tk.SLOT32 if self.capacity < 2**31 - 1 else tk.SLOT64
        self._stamp_limit = tk.STAMP_LIMIT[self._slot_dtype]
        self._optimizer: OptimizerConfig | None = None
        self._kind = "none"
        self._fill = 0.0
        self._hyper = hyper
        self._meta = np.zeros(8, np.int64)
        self._cand_keys = self._cand_stamps = _NO_CANDIDATES
        self._snap: TableSnapshot | None = None
        self._incremental = True  # build candidate lists and doubled indexes ahead, in steps (off: as before)
        #: index doublings built ahead in steps and swapped in (the rest were rebuilt at once)
        self.growths_built_ahead = 0
        #: eviction candidate lists built ahead in steps and put to use (the rest came from a rescan)
        self.lists_built_ahead = 0
        self._reset_next()
        self._emb_space: np.ndarray | None = None
        self._state_space: np.ndarray | None = None
        self._emb: np.ndarray
        self._state: np.ndarray
        self._index: np.ndarray
        self._skey: np.ndarray
        self._srow: np.ndarray
        self._sstamp: np.ndarray
        self._allocate(self._initial_rows, 0)
        self._reset_grow()
        if optimizer is not None:
            self.set_optimizer(optimizer)
        self.set_hyper(hyper)

    def _allocate(self, rows: int, keep: int) -> None:
        """(Re)allocate for ``rows`` rows, keeping rows ``0..keep-1`` and their index entries.

        Growing (``keep`` > 0) widens the views of the row arrays' reservations and rebuilds only the
        index; a fresh allocation (``keep`` = 0, as a restore makes) takes reservations of its own, so
        that a refused restore leaves the table's rows untouched."""
        self._emb_space, emb = self._row_array(self._emb_space if keep else None,
                                               self._emb[:keep] if keep else None, rows, self.dim)
        self._state_space, state = self._row_array(self._state_space if keep else None,
                                                   self._state[:keep] if keep else None, rows,
                                                   _kind_width(self._kind, self.dim))
        index = huge_empty(tk.slot_count(rows), self._slot_dtype)
        fields = index["key"], index["row"], index["stamp"]
        if keep:
            tk.rehash(self._skey, self._srow, self._sstamp, *fields)
        else:
            index["row"] = -1
        self._emb, self._state, self._index = emb, state, index
        # Field views share the slots' memory; the kernels see them as strided arrays.
        self._skey, self._srow, self._sstamp = fields
        if not keep and self._emb_space is not None:
            # a table's first rows are committed by a thread now, not page by page as lookups first write
            # them (the state is filled whole when the optimizer is set); a growth's rows still commit as
            # they fill, so no memory is held for rows that may never come
            commit_in_background(emb)

    def _row_array(self, space: np.ndarray | None, old: np.ndarray | None, rows: int,
                   width: int) -> tuple[np.ndarray | None, np.ndarray]:
        """(its reservation or None, the array) for ``rows`` rows of ``width`` floats holding ``old``'s rows.

        Rows are reserved for the whole capacity where the platform allows (:func:`.hugepages.reserve`):
        a row's pages are committed when it is first written, and a growth neither copies the rows nor
        holds them twice. Without a reservation the rows are copied into a new array."""
        if space is None and old is None:
            space = reserve((self.capacity, width), np.float32)
        if space is not None:
            return space, space[:rows]
        new = huge_empty((rows, width), np.float32)
        if old is not None:
            new[: old.shape[0]] = old
        return None, new

    def _grow(self) -> None:
        rows = self._emb.shape[0]
        if self._grow_index is None or self._emb_space is None or self._state_space is None:
            self._reset_grow()
            self._allocate(min(2 * rows, self.capacity), rows)
            return
        while not self._advance_grow(1 << 62):  # what is left of it, if the lookups did not finish it
            pass
        new_rows = min(2 * rows, self.capacity)
        self._emb, self._state = self._emb_space[:new_rows], self._state_space[:new_rows]
        self._index = self._grow_index
        self._skey, self._srow, self._sstamp = self._index["key"], self._index["row"], self._index["stamp"]
        self._reset_grow()
        self.growths_built_ahead += 1

    def _reset_grow(self) -> None:
        """No doubled index under way: the kernels' mirroring into it off."""
        self._grow_index: np.ndarray | None = None
        empty = np.empty(0, self._slot_dtype)
        self._grow_fields = empty["key"], empty["row"], empty["stamp"]
        self._grow_meta = np.zeros(1, np.int64)
        self._grow_cleared = 0

    def _advance_grow(self, budget: int) -> bool:
        """Advance the doubled index by about ``budget`` slots of work; True once it holds every entry.

        First its slots are marked empty, then the old slots are copied in order. Below capacity nothing
        is deleted, so entries never move in the old index: one inserted or touched behind the cursor
        is mirrored by the kernel, one ahead of it copied later."""
        assert self._grow_index is not None
        new_row = self._grow_index["row"]
        if self._grow_cleared < new_row.shape[0]:
            stop = min(new_row.shape[0], self._grow_cleared + budget)
            new_row[self._grow_cleared: stop] = -1
            budget -= stop - self._grow_cleared
            self._grow_cleared = stop
            if budget <= 0:
                return False
        start = int(self._grow_meta[tk.GROW_CURSOR])
        stop = min(self._skey.shape[0], start + budget)
        tk.migrate(self._skey, self._srow, self._sstamp, start, stop, *self._grow_fields)
        self._grow_meta[tk.GROW_CURSOR] = stop
        return bool(stop == self._skey.shape[0])

    def _step_grow(self, ids: int) -> None:
        """After a training lookup of ``ids`` ids: start or advance the doubled index, from 3/4 full.

        The work left (slots to clear and to copy) is spread over the rows left to fill, twice as fast as
        needed (a lookup inserts at most one row an id), so the doubled index is ready about halfway to
        the rows running out, and the kernel mirrors changes into it only from then on for what is left.
        Where the rows cannot grow in place (no reservation: they are copied), :meth:`_grow` rebuilds."""
        rows, live = self._emb.shape[0], len(self)
        if self._grow_index is None:
            if (rows < self.capacity and live >= rows - rows // 4 and rows >= 1 << 16
                    and self._emb_space is not None and self._state_space is not None):
                self._grow_index = huge_empty(tk.slot_count(min(2 * rows, self.capacity)), self._slot_dtype)
                # committed by a thread while the lookups fill it, not page by page inside them
                commit_in_background(self._grow_index)
                self._grow_fields = self._grow_index["key"], self._grow_index["row"], self._grow_index["stamp"]
            return
        left = (self._grow_index.shape[0] - self._grow_cleared) + (self._skey.shape[0] - int(self._grow_meta[0]))
        if left:
            self._advance_grow(max(1 << 12, -(-2 * left * ids // max(1, rows - live))))

    def _reset_next(self) -> None:
        """No next candidate list under way: the kernels' hooks for it off."""
        self._nxt_meta = np.zeros(6, np.int64)
        self._nxt_keys = self._nxt_stamps = _NO_CANDIDATES
        self._nxt_sort: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._nxt_index: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._nxt_cursor = 0

    def _start_next(self) -> None:
        """Begin the next candidate list: every row stamped below a threshold T, as the rescan lists them.

        It is collected by a scan of a bounded number of slots per training lookup, while the current
        list still serves evictions (it starts half consumed), then radix-sorted in bounded steps. It
        collects only rows stamped above the current list's last stamp: the current list holds every
        row stamped up to it, and each is evicted or restamped before the list runs out. Rows
        stamped later all exceed T; entries an eviction shifts back across the scan's cursor are
        collected by the kernel first; entries touched or evicted after being collected are skipped
        when met, as stale entries of any list are. So once sorted it is the list a rescan at that
        moment would have made, plus stale entries, and eviction stays exact LRU without a stop."""
        live = int(self._meta[tk.LIVE])
        want = live // tk.CAND_SHARE + (self._cand_keys.shape[0] - int(self._meta[tk.CAND_POS]))
        limit = tk.sample_threshold(self._srow, self._sstamp, self._meta[tk.CLOCK], live, want)
        if limit < 0:
            return
        room = 2 * want  # as the rescan: a sample that misses by 2x gives up (the rescan is the fallback)
        self._nxt_keys, self._nxt_stamps = np.empty(room, np.uint64), np.empty(room, np.uint64)
        self._nxt_sort = np.empty(room, np.uint64), np.empty(room, np.uint64), np.empty(1 << 16, np.int64)
        self._nxt_index = self._skey, self._srow, self._sstamp
        low = int(self._cand_stamps[-1]) if self._cand_stamps.shape[0] else -1
        self._nxt_meta[:] = (0, limit + 1, 0, -1, 0, low)
        self._nxt_cursor = 0

    def _advance_next(self, budget: int) -> bool:
        """Advance the next candidate list by about ``budget`` slots or elements; True once it is ready."""
        m = self._nxt_meta
        if m[tk.NXT_PASS] < 0:
            assert self._nxt_index is not None
            skey, srow, sstamp = self._nxt_index
            stop = min(self._nxt_cursor + budget, skey.shape[0])
            tk.next_scan(skey, srow, sstamp, self._nxt_cursor, stop, m, self._nxt_keys, self._nxt_stamps)
            # the sort's arrays, faulted in alongside (in order, a bounded run a step): its scatter writes
            # them at random, and would fault every page in one step
            assert self._nxt_sort is not None
            room = self._nxt_keys.shape[0]
            ready = room * self._nxt_cursor // skey.shape[0]
            for arr in self._nxt_sort[:2]:
                arr[ready: room * stop // skey.shape[0]] = 0
            self._nxt_cursor = stop
            if m[tk.NXT_OVER]:
                self._reset_next()
                return False
            if stop == skey.shape[0]:
                self._nxt_index = None
                m[tk.NXT_PASS] = m[tk.NXT_POS] = 0
            return False
        assert self._nxt_sort is not None
        return bool(tk.next_sort_step(self._nxt_keys, self._nxt_stamps, *self._nxt_sort, m, budget))

    def _next_sorted(self) -> tuple[np.ndarray, np.ndarray]:
        """The next list's keys and stamps, sorted (by :meth:`_advance_next`, to the end)."""
        n = int(self._nxt_meta[tk.NXT_N])
        assert self._nxt_sort is not None
        if tk.sort_digits(self._nxt_meta[tk.NXT_LIMIT]) % 2:
            return self._nxt_sort[0][:n], self._nxt_sort[1][:n]
        return self._nxt_keys[:n], self._nxt_stamps[:n]

    def _step_next(self, ids: int) -> None:
        """After a training lookup of ``ids`` ids: start or advance the next candidate list. 32 slots an id
        outpaces the evictions (at most one an id): the scan of 1.5 slots a row ends before the current
        list's remaining half (live / 16 rows) runs out."""
        if self._nxt_meta[tk.NXT_LIMIT] == 0:
            listed, live = self._cand_keys.shape[0], len(self)
            # from half the current list consumed; the first list from the last 1/16 of the fill on
            due = 2 * int(self._meta[tk.CAND_POS]) >= listed if listed else live + live // 16 >= self.capacity
            if due and live >= 1 << 16 and live + live // 16 >= self.capacity:
                self._start_next()
            return
        self._advance_next(max(1 << 14, 32 * ids))

    def _list_candidates(self) -> None:
        """List the next eviction candidates (see :mod:`.table_kernels`)."""
        if self._nxt_meta[tk.NXT_LIMIT] > 0:
            # what is left of it, if the lookups did not finish it; an overflow ends it (then: rescan)
            while not self._advance_next(1 << 62) and self._nxt_meta[tk.NXT_LIMIT]:
                pass
            keys, stamps = self._next_sorted() if self._nxt_meta[tk.NXT_LIMIT] else (_NO_CANDIDATES,) * 2
            self._reset_next()
            if keys.shape[0]:
                self._cand_keys, self._cand_stamps = keys, stamps
                self._meta[tk.CAND_POS] = 0
                self.lists_built_ahead += 1
                return
        want = max(1, int(self._meta[tk.LIVE]) // tk.CAND_SHARE)
        self._cand_keys, self._cand_stamps = tk.select_candidates(
            self._skey, self._srow, self._sstamp, self._meta[tk.CLOCK], self._meta[tk.LIVE], want)
        self._meta[tk.CAND_POS] = 0

    def _renumber(self) -> None:
        """Renumber the stamps 0..len-1 in the same order, before the clock outgrows their width."""
        if self._snap is not None:
            self._snap.finish_scan()  # renumbered stamps no longer tell T0's entries apart
        self._meta[tk.CLOCK] = tk.renumber_stamps(self._srow, self._sstamp)
        self._reset_next()
        self._reset_grow()  # its copies hold the old stamps
        self._cand_keys = self._cand_stamps = _NO_CANDIDATES
        self._meta[tk.CAND_POS] = 0

    def set_optimizer(self, cfg: OptimizerConfig) -> None:
        """Register the optimizer for :meth:`update`.

        Re-registering an optimizer of the same kind (say, a new learning rate) keeps every row's
        state. A different kind of state (SGD momentum, Adagrad, Adagrad vectorwise, Adam, or none)
        reallocates the state of every stored row and initialises it as for a fresh row.
        """
        _check_optimizer(cfg)
        kind = _state_kind(cfg)
        if kind != self._kind and self._snap is not None:
            raise Conflict("a checkpoint dump is reading this table: the optimizer's kind of state cannot change now")
        if kind != self._kind:
            self._state_space, self._state = self._row_array(None, None, self._emb.shape[0],
                                                             _kind_width(kind, self.dim))
            self._state.fill(optim.state_fill_value(cfg))
            self._kind = kind
        self._optimizer = cfg
        self._fill = float(optim.state_fill_value(cfg))

    def set_hyper(self, hyper: EmbeddingHyperparams) -> None:
        """Set the initialisation range, admission probability and weight bound for what comes next."""
        self._hyper = _check_hyper(hyper)

    def lookup(self, ids: np.ndarray, train: bool) -> np.ndarray:
        """Return the rows of ``ids`` as a fresh float32 array of shape ``(len(ids), dim)``.

        A training lookup inserts unseen ids (each admitted with ``admit_probability``; a rejected id
        reads as zeros and is not stored) and moves every id it touches to the most recently used end,
        in the order the ids appear; inserting beyond capacity evicts the least recently used row. A
        new row starts uniform in ``[init_lower, init_upper]``, drawn from a splitmix64 stream seeded
        by the id alone, so an id always starts with the same vector. Admission draws are seeded by
        the id and the table's count of training lookups: reproducible, and an id refused once may
        still be admitted when it comes back (as in PERSIA, where each sighting draws afresh).
        An eval lookup changes nothing and reads unknown ids as zeros.

        Raises:
            BadRequest: ``ids`` is not a 1-D uint64 array.
        """
        ids = _check_ids(ids)
        out = np.empty((ids.shape[0], self.dim), np.float32)
        if not train:
            tk.lookup_eval(ids, self._skey, self._srow, self._emb, self._meta, out)
            return out
        return self._lookup_train(ids, out, self._hyper.admit_probability)

    def _lookup_train(self, ids: np.ndarray, out: np.ndarray, admit_probability: float) -> np.ndarray:
        if self._meta[tk.CLOCK] + ids.shape[0] >= self._stamp_limit:
            self._renumber()
        h = self._hyper
        start = 0
        while True:
            hooks = self._snap.kernel_args() if self._snap is not None else self._no_snapshot()
            start, why = tk.lookup_train(ids, start, self._skey, self._srow, self._sstamp, self._emb, self._state,
                                         self._meta, self._cand_keys, self._cand_stamps, self.capacity,
                                         h.init_lower, h.init_upper, admit_probability, self._fill, out, *hooks,
                                         self._nxt_keys, self._nxt_stamps, self._nxt_meta, *self._grow_fields,
                                         self._grow_meta)
            if start < 0:
                break
            if why == tk.GROW:
                self._grow()
            elif why == tk.COW and self._snap is not None:
                self._snap.new_block()
            else:
                self._list_candidates()
        if self._incremental:
            self._step_next(ids.shape[0])
            self._step_grow(ids.shape[0])
        self._meta[tk.SALT] += 1
        return out

    @property
    def state_kind(self) -> str:
        """Which optimizer's state the rows carry: ``none``, ``sgd_momentum``, ``adagrad``, ``adagrad_shared``
        or ``adam``."""
        return self._kind

    def upsert(self, keys: np.ndarray, emb: np.ndarray, state: np.ndarray | None, state_kind: str) -> int:
        """Set the rows of ``keys`` to ``emb`` and ``state``, inserting the keys not held: an incremental
        update applied (:mod:`.store_incremental`).

        Each key is touched as a training lookup touches it (inserted whatever ``admit_probability``, made
        the most recently used, evicting the least recently used beyond ``capacity``), then its vector and
        optimizer state are overwritten. ``state`` of another optimizer (``state_kind`` not this table's, or
        None) leaves the state as for a fresh row. Keys must not repeat.

        Returns:
            The rows written (fewer than ``len(keys)`` only when ``keys`` alone exceed ``capacity``).

        Raises:
            BadRequest: Wrong types or shapes; nothing is changed.
        """
        keys = _check_ids(keys)
        n = keys.shape[0]
        if not isinstance(emb, np.ndarray) or emb.dtype != np.float32 or emb.shape != (n, self.dim):
            raise BadRequest(f"emb must be a float32 array of shape {(n, self.dim)}")
        if not n:
            return 0
        self._lookup_train(keys, np.empty((n, self.dim), np.float32), 1.0)
        rows = tk.find_rows(keys, self._skey, self._srow)
        held = rows >= 0
        rows = rows[held]
        if self._snap is not None:
            self._snap.save_rows(rows, self._emb, self._state)
        self._emb[rows] = emb[held]
        width = self._state.shape[1]
        if (state is not None and state_kind == self._kind and state.dtype == np.float32
                and state.shape == (n, width)):
            self._state[rows] = state[held]
        elif width:
            self._state[rows] = self._fill
        return int(rows.shape[0])

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(which of ``ids`` the table holds, their rows, their optimizer state), in the order of ``ids``,
        changing nothing. An id not held has no row to read: it is left out, not read as zeros."""
        rows = tk.find_rows(_check_ids(ids), self._skey, self._srow)
        held = rows >= 0
        return held, self._emb[rows[held]], self._state[rows[held]]

    def update(self, ids: np.ndarray, grads: np.ndarray) -> int:
        """Apply one optimizer step to the stored rows of ``ids``; gradients of repeated ids are summed.

        Updates do not refresh recency. Ids not stored are skipped and counted.

        Args:
            ids: 1-D uint64 ids.
            grads: Gradients of shape ``(len(ids), dim)``, any float dtype (used as float32).

        Returns:
            The number of ids not found.

        Raises:
            Conflict: No optimizer is registered.
            BadRequest: Wrong types or shapes, or a non-finite gradient; nothing is changed.
        """
        if self._optimizer is None:
            raise Conflict("no embedding optimizer registered")
        ids = _check_ids(ids)
        grads = _check_grads(grads, ids.shape[0], self.dim)
        rows, sums, misses, bad = tk.gather_grads(ids, grads, self._skey, self._srow)
        if bad >= 0:
            where = f"for id {ids[bad]} at position {bad}" if bad < ids.shape[0] else "after summing duplicates"
            raise BadRequest(f"non-finite gradient {where}; no update applied")
        if self._snap is not None:
            self._snap.save_rows(rows, self._emb, self._state)
        optim.apply_update(self._optimizer, rows, sums, self._emb, self._state, self._hyper.weight_bound)
        self._meta[tk.GRAD_MISS] += misses
        return int(misses)

    def __len__(self) -> int:
        return int(self._meta[tk.LIVE])

    @property
    def evictions(self) -> int:
        """Rows evicted to make room (LRU), since creation or as restored by :meth:`load_state_dict`."""
        return int(self._meta[tk.EVICTIONS])

    @property
    def inserts(self) -> int:
        """Ids inserted by training lookups."""
        return int(self._meta[tk.INSERTS])

    @property
    def gradient_id_miss_count(self) -> int:
        """Gradient ids skipped by :meth:`update` because they were not stored."""
        return int(self._meta[tk.GRAD_MISS])

    @property
    def index_miss_count(self) -> int:
        """Looked-up ids that were not stored (inserted, refused admission, or read as zeros)."""
        return int(self._meta[tk.INDEX_MISS])

    def memory_bytes(self) -> int:
        """Bytes of memory the table holds: its live rows (vector and optimizer state) and every other array
        it allocated (the index, eviction candidate lists, a doubled index being built).

        The row arrays are views of a reservation for the whole capacity, or arrays of up to twice the live
        rows after a doubling; their pages are committed only as rows are first written, and rows are
        handed out in order, so the rows past the live ones take no memory. Counting them (as this figure
        did) put it at 1.4x the process's RSS growth at 5e6 rows; counting the live ones, 0.92x."""
        arrays = [self._index, self._meta, self._cand_keys, self._cand_stamps,
                  self._nxt_keys, self._nxt_stamps, *(self._nxt_sort or ())]
        if self._grow_index is not None:
            arrays.append(self._grow_index)
        rows = len(self) * (self._emb.itemsize * self._emb.shape[1] + self._state.itemsize * self._state.shape[1])
        return int(rows + sum(a.nbytes for a in arrays))

    def allocated_row_bytes(self) -> int:
        """Bytes of the row arrays' allocated rows, live or not: what :meth:`memory_bytes` leaves out."""
        return int(self._emb.nbytes + self._state.nbytes)

    def raw_bytes_per_row(self) -> int:
        """Key + vector + optimizer state of one row: the floor :meth:`memory_bytes` is measured against."""
        return 8 + 4 * self.dim + 4 * _kind_width(self._kind, self.dim)

    def _no_snapshot(self) -> Hooks:
        """The kernels' snapshot hooks, all off (an all-zero ``cow_meta``); dtypes as a live snapshot's."""
        return (_NO_CANDIDATES, np.empty(0, self._sstamp.dtype), np.empty(0, np.int64),
                np.empty((0, self.dim), np.float32), np.empty((0, self._state.shape[1]), np.float32),
                np.zeros(4, np.int64))

    @property
    def snapshot(self) -> TableSnapshot | None:
        """The snapshot a live dump is reading, if any (:meth:`begin_snapshot`)."""
        return self._snap

    def begin_snapshot(self) -> TableSnapshot:
        """Fix the table's state now (T0) as a :class:`.TableSnapshot`, read piecewise while training goes on.

        Until :meth:`end_snapshot`, training lookups and updates first keep what the snapshot still needs
        (see :mod:`.store_snapshot`): O(1) a touched or evicted entry, one row copy a row overwritten.

        Raises:
            Conflict: A snapshot is open already.
        """
        if self._snap is not None:
            raise Conflict("a snapshot of this table is open already")
        counters = {name: int(self._meta[slot]) for name, slot in tk.COUNTERS.items()}
        self._snap = TableSnapshot(len(self), int(self._meta[tk.CLOCK]), (self._skey, self._srow, self._sstamp),
                                   self.dim, self._state.shape[1], self._kind, self.capacity, counters)
        return self._snap

    def read_snapshot(self, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The open snapshot's next up to ``rows`` rows in T0's LRU order: (keys, vectors, state) as of T0."""
        if self._snap is None:
            raise Conflict("no snapshot of this table is open")
        return self._snap.read_step(rows, self._emb, self._state)

    def end_snapshot(self) -> None:
        """Close the snapshot (read to the end or abandoned): the hooks stop, its memory goes."""
        self._snap = None

    def state_dict(self) -> dict[str, Any]:
        """Copy the table's contents, rows in LRU order (least recently used first).

        Returns:
            ``keys`` (uint64 ``(n,)``), ``emb`` (float32 ``(n, dim)``), ``state`` (float32 ``(n, w)``),
            ``state_kind`` (which optimizer the state belongs to), ``dim``, ``capacity`` and the counters.
        """
        slots = tk.lru_slots(self._srow, self._sstamp)
        rows = self._srow[slots]
        out: dict[str, Any] = {"keys": self._skey[slots], "emb": self._emb[rows], "state": self._state[rows],
                               "state_kind": self._kind, "dim": self.dim, "capacity": self.capacity}
        out.update({name: int(self._meta[slot]) for name, slot in tk.COUNTERS.items()})
        return out

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Replace the table's contents with a :meth:`state_dict`, restoring values and LRU order.

        If more rows come than ``capacity`` allows, the least recently used ones are dropped (and counted
        as evictions). If the saved state belongs to a different optimizer than the registered one, it is
        initialised afresh, as :meth:`set_optimizer` would.

        Raises:
            BadRequest: The dict is malformed (missing keys, wrong dtypes or shapes, repeated keys);
                nothing is changed.
        """
        if not isinstance(d, dict):
            raise BadRequest(f"embedding table state must be a dict, got {type(d).__name__}")
        if self._snap is not None:
            raise Conflict("a checkpoint dump is reading this table: it cannot be replaced now")
        try:
            keys, emb, state, kind = d["keys"], d["emb"], d["state"], d["state_kind"]
            counters = {name: int(d.get(name, 0)) for name in tk.COUNTERS}
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"bad embedding table state: {exc!r}") from None
        keys = _check_ids(keys)
        n = keys.shape[0]
        if kind not in _STATE_KINDS:
            raise BadRequest(f"unknown state_kind {kind!r}")
        width = _kind_width(kind, self.dim)
        for name, arr, shape in (("emb", emb, (n, self.dim)), ("state", state, (n, width))):
            if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.shape != shape:
                raise BadRequest(f"{name} must be a float32 array of shape {shape}")
        drop = max(0, n - self.capacity)
        keys, emb, state, n = keys[drop:], emb[drop:], state[drop:], n - drop
        rows = self._initial_rows
        while rows < n:
            rows = min(2 * rows, self.capacity)
        new = EmbeddingTable.__new__(EmbeddingTable)
        new.__dict__.update(self.__dict__)
        new._kind = kind
        new._allocate(rows, 0)
        new._emb[:n], new._state[:n] = emb, state
        if tk.build_index(keys, new._skey, new._srow, new._sstamp) >= 0:
            raise BadRequest("keys repeat in the embedding table state")
        new._meta = np.zeros(8, np.int64)
        new._meta[[tk.LIVE, tk.CLOCK]] = n
        for name, slot in tk.COUNTERS.items():
            new._meta[slot] = counters[name]
        new._meta[tk.EVICTIONS] += drop
        new._cand_keys = new._cand_stamps = _NO_CANDIDATES
        new._reset_next()
        new._reset_grow()
        self.__dict__.update(new.__dict__)
        if self._optimizer is not None and _state_kind(self._optimizer) != kind:
            self.set_optimizer(self._optimizer)


class EmbeddingStore:
    """One :class:`EmbeddingTable` per embedding width, created by the first training lookup of that width.

    ``capacity`` bounds each table separately (PERSIA bounds the whole PS), so a replica holding
    tables of k widths may keep up to ``k * capacity`` rows.

    Args:
        capacity: Maximum rows per table.
        optimizer: The embedding optimizer, or None until :meth:`set_optimizer`.
        hyper: Initialisation range, admission probability and weight bound for every table.
        initial_rows: Rows each new table allocates up front.
        max_dim: Widest embedding accepted.
    """

    def __init__(
        self,
        capacity: int,
        optimizer: OptimizerConfig | None = None,
        hyper: EmbeddingHyperparams = EmbeddingHyperparams(),
        initial_rows: int = 1024,
        max_dim: int = 4096,
    ) -> None:
        self.capacity = _int("capacity", capacity, 1)
        self._initial_rows = _int("initial_rows", initial_rows, 1)
        self._max_dim = _int("max_dim", max_dim, 1)
        self._optimizer = None if optimizer is None else _check_optimizer(optimizer)
        self._hyper = _check_hyper(hyper)
        self._orphan_grad_misses = 0  # gradients for a width no table holds yet
        self.tables: dict[int, EmbeddingTable] = {}
        """The tables, by embedding width (read only: use the store's methods to change them)."""

    def _check_dim(self, dim: Any) -> int:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or not 1 <= dim <= self._max_dim:
            raise BadRequest(f"embedding dim must be an int in 1..{self._max_dim}, got {dim!r}")
        return int(dim)

    def lookup(self, ids: np.ndarray, dim: int, train: bool) -> np.ndarray:
        """Look up ``ids`` in the table of width ``dim``, as :meth:`EmbeddingTable.lookup`.

        Raises:
            BadRequest: ``dim`` is out of range or ``ids`` is not a 1-D uint64 array.
        """
        dim = self._check_dim(dim)
        table = self.tables.get(dim)
        if table is None:
            ids = _check_ids(ids)
            if not train:
                return np.zeros((ids.shape[0], dim), np.float32)
            table = self.tables[dim] = EmbeddingTable(dim, self.capacity, self._optimizer, self._hyper,
                                                      self._initial_rows)
        return table.lookup(ids, train)

    def read(self, ids: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Which of ``ids`` the table of width ``dim`` holds, and their rows and optimizer state, as
        :meth:`EmbeddingTable.read`."""
        dim = self._check_dim(dim)
        table = self.tables.get(dim)
        if table is None:
            ids = _check_ids(ids)
            return np.zeros(ids.shape[0], np.bool_), np.zeros((0, dim), np.float32), np.zeros((0, 0), np.float32)
        return table.read(ids)

    def update(self, ids: np.ndarray, grads: np.ndarray) -> int:
        """Apply gradients to the table of width ``grads.shape[1]``, as :meth:`EmbeddingTable.update`.

        Returns:
            The number of ids not found.

        Raises:
            Conflict: No optimizer is registered.
            BadRequest: Bad types, shapes or values; nothing is changed.
        """
        if self._optimizer is None:
            raise Conflict("no embedding optimizer registered")
        ids = _check_ids(ids)
        grads = _check_grads(grads, ids.shape[0], None)
        table = self.tables.get(self._check_dim(grads.shape[1]))
        if table is not None:
            return table.update(ids, grads)
        if not np.isfinite(grads).all():
            raise BadRequest("non-finite gradient; no update applied")
        self._orphan_grad_misses += ids.shape[0]
        return int(ids.shape[0])

    @property
    def optimizer(self) -> OptimizerConfig | None:
        """The registered optimizer (None until one is)."""
        return self._optimizer

    def upsert(self, keys: np.ndarray, dim: int, emb: np.ndarray, state: np.ndarray | None, state_kind: str) -> int:
        """Set the rows of ``keys`` in the table of width ``dim`` (created if missing), as
        :meth:`EmbeddingTable.upsert`; returns the rows written."""
        dim = self._check_dim(dim)
        table = self.tables.get(dim)
        if table is None:
            table = self.tables[dim] = EmbeddingTable(dim, self.capacity, self._optimizer, self._hyper,
                                                      self._initial_rows)
        return table.upsert(keys, emb, state, state_kind)

    def set_optimizer(self, cfg: OptimizerConfig) -> None:
        """Register the optimizer with every table, present and future (see :meth:`EmbeddingTable.set_optimizer`)."""
        _check_optimizer(cfg)
        for table in self.tables.values():
            table.set_optimizer(cfg)
        self._optimizer = cfg

    def set_hyper(self, hyper: EmbeddingHyperparams) -> None:
        """Set the hyperparameters of every table, present and future."""
        _check_hyper(hyper)
        for table in self.tables.values():
            table.set_hyper(hyper)
        self._hyper = hyper

    def stats(self) -> dict[str, Any]:
        """Rows per width and totals: rows, memory bytes, evictions, inserts and misses."""
        tables = self.tables.values()
        return {
            "rows": len(self),
            "rows_per_dim": {dim: len(t) for dim, t in self.tables.items()},
            "memory_bytes": sum(t.memory_bytes() for t in tables),
            "evictions": sum(t.evictions for t in tables),
            "inserts": sum(t.inserts for t in tables),
            "index_miss_count": sum(t.index_miss_count for t in tables),
            "candidate_lists_built_ahead": sum(t.lists_built_ahead for t in tables),
            "index_doublings_built_ahead": sum(t.growths_built_ahead for t in tables),
            "gradient_id_miss_count": self._orphan_grad_misses + sum(t.gradient_id_miss_count for t in tables),
        }

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables.values())


@functools.cache
def warm_up() -> float:
    """Compile the store's kernels (the first run after an install: several seconds) or load them from
    numba's cache (a fraction of a second), and return the seconds it took.

    A replica calls it before it serves: otherwise the first lookup and the first update of a job
    compile them while holding the store, and the first training steps stall behind them. The ids (and
    gradients) are read-only, as the wire delivers them: numba compiles a kernel once per kind of argument.
    """
    started = time.perf_counter()
    for cfg in (SGDConfig(lr=0.1), AdagradConfig(), AdamConfig()):
        store = EmbeddingStore(4, cfg, initial_rows=2)
        ids = np.arange(1, 9, dtype=np.uint64)  # twice the capacity: inserts, growth and eviction
        ids.flags.writeable = False
        store.lookup(ids, 2, True)
        store.lookup(ids, 2, False)
        store.read(ids, 2)
        store.update(ids, np.ones((8, 2), np.float32))
        grads = np.ones((8, 2), np.float32)
        grads.flags.writeable = False  # as the wire delivers float32 gradients
        store.update(ids, grads)
        # incremental updates: a delta's copy reads, and applying one upserts, keys of writable arrays
        keys = ids.copy()
        held, emb, state = store.read(keys, 2)
        store.upsert(keys[held], 2, emb, state, store.tables[2].state_kind)
        # a checkpoint dump's scan kernel and lookups with its hooks on, as a live dump runs them; and the
        # kernels building the next eviction candidate list (tables of 2^16 rows and more)
        for table in store.tables.values():
            table._start_next()
            while table._nxt_meta[tk.NXT_LIMIT] and not table._advance_next(1 << 20):
                pass
            table._reset_next()
            table._grow_index = huge_empty(tk.slot_count(2 * table._emb.shape[0]), table._slot_dtype)
            table._grow_fields = table._grow_index["key"], table._grow_index["row"], table._grow_index["stamp"]
            # a training lookup while the doubled index is built: its fields are strided views (numba's
            # layout "A", not the "C" of the empty ones), another compilation, which otherwise fell on the
            # first lookup after a table reached 3/4 of 2^16 rows (4.3 s, 21 s on a loaded machine)
            store.lookup(ids, 2, True)
            while not table._advance_grow(1 << 20):
                pass
            table._reset_grow()
            snap = table.begin_snapshot()
            store.lookup(ids, 2, True)
            snap.finish_scan()
            table.end_snapshot()
    return time.perf_counter() - started
