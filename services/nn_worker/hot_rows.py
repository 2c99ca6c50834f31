"""The NN worker's copies of hot embedding rows, kept current without a request on the step's path.

With ``embedding_worker_config.hot_row_min_count`` set, a training lookup returns the rows a batch
reads many times (head ids) apart from the pooled sums, each with the PS version it was read at
(:class:`~common.messages.HotPart`), and every PS replica publishes the new values of those rows
after each update that touches them (``ps.<i>.rows``). :class:`RowMirror` keeps the newest copy of
each such row from both sources; just before a batch is handed to training, :meth:`RowMirror.merge`
adds the newest copies into the slot outputs. A batch looked up several steps ahead thus trains on
head rows as fresh as the PS's last applied update, which is what a deep look-ahead otherwise loses.

The mirror is a cache: a lost publication leaves an older copy that the next lookup or publication
replaces (versions decide, so a late message never overwrites a newer value). It holds at most
``max_rows`` rows, in numpy arrays per dim; rows beyond that are served from the lookup's own copy.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numba
import numpy as np

from common.codec import array_from_wire
from common.errors import BadRequest
from common.messages import HotPart, SlotEmbedding

log = logging.getLogger(__name__)

#: about 4 MiB of float32 rows at dim 16
DEFAULT_MAX_ROWS = 1 << 16


@numba.njit(cache=True, nogil=True)
def _add_rows(out: np.ndarray, rows: np.ndarray, inv: np.ndarray, target: np.ndarray, scale: np.ndarray) -> None:
    # this runs between two training steps, while the training thread waits for the batch: a compiled
    # loop costs a tenth of np.add.at, and a torch op would contend with the training thread's pool
    for p in range(inv.shape[0]):
        s = scale[p]
        r = inv[p]
        t = target[p]
        for j in range(rows.shape[1]):
            out[t, j] += s * rows[r, j]


def _warm_up() -> None:
    """Load (or compile) the kernel now, at start-up, rather than inside the first training step."""
    one = np.zeros(1, np.int32)
    _add_rows(np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32), one, one, np.zeros(1, np.float32))


class _Table:
    """One dim's rows, sorted by id, so a batch's rows are found with one ``searchsorted``."""

    __slots__ = ("ids", "rows", "versions")

    def __init__(self, dim: int) -> None:
        self.ids = np.empty(0, dtype=np.uint64)
        self.rows = np.empty((0, dim), dtype=np.float32)
        self.versions = np.empty(0, dtype=np.int64)

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
        #: ``hot_batches``, ``hot_rows_read``, ``hot_rows_fresher`` (a newer copy than the lookup's was
        #: used), ``hot_publications``, ``hot_rows_not_kept`` (the mirror was full)
        self.counters: Counter[str] = Counter() if counters is None else counters

    def __len__(self) -> int:
        return sum(t.ids.shape[0] for t in self._tables.values())

    def absorb(self, ids: np.ndarray, rows: np.ndarray, versions: np.ndarray) -> None:
        """Keep each row's copy when it is newer than the one held (ids distinct, rows (n, dim))."""
        if ids.shape[0] == 0:
            return
        dim = rows.shape[1]
        table = self._tables.get(dim)
        if table is None:
            table = self._tables[dim] = _Table(dim)
        pos, found = table.find(ids)
        at = pos[found]
        newer = versions[found] > table.versions[at]
        table.rows[at[newer]] = rows[found][newer]
        table.versions[at[newer]] = versions[found][newer]
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

    def newest(self, ids: np.ndarray, rows: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """The rows of ``ids``: a lookup's copies (``rows`` at ``versions``) or newer ones held here."""
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
        return out

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
                emb = e.emb.astype(np.float32)  # a copy: the reply's array may be float16, or shared
                _add_rows(emb, rows[int(hot.group[k])], hot.inv[lo:hi], hot.target[lo:hi], hot.scale[lo:hi])
                e = SlotEmbedding(e.name, emb, e.index)
            out.append(e)
        self.counters["hot_batches"] += 1
        return tuple(out)

    def on_published(self, msg: Mapping[str, Any]) -> None:
        """A PS replica's ``ps.<i>.rows`` message: ``{v, replica, version, groups: [{ids, rows}]}``.

        Raises:
            BadRequest: the message is malformed; nothing was taken from it.
        """
        version = msg.get("version")
        groups = msg.get("groups")
        if isinstance(version, bool) or not isinstance(version, int) or not isinstance(groups, list):
            raise BadRequest("published rows: expected an int 'version' and a list 'groups'")
        parsed = []
        for k, g in enumerate(groups):
            if not isinstance(g, Mapping):
                raise BadRequest(f"published rows: groups[{k}]: expected a map")
            ids = array_from_wire(g.get("ids"), f"groups[{k}].ids", dtype="<u8", ndim=1)
            rows = array_from_wire(g.get("rows"), f"groups[{k}].rows", dtype="<f4", ndim=2)
            if rows.shape[0] != ids.shape[0] or rows.shape[1] < 1:
                raise BadRequest(f"published rows: groups[{k}]: {ids.shape[0]} ids, rows {list(rows.shape)}")
            parsed.append((ids, rows))
        for ids, rows in parsed:
            self.absorb(ids, rows, np.full(ids.shape[0], version, dtype=np.int64))
        self.counters["hot_publications"] += 1

