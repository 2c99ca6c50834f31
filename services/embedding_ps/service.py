"""Embedding parameter server replica: serves lookups and updates of its shard of the rows.

Handlers (see ``docs/protocol.md``): ``ps.<i>.lookup``, ``ps.<i>.update``, ``ps.<i>.configure``,
``ps.<i>.checkpoint``, ``ps.<i>.info``; it publishes on ``hot.rows.<i>`` the rows an update asks for
(hot rows, see ``embedding_worker_config.hot_row_min_count``). Each subject serves its requests one
at a time, so updates apply in arrival order. The RPC server serializes per subscription only, so
the handlers that touch the store also share one lock, which a checkpoint load holds (a load is atomic).
A checkpoint dump does not: it is a :class:`~persia_nats.core.store_checkpoint.LiveDump`, a consistent
snapshot of the store at the moment the request is handled, written in bounded steps on the event loop
between the lookups and updates it lets through (see ``docs/checkpoints.md``), so no request waits for
more than one step of it, whatever the table's size. ``info`` never waits.

With a checkpoint root configured (``checkpointing_config.checkpoint_dir``, ``PERSIA_CHECKPOINT_DIR``
or ``--checkpoint-dir``), the replica loads its shard of the newest valid checkpoint there before it
serves (see ``docs/checkpoints.md``).

With ``enable_incremental_update``, the replica writes the rows its updates change as deltas under
``incremental_dir`` (:mod:`.incremental`), and every checkpoint it loads is followed by the deltas written
after it (``docs/checkpoints.md``, "Incremental updates").
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from nats.aio.client import Client as NATS
from persia_nats.common.checkpoint import (
    CheckpointError,
    checkpoint_name,
    checkpoint_number,
    list_checkpoints,
    next_number,
    read_manifest,
    verify,
)
from persia_nats.common.codec import pack
from persia_nats.common.config import GlobalConfig
from persia_nats.common.errors import BadRequest, ConfigError, Conflict, PayloadTooLarge, RemoteError
from persia_nats.common.logs import figures
from persia_nats.common.messages import (
    Empty,
    HotRows,
    HotRowsGroup,
    Ok,
    PsCheckpoint,
    PsCheckpointReply,
    PsConfigure,
    PsInfoReply,
    PsLookup,
    PsLookupReply,
    PsUpdate,
    PsUpdateGroup,
    PsUpdateReply,
)
from persia_nats.common.service import Service
from persia_nats.common.storage import CheckpointRoot, open_root, pull_newest
from persia_nats.common.subjects import Subjects
from persia_nats.core.half import to_float, to_half
from persia_nats.core.plan import to_wire_dtype
from persia_nats.core.store import EmbeddingStore, warm_up
from persia_nats.core.store_checkpoint import DumpPace, LiveDump, LoadProgress, RestoredShard, read_store
from persia_nats.core.store_incremental import restore_deltas
from persia_nats.services.embedding_ps.incremental import DeltaWriter

log = logging.getLogger(__name__)

#: far more than can be in flight: a retry arrives within seconds of the original
APPLIED_IDS_KEPT = 100_000
#: seconds between a load's progress lines in the log (ps.<i>.info's waiting_for follows every block)
LOAD_LOG_EVERY = 5.0


def _str_keys(obj: Any) -> Any:
    """msgpack maps on this wire have string keys only (decoders run with strict_map_key)."""
    if isinstance(obj, dict):
        return {str(k): _str_keys(v) for k, v in obj.items()}
    return obj


_HALF = np.dtype(np.float16)


def _warm_up() -> float:
    """The store's kernels and the float16 conversion of lookup replies, compiled or loaded from cache."""
    started = time.perf_counter()
    warm_up()
    to_half(np.zeros((1, 1), np.float32))
    to_float(np.zeros((1, 1), np.float16), 1.0)
    return time.perf_counter() - started


def _gradients(group: PsUpdateGroup) -> np.ndarray:
    """A group's gradients as float32, its scale divided out (exactly: a power of two)."""
    if group.grads.dtype == np.float16:
        return to_float(group.grads, group.scale)[0]  # finite: the message was checked
    if group.scale != 1.0:
        return group.grads / np.float32(group.scale)
    # float32 gradients are used where they arrived, read-only in the message: no copy
    return group.grads.astype(np.float32, copy=False)


class EmbeddingParameterServer(Service):
    """One PS replica.

    Args:
        nc: The NATS connection.
        global_config: The job's config.
        replica_index: This replica.
        replica_size: Number of PS replicas.
        checkpoint_dir: The checkpoint root; None takes ``checkpointing_config.checkpoint_dir``
            ("" there: no root, so no load at start and ``ps.<i>.checkpoint`` is refused).
    """

    role = "embedding-parameter-server"

    def __init__(self, nc: NATS, global_config: GlobalConfig, replica_index: int = 0, replica_size: int = 1,
                 checkpoint_dir: str | None = None) -> None:
        super().__init__(nc)
        if not 0 <= replica_index < replica_size:
            raise ConfigError(f"replica index {replica_index} is outside 0..{replica_size - 1}")
        self.replica_index = replica_index
        self.replica_size = replica_size
        self.subjects = Subjects(global_config.common_config.job_name)
        ps_config = global_config.embedding_parameter_server_config
        self.store = EmbeddingStore(ps_config.capacity, initial_rows=ps_config.initial_rows)
        self.configured = False
        # what configure requests set: fixed for the process's life (a checkpoint's optimizer is not, so
        # a resumed job may train on with a new learning rate)
        self._configured_with: dict[str, Any] = {}
        self.configure_refused = 0
        self.refused: Counter[str] = Counter()
        self.max_reply_bytes = global_config.embedding_parameter_server_config.max_reply_bytes
        # ids of recently applied updates, so a retried update is applied once
        self._applied: OrderedDict[str, None] = OrderedDict()
        self.duplicate_updates = 0
        root = checkpoint_dir
        if root is None:
            root = global_config.common_config.checkpointing_config.checkpoint_dir
        #: the checkpoint root as configured (a path, or a URL mirrored in a local cache: persia_nats.common.storage)
        self.storage: CheckpointRoot | None = open_root(root) if root else None
        self.checkpoint_root: Path | None = self.storage.local if self.storage is not None else None
        self.loaded_checkpoint = ""
        #: what keeps the replica from serving lookups now ("" once it serves): its readiness on ps.<i>.info
        self.waiting_for = "start-up"
        self._store_lock = asyncio.Lock()
        #: work per step of a checkpoint dump, between the requests it lets through
        self.dump_pace = DumpPace()
        # the store's version: raised by every applied update, answered with every lookup and sent with
        # every published row, so a reader holding two copies of a row can tell which is newer. Started
        # from the clock, so a restarted replica's rows (a checkpoint reloaded) count as newer than any
        # copy taken before the restart.
        self.version = time.time_ns()
        self.rows_published = 0
        self.publish_failures = 0
        self.job = global_config.common_config.job_name
        #: incremental updates (enable_incremental_update): the deltas this replica writes, None when off
        self.incremental: DeltaWriter | None = None
        self.incremental_dir: Path | None = None
        if ps_config.enable_incremental_update:
            self.incremental_dir = Path(ps_config.incremental_dir)
            self.incremental = DeltaWriter(self.store, ps_config, self.job, replica_index, replica_size,
                                           self._store_lock, lambda: self.store.optimizer, self.checkpoint_root)
        #: deltas applied after the checkpoint loaded, and their rows
        self.deltas_applied = self.delta_rows_applied = 0

    def _bump_version(self) -> int:
        self.version = max(self.version + 1, time.time_ns())
        return self.version

    def _exclusive(self, handler: Callable[[Any], Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def run(msg: Any) -> Any:
            async with self._store_lock:
                return await handler(msg)

        return run

    async def start(self) -> None:
        s, i = self.subjects, self.replica_index
        # info first: a replica loading a large checkpoint answers "alive, not ready", so no liveness probe
        # kills it, and peers still find it only through its $SRV registration below, made once it serves
        await self.rpc.add(s.ps(i, "info"), self._on_info, concurrent=False, request=Empty)
        self.waiting_for = "its store kernels"
        took = await asyncio.to_thread(_warm_up)
        log.info("PS replica %d: store kernels ready in %.1f s", self.replica_index, took)
        if self.storage is not None and self.storage.remote is not None:
            self.waiting_for = "the download of the newest checkpoint"
            await asyncio.to_thread(pull_newest, self.storage)  # into the cache the loading reads
        if self.checkpoint_root is not None:
            await self._load_at_start(self.checkpoint_root)
        if self.incremental is not None:
            await self.incremental.start()
        await self.rpc.add(s.ps(i, "lookup"), self._exclusive(self._on_lookup), concurrent=False, request=PsLookup)
        await self.rpc.add(s.ps(i, "update"), self._exclusive(self._on_update), concurrent=False, request=PsUpdate)
        await self.rpc.add(s.ps(i, "configure"), self._exclusive(self._on_configure), concurrent=False,
                           request=PsConfigure)
        # not exclusive: a dump lets lookups and updates through (a load takes the lock itself)
        await self.rpc.add(s.ps(i, "checkpoint"), self._on_checkpoint, concurrent=False, request=PsCheckpoint)
        await self.serve_status(s.status(), i, f"ps-{i}")
        self.waiting_for = ""
        log.info("PS replica %d of %d serving", i, self.replica_size)

    async def _on_lookup(self, req: PsLookup) -> PsLookupReply:
        for k, g in enumerate(req.groups):
            self._served_dim(g.dim, f"groups[{k}].dim")
        reply_bytes = sum(4 * g.ids.shape[0] * g.dim for g in req.groups)
        if reply_bytes > self.max_reply_bytes:
            # refused before a row is read: answering, then finding the reply too large, peaked at GBs
            self.refused["lookup_too_large"] += 1
            raise PayloadTooLarge(f"a lookup of {reply_bytes} bytes of rows exceeds this PS's limit of "
                                  f"{self.max_reply_bytes} (embedding_parameter_server_config.max_reply_bytes)")
        # validated everything first: a bad group later in the list must not insert rows for earlier ones
        rows = [self.store.lookup(g.ids, g.dim, req.train) for g in req.groups]
        # a group that asked for half gets float16 unless a value is beyond its range (float32 then,
        # which the embedding worker takes as well): what the worker itself sends its NN workers
        sent = (to_wire_dtype(r, _HALF) if g.half else r for r, g in zip(rows, req.groups, strict=True))
        return PsLookupReply(tuple(sent), self.version)

    def _served_dim(self, dim: int, where: str) -> int:
        """``dim`` when this PS serves that width: one of the job's once it told them (PsLookup checked the range)."""
        dims = self._configured_with.get("dims")
        if dims is not None and dim not in dims:
            # a table per width nobody configured would reserve its rows for good
            self.refused["unconfigured_dim"] += 1
            raise BadRequest(f"{where}: width {dim} is none of the job's embedding widths {list(dims)}")
        return dim

    async def _on_update(self, req: PsUpdate) -> PsUpdateReply:
        update_id = req.update_id
        if update_id is not None and update_id in self._applied:
            self.duplicate_updates += 1
            return PsUpdateReply(0, duplicate=True)
        for k, g in enumerate(req.groups):
            self._served_dim(g.dim, f"groups[{k}].grads")
        updates = [(g.ids, _gradients(g), g.publish) for g in req.groups]
        missing = sum(self.store.update(ids, grads) for ids, grads, _ in updates)
        if self.incremental is not None:  # before any await: the tracked keys match the store at every step
            for ids, grads, _ in updates:
                self.incremental.updated(grads.shape[1], ids)
        version = self._bump_version()
        if update_id is not None:
            self._applied[update_id] = None
            if len(self._applied) > APPLIED_IDS_KEPT:
                self._applied.popitem(last=False)
        # published under the batch's public name: NN ranks match it, and the idempotency key stays unseen
        await self._publish_rows(updates, version, req.batch if req.batch is not None else update_id)
        return PsUpdateReply(int(missing))

    async def _publish_rows(self, updates: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]],
                            version: int, update_id: str | None) -> None:
        """The values and optimizer state the update left in the rows it was asked to publish.

        A cache refresh, not a request: a reader that misses one keeps the copy it has, whose version
        says how old it is, and reads the row again with its next lookup.
        """
        groups = []
        published = 0
        for ids, grads, publish in updates:
            if publish is None or not publish.size:
                continue
            chosen = ids[publish]
            # a row evicted before the update is not stored and has no value to send: it is named
            # apart, so readers still know the update reached it
            held, rows, state = self.store.read(chosen, grads.shape[1])
            groups.append(HotRowsGroup(chosen[held], rows, state, None if held.all() else chosen[~held]))
            published += int(held.sum())
        if not groups:
            return
        try:
            await self.nc.publish(self.subjects.hot_rows(self.replica_index),
                                  pack(HotRows(self.replica_index, version, update_id, tuple(groups)).to_wire()))
        except Exception as exc:  # the update is applied; only the readers' refresh is lost
            self.publish_failures += 1
            log.warning("PS replica %d: could not publish updated rows: %s", self.replica_index, exc)
            return
        self.rows_published += published

    async def _on_configure(self, req: PsConfigure) -> Ok:
        optimizer, hyper, dims = req.optimizer, req.hyper, req.dims
        given = {k: v for k, v in (("optimizer", optimizer), ("hyper", hyper), ("dims", dims)) if v is not None}
        changed = sorted(k for k, v in given.items() if self._configured_with.get(k, v) != v)
        if changed:
            # the job configures once (and again, identically, after a replica restarts); anyone else
            # changing it mid-run (SGD lr 1e6, say) would wreck every row the job has trained
            self.configure_refused += 1
            raise Conflict(f"{' and '.join(changed)} already configured for this run as "
                           f"{[self._configured_with[k] for k in changed]}; only an identical configure is accepted")
        if hyper is not None:
            self.store.set_hyper(hyper)
        if optimizer is not None:
            self.store.set_optimizer(optimizer)
            self.configured = True
        self._configured_with.update(given)
        log.info("PS replica %d configured", self.replica_index,
                 extra=figures({"optimizer": str(optimizer), "hyper": str(hyper), "dims": str(dims)}))
        return Ok()

    # -- checkpoints ---------------------------------------------------------------------------

    async def _load_at_start(self, root: Path) -> None:
        """Load this replica's shard of the newest checkpoint in ``root`` that verifies and loads.

        Like :func:`persia_nats.common.checkpoint.latest_valid`, but a checkpoint that verifies and still cannot
        be loaded (a replica's shard never made it in, say) also falls back to the previous one, and what is
        hashed is only what this replica reads (:meth:`_load`): a file damaged in another replica's shard
        makes that replica fall back, not this one.
        """
        for ckpt in await asyncio.to_thread(list_checkpoints, root):
            self.waiting_for = f"the load of checkpoint {ckpt.name}"
            try:
                rows = await self._load(ckpt)
            except CheckpointError as exc:
                log.warning("PS replica %d: checkpoint %s rejected: %s", self.replica_index, ckpt, exc.description)
                continue
            log.info("PS replica %d of %d loaded %d rows from checkpoint %s (optimizer %s)", self.replica_index,
                     self.replica_size, rows, ckpt, "restored" if self.configured else "not in the checkpoint")
            return
        log.info("PS replica %d: no valid checkpoint in %s; starting empty", self.replica_index, root)

    async def _load(self, ckpt: Path) -> int:
        """Check ``ckpt``, build this replica's share aside, then swap it in; the store is unchanged on error.

        Every listed file must be there at its listed size (a torn or truncated checkpoint is refused whole, by
        every replica alike), but only the files this replica reads are hashed, as it reads them: the other
        replicas' shards are theirs to check.
        """
        problems = await asyncio.to_thread(verify, ckpt, hash_files=False)
        if problems:
            raise CheckpointError(f"checkpoint {ckpt.name} is invalid: " + "; ".join(problems))
        files = (await asyncio.to_thread(read_manifest, ckpt))["files"]
        progress = LoadProgress(self._load_reporter(ckpt.name))
        started = time.perf_counter()
        try:
            restored: RestoredShard = await asyncio.to_thread(
                read_store, self.store, ckpt, self.replica_index, self.replica_size, files, progress=progress)
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {ckpt.name} is invalid: {exc.description}") from None
        log.info("PS replica %d: read %.3f GB of checkpoint %s (%d files, %d of them hashed) in %.1f s",
                 self.replica_index, progress.done / 1e9, ckpt.name, len(progress.files),
                 sum(progress.files.values()), time.perf_counter() - started)
        deltas = rows_applied = 0
        if self.incremental_dir is not None:
            deltas, rows_applied = await asyncio.to_thread(
                restore_deltas, restored, self.store, self.incremental_dir, job=self.job, base=ckpt.name,
                replica_index=self.replica_index, replica_size=self.replica_size)
        # swapped in on the event loop, so info and stats never see a half-replaced store
        rows = restored.install(self.store)
        self._bump_version()  # every row may have changed: copies taken before are older
        self.loaded_checkpoint = ckpt.name
        self.deltas_applied, self.delta_rows_applied = deltas, rows_applied
        if self.incremental is not None:
            self.incremental.reset(ckpt.name)
        if restored.optimizer is not None:
            self.configured = True
        return rows

    def _load_reporter(self, name: str) -> Callable[[LoadProgress], None]:
        """What a load's reading thread calls after every block: ``waiting_for`` says how far it is (ps.<i>.info
        shows it), and a line is logged at most every :data:`LOAD_LOG_EVERY` seconds."""
        logged = time.monotonic()

        def report(progress: LoadProgress) -> None:
            nonlocal logged
            said = progress.describe()
            self.waiting_for = f"the load of checkpoint {name}: {said}"  # one assignment: safe across threads
            now = time.monotonic()
            if now - logged >= LOAD_LOG_EVERY:
                logged = now
                log.info("PS replica %d: loading checkpoint %s: %s", self.replica_index, name, said)

        return report

    def _checkpoint_path(self, raw: str, action: str) -> Path:
        """The checkpoint directory a request names; inside the checkpoint root when there is one."""
        root = self.checkpoint_root
        if root is None:
            # a request must never make a PS write to, or read from, a path nobody configured for it
            raise BadRequest("this PS has no checkpoint root: set common_config.checkpointing_config.checkpoint_dir "
                             "(or PERSIA_CHECKPOINT_DIR / --checkpoint-dir)")
        path = Path(raw)
        if not path.is_absolute():
            path = root / path
        try:
            path = path.resolve()  # symlinks and '..' resolved before the containment check
        except (OSError, RuntimeError) as exc:  # a symlink loop, say
            raise BadRequest(f"dir {raw!r}: cannot be resolved: {exc}") from None
        if path == root or not path.is_relative_to(root):
            raise BadRequest(f"dir {raw!r} is outside the checkpoint root {root}")
        parsed = checkpoint_number(path.name)
        want_partial = action == "dump"
        # a dump creates directories, so only where the job's own counter would: a load may read deeper
        if parsed is None or parsed[1] != want_partial or (want_partial and path.parent != root):
            form = "ckpt-<number>.partial" if want_partial else "ckpt-<number>"
            raise BadRequest(f"dir {raw!r}: {action} needs a directory named {form} (8 ASCII digits)"
                             + (" directly in the checkpoint root" if want_partial else ""))
        if not want_partial and not path.is_dir():
            raise BadRequest(f"dir {raw!r}: no such checkpoint")
        if want_partial and not path.is_dir() and parsed[0] != next_number(root):
            # the job numbers checkpoints in sequence: a dump far ahead would move every later number there
            raise BadRequest(f"dir {raw!r}: a new partial checkpoint must be the next number, "
                             f"{checkpoint_name(next_number(root))}.partial")
        return path

    async def _on_checkpoint(self, req: PsCheckpoint) -> PsCheckpointReply:
        path = self._checkpoint_path(req.dir, req.action)
        if req.action == "load":
            async with self._store_lock:
                # lookups wait for the lock meanwhile: not ready, as at start
                before, self.waiting_for = self.waiting_for, f"the load of checkpoint {path.name}"
                try:
                    rows = await self._load(path)
                finally:
                    self.waiting_for = before
            log.info("PS replica %d loaded %d rows from checkpoint %s", self.replica_index, rows, path)
            return PsCheckpointReply(rows, checkpoint=path.name)
        began = None
        if self.incremental is not None:  # the delta cut at T0: later deltas follow this checkpoint
            parsed = checkpoint_number(path.name)
            name = checkpoint_name(parsed[0]) if parsed is not None else path.name
            began = functools.partial(self.incremental.dump_began, name)
        dump = LiveDump(self.store, path, self.replica_index, self.replica_size, self.dump_pace, on_begin=began)
        started = time.perf_counter()
        try:
            files = await dump.run()
        except OSError as exc:  # a full disk or a permission: the store is untouched, the caller must know
            log.error("PS replica %d: checkpoint dump to %s failed: %s", self.replica_index, path, exc)
            raise RemoteError(f"checkpoint dump to {path} failed: {exc}") from None
        rows = dump.rows
        log.info("PS replica %d dumped %d rows into %s in %.1f s, serving throughout", self.replica_index, rows,
                 path, time.perf_counter() - started)
        return PsCheckpointReply(rows, files={rel: {"size": size, "sha256": sha} for rel, (size, sha) in files.items()})

    def stats(self) -> dict[str, Any]:
        st = self.store.stats()
        return {"replica": self.replica_index, "configured": self.configured,
                "configure_refused": self.configure_refused, "duplicate_updates": self.duplicate_updates,
                "refused_unconfigured_dim": self.refused["unconfigured_dim"],
                "refused_lookup_too_large": self.refused["lookup_too_large"],
                "rows_published": self.rows_published,
                "rows_publish_failed": self.publish_failures, "loaded_checkpoint": self.loaded_checkpoint,
                "incremental_deltas_applied": self.deltas_applied,
                "incremental_rows_applied": self.delta_rows_applied,
                **(self.incremental.stats() if self.incremental is not None else {}),
                **{k: v for k, v in st.items() if isinstance(v, int | float)}}

    async def teardown(self) -> None:
        if self.incremental is not None:  # what was tracked since the last delta is written before the end
            await self.incremental.close()

    async def _on_info(self, _req: Empty) -> PsInfoReply:
        return PsInfoReply(self.replica_index, self.replica_size, self.configured, _str_keys(self.store.stats()),
                           self.loaded_checkpoint, not self.waiting_for, self.waiting_for)
