"""A consistent snapshot of one :class:`~persia_nats.core.store.EmbeddingTable`, read while the table keeps training.

**What the snapshot is.** :meth:`EmbeddingTable.begin_snapshot` fixes an instant T0 between two table
operations. The snapshot is exactly what :meth:`EmbeddingTable.state_dict` would have returned at T0: the
``live0`` rows held then, in their LRU order then, with their keys, vectors, optimizer state and counters
as they were then. Lookups, inserts, evictions, updates and growth go on meanwhile; none of them shows in
the snapshot, and the snapshot changes nothing they see.

**How, without copying the table.** Rows never move (a row number keeps its key until the key is
evicted, and growth keeps row numbers), so the snapshot is kept by row number, ``0..live0-1``, in two
phases:

1. *Keys and stamps.* A scan of the index as it was at T0, a bounded number of slots a step, records
   each entry still stamped before T0's clock (untouched since) by its row: ``mkey[row]``,
   ``mstamp[row]``. Entries that change before the scan reaches them are recorded by the kernels first
   (:mod:`.table_kernels`): a touch records the old stamp, an eviction records every entry of the
   victim's probe run (the deletion may shift any of them back across the cursor). A growth leaves the
   T0 index unchanged behind it (a new index is built), so the scan reads on from the old arrays. A
   stamp renumbering (once per ~4e9 touches) first finishes the scan in one go. Sorting ``mstamp``
   (in a thread: numpy's sort releases the GIL) gives the LRU order at T0.
2. *Rows.* The rows are read in that order, a bounded number a step, from the live arrays. A row the
   table is about to overwrite before it was read (an update, or an eviction handing it to a new key)
   has its values copied first into blocks of pre-images (``cow_pos[row]`` = position + 1; -1 once
   read); the step reading it takes the pre-image instead.

**Memory.** Per row of the snapshot: ``mkey`` 8 bytes, ``mstamp`` 4 (8 beyond 2^31 rows), ``cow_pos`` 8,
the sort's order 8 (``mstamp`` is freed once sorted): 24-28 bytes, 15-18% of a width-16 Adagrad row
with its index slots (160 bytes). Plus the T0 index while the scan runs after a growth, plus one
pre-image per row overwritten before it was read: a row updated many times is copied once, and no row
is copied after it was read. The per-row arrays are faulted in by bounded steps before the scan, so
no step pays for pages of the whole table.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from persia_nats.core import table_kernels as tk

__all__ = ["Hooks", "TableSnapshot"]

#: the kernels' snapshot arguments: mkey, mstamp, cow_pos, block emb, block state, cow_meta
Hooks = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]

#: rows a pre-image block holds; a full block stops a training lookup once, to add the next
BLOCK_ROWS = 16384


class TableSnapshot:
    """The state of one table at T0, read piecewise (see the module docstring). Built by the table.

    Args:
        live: Rows at T0.
        clock: The table's clock at T0: every stamp given before T0 is below it.
        index: The index's (key, row, stamp) field views at T0.
        dim: Embedding width.
        width: Optimizer state columns.
        state_kind: The optimizer state's kind at T0.
        capacity: The table's capacity.
        counters: The table's counters at T0.
    """

    def __init__(self, live: int, clock: int, index: tuple[np.ndarray, np.ndarray, np.ndarray], dim: int,
                 width: int, state_kind: str, capacity: int, counters: dict[str, int]) -> None:
        self.rows = live
        self.dim, self.width = dim, width
        self.state_kind, self.capacity, self.counters = state_kind, capacity, counters
        self._index: tuple[np.ndarray, np.ndarray, np.ndarray] | None = index
        self._scanned = 0
        self._faulted = 0
        # 4 KiB pages: on 2 MiB ones a first touch (the kernel zeroing, compacting) stalled a step 0.2 s
        self.mkey = np.empty(live, np.uint64)
        self.mstamp: np.ndarray | None = np.empty(live, index[2].dtype)
        self._no_stamps = np.empty(0, index[2].dtype)  # once sorted: same dtype, so no new kernel signature
        self.cow_pos = np.zeros(live, np.int64)
        self.cow_meta = np.zeros(4, np.int64)
        self.cow_meta[tk.SNAP_CLOCK] = clock if live else 0
        self.cow_meta[tk.COW_LIVE] = live
        self._blocks: list[tuple[np.ndarray, np.ndarray]] = []
        self._order: np.ndarray | None = None
        self._read = 0
        self.new_block()
        if not live:
            self._index = None

    # -- the kernels' view --------------------------------------------------------------------

    def kernel_args(self) -> Hooks:
        """(mkey, mstamp, cow_pos, block emb, block state, cow_meta) for :func:`.table_kernels.lookup_train`."""
        emb, state = self._blocks[-1]
        mstamp = self.mstamp if self.mstamp is not None else self._no_stamps
        return self.mkey, mstamp, self.cow_pos, emb, state, self.cow_meta

    def new_block(self) -> None:
        """Start the next block of pre-images (the current one is full)."""
        self.cow_meta[tk.COW_BASE] = len(self._blocks) * BLOCK_ROWS
        self._blocks.append((np.empty((BLOCK_ROWS, self.dim), np.float32),
                             np.empty((BLOCK_ROWS, self.width), np.float32)))

    @property
    def preimages(self) -> int:
        """Rows whose values were copied aside because the table overwrote them before they were read."""
        return int(self.cow_meta[tk.COW_SAVED])

    def nbytes(self) -> int:
        """Bytes this snapshot holds (its per-row arrays and pre-image blocks; not the T0 index it pins)."""
        arrays = [self.mkey, self.cow_pos] + [a for block in self._blocks for a in block]
        arrays += [a for a in (self.mstamp, self._order) if a is not None]
        return sum(a.nbytes for a in arrays)

    # -- phase 1: keys and stamps -------------------------------------------------------------

    @property
    def scanning(self) -> bool:
        return self._index is not None

    def scan_step(self, slots: int) -> bool:
        """Scan up to ``slots`` more slots of the T0 index; True once the whole index has been scanned."""
        if self._index is None:
            return True
        if self._faulted < self.rows:
            # The scan writes rows at random: its first step would fault in every page of the per-row
            # arrays at once (~270 ms at 1e7 rows). Touched here in order, a bounded run a step,
            # keeping what the kernels' hooks wrote already.
            part = slice(self._faulted, self._faulted + slots)
            for arr in (self.mkey, self.mstamp, self.cow_pos):
                assert arr is not None
                arr[part] |= 0
            self._faulted = min(self.rows, self._faulted + slots)
            return False
        skey, srow, sstamp = self._index
        assert self.mstamp is not None  # freed only by sort(), after the scan
        stop = min(self._scanned + slots, skey.shape[0])
        tk.snap_scan(skey, srow, sstamp, self._scanned, stop, self.cow_meta[tk.SNAP_CLOCK], self.mkey, self.mstamp)
        self._scanned = stop
        if stop == skey.shape[0]:
            self._index = None  # unpins an index a growth replaced
            self.cow_meta[tk.SNAP_CLOCK] = 0  # the kernels stop recording keys and stamps
        return self._index is None

    def finish_scan(self) -> None:
        """Scan the rest at once: before the table renumbers its stamps, which would hide T0's."""
        while not self.scan_step(1 << 62):  # the first call faults the arrays in, the second scans
            pass

    def sort(self) -> None:
        """Order the rows by their T0 stamps (LRU first). Touches only the snapshot's own arrays, so it may
        run in a thread while the table serves; call it once the scan is done."""
        assert self._index is None and self.mstamp is not None
        self._order = np.argsort(self.mstamp)  # stamps are distinct: any sort gives the one order
        self.mstamp = None

    # -- phase 2: rows -------------------------------------------------------------------------

    def save_rows(self, rows: np.ndarray, emb: np.ndarray, state: np.ndarray) -> None:
        """Copy aside the T0 values of those of ``rows`` (distinct) not read yet, before the table overwrites them."""
        rows = rows[rows < self.rows]
        rows = rows[self.cow_pos[rows] == 0]
        done = 0
        while done < rows.shape[0]:
            saved = int(self.cow_meta[tk.COW_SAVED])
            at = saved - int(self.cow_meta[tk.COW_BASE])
            if at == BLOCK_ROWS:
                self.new_block()
                continue
            take = rows[done: done + BLOCK_ROWS - at]
            block_emb, block_state = self._blocks[-1]
            block_emb[at: at + take.shape[0]] = emb[take]
            block_state[at: at + take.shape[0]] = state[take]
            self.cow_pos[take] = np.arange(saved + 1, saved + 1 + take.shape[0])
            self.cow_meta[tk.COW_SAVED] = saved + take.shape[0]
            done += take.shape[0]

    @property
    def remaining(self) -> int:
        """Rows not read yet."""
        return self.rows - self._read

    def read_step(self, rows: int, emb: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next up to ``rows`` rows in T0's LRU order: (keys, vectors, state), from the table's arrays
        ``emb`` and ``state`` or, where the table overwrote them since T0, from their pre-images."""
        assert self._order is not None, "sort() first"
        which = self._order[self._read: self._read + rows]
        self._read += which.shape[0]
        keys, out_emb, out_state = self.mkey[which], emb[which], state[which]
        pos = self.cow_pos[which]
        saved = np.flatnonzero(pos > 0)
        if saved.shape[0]:
            at = pos[saved] - 1
            block = at // BLOCK_ROWS
            for b in np.unique(block):
                sel = block == b
                block_emb, block_state = self._blocks[b]
                out_emb[saved[sel]] = block_emb[at[sel] % BLOCK_ROWS]
                out_state[saved[sel]] = block_state[at[sel] % BLOCK_ROWS]
        self.cow_pos[which] = -1
        return keys, out_emb, out_state

    def describe(self) -> dict[str, Any]:
        return {"rows": self.rows, "state_kind": self.state_kind, "state_width": self.width,
                "capacity": self.capacity, "counters": dict(self.counters)}
