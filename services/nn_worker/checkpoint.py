"""Whole-job checkpoints, coordinated by NN rank 0 at a step boundary.

A checkpoint holds what a restarted job needs to go on: every PS replica's rows with their
optimizer state (written by the replicas themselves, ``ps.<i>.checkpoint``), the dense model and
the dense optimizer, the training step, the sync mode, and the ingestion stream's position. It is
cut where nothing is in flight: every rank first waits until its gradients are applied, the ranks
meet at a barrier, rank 0 asks every replica to dump (each snapshots its table as the request arrives and
writes it while it goes on serving), takes the dense model and optimizer as bytes and reads the stream's
position, and the ranks meet again. A periodic checkpoint is then finished in the background (the
replicas' replies, the dense files, the manifest) while training goes on, one at a time: a dump of a
large table takes tens of seconds, which training used to wait out. An explicit one
(:meth:`TrainCtx.dump_checkpoint`, the final one) is finished before it returns. Files go into
``ckpt-N.partial`` and :func:`persia_nats.common.checkpoint.finalize` makes the checkpoint visible in
one rename, its manifest (with every file's checksum) written last.

Restoring is split the same way: a PS replica loads its shard itself when it starts (so a replica
that crashed alone comes back with the latest state and the others keep theirs); an NN worker
loads the dense model, the dense optimizer and the step when it enters :class:`TrainCtx`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from persia_nats.common import checkpoint as ck
from persia_nats.common.discovery import discover_replica_size
from persia_nats.common.errors import RemoteError
from persia_nats.common.messages import Empty, PsCheckpoint, PsCheckpointReply, PsInfoReply
from persia_nats.common.rpc import request, request_with_retry
from persia_nats.common.storage import open_root, prune_remote, publish
from persia_nats.dense.checkpoint import MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, torch_bytes

if TYPE_CHECKING:
    from persia_nats.services.nn_worker.ctx import TrainCtx

log = logging.getLogger(__name__)

#: loading a checkpoint into a 100M-row table reads gigabytes
PS_LOAD_TIMEOUT = 1800.0
#: the share more room than the estimate a dump asks for: tables grow between checkpoints
SPACE_MARGIN = 1.25


def bytes_needed(root: Path, dense_bytes: int) -> int:
    """What a new checkpoint under ``root`` will take, estimated: the newest one's files (its PS shards
    included) where there is one, else the dense model and optimizer alone, with :data:`SPACE_MARGIN`."""
    newest = ck.list_checkpoints(root)
    size = dense_bytes
    if newest:
        try:
            manifest = ck.read_manifest(newest[0])
            size = max(size, sum(int(d["size"]) if isinstance(d, dict) else int(d[0])
                                 for d in manifest["files"].values()))
        except ck.CheckpointError:  # a torn newest checkpoint says nothing about size: the dense part does
            pass
    return int(size * SPACE_MARGIN)


def check_free_space(root: Path, needed: int) -> None:
    """Refuse a dump the disk under ``root`` cannot hold, before anything is written: a full disk would
    otherwise fail it half-way (ENOSPC), after the PS replicas spent their time dumping.

    Raises:
        CheckpointError: naming the path, the bytes needed and the bytes free.
    """
    free = shutil.disk_usage(root).free
    if free < needed:
        raise ck.CheckpointError(f"{root}: a checkpoint needs about {needed} bytes (the newest one's size with "
                                 f"{SPACE_MARGIN - 1:.0%} margin) but {free} are free; nothing was written")


def _dense_bytes(ctx: TrainCtx) -> int:
    assert ctx.model is not None
    tensors = [*ctx.model.state_dict().values(), *(v for st in ctx.dense_optimizer.state_dict()["state"].values()
                                                   for v in st.values())]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Checkpointer:
    """Takes checkpoints of a training job every ``every_batches`` steps / ``every_sec`` seconds / on demand.

    Every rank calls :meth:`after_step` after each dense step (idle steps included), so all ranks
    take the same decision at the same step: the step count is global, and the time-based and
    on-demand decisions are rank 0's, broadcast every ``check_every`` steps. While no rank has a batch
    to train on, every rank calls :meth:`when_idle` instead, at the same point: a checkpoint asked for
    is taken then, at once, rather than at a next step that may be long in coming.
    """

    def __init__(self, ctx: TrainCtx, root: str | Path, every_batches: int = 0, every_sec: float = 0.0,
                 keep: int = 3, check_every: int = 10) -> None:
        self.ctx = ctx
        #: a path, or a URL whose local cache the PS replicas and this rank write (persia_nats.common.storage)
        self.storage = open_root(str(root))
        self.root = self.storage.local
        self.every_batches = every_batches
        self.every_sec = every_sec
        self.keep = keep
        self.check_every = max(1, check_every)
        self._last_time = time.monotonic()
        self.taken: list[Path] = []
        #: rank 0's failed checkpoints, each ``{"step", "error"}``, for the job's result
        self.failed: list[dict[str, Any]] = []
        #: rank 0's periodic checkpoint being finished in the background, at most one
        self._pending: concurrent.futures.Future[Path] | None = None
        self._finisher: concurrent.futures.ThreadPoolExecutor | None = None

    def _due(self, step: int) -> bool:
        if self.every_batches and step % self.every_batches == 0:
            return True
        if step % self.check_every:
            return False
        rt = self.ctx.runtime
        wanted = False
        if self.ctx.rank == 0:
            wanted = bool(self.every_sec and time.monotonic() - self._last_time >= self.every_sec)
            wanted = wanted or bool(rt is not None and rt.checkpoint_requests)
            if wanted and self.busy():  # the one before is still being written: asked again at a later step
                wanted = False
        return self._agree(wanted)

    def _agree(self, wanted: bool) -> bool:
        """Rank 0's ``wanted``, on every rank (a collective when there are several)."""
        if self.ctx.dense_sync is not None:
            import torch.distributed as dist

            flag = torch.tensor([1.0 if wanted else 0.0], device=self.ctx.device)
            dist.broadcast(flag, src=0)
            wanted = bool(flag.item())
        return wanted

    def after_step(self, step: int) -> Path | None:
        """A checkpoint at ``step`` when one is due, finished in the background (None returned: the path
        is in :attr:`taken` once it is written)."""
        if not self._due(step):
            return None
        return self.dump(step, background=True)

    def busy(self) -> bool:
        """Rank 0 is still finishing a periodic checkpoint."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Let the periodic checkpoint being finished in the background end (rank 0; a no-op elsewhere)."""
        pending = self._pending
        if pending is not None:
            concurrent.futures.wait([pending])
        if self._finisher is not None:
            self._finisher.shutdown(wait=True)
            self._finisher = None

    def when_idle(self) -> Path | None:
        """No rank has a batch to train on: every rank is between steps, where a checkpoint is consistent,
        so one asked for on demand is taken now (at the current step) instead of waiting for a step.
        Collective like :meth:`after_step`: every rank calls it at the same point."""
        rt = self.ctx.runtime
        if not self._agree(self.ctx.rank == 0 and rt is not None and bool(rt.checkpoint_requests)):
            return None
        log.info("taking the checkpoint asked for while waiting for batches, at step %d", self.ctx.steps)
        return self.dump(self.ctx.steps)

    def dump(self, step: int, final: bool = False, background: bool = False) -> Path | None:
        """Collective: every rank calls it at the same step; rank 0 writes and returns the checkpoint.

        A failure is logged and counted (:attr:`failed`), and training goes on: the previous checkpoint
        still stands. ``final`` (the checkpoint a job ends with) under ``checkpointing_config.final_required``:
        rank 0 raises :class:`~persia_nats.common.checkpoint.CheckpointError` instead, once the ranks met.
        ``background``: return once the cut is taken (the replicas asked, the dense part in memory, the
        stream's position read) and finish the checkpoint while training goes on; None is returned.
        """
        ctx = self.ctx
        self.wait()  # one checkpoint at a time, and an explicit one after the periodic one before it
        ctx.wait_for_gradients()
        sync = ctx.dense_sync
        if sync is not None:
            sync.barrier()
        path: Path | None = None
        error: BaseException | None = None
        if ctx.rank == 0:
            started = time.perf_counter()
            try:
                cut = self._cut(step)
                if background:
                    self._finish_in_background(cut, started)
                else:
                    path = self._finish(cut)
                    log.info("checkpoint %s written in %.2fs at step %d", path, time.perf_counter() - started, step)
            except Exception as exc:  # a failed checkpoint must not end training: the previous one still stands
                error = exc
                self._failed(step, exc)
            self._last_time = time.monotonic()
            rt = ctx.runtime
            if rt is not None and not (background and error is None):
                rt.checkpoint_done(path, error)
        if sync is not None:
            sync.barrier()
        if path is not None:
            self.taken.append(path)
        if error is not None and final and ctx.global_config.common_config.checkpointing_config.final_required:
            raise ck.CheckpointError(f"the final checkpoint at step {step} in {self.root} failed: "
                                     f"{self.failed[-1]['error']} (checkpointing_config.final_required: true)")
        return path

    def _failed(self, step: int, exc: BaseException) -> None:
        said = exc.description if isinstance(exc, ck.CheckpointError) else f"{type(exc).__name__}: {exc}"
        self.failed.append({"step": step, "error": said[:500]})
        if isinstance(exc, ck.CheckpointError):  # a refusal that says it all: no traceback
            log.error("checkpoint at step %d failed: %s", step, exc)
        else:
            log.error("checkpoint at step %d failed", step, exc_info=exc)

    def _finish_in_background(self, cut: _Cut, started: float) -> None:
        """Finish ``cut`` on a thread of its own while training goes on; :attr:`taken` / :attr:`failed` and
        the on-demand requests learn the outcome when it is written."""
        if self._finisher is None:
            self._finisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._pending = self._finisher.submit(self._finish, cut)
        log.info("checkpoint at step %d: the replicas are dumping; training goes on while it is written", cut.step)

        def done(fut: concurrent.futures.Future[Path]) -> None:
            path: Path | None = None
            error = fut.exception()
            if error is None:
                path = fut.result()
                self.taken.append(path)
                log.info("checkpoint %s written in %.2fs at step %d, training throughout", path,
                         time.perf_counter() - started, cut.step)
            else:
                self._failed(cut.step, error)
            rt = self.ctx.runtime
            if rt is not None:
                rt.checkpoint_done(path, error)

        self._pending.add_done_callback(done)

    def summary(self) -> dict[str, Any]:
        """Checkpoints taken and failed (rank 0's figures; other ranks write none), for the job's result."""
        self.wait()
        return {"taken": len(self.taken), "failed": len(self.failed), "failures": self.failed[-5:],
                "last": str(self.taken[-1]) if self.taken else None}

    def _cut(self, step: int) -> _Cut:
        """Where training stands at ``step`` (every gradient applied, the ranks met): each replica asked to
        dump (a replica snapshots its table as the request arrives; the requests are at the server before
        this returns, so ahead of any update of a later step, which goes through an embedding worker first),
        the dense model and optimizer as bytes, and
        the stream's position."""
        ctx = self.ctx
        assert ctx.io is not None and ctx.runtime is not None and ctx.model is not None
        self.root.mkdir(parents=True, exist_ok=True)
        check_free_space(self.root, bytes_needed(self.root, _dense_bytes(ctx)))
        number = ck.next_number(self.root)
        partial = ck.partial_dir(self.root, number)
        partial.mkdir(parents=True)
        rt, subjects, timeout = ctx.runtime, ctx.subjects, ctx.timeout
        # a request lost to a nats-server restart is never answered: the bound keeps training from waiting on it
        dump_timeout = ctx.global_config.common_config.checkpointing_config.dump_timeout_sec

        async def ask() -> tuple[int, list[asyncio.Task[Any]], dict[str, Any] | None]:
            size = await discover_replica_size(rt.nc, subjects, timeout, deadline=60)
            replies = [asyncio.ensure_future(request(rt.nc, subjects.ps(i, "checkpoint"),
                                                     PsCheckpoint("dump", str(partial.resolve())), dump_timeout))
                       for i in range(size)]
            await asyncio.sleep(0)  # each request published
            await rt.nc.flush(timeout=max(1, int(timeout)))  # and at the server
            return size, replies, await _stream_position(rt)

        size, replies, stream = ctx.io.run(ask(), timeout=timeout * 4 + 60)
        dense = {MODEL_FILE: torch_bytes(ctx.model.state_dict()),
                 OPTIMIZER_FILE: torch_bytes(ctx.dense_optimizer.state_dict())}
        nn_cfg = ctx.global_config.nn_worker_config
        state = {"step": step, "world_size": ctx.world_size, "ps_replicas": size,
                 "sync_mode": nn_cfg.sync_mode, "embedding_staleness": nn_cfg.embedding_staleness,
                 "job_name": ctx.global_config.common_config.job_name, "stream": stream}
        return _Cut(step, partial, replies, dense, state, dump_timeout)

    def _finish(self, cut: _Cut) -> Path:
        """The replicas' dumps awaited, the dense part and the state written, the checkpoint made visible."""
        ctx = self.ctx
        assert ctx.io is not None

        async def replies() -> tuple[dict[str, Any], int]:
            files: dict[str, Any] = {}
            rows = 0
            for raw in await asyncio.gather(*cut.replies):
                reply = PsCheckpointReply.from_wire(raw)
                if reply.files is None:
                    raise RemoteError("a PS replica answered a checkpoint dump without its files")
                files.update(reply.files)
                rows += reply.rows
            return files, rows

        try:
            ps_files, rows = ctx.io.run(replies(), timeout=cut.dump_timeout + 120)
        except BaseException:
            for task in cut.replies:  # none left waiting on the loop for a checkpoint given up
                ctx.io.call_soon(task.cancel)
            raise
        files: dict[str, Any] = dict(ps_files)
        for name, data in cut.dense.items():
            (cut.partial / name).parent.mkdir(parents=True, exist_ok=True)
            files[name] = ck.write_bytes_atomic(cut.partial / name, data)
        state = dict(cut.state, ps_rows=rows)
        files[STATE_FILE] = ck.write_bytes_atomic(cut.partial / STATE_FILE, json.dumps(state, indent=1).encode())
        final = ck.finalize(cut.partial, files, extra={"step": cut.step, "ps_replicas": state["ps_replicas"]})
        ck.prune(self.root, self.keep)
        if self.storage.remote is not None:
            publish(self.storage, final)  # files, then the manifest: the remote checkpoint exists once it is there
            prune_remote(self.storage, self.keep)
        return final


@dataclass(frozen=True, slots=True)
class _Cut:
    """A checkpoint cut at a step: what :meth:`Checkpointer._finish` needs to write it."""

    step: int
    partial: Path  # ckpt-N.partial, the replicas' shards going in
    replies: list[asyncio.Task[Any]]  # each replica's answer to its dump request, on the job's loop
    dense: dict[str, bytes]  # the dense model's and optimizer's files
    state: dict[str, Any]  # state.json less the rows the replicas report
    dump_timeout: float


async def _stream_position(rt: Any) -> dict[str, Any] | None:
    """The ingestion consumer's position (None when the job has no stream, or when it could not be read,
    which is logged: the checkpoint is still whole, only its record of the position is missing)."""
    from nats.js.errors import NotFoundError

    try:
        info = await rt.nc.jetstream().consumer_info(rt.subjects.stream, rt.subjects.stream_consumer, timeout=5)
    except NotFoundError:  # a job fed by plain publishes has no stream
        return None
    except Exception as exc:  # noqa: BLE001 (a checkpoint must not fail on what it only records)
        # a NATS user without $JS.API.CONSUMER.INFO (deploy/nats-auth.conf's NN_WORKER has it) times out here
        log.warning("checkpoint: the ingestion consumer %s/%s's position could not be read (%s: %s); this "
                    "checkpoint records none", rt.subjects.stream, rt.subjects.stream_consumer,
                    type(exc).__name__, exc)
        return None
    return {"stream": rt.subjects.stream, "consumer": rt.subjects.stream_consumer,
            "ack_floor": info.ack_floor.stream_seq, "delivered": info.delivered.stream_seq,
            "ack_pending": info.num_ack_pending, "pending": info.num_pending}


async def load_ps(rt: Any, ckpt: Path, timeout: float) -> int:
    """Have every PS replica load its shard of ``ckpt`` (resharding when the replica count changed)."""
    size = await discover_replica_size(rt.nc, rt.subjects, timeout, deadline=60)
    return await _load_on(rt, ckpt, range(size))


async def _load_on(rt: Any, ckpt: Path, replicas: Iterable[int]) -> int:
    """Have the PS ``replicas`` load ``ckpt`` at once; the rows they loaded."""
    path = str(await asyncio.to_thread(lambda: Path(ckpt).resolve()))
    replies = await asyncio.gather(*(
        request_with_retry(rt.nc, rt.subjects.ps(i, "checkpoint"), PsCheckpoint("load", path),
                           PS_LOAD_TIMEOUT, deadline=PS_LOAD_TIMEOUT)
        for i in replicas))
    return sum(PsCheckpointReply.from_wire(r).rows for r in replies)


#: seconds the replicas get to be found serving when a resumed worker checks what they loaded
PS_FIND_DEADLINE_S = 120.0


def _number(name: str) -> int:
    """A loaded checkpoint's number; -1 for none (or a name the job does not write)."""
    parsed = ck.checkpoint_number(name) if name else None
    return parsed[0] if parsed is not None else -1


def ahead_of(held: list[str], ckpt: Path | None) -> list[int]:
    """The replicas holding a checkpoint newer than ``ckpt``, the one the resuming worker chose.

    The worker hashes every file of a checkpoint and a replica only the files it reads, so a replica can
    accept a checkpoint the worker refused (a damaged file of another shard), never the other way round;
    and a replica that has trained on since its start loaded it at that start, before any checkpoint newer
    than the worker's could exist. So a replica ahead of the worker loaded what the job must not run on,
    and one behind it is live (an NN worker restarted alone): only the first are told to reload."""
    want = -1 if ckpt is None else _number(ckpt.name)
    return [i for i, name in enumerate(held) if _number(name) > want]


async def align_ps(rt: Any, ckpt: Path | None, timeout: float) -> list[int]:
    """Have the PS replicas that loaded a checkpoint newer than ``ckpt`` (:func:`ahead_of`) load ``ckpt``;
    returns them. Without ``ckpt`` (nothing valid to resume from) they are only reported: their rows stay,
    and the job's first checkpoint replaces them."""
    size = await discover_replica_size(rt.nc, rt.subjects, timeout, deadline=PS_FIND_DEADLINE_S)
    infos = await asyncio.gather(*(request(rt.nc, rt.subjects.ps(i, "info"), Empty(), timeout) for i in range(size)))
    held = [PsInfoReply.from_wire(raw).loaded_checkpoint for raw in infos]
    ahead = ahead_of(held, ckpt)
    if not ahead:
        return []
    found = sorted({held[i] for i in ahead})
    if ckpt is None:
        log.error("no valid checkpoint to resume from, but PS replica(s) %s loaded %s at their start (a file of "
                  "another shard is damaged): their rows stay", ahead, found)
        return ahead
    log.warning("PS replica(s) %s loaded %s, which this worker found damaged in another shard; it resumes from "
                "%s, and so do they", ahead, found, ckpt.name)
    await _load_on(rt, ckpt, ahead)
    return ahead
