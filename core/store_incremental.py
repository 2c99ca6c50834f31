"""Incremental updates (PERSIA's ``enable_incremental_update``): deltas of the rows a PS replica updated.

A replica in training tracks the keys its gradient updates touch (:class:`KeyTracker`); from time to time
it takes those keys as a delta, copies their rows out of its store (their embedding and optimizer state:
:meth:`DeltaRows.copy_steps`, in bounded steps between the requests it goes on serving) and writes them
outside of any lock (:func:`write_delta`), as PERSIA does, under ``incremental_dir``::

    <incremental_dir>/s<i>/inc_<YYYYmmddHHMMSSffffff>/   written by replica i; the name is the UTC time
                                                          its keys were taken, to the microsecond
        dim<d>.keys.npy   uint64 (rows,)      the keys of width d updated since the replica's previous delta
        dim<d>.emb.npy    float32 (rows, d)   their embeddings
        dim<d>.state.npy  float32 (rows, w)   their optimizer state
        inc_update_done   written last, atomically: JSON with every file's size and SHA-256 (the form of a
                          checkpoint's MANIFEST.json), the replica, its count, the job, the optimizer, the
                          widths, and ``follows``: the full checkpoint the delta is relative to

The arrays are the full checkpoints' ``.npy`` files (written as a live dump writes them, piece by piece
through :class:`persia_nats.common.checkpoint.AtomicWriter`), read back with
:func:`persia_nats.common.checkpoint.read_rows`, hashed as they are read against the marker. A directory
without the marker is incomplete (being written, or left by a crash) and is never read.

Consistency: a replica copies and writes its deltas one at a time, in the order it took their keys, so a row
in a delta is at least as new as in every earlier delta of that replica; a row updated after its copy step
is tracked again for the next delta, so no update is left out. When a full checkpoint's dump begins (its
T0), the keys tracked so far are taken at that same moment as one last delta following the previous
checkpoint, and tracking starts again: every later delta ``follows`` the new checkpoint, so the
checkpoint plus the deltas that follow it (or any later checkpoint number, should that one never be
sealed) hold every update the replica applied. Restoring (:func:`deltas_to_apply`, :func:`read_delta`,
:func:`apply_delta`) takes a loaded checkpoint ``N`` and applies, in the order of their times, every
complete delta of this job that follows checkpoint ``N`` or a later number, keeping the rows the loading
replica owns (whatever replica count wrote them), and logs the incomplete ones it passes by.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import shutil
import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numba
import numpy as np
from persia_nats.common.checkpoint import (
    AtomicWriter,
    CheckpointError,
    Digest,
    checkpoint_number,
    fsync_dir,
    npy_header,
    read_rows,
    write_bytes_atomic,
)
from persia_nats.common.errors import BadRequest
from persia_nats.core.sharding import shard_of
from persia_nats.core.store import EmbeddingStore
from persia_nats.core.store_checkpoint import RestoredShard, shards_to_read, store_config

__all__ = ["DONE", "DeltaRows", "DeltaSource", "KeyTracker", "apply_delta", "apply_deltas", "apply_steps", "delta_name",
           "deltas_to_apply", "list_deltas", "prune_deltas", "read_delta", "read_delta_meta", "restore_deltas",
           "take_delta", "write_delta"]

log = logging.getLogger(__name__)

DELTA_FORMAT = 1
#: the marker a complete delta holds, written last (PERSIA's name)
DONE = "inc_update_done"
_DELTA_DIR = re.compile(r"^inc_(\d{20})$")
_REPLICA_DIR = re.compile(r"^s(\d{1,6})$")
_PARTS = ("keys", "emb", "state")


def delta_name(time_us: int) -> str:
    """``inc_<YYYYmmddHHMMSSffffff>``: the UTC time, to the microsecond; names sort as times do."""
    when = dt.datetime.fromtimestamp(time_us // 1_000_000, dt.UTC).replace(microsecond=time_us % 1_000_000)
    return "inc_" + when.strftime("%Y%m%d%H%M%S%f")


def delta_time(name: str) -> int | None:
    """The microseconds since the epoch a delta's name says, None for any other name."""
    m = _DELTA_DIR.match(name)
    if m is None:
        return None
    try:
        when = dt.datetime.strptime(m.group(1), "%Y%m%d%H%M%S%f").replace(tzinfo=dt.UTC)
    except ValueError:
        return None
    return int(when.timestamp()) * 1_000_000 + when.microsecond


def follows_number(follows: str) -> int:
    """The checkpoint number a delta follows (0: none, the replica's start)."""
    parsed = checkpoint_number(follows) if follows else None
    return parsed[0] if parsed is not None else 0


# ---------------------------------------------------------------------------------------------
# Tracking (training)
# ---------------------------------------------------------------------------------------------


_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


@numba.njit(cache=True)
def _set_add(keys: np.ndarray, slots: np.ndarray, meta: np.ndarray) -> None:
    """Insert ``keys`` into an open-addressing set of nonzero uint64 (``slots``: a power of two, 0 = empty;
    ``meta``: [count of nonzero keys, 1 if key 0 was added]). The caller keeps the load at most 1/2."""
    mask = np.uint64(slots.shape[0] - 1)
    n = meta[0]
    for i in range(keys.shape[0]):
        k = keys[i]
        if k == 0:
            meta[1] = 1
            continue
        z = k
        z = (z ^ (z >> _S30)) * _MIX1
        z = (z ^ (z >> _S27)) * _MIX2
        h = (z ^ (z >> _S31)) & mask
        while True:
            s = slots[h]
            if s == k:
                break
            if s == 0:
                slots[h] = k
                n += 1
                break
            h = (h + np.uint64(1)) & mask
    meta[0] = n


class _KeySet:
    """The distinct uint64 keys of one width: an open-addressing hash set (load at most 1/2) run by numba."""

    def __init__(self) -> None:
        self.slots = np.zeros(1024, np.uint64)
        self.meta = np.zeros(2, np.int64)

    def __len__(self) -> int:
        return int(self.meta[0] + self.meta[1])

    def add(self, keys: np.ndarray) -> int:
        """Add ``keys``; returns how many were new."""
        before = len(self)
        need = 2 * (int(self.meta[0]) + keys.shape[0])
        if need > self.slots.shape[0]:  # grow first: O(held) once per doubling
            size = self.slots.shape[0]
            while size < need:
                size *= 2
            held, self.slots = self.slots[self.slots != 0], np.zeros(size, np.uint64)
            self.meta[0] = 0
            _set_add(held, self.slots, self.meta)
        _set_add(keys, self.slots, self.meta)
        return len(self) - before

    def keys(self) -> np.ndarray:
        held = self.slots[self.slots != 0]
        return np.concatenate([np.zeros(1, np.uint64), held]) if self.meta[1] else held


def warm_up() -> None:
    """Compile (or load from numba's cache) the tracker's kernel for the arrays it is given: read-only ids
    off the wire, writable ones put back; otherwise the first update of a job pays for it."""
    for writeable in (False, True):
        ids = np.arange(1, 9, dtype=np.uint64)
        ids.flags.writeable = writeable
        KeyTracker().add(1, ids)


class KeyTracker:
    """The distinct keys updated since the last :meth:`take`, per embedding width.

    A hash set of the keys per width, in one flat uint64 array (16 to 32 bytes a distinct key: its load stays
    between 1/4 and 1/2), filled by a numba kernel: about as many random memory accesses as the update
    itself makes for its ids, and no Python object per key. :attr:`distinct` is exact after every add.
    """

    def __init__(self) -> None:
        self._sets: dict[int, _KeySet] = {}
        self._distinct = 0
        #: monotonic time of the first key added since the last take (None: nothing tracked)
        self.since: float | None = None

    @property
    def distinct(self) -> int:
        """Distinct keys tracked, all widths."""
        return self._distinct

    @property
    def nbytes(self) -> int:
        """Bytes the sets take."""
        return sum(ks.slots.nbytes for ks in self._sets.values())

    def __bool__(self) -> bool:
        return self._distinct > 0

    def add(self, dim: int, keys: np.ndarray) -> None:
        """Track ``keys`` (uint64) of width ``dim``."""
        if not keys.shape[0]:
            return
        if self.since is None:
            self.since = time.monotonic()
        ks = self._sets.get(dim)
        if ks is None:
            ks = self._sets[dim] = _KeySet()
        self._distinct += ks.add(np.ascontiguousarray(keys, np.uint64))

    def take(self) -> dict[int, np.ndarray]:
        """Every width's distinct keys (in no particular order), and tracking starts again from nothing."""
        out = {dim: ks.keys() for dim, ks in self._sets.items() if len(ks)}
        self._sets = {}
        self._distinct = 0
        self.since = None
        return out

    def put_back(self, keys: dict[int, np.ndarray]) -> None:
        """Track again keys a delta failed to write (the next delta writes their rows as they are then)."""
        for dim, k in keys.items():
            self.add(dim, k)


# ---------------------------------------------------------------------------------------------
# Writing (training)
# ---------------------------------------------------------------------------------------------


@dataclass
class DeltaRows:
    """Rows copied out of a store for one delta: per width the pieces copied (keys, embeddings, optimizer
    state), each step's, and the optimizer's kind of state. Written as they are, without joining them."""

    name: str
    created: float
    follows: str
    #: the keys to copy, per width (:meth:`copy_steps` moves them into ``dims``)
    todo: dict[int, np.ndarray] = field(default_factory=dict)
    dims: dict[int, tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], str]] = field(default_factory=dict)
    #: keys tracked but no longer held (evicted since their update): not written
    gone: int = 0

    @property
    def rows(self) -> int:
        return sum(sum(k.shape[0] for k in keys) for keys, *_ in self.dims.values())

    @property
    def nbytes(self) -> int:
        return sum(sum(a.nbytes for part in parts[:3] for a in part) for parts in self.dims.values())

    def keys(self) -> dict[int, np.ndarray]:
        """Every key of the delta, copied or still to copy, per width."""
        out = dict(self.todo)
        for dim, (keys, *_) in self.dims.items():
            out[dim] = np.concatenate([*keys, out.get(dim, np.empty(0, np.uint64))])
        return out

    def copy_steps(self, store: EmbeddingStore, step_rows: int) -> Generator[int, None, None]:
        """Copy the rows of :attr:`todo` out of ``store`` as they are at each step, at most ``step_rows`` rows a
        step; yields the rows each step read. Between steps the store may change: a row updated after its
        step is tracked again (its next delta copies it again), one updated before is copied newer, so a row
        in a delta is never older than in the replica's previous one, whatever the steps."""
        for dim in sorted(self.todo):
            keys = self.todo[dim]
            for at in range(0, keys.shape[0], step_rows):
                part = keys[at: at + step_rows]
                table = store.tables.get(dim)
                if table is None:
                    self.gone += part.shape[0]
                else:
                    held, emb, state = table.read(part)
                    ks, es, ss, _ = self.dims.setdefault(dim, ([], [], [], table.state_kind))
                    ks.append(part[held])
                    es.append(emb)
                    ss.append(state)
                    self.gone += int(part.shape[0] - np.count_nonzero(held))
                self.todo[dim] = keys[at + step_rows:]
                yield part.shape[0]
            del self.todo[dim]


def take_delta(store: EmbeddingStore, keys: dict[int, np.ndarray], name: str, follows: str) -> DeltaRows:
    """Copy the rows of ``keys`` (per width, distinct) out of ``store`` as they are now, at once (a PS copies
    them in steps between requests: :meth:`DeltaRows.copy_steps`)."""
    delta = DeltaRows(name, time.time(), follows, dict(keys))
    for _ in delta.copy_steps(store, 1 << 62):
        pass
    return delta


def write_delta(root: Path, delta: DeltaRows, *, job: str, replica_index: int, replica_size: int,
                optimizer: dict[str, Any] | None = None) -> tuple[Path, int]:
    """Write ``delta`` as ``root/s<i>/<delta.name>/``: the arrays, then the done marker, each atomically.

    Returns:
        (the delta's directory, bytes written).

    Raises:
        OSError: The files cannot be written (what was written is removed, best effort).
    """
    out = Path(root) / f"s{replica_index}" / delta.name
    if out.exists():  # a retried write of the same name: nothing of the failed one may linger
        shutil.rmtree(out)
    out.mkdir(parents=True)
    fsync_dir(out.parent)
    writers: list[AtomicWriter] = []
    try:
        files: dict[str, Digest] = {}
        dims: dict[str, Any] = {}
        for dim, (keys, emb, state, kind) in sorted(delta.dims.items()):
            rows = sum(k.shape[0] for k in keys)
            width = state[0].shape[1] if state else 0
            parts = (("keys", keys, np.uint64, (rows,)), ("emb", emb, np.float32, (rows, dim)),
                     ("state", state, np.float32, (rows, width)))
            for part, pieces, dtype, shape in parts:
                # the file save_array writes for the pieces joined, byte for byte, written piece by piece
                writer = AtomicWriter(out / f"dim{dim}.{part}.npy")
                writers.append(writer)
                writer.write(npy_header(dtype, shape))
                for piece in pieces:
                    if piece.size:
                        writer.write(np.ascontiguousarray(piece, dtype).data)
                files[f"dim{dim}.{part}.npy"] = writer.commit()
            dims[str(dim)] = {"rows": int(rows), "state_kind": kind, "state_width": int(width)}
        meta = {"format": DELTA_FORMAT, "job": job, "replica_index": replica_index, "replica_size": replica_size,
                "name": delta.name, "created": delta.created, "follows": delta.follows, "gone": delta.gone,
                "optimizer": optimizer, "dims": dims,
                "files": {rel: {"size": size, "sha256": sha} for rel, (size, sha) in files.items()}}
        data = json.dumps(meta, indent=1, sort_keys=True, allow_nan=False).encode()
        write_bytes_atomic(out / DONE, data)
    except BaseException:
        for writer in writers:
            writer.abort()
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out, sum(size for size, _ in files.values()) + len(data)


# ---------------------------------------------------------------------------------------------
# Reading (restore, serving)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeltaSource:
    """One ``s<j>/inc_<time>`` directory found under the incremental root."""

    path: Path
    replica_dir: int
    name: str
    time_us: int
    complete: bool

    @property
    def rel(self) -> str:
        return f"s{self.replica_dir}/{self.name}"


def list_deltas(root: Path) -> list[DeltaSource]:
    """Every delta directory under ``root``, complete or not, oldest first (by time, then replica)."""
    found = []
    try:
        replicas = [(int(m.group(1)), p) for p in Path(root).iterdir() if (m := _REPLICA_DIR.match(p.name))]
    except (FileNotFoundError, NotADirectoryError):
        return []
    for j, rdir in replicas:
        try:
            entries = list(rdir.iterdir())
        except OSError:
            continue
        for path in entries:
            t = delta_time(path.name)
            if t is not None and path.is_dir():
                found.append(DeltaSource(path, j, path.name, t, (path / DONE).is_file()))
    return sorted(found, key=lambda d: (d.time_us, d.replica_dir))


def last_time(root: Path, replica_index: int) -> int:
    """The newest delta time (microseconds) replica ``replica_index`` wrote under ``root``, 0 if none."""
    times = [d.time_us for d in list_deltas(root) if d.replica_dir == replica_index]
    return max(times, default=0)


def read_delta_meta(src: DeltaSource) -> dict[str, Any]:
    """A complete delta's marker, checked.

    Raises:
        CheckpointError: It is missing, not JSON, or malformed.
    """
    path = src.path / DONE
    try:
        meta = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{src.path}: incomplete (no {DONE})") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    ok = (isinstance(meta, dict) and meta.get("format") == DELTA_FORMAT and isinstance(meta.get("dims"), dict)
          and isinstance(meta.get("files"), dict) and isinstance(meta.get("follows"), str)
          and meta.get("replica_index") == src.replica_dir and isinstance(meta.get("replica_size"), int)
          and not isinstance(meta.get("replica_size"), bool) and 1 <= meta["replica_size"]
          and 0 <= src.replica_dir < meta["replica_size"] and isinstance(meta.get("created"), int | float))
    if not ok:
        raise CheckpointError(f"{path}: not a format-{DELTA_FORMAT} delta of replica {src.replica_dir}")
    for key, d in meta["dims"].items():
        if not (isinstance(key, str) and key.isdigit() and len(key) < 7 and isinstance(d, dict)
                and isinstance(d.get("rows"), int) and d["rows"] >= 0 and isinstance(d.get("state_kind"), str)
                and isinstance(d.get("state_width"), int) and d["state_width"] >= 0):
            raise CheckpointError(f"{path}: malformed entry for dim {key!r}")
    checked: dict[str, Any] = meta
    return checked


def deltas_to_apply(root: Path, *, job: str, base: str, replica_index: int = 0, replica_size: int = 1,
                    skip: Iterable[str] = ()) -> list[tuple[DeltaSource, dict[str, Any]]]:
    """The complete deltas a store loaded from checkpoint ``base`` takes, oldest first.

    Those of job ``job`` that follow ``base``'s number or a later one, written by a replica whose keys may
    be replica ``replica_index`` of ``replica_size``'s (:func:`shards_to_read`); ``skip`` names (``s<j>/inc_…``)
    already applied. Incomplete deltas are left out, each logged; so are unreadable markers.
    """
    skip = set(skip)
    floor = follows_number(base)
    out = []
    for src in list_deltas(root):
        if src.rel in skip:
            continue
        if not src.complete:
            log.info("incremental update %s is incomplete (no %s): ignored", src.path, DONE)
            continue
        try:
            meta = read_delta_meta(src)
        except CheckpointError as exc:
            log.warning("incremental update %s ignored: %s", src.path, exc.description)
            continue
        if meta.get("job") != job or follows_number(meta["follows"]) < floor:
            continue
        if replica_size > 1 and src.replica_dir not in shards_to_read(meta["replica_size"], replica_index,
                                                                       replica_size):
            continue
        out.append((src, meta))
    return out


def read_delta(src: DeltaSource, meta: dict[str, Any], replica_index: int = 0,
               replica_size: int = 1) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, str]]:
    """A delta's rows that replica ``replica_index`` of ``replica_size`` owns, per width, each file hashed
    against the marker as it is read.

    Raises:
        CheckpointError: A file is missing, truncated, corrupt or not the array the marker describes.
    """
    files = meta["files"]
    out = {}
    for key, d in sorted(meta["dims"].items(), key=lambda kv: int(kv[0])):
        dim, rows, width = int(key), d["rows"], d["state_width"]

        def want(part: str, dim: int = dim) -> Any:
            rel = f"dim{dim}.{part}.npy"
            if rel not in files:
                raise CheckpointError(f"{src.path}: {rel} not listed in {DONE}")
            return files[rel]

        keys = read_rows(src.path / f"dim{dim}.keys.npy", want("keys"), np.uint64, (rows,))
        keep = None if replica_size == 1 else shard_of(keys, replica_size) == replica_index
        emb = read_rows(src.path / f"dim{dim}.emb.npy", want("emb"), np.float32, (rows, dim), keep=keep)
        state = read_rows(src.path / f"dim{dim}.state.npy", want("state"), np.float32, (rows, width), keep=keep)
        out[dim] = (keys if keep is None else keys[keep], emb, state, d["state_kind"])
    return out


def apply_delta(store: EmbeddingStore, rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, str]],
                step_rows: int | None = None) -> int:
    """Write a delta's rows into ``store`` (:meth:`EmbeddingStore.upsert`); returns the rows written.

    With ``step_rows``, use :func:`apply_steps` to interleave the work with other operations instead.
    """
    return sum(n for n in apply_steps(store, rows, step_rows or (1 << 62)))


def apply_steps(store: EmbeddingStore, rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, str]],
                step_rows: int) -> Iterable[int]:
    """:func:`apply_delta` in steps of at most ``step_rows`` rows, yielding the rows each step wrote."""
    for dim, (keys, emb, state, kind) in sorted(rows.items()):
        for at in range(0, keys.shape[0], step_rows):
            part = slice(at, at + step_rows)
            try:
                yield store.upsert(keys[part], dim, emb[part], state[part], kind)
            except BadRequest as exc:  # a width this store refuses, or repeated keys
                raise CheckpointError(f"incremental rows of dim {dim}: {exc.description}") from None


def prune_deltas(root: Path, replica_index: int, oldest_kept: int) -> list[Path]:
    """Delete replica ``replica_index``'s deltas that no kept checkpoint needs: the complete ones following a
    checkpoint numbered below ``oldest_kept`` (the oldest final checkpoint left in the root; restoring any
    kept checkpoint skips them), and the incomplete ones older than its newest complete one (a write cut
    short, which never completes). Returns what was deleted."""
    mine = [d for d in list_deltas(root) if d.replica_dir == replica_index]
    newest_complete = max((d.time_us for d in mine if d.complete), default=0)
    gone = []
    for src in mine:
        if src.complete:
            try:
                meta = read_delta_meta(src)
            except CheckpointError:
                continue  # left for a person to look at
            if follows_number(meta["follows"]) >= oldest_kept:
                continue
        elif src.time_us >= newest_complete:
            continue  # may be being written
        shutil.rmtree(src.path, ignore_errors=True)
        gone.append(src.path)
    return gone


def apply_deltas(store: EmbeddingStore, root: Path, *, job: str, base: str, replica_index: int = 0,
                 replica_size: int = 1, skip: Iterable[str] = ()) -> tuple[list[tuple[DeltaSource, Any]], int]:
    """Apply to ``store`` (not serving meanwhile) every delta :func:`deltas_to_apply` lists, oldest first, the rows
    replica ``replica_index`` of ``replica_size`` owns. A delta that fails its checks is skipped and logged.

    Returns:
        (the deltas applied with their markers, the rows written).
    """
    applied, rows = [], 0
    for src, meta in deltas_to_apply(root, job=job, base=base, replica_index=replica_index,
                                     replica_size=replica_size, skip=skip):
        try:
            rows += apply_delta(store, read_delta(src, meta, replica_index, replica_size))
        except CheckpointError as exc:
            log.warning("incremental update %s skipped: %s", src.path, exc.description)
            continue
        applied.append((src, meta))
    if applied:
        log.info("applied %d incremental updates (%d rows) after checkpoint %s, the newest %s", len(applied), rows,
                 base, applied[-1][0].rel)
    return applied, rows


def restore_deltas(restored: RestoredShard, like: EmbeddingStore, root: Path, *, job: str, base: str,
                   replica_index: int, replica_size: int) -> tuple[int, int]:
    """:func:`apply_deltas` to a checkpoint's share built aside (:func:`~.store_checkpoint.read_store`), before
    it is installed in ``like``; returns (deltas applied, rows written)."""
    optimizer, hyper, initial_rows = store_config(like)
    aside = EmbeddingStore(like.capacity, restored.optimizer or optimizer, restored.hyper or hyper, initial_rows)
    aside.tables.update(restored.tables)
    applied, rows = apply_deltas(aside, root, job=job, base=base, replica_index=replica_index,
                                 replica_size=replica_size)
    restored.tables = aside.tables
    return len(applied), rows
