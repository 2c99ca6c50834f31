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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from persia_nats.common import checkpoint as ck
from persia_nats.common.storage import open_root, prune_remote, publish
from persia_nats.dense.checkpoint import MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, torch_bytes
from persia_nats.services.nn_worker.dense_sync import DenseSync
from persia_nats.services.nn_worker.rank_loop import RankLoop

log = logging.getLogger(__name__)
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


@dataclass(frozen=True, slots=True)
class DenseJob:
    """What a checkpoint holds of the dense side and records of the job, and how rank 0 takes it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    rank: int
    world_size: int
    device: torch.device
    job_name: str
    sync_mode: str
    embedding_staleness: int
    #: each replica's dump answers within this (``checkpointing_config.dump_timeout_sec``)
    dump_timeout: float
    #: the checkpoint a job ends with must succeed (``checkpointing_config.final_required``)
    final_required: bool

    def dense_bytes(self) -> int:
        tensors = [*self.model.state_dict().values(),
                   *(v for st in self.optimizer.state_dict()["state"].values() for v in st.values())]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Checkpointer:
    """Takes checkpoints of a training job every ``every_batches`` steps / ``every_sec`` seconds / on demand.

    Every rank calls :meth:`after_step` after each dense step (idle steps included), so all ranks
    take the same decision at the same step: the step count is global, and the time-based and
    on-demand decisions are rank 0's, broadcast every ``check_every`` steps. While no rank has a batch
    to train on, every rank calls :meth:`when_idle` instead, at the same point: a checkpoint asked for
    is taken then, at once, rather than at a next step that may be long in coming.
    """

    def __init__(self, root: str | Path, *, loop: RankLoop, job: DenseJob, dense_sync: DenseSync | None,
                 every_batches: int = 0, every_sec: float = 0.0, keep: int = 3, check_every: int = 10) -> None:
        """``dense_sync``: the ranks' collectives (None for a lone rank), which every decision is agreed over."""
        self.loop = loop
        self.job = job
        self.dense_sync = dense_sync
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
        wanted = False
        if self.job.rank == 0:
            wanted = bool(self.every_sec and time.monotonic() - self._last_time >= self.every_sec)
            wanted = wanted or self.loop.checkpoint_asked()
            if wanted and self.busy():  # the one before is still being written: asked again at a later step
                wanted = False
        return self._agree(wanted)

    def _agree(self, wanted: bool) -> bool:
        """Rank 0's ``wanted``, on every rank (a collective when there are several)."""
        if self.dense_sync is not None:
            import torch.distributed as dist

            flag = torch.tensor([1.0 if wanted else 0.0], device=self.job.device)
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

    def when_idle(self, step: int) -> Path | None:
        """No rank has a batch to train on: every rank is between steps (at ``step``), where a checkpoint is
        consistent, so one asked for on demand is taken now instead of waiting for a step.
        Collective like :meth:`after_step`: every rank calls it at the same point."""
        if not self._agree(self.job.rank == 0 and self.loop.checkpoint_asked()):
            return None
        log.info("taking the checkpoint asked for while waiting for batches, at step %d", step)
        return self.dump(step)

    def dump(self, step: int, final: bool = False, background: bool = False) -> Path | None:
        """Collective: every rank calls it at the same step; rank 0 writes and returns the checkpoint.

        A failure is logged and counted (:attr:`failed`), and training goes on: the previous checkpoint
        still stands. ``final`` (the checkpoint a job ends with) under ``checkpointing_config.final_required``:
        rank 0 raises :class:`~persia_nats.common.checkpoint.CheckpointError` instead, once the ranks met.
        ``background``: return once the cut is taken (the replicas asked, the dense part in memory, the
        stream's position read) and finish the checkpoint while training goes on; None is returned.
        """
        self.wait()  # one checkpoint at a time, and an explicit one after the periodic one before it
        self.loop.flush_grads()
        sync = self.dense_sync
        if sync is not None:
            sync.barrier()
        path: Path | None = None
        error: BaseException | None = None
        if self.job.rank == 0:
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
            if not (background and error is None):
                self.loop.checkpoint_done(path, error)
        if sync is not None:
            sync.barrier()
        if path is not None:
            self.taken.append(path)
        if error is not None and final and self.job.final_required:
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
            self.loop.checkpoint_done(path, error)

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
        the dense model and optimizer as bytes, and the stream's position."""
        job = self.job
        self.root.mkdir(parents=True, exist_ok=True)
        check_free_space(self.root, bytes_needed(self.root, job.dense_bytes()))
        number = ck.next_number(self.root)
        partial = ck.partial_dir(self.root, number)
        partial.mkdir(parents=True)
        size, replies, stream = self.loop.ask_to_dump(partial, job.dump_timeout)
        dense = {MODEL_FILE: torch_bytes(job.model.state_dict()),
                 OPTIMIZER_FILE: torch_bytes(job.optimizer.state_dict())}
        state = {"step": step, "world_size": job.world_size, "ps_replicas": size, "sync_mode": job.sync_mode,
                 "embedding_staleness": job.embedding_staleness, "job_name": job.job_name, "stream": stream}
        return _Cut(step, partial, replies, dense, state, job.dump_timeout)

    def _finish(self, cut: _Cut) -> Path:
        """The replicas' dumps awaited, the dense part and the state written, the checkpoint made visible."""
        ps_files, rows = self.loop.gather_dumps(cut.replies, timeout=cut.dump_timeout + 120)
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
