"""Dump a PS replica's store into a checkpoint, and load it back under any replica count.

Replica ``i`` of ``n`` writes ``<ckpt>/ps/replica-<i>-of-<n>/``:

* per embedding width ``d``: ``dim<d>.keys.npy`` (uint64 ``(rows,)``), ``dim<d>.emb.npy`` (float32
  ``(rows, d)``) and ``dim<d>.state.npy`` (float32 ``(rows, w)``, the optimizer's columns), rows in
  LRU order (least recently used first), as :meth:`EmbeddingTable.state_dict` lists them;
* ``shard.json``: the replica index and count, the optimizer and hyperparameters in their wire
  form (:func:`~persia_nats.common.optim_config.to_wire`), and per width the row count, the state kind and the
  table's counters.

Dumping never stops the replica: :class:`LiveDump` writes a consistent snapshot of the store at the
moment it begins (T0), in bounded steps between the requests the replica goes on serving, with extra
memory of 24-28 bytes a row plus the rows overwritten before it read them (:mod:`.store_snapshot`).
Its files are byte for byte those of the stop-the-world dump at T0 (:func:`dump_store_stopped`, kept
as the reference).

Loading keeps the keys this replica owns under the embedding workers' routing
(:func:`persia_nats.core.sharding.shard_of`), whatever replica count wrote the checkpoint, so a job can
restart with more or fewer PS replicas. It reads only the shards that can hold such keys
(:func:`shards_to_read`: its own when the count is unchanged, those ``j = i (mod gcd(m, n))`` otherwise),
each file once, hashing it as it reads it (:func:`persia_nats.common.checkpoint.read_rows`), so a replica
verifies exactly the files it reads and never the others' shards.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
import shutil
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from persia_nats.common.checkpoint import (
    MANIFEST,
    AtomicWriter,
    CheckpointError,
    Digest,
    check_file,
    npy_header,
    npy_shape,
    read_rows,
    save_array,
    write_bytes_atomic,
)
from persia_nats.common.errors import BadRequest, ConfigError, Conflict
from persia_nats.common.optim_config import (
    EmbeddingHyperparams,
    OptimizerConfig,
    hyperparams_from_wire,
    hyperparams_to_wire,
    optimizer_from_wire,
    to_wire,
)
from persia_nats.core.hugepages import huge_empty
from persia_nats.core.sharding import shard_of
from persia_nats.core.store import EmbeddingStore, EmbeddingTable
from persia_nats.core.store_snapshot import TableSnapshot
from persia_nats.core.table_kernels import COUNTERS

__all__ = ["DumpPace", "LiveDump", "LoadProgress", "RestoredShard", "dump_store", "dump_store_stopped", "load_store",
           "read_store", "shard_dirname", "shards_to_read", "store_config"]

log = logging.getLogger(__name__)

SHARD_FORMAT = 1
SHARD_META = "shard.json"
_SHARD_DIR = re.compile(r"^replica-(\d{1,6})-of-(\d{1,6})$")
_PARTS = ("keys", "emb", "state")
# admission_salt seeds admission draws: it is a clock, not a tally, so it is never split or summed
_ADDITIVE = tuple(name for name in COUNTERS if name != "admission_salt")


def shard_dirname(replica_index: int, replica_size: int) -> str:
    """The directory (under ``ps/``) replica ``replica_index`` of ``replica_size`` writes."""
    return f"replica-{int(replica_index)}-of-{int(replica_size)}"


def store_config(store: EmbeddingStore) -> tuple[OptimizerConfig | None, EmbeddingHyperparams, int]:
    """``store``'s optimizer, hyperparameters and initial rows: what a checkpoint shard or a delta records
    and what a table restored from one is built with."""
    # EmbeddingStore has no public getters for these; read in this one place only.
    return store._optimizer, store._hyper, store._initial_rows


def _check_replica(replica_index: int, replica_size: int) -> None:
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (replica_index, replica_size))
    if not ok or not 0 <= replica_index < replica_size:
        raise ConfigError(f"replica {replica_index!r} of {replica_size!r} is not a valid replica")


# ---------------------------------------------------------------------------------------------
# Dump
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DumpPace:
    """How much a live dump does per step on the event loop, between the requests it lets through.

    Args:
        scan_slots: Index slots scanned a step (16 or 24 bytes each, read in order, their rows recorded at
            random: ~1-4 ms at 2^16).
        step_bytes: Row bytes (key, vector, state) gathered a step, read in LRU order, i.e. at random
            (~1-4 ms at 1 MiB); then written by a thread while requests run.
        loop_share: The most of the event loop's time the steps take: after a step of t seconds the
            dump sleeps ``t * (1 / loop_share - 1)``, so requests keep at least the rest.
    """

    scan_slots: int = 1 << 16
    step_bytes: int = 1 << 20
    loop_share: float = 0.5


class LiveDump:
    """Writes a store's consistent snapshot in bounded steps, while the store keeps serving.

    :meth:`begin` fixes T0 for every table at once (:meth:`EmbeddingTable.begin_snapshot`); the files are
    those :func:`dump_store_stopped` would have written at T0, byte for byte. Each step does bounded work
    on the caller's thread (scan a few index slots; gather a few thousand rows), and hands the work that
    touches only the dump's own arrays (sorting, writing, hashing, fsync) to :meth:`run`'s threads. The
    longest a request waits on a dump is one step, whatever the table's size.

    Args:
        store: The replica's store.
        ckpt_dir: The checkpoint's partial directory (created when missing).
        replica_index: This replica.
        replica_size: Number of PS replicas.
        pace: Work per step.
    """

    def __init__(self, store: EmbeddingStore, ckpt_dir: Path, replica_index: int, replica_size: int,
                 pace: DumpPace = DumpPace(), on_begin: Callable[[], object] | None = None) -> None:
        _check_replica(replica_index, replica_size)
        self.store, self.pace = store, pace
        #: called by :meth:`run` right after :meth:`begin`, on the same step (at T0: an incremental update's cut)
        self.on_begin = on_begin
        self.ckpt_dir = Path(ckpt_dir)
        self.rel = PurePosixPath("ps", shard_dirname(replica_index, replica_size))
        self.replica_index, self.replica_size = replica_index, replica_size
        self.files: dict[str, Digest] = {}
        self._tables: list[tuple[int, EmbeddingTable, TableSnapshot]] = []
        self._config: tuple[OptimizerConfig | None, EmbeddingHyperparams] | None = None
        self._open: list[AtomicWriter] = []
        #: rows copied aside because the table overwrote them before the dump read them
        self.preimages = 0
        #: seconds of the longest step (:meth:`begin` included), and of all steps, taken on the caller's thread;
        #: and the longest step's CPU seconds (wall time on a shared machine includes other processes' turns)
        self.longest_step = self.step_seconds = self.longest_step_cpu = 0.0
        #: seconds of the work handed to threads
        self.thread_seconds = 0.0

    @property
    def rows(self) -> int:
        """Rows in the snapshot (all widths)."""
        return sum(snap.rows for _, _, snap in self._tables)

    def prepare(self) -> None:
        """Make the shard's directory, replacing what an earlier attempt left (file I/O: a thread's work).

        Raises:
            CheckpointError: ``ckpt_dir`` already holds a manifest (it is sealed).
        """
        if (self.ckpt_dir / MANIFEST).exists():
            raise CheckpointError(f"{self.ckpt_dir} is a finalized checkpoint; dump into a partial one")
        out = self.ckpt_dir / self.rel
        if out.exists():  # a retried dump: stale widths of the failed attempt must not linger
            shutil.rmtree(out)
        out.mkdir(parents=True)

    def begin(self) -> None:
        """T0: snapshot every table now. O(tables); call it where no store operation is half done.

        Raises:
            Conflict: A snapshot of some table is open already (another dump); nothing is changed.
        """
        tables = sorted(self.store.tables.items())
        if any(table.snapshot is not None for _, table in tables):
            raise Conflict("another checkpoint dump is reading this store")
        optimizer, hyper, _ = store_config(self.store)
        self._config = optimizer, hyper
        self._tables = [(dim, table, table.begin_snapshot()) for dim, table in tables]

    def steps(self) -> Generator[Callable[[], object] | None, None, None]:
        """The dump after :meth:`begin`, one bounded step per ``next``: yields None after a step done in
        place, or a callable to run before the next step (anywhere: it touches no table). Closing the
        iterator early abandons the dump: temporary files removed, snapshots closed."""
        assert self._config is not None, "begin() first"
        out = self.ckpt_dir / self.rel
        try:
            dims: dict[str, Any] = {}
            for dim, table, snap in self._tables:
                writers = [AtomicWriter(out / f"dim{dim}.{part}.npy") for part in _PARTS]
                self._open = writers
                shapes = ((snap.rows,), (snap.rows, dim), (snap.rows, snap.width))
                for writer, dtype, shape in zip(writers, (np.uint64, np.float32, np.float32), shapes, strict=True):
                    writer.write(npy_header(dtype, shape))
                while not snap.scan_step(self.pace.scan_slots):
                    yield None
                yield snap.sort
                per = max(1, self.pace.step_bytes // (8 + 4 * dim + 4 * snap.width))
                while snap.remaining:
                    parts = table.read_snapshot(per)
                    yield functools.partial(_write_parts, writers, parts)
                digests: list[Digest] = []
                yield lambda w=writers, d=digests: d.extend(x.commit() for x in w)  # type: ignore[misc]
                self._open = []
                table.end_snapshot()
                self.preimages += snap.preimages
                self.files.update({str(self.rel / f"dim{dim}.{part}.npy"): d
                                   for part, d in zip(_PARTS, digests, strict=True)})
                dims[str(dim)] = snap.describe()
            optimizer, hyper = self._config
            meta = {"format": SHARD_FORMAT, "replica_index": self.replica_index, "replica_size": self.replica_size,
                    "optimizer": None if optimizer is None else to_wire(optimizer),
                    "hyper": hyperparams_to_wire(hyper), "dims": dims}
            data = json.dumps(meta, indent=1, sort_keys=True, allow_nan=False).encode()
            yield lambda: self.files.update({str(self.rel / SHARD_META): write_bytes_atomic(out / SHARD_META, data)})
        finally:
            for writer in self._open:
                writer.abort()
            self._open = []
            for _, table, snap in self._tables:
                if table.snapshot is snap:
                    table.end_snapshot()

    def run_sync(self) -> dict[str, Digest]:
        """:meth:`prepare`, :meth:`begin` and every step here and now (no concurrent requests to let through)."""
        self.prepare()
        self.begin()
        steps = self.steps()
        try:
            for work in steps:
                if work is not None:
                    work()
        finally:
            steps.close()
        return self.files

    async def run(self) -> dict[str, Digest]:
        """:meth:`prepare` and the file work in threads, :meth:`begin` and each step on the event loop,
        yielding to it after every step, so requests interleave with the dump.

        Returns:
            ``{path relative to ckpt_dir: (size, sha256)}`` for every file written, for the manifest.
        """
        await asyncio.to_thread(self.prepare)
        started, cpu = time.perf_counter(), time.thread_time()
        self.begin()
        if self.on_begin is not None:
            try:
                self.on_begin()
            except BaseException:
                for _, table, _ in self._tables:
                    table.end_snapshot()
                raise
        steps = self.steps()
        try:
            while True:
                work = next(steps, _end_marker)
                took = time.perf_counter() - started
                self.longest_step_cpu = max(self.longest_step_cpu, time.thread_time() - cpu)
                self.longest_step = max(self.longest_step, took)
                self.step_seconds += took
                if work is _end_marker:
                    break
                if work is not None:
                    started = time.perf_counter()
                    await asyncio.to_thread(work)
                    self.thread_seconds += time.perf_counter() - started
                # the steps take at most pace.loop_share of the loop's time: the rest is the requests'
                await asyncio.sleep(took * (1 / self.pace.loop_share - 1))
                started, cpu = time.perf_counter(), time.thread_time()
        finally:
            steps.close()
        return self.files


def _end_marker() -> None:
    """Not a step: :meth:`LiveDump.run`'s end marker."""


def _write_parts(writers: list[AtomicWriter], parts: tuple[np.ndarray, ...]) -> None:
    for writer, part in zip(writers, parts, strict=True):
        if part.size:  # plain SGD has no state columns
            writer.write(np.ascontiguousarray(part).data)


def dump_store(store: EmbeddingStore, ckpt_dir: Path, replica_index: int, replica_size: int) -> dict[str, Digest]:
    """Write the store into ``ckpt_dir/ps/replica-<i>-of-<n>/`` (replacing what an earlier attempt left): a
    :class:`LiveDump` run to the end at once. A PS serving requests runs :meth:`LiveDump.run` instead.

    Args:
        store: The replica's store.
        ckpt_dir: The checkpoint's partial directory (created when missing).
        replica_index: This replica.
        replica_size: Number of PS replicas.

    Returns:
        ``{path relative to ckpt_dir: (size, sha256)}`` for every file written, for the manifest.

    Raises:
        CheckpointError: ``ckpt_dir`` already holds a manifest (it is sealed).
        OSError: The files cannot be written.
    """
    return LiveDump(store, ckpt_dir, replica_index, replica_size).run_sync()


def dump_store_stopped(store: EmbeddingStore, ckpt_dir: Path, replica_index: int,
                       replica_size: int) -> dict[str, Digest]:
    """The stop-the-world dump :class:`LiveDump` replaced, kept as the reference its tests and benchmark
    compare with: the same files, written from one whole copy of a table at a time (the caller keeps the
    store unchanged meanwhile, so it stops for the whole dump, and needs one extra copy of the largest
    table).

    Args:
        store: The replica's store.
        ckpt_dir: The checkpoint's partial directory (created when missing).
        replica_index: This replica.
        replica_size: Number of PS replicas.

    Returns:
        ``{path relative to ckpt_dir: (size, sha256)}`` for every file written, for the manifest.

    Raises:
        CheckpointError: ``ckpt_dir`` already holds a manifest (it is sealed).
        OSError: The files cannot be written.
    """
    _check_replica(replica_index, replica_size)
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / MANIFEST).exists():
        raise CheckpointError(f"{ckpt_dir} is a finalized checkpoint; dump into a partial one")
    rel = PurePosixPath("ps", shard_dirname(replica_index, replica_size))
    out = ckpt_dir / rel
    if out.exists():  # a retried dump: stale widths of the failed attempt must not linger
        shutil.rmtree(out)
    out.mkdir(parents=True)
    optimizer, hyper, _ = store_config(store)
    files: dict[str, Digest] = {}
    dims: dict[str, Any] = {}
    for dim, table in sorted(store.tables.items()):
        sd = table.state_dict()
        for part in _PARTS:
            name = f"dim{dim}.{part}.npy"
            files[str(rel / name)] = save_array(out / name, sd[part])
        dims[str(dim)] = {"rows": int(sd["keys"].shape[0]), "state_kind": sd["state_kind"],
                          "state_width": int(sd["state"].shape[1]), "capacity": int(sd["capacity"]),
                          "counters": {name: int(sd[name]) for name in COUNTERS}}
        del sd  # free this table's copy before the next one is made
    meta = {"format": SHARD_FORMAT, "replica_index": replica_index, "replica_size": replica_size,
            "optimizer": None if optimizer is None else to_wire(optimizer),
            "hyper": hyperparams_to_wire(hyper), "dims": dims}
    data = json.dumps(meta, indent=1, sort_keys=True, allow_nan=False).encode()
    files[str(rel / SHARD_META)] = write_bytes_atomic(out / SHARD_META, data)
    return files


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


@dataclass
class _Shard:
    """One ``ps/replica-j-of-m`` directory of a checkpoint, its metadata validated."""

    index: int
    size: int
    path: Path
    rel: PurePosixPath
    dims: dict[int, dict[str, Any]]
    optimizer: OptimizerConfig | None
    hyper: EmbeddingHyperparams | None


@dataclass
class RestoredShard:
    """This replica's share of a checkpoint, built aside from the live store.

    :meth:`install` swaps it in; nothing before that touches the store, so a checkpoint that turns
    out corrupt halfway through leaves the store as it was.
    """

    tables: dict[int, EmbeddingTable] = field(default_factory=dict)
    optimizer: OptimizerConfig | None = None
    hyper: EmbeddingHyperparams | None = None

    @property
    def rows(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def install(self, store: EmbeddingStore) -> int:
        """Replace ``store``'s tables, optimizer and hyperparameters with these; return the rows now held.

        Cannot fail halfway: everything was validated when it was built.
        """
        store.tables.clear()
        store.tables.update(self.tables)
        if self.hyper is not None:
            store.set_hyper(self.hyper)
        if self.optimizer is not None:
            store.set_optimizer(self.optimizer)
        return self.rows


class LoadProgress:
    """How far a load has read: bytes of the files it reads, read so far, out of all it will read.

    Updated by the thread that reads (:func:`read_store`); ``on_change`` is called there after every block
    (about 8 MiB), so it must be cheap and safe to call from that thread.
    """

    def __init__(self, on_change: Callable[[LoadProgress], object] | None = None) -> None:
        self.total = 0
        self.done = 0
        #: every file read, relative to the checkpoint, and whether it was hashed against the manifest
        self.files: dict[str, bool] = {}
        #: bytes of the files hashed
        self.hashed_bytes = 0
        self.on_change = on_change

    def add(self, n: int) -> None:
        self.done += n
        if self.on_change is not None:
            self.on_change(self)

    def describe(self) -> str:
        """``"1.2 of 2.4 GB read"``, in the unit of the total."""
        unit, scale = next(((u, x) for u, x in (("GB", 1e9), ("MB", 1e6)) if self.total >= x), ("kB", 1e3))
        return f"{self.done / scale:.1f} of {self.total / scale:.1f} {unit} read"


class _Reader:
    """Reads files of one checkpoint, each hashed against the manifest as it is read when one is given."""

    def __init__(self, ckpt_dir: Path, manifest_files: Mapping[str, Any] | None, check_sums: bool,
                 progress: LoadProgress) -> None:
        self.ckpt_dir = ckpt_dir
        self.files = manifest_files
        self.check_sums = check_sums
        self.progress = progress

    def _expected(self, rel: str) -> Any:
        if self.files is None:
            return None
        if rel not in self.files:
            raise CheckpointError(f"{self.ckpt_dir / rel}: not listed in the manifest")
        return self.files[rel] if self.check_sums else None

    def size(self, rel: PurePosixPath) -> int:
        """The file's size: the manifest's (checked against the file as it is read), else the file's."""
        if self.files is not None and str(rel) in self.files:
            entry = self.files[str(rel)]
            size = entry.get("size") if isinstance(entry, Mapping) else entry[0]
            if isinstance(size, int) and not isinstance(size, bool):
                return size
        try:
            return (self.ckpt_dir / rel).stat().st_size
        except OSError:
            return 0  # reading it will say what is wrong

    def _read(self, rel: PurePosixPath, expected: Any, size: int) -> None:
        self.progress.files[str(rel)] = expected is not None
        if expected is not None:
            self.progress.hashed_bytes += size

    def rows(self, rel: PurePosixPath, dtype: type, shape: tuple[int | None, ...], *, keep: np.ndarray | None = None,
             out: np.ndarray | None = None) -> np.ndarray:
        expected = self._expected(str(rel))
        arr = read_rows(self.ckpt_dir / rel, expected, dtype, shape, keep=keep, out=out, progress=self.progress.add)
        self._read(rel, expected, self.size(rel))
        return arr

    def width(self, rel: PurePosixPath) -> int:
        """The second dimension a 2-D ``.npy`` file's header declares (checked again when it is read)."""
        shape = npy_shape(self.ckpt_dir / rel)
        if len(shape) != 2:
            raise CheckpointError(f"{self.ckpt_dir / rel}: expected a 2-D array, its header says shape {shape}")
        return shape[1]

    def json(self, rel: PurePosixPath) -> Any:
        expected = self._expected(str(rel))
        path = self.ckpt_dir / rel
        if expected is not None:
            check_file(path, expected)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing") from None
        except OSError as exc:
            raise CheckpointError(f"{path}: unreadable: {exc}") from None
        self._read(rel, expected, len(data))
        self.progress.total += len(data)
        self.progress.add(len(data))
        try:
            return json.loads(data)
        except ValueError as exc:
            raise CheckpointError(f"{path}: not JSON: {exc}") from None


def _int(value: Any, low: int = 0) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return None
    return value


def _parse_shard(reader: _Reader, index: int, size: int) -> _Shard:
    rel = PurePosixPath("ps", shard_dirname(index, size))
    where = reader.ckpt_dir / rel / SHARD_META
    meta = reader.json(rel / SHARD_META)
    if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT:
        raise CheckpointError(f"{where}: not a format-{SHARD_FORMAT} shard description")
    if (meta.get("replica_index"), meta.get("replica_size")) != (index, size):
        raise CheckpointError(f"{where}: says replica {meta.get('replica_index')!r} of "
                              f"{meta.get('replica_size')!r}, its directory {index} of {size}")
    try:
        optimizer = None if meta.get("optimizer") is None else optimizer_from_wire(meta["optimizer"])
        hyper = None if meta.get("hyper") is None else hyperparams_from_wire(meta["hyper"])
    except ConfigError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    raw_dims = meta.get("dims")
    if not isinstance(raw_dims, dict):
        raise CheckpointError(f"{where}: dims must be an object")
    dims: dict[int, dict[str, Any]] = {}
    for key, d in raw_dims.items():
        dim = _int(int(key), 1) if isinstance(key, str) and key.isdigit() and len(key) < 7 else None
        counters = d.get("counters") if isinstance(d, dict) else None
        if (dim is None or not isinstance(d, dict) or _int(d.get("rows")) is None
                or not isinstance(d.get("state_kind"), str) or not isinstance(counters, dict)
                or any(_int(counters.get(name, 0)) is None for name in COUNTERS)):
            raise CheckpointError(f"{where}: malformed entry for dim {key!r}")
        dims[dim] = d
    return _Shard(index, size, reader.ckpt_dir / rel, rel, dims, optimizer, hyper)


def _find_shards(reader: _Reader) -> list[_Shard]:
    """Every shard of the checkpoint; they must come from one complete set of replicas."""
    ps = reader.ckpt_dir / "ps"
    try:
        names = sorted(child.name for child in ps.iterdir() if child.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"{reader.ckpt_dir}: holds no PS shards (no ps/ directory)") from None
    found = []
    for name in names:
        m = _SHARD_DIR.match(name)
        if m is None:
            continue
        # With a manifest, a shard it does not list is the leftover of an attempt that never made it in.
        if reader.files is not None and f"ps/{name}/{SHARD_META}" not in reader.files:
            continue
        found.append((int(m.group(1)), int(m.group(2))))
    sizes = sorted({size for _, size in found})
    if not found:
        raise CheckpointError(f"{reader.ckpt_dir}: holds no PS shards")
    if len(sizes) > 1:
        raise CheckpointError(f"{reader.ckpt_dir}: shards written by different replica counts {sizes}")
    size = sizes[0]
    missing = sorted(set(range(size)) - {index for index, _ in found})
    if missing or any(index >= size for index, _ in found):
        raise CheckpointError(f"{reader.ckpt_dir}: incomplete: shards of replicas {missing} of {size} are missing")
    return [_parse_shard(reader, index, size) for index, _ in sorted(found)]


def _restore_table(
    reader: _Reader,
    shards: list[_Shard],
    dim: int,
    replica_index: int,
    replica_size: int,
    store: EmbeddingStore,
    optimizer: OptimizerConfig | None,
    hyper: EmbeddingHyperparams,
) -> EmbeddingTable:
    """Build this replica's table of width ``dim`` from the shards that may hold some of its keys.

    Each shard's keys are read whole (routing needs every key); its values and optimizer state are read
    straight into this replica's arrays when the whole shard is its own, through a small buffer keeping
    only its rows when the shard is split, and not at all when it holds none of them.
    """
    parts = []
    for shard in shards:
        meta = shard.dims.get(dim)
        if meta is None:
            continue
        rows = meta["rows"]
        keys = reader.rows(shard.rel / f"dim{dim}.keys.npy", np.uint64, (rows,))
        mine = shard_of(keys, replica_size) == replica_index
        kept = int(np.count_nonzero(mine))
        if kept < rows:  # only the routing mask and the kept keys stay in memory
            keys = keys[mine]
        parts.append((shard, meta, keys, None if kept == rows else mine, kept))
    kinds = sorted({meta["state_kind"] for _, meta, _, _, _ in parts})
    if len(kinds) > 1:
        raise CheckpointError(f"{reader.ckpt_dir}: the shards of dim {dim} hold different optimizer states {kinds}")
    total = sum(kept for *_, kept in parts)
    keys_out = np.concatenate([keys for _, _, keys, _, _ in parts]) if parts else np.empty(0, np.uint64)
    # huge pages: faults of reading into fresh 4 KiB pages cost up to 3x the hashing (250 MB/s against 1.1 GB/s)
    emb_out = huge_empty((total, dim), np.float32)
    width = reader.width(parts[0][0].rel / f"dim{dim}.state.npy") if parts else 0
    state_out = huge_empty((total, width), np.float32)
    counters = dict.fromkeys(_ADDITIVE, 0)
    salt = 0
    pos = 0
    for shard, meta, _, mine, kept in parts:
        rows = meta["rows"]
        seg = slice(pos, pos + kept)
        if kept:
            reader.rows(shard.rel / f"dim{dim}.emb.npy", np.float32, (rows, dim), keep=mine, out=emb_out[seg])
            reader.rows(shard.rel / f"dim{dim}.state.npy", np.float32, (rows, width), keep=mine, out=state_out[seg])
        else:  # none of its rows are ours: nothing of these files is used, so nothing is read
            reader.progress.total -= sum(reader.size(shard.rel / f"dim{dim}.{part}.npy") for part in ("emb", "state"))
        pos += kept
        # Tallies split in proportion to the rows taken; an empty shard's go to replica j mod n, so
        # each is counted once across the new replicas (exact when the replica count is unchanged).
        c = meta["counters"]
        whole = kept == rows if rows else shard.index % replica_size == replica_index
        for name in _ADDITIVE:
            counters[name] += c.get(name, 0) if whole else c.get(name, 0) * kept // rows
        if kept or whole:
            salt = max(salt, c.get("admission_salt", 0))
    _, _, initial_rows = store_config(store)
    table = EmbeddingTable(dim, store.capacity, optimizer, hyper, initial_rows)
    # Rows keep each shard's LRU order, shard after shard: recency cannot be compared across
    # replicas (each has its own clock). Beyond capacity, load_state_dict drops from the front,
    # i.e. the oldest rows of the lowest-numbered shards.
    state_dict = {"keys": keys_out, "emb": emb_out, "state": state_out, "state_kind": kinds[0] if kinds else "none",
                  **counters, "admission_salt": salt}
    try:
        table.load_state_dict(state_dict)
    except BadRequest as exc:
        raise CheckpointError(f"{reader.ckpt_dir}: dim {dim}: {exc.description}") from None
    return table


def shards_to_read(old_size: int, replica_index: int, replica_size: int) -> list[int]:
    """The shards of a checkpoint written by ``old_size`` replicas that may hold rows of replica ``replica_index``
    of ``replica_size``: a key of shard ``j`` of ``m`` has ``h mod m = j`` (``h`` its routing hash), and replica
    ``r`` of ``n`` keeps it when ``h mod n = r``, which needs ``j = r (mod gcd(m, n))`` and, by the Chinese
    remainder theorem, may happen whenever that holds. So an unchanged count reads shard ``r`` alone, ``n``
    dividing ``m`` the ``m / n`` shards wholly its own, ``m`` dividing ``n`` one shard (keeping ``m / n`` of it),
    and coprime counts (2 -> 3, 3 -> 2) every shard."""
    g = math.gcd(old_size, replica_size)
    return [j for j in range(old_size) if j % g == replica_index % g]


def read_store(
    store: EmbeddingStore,
    ckpt_dir: Path,
    replica_index: int,
    replica_size: int,
    manifest_files: Mapping[str, Any] | None = None,
    *,
    check_sums: bool = True,
    progress: LoadProgress | None = None,
) -> RestoredShard:
    """Build replica ``replica_index`` of ``replica_size``'s share of a checkpoint, without touching ``store``.

    ``store`` only lends its capacity, initial row count and (when the checkpoint has none) its
    optimizer and hyperparameters. It reads only the shards that may hold its rows
    (:func:`shards_to_read`), each file once, hashing it on the way: every shard's ``shard.json``, and of
    those shards the keys whole and the values and optimizer state whole where it keeps any of their rows
    (the rows it does not keep are read, hashed and dropped block by block). Peak memory is the tables built
    so far plus one width's rows in staging arrays.

    Args:
        store: The store the result is meant for.
        ckpt_dir: A checkpoint directory.
        replica_index: This replica.
        replica_size: Number of PS replicas now (may differ from the count that wrote the checkpoint).
        manifest_files: The manifest's ``files``: shards it does not list are ignored, files it
            does not list are refused, and with ``check_sums`` each file read is hashed as it is read.
        check_sums: Hash files against ``manifest_files`` (pass False right after :func:`verify`).
        progress: Told the bytes to read and read so far.

    Raises:
        CheckpointError: A shard is missing, malformed, torn or corrupt.
    """
    _check_replica(replica_index, replica_size)
    progress = LoadProgress() if progress is None else progress
    reader = _Reader(Path(ckpt_dir), manifest_files, check_sums, progress)
    shards = _find_shards(reader)
    first = shards[0]
    if any((s.optimizer, s.hyper) != (first.optimizer, first.hyper) for s in shards[1:]):
        log.warning("PS shards of %s disagree on the optimizer or hyperparameters; using replica 0's", ckpt_dir)
    wanted = set(shards_to_read(first.size, replica_index, replica_size))
    mine = [s for s in shards if s.index in wanted]
    progress.total += sum(reader.size(s.rel / f"dim{dim}.{part}.npy")
                          for s in mine for dim in s.dims for part in _PARTS)
    current_optimizer, current_hyper, _ = store_config(store)
    optimizer = first.optimizer if first.optimizer is not None else current_optimizer
    hyper = first.hyper if first.hyper is not None else current_hyper
    dims = sorted({dim for s in shards for dim in s.dims})
    restored = RestoredShard(optimizer=first.optimizer, hyper=first.hyper)
    try:
        for dim in dims:
            restored.tables[dim] = _restore_table(reader, mine, dim, replica_index, replica_size, store,
                                                  optimizer, hyper)
    except ConfigError as exc:  # a width the store cannot hold
        raise CheckpointError(f"{ckpt_dir}: {exc}") from None
    return restored


def load_store(
    store: EmbeddingStore,
    ckpt_dir: Path,
    replica_index: int,
    replica_size: int,
    manifest_files: Mapping[str, Any] | None = None,
    *,
    check_sums: bool = True,
    progress: LoadProgress | None = None,
) -> int:
    """Replace the store's contents with replica ``replica_index`` of ``replica_size``'s share of a checkpoint.

    All or nothing: everything is read and built first (:func:`read_store`), then swapped in, so a
    corrupt file raises and leaves the store unchanged. The optimizer and hyperparameters the
    checkpoint carries replace the store's.

    Returns:
        The rows the store now holds.

    Raises:
        CheckpointError: As :func:`read_store`.
    """
    return read_store(store, ckpt_dir, replica_index, replica_size, manifest_files,
                      check_sums=check_sums, progress=progress).install(store)
