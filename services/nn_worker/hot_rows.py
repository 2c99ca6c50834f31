"""The NN worker's copies of hot embedding rows, kept current without a request on the step's path.

With hot rows on (``embedding_worker_config.hot_row_min_count`` unset, the default, or > 0), a
training lookup returns the rows that need a fresh read (head ids) apart from the pooled sums, each
with the PS version it was read at (:class:`~persia_nats.common.messages.HotPart`), and every PS replica
publishes the new values of those rows after each update that touches them (``hot.rows.<i>``).
:class:`RowMirror` keeps the newest copy of
each such row from both sources; just before a batch is handed to training, :meth:`RowMirror.merge`
adds the newest copies into the slot outputs. A batch looked up several steps ahead thus trains on
head rows as fresh as the PS's last applied update, which is what a deep look-ahead otherwise loses.

Adding the PS's newest value still misses the gradients in flight: sent by this rank or another for
earlier batches, not yet applied by the PS. So each NN rank also publishes its gradient of a batch's
hot rows (``hot.grads.<rank>``) just before sending the batch's gradients; every rank keeps such
gradients as pending until the PS publishes the rows of that update, and applies the pending ones,
with the job's embedding optimizer, to a copy of each row whose published value and optimizer state
it holds. A batch then trains on hot rows that include every gradient sent before it, as in sync mode,
while the PS stays the only place where rows are stored.

The mirror is a cache: a lost publication leaves an older copy that the next lookup or publication
replaces (versions decide, so a late message never overwrites a newer value). It holds at most
``max_bytes`` of rows, optimizer state and index (``nn_worker_config.hot_row_cache_bytes``), in numpy
arrays per dim, whatever the rows' width; rows beyond that are served from the lookup's own copy.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence

import numba
import numpy as np
from persia_nats.common.messages import GatheredSlots, HotGrads, HotPart, HotRows, SlotEmbedding
from persia_nats.common.optim_config import OptimizerConfig
from persia_nats.core.lookup import expand, expand_deferred, frozen
from persia_nats.core.optim import apply_update
from persia_nats.core.plan import add_adjoint_slots, add_pooled_slots
from persia_nats.core.table_kernels import find_slot, slot_count

log = logging.getLogger(__name__)

#: 64 MiB: some 400,000 rows at dim 16 with Adagrad state
DEFAULT_MAX_BYTES = 64 << 20
#: index bytes per row: two probe slots (key, row) of 16 bytes each
_INDEX_BYTES_PER_ROW = 32
#: gradients kept waiting for their publication; more means publications are being lost
MAX_PENDING_UPDATES = 64
_NO_STATE = np.zeros((1, 1), np.float32)


@functools.cache
def _warm_up() -> None:
    """Load (or compile) the kernels for this module's index types now, at start-up, rather than
    inside the first training step."""
    one, row = frozen(np.zeros(1), np.int32), np.zeros((1, 1), np.float32)
    fixed, scale, offsets = frozen(row, np.float32), frozen(np.zeros(1), np.float32), frozen(np.zeros(1), np.int64)
    add_pooled_slots(row, fixed, one, one, scale, one, offsets)
    add_adjoint_slots(fixed, one, one, scale, one, offsets, np.float32(1), row)
    table, ids, versions = _Table(1, 2), frozen(np.ones(1), np.uint64), frozen(np.ones(1), np.int64)
    _absorb(ids, frozen(row, np.float32), versions, frozen(row, np.float32), True, 1, table.skey, table.srow,
            table.ids, table.rows, table.versions, table.state, table.has_state, 0)
    _newest(ids, versions, table.skey, table.srow, table.rows, table.versions, row, np.zeros(1, np.int64))
    _unsettled(ids, ids)
    _matches(ids, ids)


_NEVER = np.iinfo(np.int64).min  # the version of a row slot before any copy


@numba.njit(cache=True)
def _absorb(ids, rows, versions, state, with_state, limit, skey, srow, t_ids, t_rows, t_versions, t_state, t_has, n):
    """Take each copy newer than the row's held one; add unknown ids while fewer than ``limit`` rows
    are held. Returns (rows held, ids not kept)."""
    not_kept = 0
    for i in range(ids.shape[0]):
        r, s = find_slot(skey, srow, ids[i])
        if r < 0:
            if n >= limit:
                not_kept += 1
                continue
            r = n
            n += 1
            skey[s], srow[s], t_ids[r], t_versions[r] = ids[i], r, ids[i], _NEVER
        if versions[i] <= t_versions[r]:
            continue
        t_rows[r, :] = rows[i, :]
        t_versions[r] = versions[i]
        t_has[r] = with_state
        if with_state:
            t_state[r, :] = state[i, :]
    return n, not_kept


@numba.njit(cache=True)
def _newest(ids, versions, skey, srow, t_rows, t_versions, out, pos):
    """``out[i]``: the held copy of ``ids[i]`` (``pos[i]`` its row, -1 when not held); returns how many
    held copies are newer than ``versions``."""
    fresher = 0
    for i in range(ids.shape[0]):
        r = find_slot(skey, srow, ids[i])[0]
        pos[i] = r
        if r >= 0:
            fresher += t_versions[r] > versions[i]
            out[i, :] = t_rows[r, :]
    return fresher


@numba.njit(cache=True)
def _reindex(t_ids, n, skey, srow):
    srow[:] = -1
    for r in range(n):
        s = find_slot(skey, srow, t_ids[r])[1]
        skey[s], srow[s] = t_ids[r], r


@numba.njit(cache=True)
def _matches(e_ids, ids):
    """(positions in ``ids``, positions in ``e_ids`` (sorted)) of the ids both hold."""
    at = np.empty(ids.shape[0], np.int64)
    of = np.empty(ids.shape[0], np.int64)
    n = 0
    for i in range(ids.shape[0]):
        p = np.searchsorted(e_ids, ids[i])
        if p < e_ids.shape[0] and e_ids[p] == ids[i]:
            at[n], of[n] = i, p
            n += 1
    return at[:n], of[:n]


@numba.njit(cache=True)
def _unsettled(e_ids, ids):
    """Which of ``e_ids`` (sorted) are not among ``ids``."""
    keep = np.ones(e_ids.shape[0], np.bool_)
    for i in range(ids.shape[0]):
        p = np.searchsorted(e_ids, ids[i])
        if p < e_ids.shape[0] and e_ids[p] == ids[i]:
            keep[p] = False
    return keep


class _Table:
    """One dim's rows in arrays, found through an open-addressing index (the PS's probing), so a
    batch's rows are read or replaced in one compiled pass; grown by doubling up to the mirror's
    bound."""

    __slots__ = ("n", "skey", "srow", "ids", "rows", "versions", "state", "has_state")

    def __init__(self, dim: int, capacity: int) -> None:
        self.n = 0
        self.ids = np.empty(0, np.uint64)
        self.rows = np.empty((0, dim), np.float32)
        self.versions = np.empty(0, np.int64)
        #: optimizer state, known for rows whose newest copy came from a PS publication
        self.state = np.empty((0, 0), np.float32)
        self.has_state = np.empty(0, np.bool_)
        self.skey = np.empty(0, np.uint64)
        self.srow = np.empty(0, np.int64)
        self.grow(capacity)

    @property
    def capacity(self) -> int:
        return self.ids.shape[0]

    def grow(self, capacity: int) -> None:
        n = self.n

        def keep(arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
            out = np.zeros(shape, arr.dtype)
            out[:n] = arr[:n]
            return out

        self.ids = keep(self.ids, (capacity,))
        self.rows = keep(self.rows, (capacity, self.rows.shape[1]))
        self.versions = keep(self.versions, (capacity,))
        self.state = keep(self.state, (capacity, self.state.shape[1]))
        self.has_state = keep(self.has_state, (capacity,))
        self.skey = np.zeros(slot_count(capacity), np.uint64)
        self.srow = np.full(slot_count(capacity), -1, np.int64)
        _reindex(self.ids, n, self.skey, self.srow)


def _row_bytes(dim: int, state_width: int) -> int:
    return 4 * (dim + state_width) + 8 + 8 + 1 + _INDEX_BYTES_PER_ROW


class RowMirror:
    """Newest known value of each hot row, per embedding dim."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, counters: Counter[str] | None = None,
                 optimizer: tuple[OptimizerConfig, float] | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._tables: dict[int, _Table] = {}
        #: the job's embedding optimizer and weight bound (the training context's); without it no
        #: pending gradient is applied
        self.optimizer = optimizer
        #: update id -> dim -> (ids sorted, gradients): gradients sent, their rows not yet published
        self._pending: OrderedDict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = OrderedDict()
        self._published: OrderedDict[str, None] = OrderedDict()
        #: rank -> how many batches' hot-row gradients it has announced (``seq`` of its last message)
        self.sent_by: dict[int, int] = {}
        #: ``hot_batches``, ``hot_rows_read``, ``hot_rows_fresher`` (a newer copy than the lookup's was
        #: used), ``hot_publications``, ``hot_rows_not_kept`` (the mirror was full), ``hot_grads``
        #: (announced gradients taken), ``hot_row_corrections`` (pending gradients applied to a row),
        #: ``hot_grads_late`` (announced after their publication: not applied), ``hot_grads_expired``
        #: (dropped unpublished: a failed update or a lost publication), ``hot_corrections_failed``
        self.counters: Counter[str] = Counter() if counters is None else counters

    def __len__(self) -> int:
        return sum(t.n for t in self._tables.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays the tables allocated (rows, state, ids, versions, index)."""
        return sum(t.capacity * _row_bytes(t.rows.shape[1], t.state.shape[1]) for t in self._tables.values())

    @staticmethod
    def warm_up() -> float:
        """Load the compiled kernels now (about 0.4 s of CPU), for a job that will use hot rows: not
        in the I/O loop at its first hot batch, and not at all in a job without them. Returns the
        seconds it took (0 once loaded), as the PS's and the embedding worker's warm-ups do."""
        started = time.perf_counter()
        _warm_up()
        return time.perf_counter() - started

    def absorb(self, ids: np.ndarray, rows: np.ndarray, versions: np.ndarray, state: np.ndarray | None = None
               ) -> None:
        """Keep each row's copy when it is newer than the one held (rows (n, dim)).

        ``state``: the rows' optimizer state, sent with a PS publication; a copy without it (a lookup's)
        leaves the row's state unknown.
        """
        if ids.shape[0] == 0:
            return
        dim = rows.shape[1]
        table = self._tables.get(dim)
        state_width = state.shape[1] if state is not None else table.state.shape[1] if table is not None else 0
        # the rows this dim's table may reach: its own allocation plus what the other tables leave free
        others = self.nbytes - (table.capacity * _row_bytes(dim, table.state.shape[1]) if table is not None else 0)
        limit = max(self.max_bytes - others, 0) // _row_bytes(dim, state_width)
        if table is not None and state_width != table.state.shape[1] and table.capacity > limit:
            del self._tables[dim]  # wider state would not fit this allocation: start the dim's table afresh
            table = None
        if table is None:
            if limit == 0:
                self.counters["hot_rows_not_kept"] += int(ids.shape[0])
                return
            table = self._tables[dim] = _Table(dim, min(limit, max(1024, ids.shape[0])))
        limit = max(limit, table.n)
        if table.n + ids.shape[0] > table.capacity and table.capacity < limit:
            table.grow(min(limit, max(2 * table.capacity, table.n + ids.shape[0])))
        if state is not None and state.shape[1] != table.state.shape[1]:
            # first publication, or another optimizer: what was known of the state no longer fits
            table.state = np.zeros((table.capacity, state.shape[1]), np.float32)
            table.has_state[:] = False
        table.n, not_kept = _absorb(
            frozen(ids, np.uint64), frozen(rows, np.float32), frozen(versions, np.int64),
            frozen(_NO_STATE if state is None else state, np.float32), state is not None,
            min(limit, table.capacity), table.skey, table.srow, table.ids, table.rows, table.versions,
            table.state, table.has_state, table.n)
        if not_kept:
            self.counters["hot_rows_not_kept"] += int(not_kept)

    def newest(self, ids: np.ndarray, rows: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` as of now: the newest copy known, plus the gradients still in flight.

        ``rows`` and ``versions``: a lookup's copies. Where a PS publication is newer, its value is
        taken, and where its optimizer state is known too, the pending gradients of other updates
        (:meth:`on_hot_grads`) are applied to it with the job's optimizer (:attr:`optimizer`).
        """
        self.absorb(ids, rows, versions)
        table = self._tables.get(rows.shape[1])
        if table is None:
            return rows
        out = np.array(rows, np.float32)
        pos = np.empty(ids.shape[0], np.int64)
        fresher = _newest(frozen(ids, np.uint64), frozen(versions, np.int64), table.skey, table.srow, table.rows,
                          table.versions, out, pos)
        self.counters["hot_rows_read"] += int(ids.shape[0])
        self.counters["hot_rows_fresher"] += int(fresher)
        if self._pending and self.optimizer is not None:
            known = np.flatnonzero(pos >= 0)
            known = known[table.has_state[pos[known]]]
            if known.size:
                out[known] = self._in_flight(rows.shape[1], ids[known], out[known], table.state[pos[known]])
        return out

    def _in_flight(self, dim: int, ids: np.ndarray, rows: np.ndarray, state: np.ndarray) -> np.ndarray:
        """``rows`` (with their optimizer ``state``) after the pending gradients of ``ids``, oldest first."""
        assert self.optimizer is not None
        cfg, bound = self.optimizer
        at_parts, grad_parts = [], []
        for entry in self._pending.values():
            part = entry.get(dim)
            if part is None:
                continue
            e_ids, e_grads = part
            at, of = _matches(frozen(e_ids, np.uint64), frozen(ids, np.uint64))
            if at.size:
                at_parts.append(at)
                grad_parts.append(e_grads[of])
        if not at_parts:
            return rows
        emb, state = rows.copy(), state.copy()
        at = np.concatenate(at_parts)
        try:
            # one call for every pending update: a row listed again gets its next step after the
            # previous one, in the order the updates were sent, as separate calls would apply them
            apply_update(cfg, at, np.concatenate(grad_parts), emb, state, bound)
        except (ValueError, TypeError) as exc:  # a state that does not fit the optimizer: no correction
            self.counters["hot_corrections_failed"] += 1
            log.warning("pending gradients of hot rows not applied: %s", exc)
            return rows
        self.counters["hot_row_corrections"] += int(at.size)
        return emb

    def merge(self, embeddings: Sequence[SlotEmbedding], hot: HotPart, gathered: Sequence[GatheredSlots] = ()
              ) -> tuple[SlotEmbedding, ...]:
        """The slot outputs with the hot rows added back, each at the newest value known now
        (:func:`persia_nats.core.lookup.expand`)."""
        out = expand(embeddings, gathered, hot, [self.newest(g.ids, g.rows, g.versions) for g in hot.groups])
        self.counters["hot_batches"] += 1
        return out

    def merge_deferred(self, embeddings: Sequence[SlotEmbedding], hot: HotPart, gathered: Sequence[GatheredSlots]
                       ) -> tuple[tuple[SlotEmbedding, ...], tuple[GatheredSlots, ...]]:
        """:meth:`merge` with the gathered widths' slots left to the model's device: the reply's own slots and
        the gathered widths, hot rows at the newest values known now
        (:func:`persia_nats.core.lookup.expand_deferred`)."""
        out = expand_deferred(embeddings, gathered, hot, [self.newest(g.ids, g.rows, g.versions) for g in hot.groups])
        self.counters["hot_batches"] += 1
        return out

    def on_published(self, msg: HotRows) -> None:
        """A PS replica's ``hot.rows.<i>`` message (decoded and checked: :class:`HotRows`)."""
        update_id = msg.update_id
        for g in msg.groups:
            self.absorb(g.ids, g.rows, np.full(g.ids.shape[0], msg.version, dtype=np.int64), g.state)
            if update_id is not None:
                # rows the PS no longer held took no step: their part of the update is over too
                gone = g.gone
                self._settle(update_id, g.rows.shape[1],
                             np.concatenate([g.ids, gone]) if gone is not None and gone.size else g.ids)
        if update_id is not None:
            self._published[update_id] = None
            while len(self._published) > 4 * MAX_PENDING_UPDATES:
                self._published.popitem(last=False)
        self.counters["hot_publications"] += 1

    def _settle(self, update_id: str, dim: int, ids: np.ndarray) -> None:
        """The PS applied ``update_id`` to ``ids``: their part of it is no longer in flight."""
        entry = self._pending.get(update_id)
        if entry is None or dim not in entry:
            return
        e_ids, e_grads = entry[dim]
        keep = _unsettled(frozen(e_ids, np.uint64), frozen(ids, np.uint64))
        if keep.any():
            entry[dim] = (e_ids[keep], e_grads[keep])
        else:
            del entry[dim]
            if not entry:
                del self._pending[update_id]

    def on_hot_grads(self, msg: HotGrads) -> None:
        """An NN rank's ``hot.grads.<rank>``: a batch's gradient of its hot rows, in flight until published."""
        self.add_pending(msg.update_id, {g.dim: (g.ids, g.grads) for g in msg.groups})
        self.sent_by[msg.rank] = max(self.sent_by.get(msg.rank, 0), msg.seq)

    def add_pending(self, update_id: str, entry: Mapping[int, tuple[np.ndarray, np.ndarray]]) -> None:
        """Gradients of hot rows sent for ``update_id`` (per dim: ids, gradients), until the PS publishes them."""
        if update_id in self._published:
            # its rows were published before the gradient arrived: already in the copies held
            self.counters["hot_grads_late"] += 1
            return
        if not entry:
            return
        sorted_entry = {}
        for dim, (ids, grads) in entry.items():
            order = np.argsort(ids)
            sorted_entry[dim] = (ids[order], grads[order])
        self._pending[update_id] = sorted_entry
        self._pending.move_to_end(update_id)
        while len(self._pending) > MAX_PENDING_UPDATES:
            self._pending.popitem(last=False)
            self.counters["hot_grads_expired"] += 1
        self.counters["hot_grads"] += 1

    def forget(self, update_id: str) -> None:
        """``update_id`` will not be applied (its push failed): stop applying its gradients."""
        if self._pending.pop(update_id, None) is not None:
            self.counters["hot_grads_forgotten"] += 1

    @property
    def pending(self) -> int:
        """Updates whose hot-row gradients are known here and not yet published by the PS."""
        return len(self._pending)
