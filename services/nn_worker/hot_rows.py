"""The NN worker's copies of hot embedding rows, kept current without a request on the step's path.

With ``embedding_worker_config.hot_row_min_count`` set, a training lookup returns the rows a batch
reads many times (head ids) apart from the pooled sums, each with the PS version it was read at
(:class:`~common.messages.HotPart`), and every PS replica publishes the new values of those rows
after each update that touches them (``hot.rows.<i>``). :class:`RowMirror` keeps the newest copy of
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
``max_rows`` rows, in numpy arrays per dim; rows beyond that are served from the lookup's own copy.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from common.codec import array_from_wire
from common.errors import BadRequest
from common.messages import HotPart, SlotEmbedding, SlotGradient
from common.optim_config import OptimizerConfig
from services.embedding_ps.optim import apply_update
from services.embedding_worker.plan import add_adjoint, add_pooled

log = logging.getLogger(__name__)

#: about 4 MiB of float32 rows at dim 16
DEFAULT_MAX_ROWS = 1 << 16
#: gradients kept waiting for their publication; more means publications are being lost
MAX_PENDING_UPDATES = 64


def _warm_up() -> None:
    """Load (or compile) the kernels for this module's index types now, at start-up, rather than
    inside the first training step."""
    one, row = np.zeros(1, np.int32), np.zeros((1, 1), np.float32)
    add_pooled(row, row, one, one, np.zeros(1, np.float32))
    add_adjoint(row, one, one, np.zeros(1, np.float32), row)


def _float32(arr: np.ndarray) -> np.ndarray:
    """A writable float32 copy; torch converts float16 four times faster than numpy's astype."""
    if arr.dtype == np.float32:
        return arr.copy()
    return torch.from_numpy(np.array(arr)).float().numpy()  # np.array: wire arrays are read-only views


def hot_row_grads(hot: HotPart, grads: Sequence[SlotGradient], loss_scale: float
                  ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """A batch's gradient of each hot row, ``{dim: (ids, grads)}``, as the embedding worker computes it.

    Slots whose gradient is not finite are left out, as the embedding worker skips them.
    """
    by_name = {g.name: g for g in grads}
    out = [np.zeros((g.ids.shape[0], g.dim), np.float32) for g in hot.groups]
    ends = np.cumsum(hot.counts)
    for k, name in enumerate(hot.slots):
        g = by_name.get(name)
        if g is None:
            continue
        grad = _float32(g.grad)
        if not np.isfinite(grad).all():
            continue
        lo, hi = int(ends[k] - hot.counts[k]), int(ends[k])
        scale = hot.scale[lo:hi] / np.float32(loss_scale) if loss_scale != 1.0 else hot.scale[lo:hi]
        add_adjoint(grad, hot.inv[lo:hi], hot.target[lo:hi], scale, out[int(hot.group[k])])
    return {g.dim: (g.ids, o) for g, o in zip(hot.groups, out, strict=True)}


class _Table:
    """One dim's rows, sorted by id, so a batch's rows are found with one ``searchsorted``."""

    __slots__ = ("ids", "rows", "versions", "state", "has_state")

    def __init__(self, dim: int) -> None:
        self.ids = np.empty(0, dtype=np.uint64)
        self.rows = np.empty((0, dim), dtype=np.float32)
        self.versions = np.empty(0, dtype=np.int64)
        #: optimizer state, known for rows whose newest copy came from a PS publication
        self.state = np.empty((0, 0), dtype=np.float32)
        self.has_state = np.empty(0, dtype=bool)

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions, found mask) of ``ids`` in the table."""
        pos = np.searchsorted(self.ids, ids)
        found = pos < self.ids.shape[0]
        found[found] = self.ids[pos[found]] == ids[found]
        return pos, found


class RowMirror:
    """Newest known value of each hot row, per embedding dim."""

    def __init__(self, max_rows: int = DEFAULT_MAX_ROWS, counters: Counter[str] | None = None) -> None:
        if max_rows < 0:
            raise ValueError(f"max_rows must be >= 0, got {max_rows}")
        self.max_rows = max_rows
        _warm_up()
        self._tables: dict[int, _Table] = {}
        #: the job's embedding optimizer and weight bound (set by the training context); without it no
        #: pending gradient is applied
        self.optimizer: tuple[OptimizerConfig, float] | None = None
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
        return sum(t.ids.shape[0] for t in self._tables.values())

    def absorb(self, ids: np.ndarray, rows: np.ndarray, versions: np.ndarray, state: np.ndarray | None = None
               ) -> None:
        """Keep each row's copy when it is newer than the one held (ids distinct, rows (n, dim)).

        ``state``: the rows' optimizer state, sent with a PS publication; a copy without it (a lookup's)
        leaves the row's state unknown.
        """
        if ids.shape[0] == 0:
            return
        dim = rows.shape[1]
        table = self._tables.get(dim)
        if table is None:
            table = self._tables[dim] = _Table(dim)
        if state is not None and state.shape[1] != table.state.shape[1]:
            # first publication, or another optimizer: what was known of the state no longer fits
            table.state = np.zeros((table.ids.shape[0], state.shape[1]), np.float32)
            table.has_state[:] = False
        pos, found = table.find(ids)
        at = pos[found]
        newer = versions[found] > table.versions[at]
        table.rows[at[newer]] = rows[found][newer]
        table.versions[at[newer]] = versions[found][newer]
        table.has_state[at[newer]] = state is not None
        if state is not None:
            table.state[at[newer]] = state[found][newer]
        new = np.flatnonzero(~found)
        if not new.size:
            return
        room = max(self.max_rows - len(self), 0)
        if new.size > room:
            self.counters["hot_rows_not_kept"] += int(new.size - room)
            new = new[:room]
            if not new.size:
                return
        all_ids = np.concatenate([table.ids, ids[new]])
        order = np.argsort(all_ids, kind="stable")
        table.ids = all_ids[order]
        table.rows = np.concatenate([table.rows, rows[new]])[order]
        table.versions = np.concatenate([table.versions, versions[new]])[order]
        added = state[new] if state is not None else np.zeros((new.size, table.state.shape[1]), np.float32)
        table.state = np.concatenate([table.state, added])[order]
        table.has_state = np.concatenate([table.has_state, np.full(new.size, state is not None)])[order]

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
        pos, found = table.find(ids)
        at = pos[found]
        fresher = table.versions[at] > versions[found]
        self.counters["hot_rows_read"] += int(ids.shape[0])
        self.counters["hot_rows_fresher"] += int(fresher.sum())
        out = rows.copy()
        out[found] = table.rows[at]
        if self._pending and self.optimizer is not None:
            known = np.flatnonzero(found)[table.has_state[at]]
            if known.size:
                out[known] = self._in_flight(rows.shape[1], ids[known], out[known], table.state[pos[known]])
        return out

    def _in_flight(self, dim: int, ids: np.ndarray, rows: np.ndarray, state: np.ndarray) -> np.ndarray:
        """``rows`` (with their optimizer ``state``) after the pending gradients of ``ids``, oldest first."""
        assert self.optimizer is not None
        cfg, bound = self.optimizer
        emb, state = rows.copy(), state.copy()
        for entry in self._pending.values():
            part = entry.get(dim)
            if part is None:
                continue
            e_ids, e_grads = part
            p = np.searchsorted(e_ids, ids)
            hit = p < e_ids.shape[0]
            hit[hit] = e_ids[p[hit]] == ids[hit]
            if not hit.any():
                continue
            try:
                apply_update(cfg, np.flatnonzero(hit), e_grads[p[hit]], emb, state, bound)
            except (ValueError, TypeError) as exc:  # a state that does not fit the optimizer: no correction
                self.counters["hot_corrections_failed"] += 1
                log.warning("pending gradients of hot rows not applied: %s", exc)
                return rows
            self.counters["hot_row_corrections"] += int(hit.sum())
        return emb

    def merge(self, embeddings: Sequence[SlotEmbedding], hot: HotPart) -> tuple[SlotEmbedding, ...]:
        """The slot outputs with the hot rows added back, each at the newest value known now."""
        rows = [self.newest(g.ids, g.rows, g.versions) for g in hot.groups]
        ends = np.cumsum(hot.counts)
        at = {name: k for k, name in enumerate(hot.slots)}
        out = []
        for e in embeddings:
            k = at.get(e.name)
            if k is not None:
                lo, hi = int(ends[k] - hot.counts[k]), int(ends[k])
                emb = _float32(e.emb)
                # a compiled loop between two steps, while the training thread waits for the batch:
                # a tenth of np.add.at's time, and no torch op contending with the training thread
                add_pooled(emb, rows[int(hot.group[k])], hot.inv[lo:hi], hot.target[lo:hi], hot.scale[lo:hi])
                e = SlotEmbedding(e.name, emb, e.index)
            out.append(e)
        self.counters["hot_batches"] += 1
        return tuple(out)

    def on_published(self, msg: Mapping[str, Any]) -> None:
        """A PS replica's ``hot.rows.<i>`` message: ``{v, replica, version, update_id, groups: [{ids, rows, state}]}``.

        Raises:
            BadRequest: the message is malformed; nothing was taken from it.
        """
        version = msg.get("version")
        groups = msg.get("groups")
        update_id = msg.get("update_id")
        if isinstance(version, bool) or not isinstance(version, int) or not isinstance(groups, list) \
                or not (update_id is None or isinstance(update_id, str)):
            raise BadRequest("published rows: expected an int 'version', a list 'groups' and a str 'update_id'")
        parsed = []
        for k, g in enumerate(groups):
            if not isinstance(g, Mapping):
                raise BadRequest(f"published rows: groups[{k}]: expected a map")
            ids = array_from_wire(g.get("ids"), f"groups[{k}].ids", dtype="<u8", ndim=1)
            rows = array_from_wire(g.get("rows"), f"groups[{k}].rows", dtype="<f4", ndim=2)
            state = None
            if g.get("state") is not None:
                state = array_from_wire(g.get("state"), f"groups[{k}].state", dtype="<f4", ndim=2)
            if rows.shape[0] != ids.shape[0] or rows.shape[1] < 1 or (
                    state is not None and state.shape[0] != ids.shape[0]):
                raise BadRequest(f"published rows: groups[{k}]: {ids.shape[0]} ids, rows {list(rows.shape)}")
            parsed.append((ids, rows, state))
        for ids, rows, state in parsed:
            self.absorb(ids, rows, np.full(ids.shape[0], version, dtype=np.int64), state)
            if update_id is not None:
                self._settle(update_id, rows.shape[1], ids)
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
        keep = ~np.isin(e_ids, ids)
        if keep.any():
            entry[dim] = (e_ids[keep], e_grads[keep])
        else:
            del entry[dim]
            if not entry:
                del self._pending[update_id]

    def on_hot_grads(self, msg: Mapping[str, Any]) -> None:
        """An NN rank's ``hot.grads.<rank>``: a batch's gradient of its hot rows, in flight until published.

        Raises:
            BadRequest: the message is malformed; nothing was taken from it.
        """
        update_id, rank, seq, groups = (msg.get(k) for k in ("update_id", "rank", "seq", "groups"))
        if not isinstance(update_id, str) or not isinstance(groups, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in (rank, seq)):
            raise BadRequest("hot gradients: expected a str 'update_id', ints 'rank' and 'seq', a list 'groups'")
        entry: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for k, g in enumerate(groups):
            if not isinstance(g, Mapping) or isinstance(g.get("dim"), bool) or not isinstance(g.get("dim"), int):
                raise BadRequest(f"hot gradients: groups[{k}]: expected a map with an int 'dim'")
            ids = array_from_wire(g.get("ids"), f"groups[{k}].ids", dtype="<u8", ndim=1)
            grads = array_from_wire(g.get("grads"), f"groups[{k}].grads", dtype="<f4", ndim=2)
            if grads.shape != (ids.shape[0], g["dim"]) or g["dim"] in entry:
                raise BadRequest(f"hot gradients: groups[{k}]: {ids.shape[0]} ids of dim {g['dim']}, "
                                 f"gradients {list(grads.shape)}, or a dim given twice")
            entry[g["dim"]] = (ids, grads)
        self.add_pending(update_id, entry)
        self.sent_by[rank] = max(self.sent_by.get(rank, 0), seq)

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
