"""PERSIA's NN-worker contexts: ``EmbeddingCtx``, ``TrainCtx`` and ``eval_ctx``, the user's API.

The dense model lives here, in PyTorch; embeddings come from the embedding workers over NATS. Entering a
context builds the rank: its event loop and runtime (:class:`~persia_nats.services.nn_worker.rank_loop.RankLoop`,
the only way from this thread onto that loop), and for training the dense group
(:func:`~persia_nats.services.nn_worker.dense_sync.join_dense_group`), the
:class:`~persia_nats.services.nn_worker.checkpoint.Checkpointer` and the
:class:`~persia_nats.services.nn_worker.step.TrainStep`, which ``TrainCtx.backward`` runs: the dense backward
and optimizer step, the embedding gradients pushed back in the background so the next batch starts at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import logging
import math
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch
from persia_nats.common.batch import BatchSchema, PersiaBatch
from persia_nats.common.config import BatchErrorPolicy, GlobalConfig
from persia_nats.common.discovery import discover_replica_size
from persia_nats.common.env import Env, read_env
from persia_nats.common.messages import GatheredSlots, PsConfigure, SlotEmbedding
from persia_nats.common.optim_config import EmbeddingHyperparams
from persia_nats.common.rpc import request_with_retry
from persia_nats.common.service import connect_from_env
from persia_nats.common.settings import global_config_from_env
from persia_nats.common.subjects import Subjects
from persia_nats.core.adjoint import warm_up as warm_up_adjoint
from persia_nats.dense.tensors import EmbeddingLeaves, embedding_tensors, to_tensor
from persia_nats.services.nn_worker.checkpoint import Checkpointer, DenseJob
from persia_nats.services.nn_worker.dense_sync import DenseSync, join_dense_group
from persia_nats.services.nn_worker.figures import TrainingFigures
from persia_nats.services.nn_worker.hot_rows import RowMirror
from persia_nats.services.nn_worker.metrics import CallTimes, start_nn_metrics
from persia_nats.services.nn_worker.rank_loop import RankLoop
from persia_nats.services.nn_worker.runtime import HotRowSettings, NNRuntime, TrainingBatch
from persia_nats.services.nn_worker.step import BatchError, Forward, TrainStep

log = logging.getLogger(__name__)

_current: contextvars.ContextVar[EmbeddingCtx | None] = contextvars.ContextVar("persia_ctx", default=None)


def current_ctx() -> EmbeddingCtx:
    """The innermost entered context (what PERSIA's ``cnt_ctx()`` returns)."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("no PERSIA context is active: enter a TrainCtx or eval_ctx first")
    return ctx


class PreprocessMode(enum.IntEnum):
    TRAIN = 1
    EVAL = 2
    INFERENCE = 3


_FIGURE_NAME = re.compile(r"[a-z][a-z0-9_]*")


class EmbeddingCtx:
    """Connects to the job and turns looked-up batches into tensors for the model.

    Args:
        preprocess_mode: TRAIN or EVAL.
        model: the dense ``torch.nn.Module`` called as ``model(non_id_tensors, embedding_tensors)``.
        embedding_config: initialisation, admission and weight bound pushed to every PS on enter.
        device_id: CUDA device index; None trains on the CPU.
    """

    def __init__(self, preprocess_mode: PreprocessMode = PreprocessMode.EVAL, model: torch.nn.Module | None = None,
                 embedding_config: EmbeddingHyperparams | None = None, device_id: int | None = None, *,
                 env: Env | None = None, global_config: GlobalConfig | None = None) -> None:
        self.preprocess_mode = preprocess_mode
        self.model = model
        self.embedding_config = embedding_config
        self.env = env or read_env()
        self.global_config = global_config or global_config_from_env(self.env)
        self.subjects = Subjects(self.global_config.common_config.job_name)
        self.timeout = self.global_config.nn_worker_config.request_timeout_sec
        # embedding gradients travel in the dtype embeddings come in (embedding_worker_config.wire_dtype)
        wire = self.global_config.embedding_worker_config.wire_dtype
        self._grad_wire_dtype = np.dtype(wire)
        if device_id is not None and torch.cuda.is_available():
            visible = torch.cuda.device_count()
            if not 0 <= device_id < visible:
                # an index past the host's GPUs is a mistake (ranks share GPUs by index: PERSIA_SHARE_GPUS)
                raise ValueError(f"device_id={device_id}, but {visible} CUDA device(s) are visible: run at most "
                                 f"{visible} NN worker(s) per host on GPUs, or pass device_id=None to train on "
                                 "the CPU (persia.env.get_device_id() picks one of the two)")
            self.device = torch.device("cuda", device_id)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        #: the rank's event loop and runtime, once entered
        self.loop: RankLoop | None = None
        self._token: contextvars.Token[EmbeddingCtx | None] | None = None
        self.metrics_server: Any = None  # the rank's Prometheus endpoint (metrics_config.enable_metrics)
        self._reported_at: int | None = None  # the endpoint's scrape count at the last report()

    @property
    def runtime(self) -> NNRuntime | None:
        """The rank's runtime (its counters and figures), once entered."""
        return self.loop.runtime if self.loop is not None else None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def __enter__(self) -> EmbeddingCtx:
        metrics = self.global_config.common_config.metrics_config
        calls = CallTimes() if metrics is not None and metrics.enable_metrics else None

        async def setup() -> NNRuntime:
            nc = await connect_from_env(self.env, f"nn-worker-{self.rank}")
            loader_config = self.global_config.data_loader_config
            # a sync-mode lookup starts once every earlier gradient is applied: the rows it reads are
            # the newest there are, and hot rows would only cost
            hot = None
            if self.global_config.embedding_worker_config.hot_row_min_count != 0 \
                    and self.global_config.nn_worker_config.sync_mode != "sync":
                hot = HotRowSettings(max_bytes=self.global_config.nn_worker_config.hot_row_cache_bytes,
                                     optimizer=self._mirror_optimizer())
                RowMirror.warm_up()
            return NNRuntime.build(nc, self.subjects, rank=self.rank, world_size=self.world_size,
                                   timeout=self.timeout, schema=BatchSchema.from_config(None, loader_config),
                                   max_deliveries=loader_config.max_deliveries, hot_rows=hot,
                                   reconfigure=self._ps_configurer(nc),
                                   checkpoint_enabled=self._checkpoints_on_demand(),
                                   observe_call=calls.observe if calls is not None else None,
                                   gather_on_device=self.gather_on_device)

        self.loop = loop = RankLoop.open(f"persia-nn-{self.rank}", setup)
        try:
            warm_up_adjoint()
            loop.configure_ps()
            loop.start()
            if calls is not None:
                self.metrics_server = loop.serve_metrics(
                    lambda rt: start_nn_metrics(rt, metrics, calls=calls, local_rank=self.env.local_rank))
        except BaseException:  # a PS that never answers, say: the loop and its connection go with the context
            EmbeddingCtx.__exit__(self, None, None, None)
            raise
        self._token = _current.set(self)
        if self.model is not None:
            self.model.to(self.device)
            self.model.train(self.preprocess_mode == PreprocessMode.TRAIN)
        return self

    def _ps_message(self) -> PsConfigure | None:
        if self.embedding_config is None:
            return None
        return PsConfigure(hyper=self.embedding_config)

    def _mirror_optimizer(self) -> tuple[Any, float] | None:
        """The embedding optimizer and weight bound the hot-row copies apply gradients in flight with."""
        return None

    def _checkpoints_on_demand(self) -> bool:
        return False

    def _ps_configurer(self, nc: Any) -> Callable[[], Awaitable[int]] | None:
        """Registers this context's embedding settings on every PS (returns the replica count); None
        without any to register."""
        msg = self._ps_message()
        if msg is None:
            return None
        s, timeout = self.subjects, self.timeout

        async def configure() -> int:
            size = await discover_replica_size(nc, s, timeout, deadline=120)
            for i in range(size):
                await request_with_retry(nc, s.ps(i, "configure"), msg, timeout, deadline=120)
            return size

        return configure

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        if self.loop is not None:
            try:
                self.loop.close()
            finally:
                self.loop = None
                if self.metrics_server is not None:
                    wait = self.global_config.common_config.metrics_config.final_scrape_seconds
                    self.metrics_server.close(wait, self._reported_at)
                    self.metrics_server = None
                    self._reported_at = None

    # -- features -----------------------------------------------------------------------------------

    @property
    def gather_on_device(self) -> bool:
        """The gathered widths' slots are built on this rank's device (``nn_worker_config.embedding_gather``)."""
        place = self.global_config.nn_worker_config.embedding_gather
        return place == "device" or (place == "auto" and self.device.type == "cuda")

    def _embedding_tensors(self, embeddings: Sequence[SlotEmbedding], requires_grad: bool,
                           gathered: Sequence[GatheredSlots] = ()) -> tuple[list[torch.Tensor], EmbeddingLeaves]:
        return embedding_tensors(embeddings, self.device, requires_grad, gathered)

    def prepare_features(self, batch: TrainingBatch | PersiaBatch
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
        """(non-id tensors, embedding tensors, label tensors or None), on this context's device."""
        runtime = self.runtime
        with runtime.figures.host_work() if runtime is not None else contextlib.nullcontext():
            tb = self._as_training_batch(batch)
            train = self.preprocess_mode == PreprocessMode.TRAIN and tb.requires_grad
            inputs, leaves = self._embedding_tensors(tb.embeddings, requires_grad=train,
                                                     gathered=tb.gathered if tb.gathered_on_device else ())
            self._took(tb, leaves)
            non_id = [to_tensor(a.data, self.device) for a in tb.non_id]
            labels = [to_tensor(a.data, self.device) for a in tb.labels] if tb.labels else None
        return non_id, inputs, labels

    def _took(self, batch: TrainingBatch, leaves: EmbeddingLeaves) -> None:
        """The model's input for ``batch`` was made (a training context's step keeps its leaves)."""

    def forward(self, batch: TrainingBatch | PersiaBatch) -> Forward:
        """Run the model on a batch: returns ``(output, labels)``."""
        if self.model is None:
            raise RuntimeError("this context has no model")
        non_id, emb, labels = self.prepare_features(batch)
        if self.preprocess_mode == PreprocessMode.TRAIN:
            return self.model(non_id, emb), labels
        with torch.no_grad():
            return self.model(non_id, emb), labels

    def get_embedding_from_data(self, batch: PersiaBatch) -> TrainingBatch:
        """Look a batch up directly (no buffering, no insertion of unseen ids)."""
        return self._as_training_batch(batch)

    def _as_training_batch(self, batch: TrainingBatch | PersiaBatch) -> TrainingBatch:
        if isinstance(batch, TrainingBatch):
            return batch
        if not isinstance(batch, PersiaBatch):
            raise TypeError(f"expected a PersiaBatch or a looked-up batch, got {type(batch).__name__}")
        emb = self._entered().lookup_direct(batch.ingest_request())
        return TrainingBatch(batch_id=-1, non_id=batch.non_id_wire(), labels=batch.labels_wire(), embeddings=emb,
                             requires_grad=False, meta=batch.meta, batch_size=batch.batch_size)

    def ps_info(self) -> list[dict[str, Any]]:
        """Each PS replica's info (rows, memory, counters)."""
        return self._entered().ps_info()

    def _entered(self) -> RankLoop:
        if self.loop is None:
            raise RuntimeError("enter the context first (with TrainCtx(...) as ctx / with eval_ctx() as ctx)")
        return self.loop

    def get_embedding_size(self) -> list[int]:
        """Rows held by each PS replica."""
        return [int(info["stats"]["rows"]) for info in self.ps_info()]

    def report(self, **figures: float) -> None:
        """Publish the script's own figures (``test_auc=0.91``) as gauges ``persia_nn_worker_<name>``
        on this rank's metrics endpoint and in its ``status``, until replaced or the context exits.
        A context that exits before a scrape has read them waits for one (up to
        ``metrics_config.final_scrape_seconds``, and only where Prometheus has scraped this process).

        Raises:
            ValueError: a name that is not a lower-case identifier, or a value that is not a finite number.
        """
        for name, value in figures.items():
            if not _FIGURE_NAME.fullmatch(name):
                raise ValueError(f"report(): figure name {name!r} must match {_FIGURE_NAME.pattern}")
            if isinstance(value, bool) or not isinstance(value, int | float | np.number) or not math.isfinite(value):
                raise ValueError(f"report(): {name}={value!r} is not a finite number")
        if self.runtime is None:
            raise RuntimeError("report() needs the context entered")
        self.runtime.figures.report({name: float(value) for name, value in figures.items()})
        if self.metrics_server is not None:
            self._reported_at = self.metrics_server.clock.scrapes


class TrainCtx(EmbeddingCtx):
    """Training context: dense optimizer, embedding optimizer, backward.

    Args:
        embedding_optimizer: ``persia.embedding.optim.{SGD, Adagrad, Adam}``, registered on every PS.
        dense_optimizer: a ``torch.optim`` optimizer over the model's parameters.
        mixed_precision: use ``torch.autocast`` + GradScaler; honoured on CUDA only.
        clip_grad_norm: if set, clip the dense gradients' global norm to this value before the step.
        checkpoint_dir: checkpoint root (default: ``checkpointing_config.checkpoint_dir`` or
            ``PERSIA_CHECKPOINT_DIR``); checkpoints are taken every ``checkpoint_every_batches`` steps
            and ``checkpoint_every_sec`` seconds (defaults from ``checkpointing_config``; 0: never)
            and on demand (``persia-launcher checkpoint``).
        resume: on enter, load the dense model, dense optimizer and step of the newest valid
            checkpoint in ``checkpoint_dir`` (default: ``checkpointing_config.resume``).
        on_batch_error: what an error raised by the model's forward or by backward does (default:
            ``nn_worker_config.on_batch_error``). ``stop``: :class:`BatchError`, naming the batch, ends
            the loop. ``skip``: the batch is counted (``batches_failed``), logged and given back;
            ``forward`` returns a stand-in output of zeros shaped like the first label so the loop's loss
            still computes, and ``backward`` then trains nothing; every rank still takes the step. A
            stream batch is delivered again, and dead-lettered with the error once it has failed
            ``data_loader_config.max_deliveries`` times. ``auto``: skip stream batches, stop on others.
    """

    def __init__(self, embedding_optimizer: Any, dense_optimizer: torch.optim.Optimizer, *,
                 model: torch.nn.Module, embedding_config: EmbeddingHyperparams | None = None,
                 mixed_precision: bool = True, device_id: int | None = None, clip_grad_norm: float | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every_batches: int | None = None,
                 checkpoint_every_sec: float | None = None, resume: bool | None = None,
                 on_batch_error: BatchErrorPolicy | None = None,
                 env: Env | None = None, global_config: GlobalConfig | None = None) -> None:
        super().__init__(PreprocessMode.TRAIN, model, embedding_config or EmbeddingHyperparams(), device_id,
                         env=env, global_config=global_config)
        self.on_batch_error = on_batch_error or self.global_config.nn_worker_config.on_batch_error
        if self.on_batch_error not in ("auto", "skip", "stop"):
            raise ValueError(f"on_batch_error must be 'auto', 'skip' or 'stop', got {on_batch_error!r}")
        self.embedding_optimizer = embedding_optimizer
        self.dense_optimizer = dense_optimizer
        self.clip_grad_norm = clip_grad_norm
        self.mixed_precision = mixed_precision and self.device.type == "cuda"
        if mixed_precision and not self.mixed_precision:
            log.info("mixed precision needs CUDA; training in float32 on %s", self.device)
        ckcfg = self.global_config.common_config.checkpointing_config
        self.checkpoint_dir = checkpoint_dir if checkpoint_dir is not None else (ckcfg.checkpoint_dir or None)
        self._every = (ckcfg.every_batches if checkpoint_every_batches is None else checkpoint_every_batches,
                       ckcfg.every_sec if checkpoint_every_sec is None else checkpoint_every_sec)
        self.resume = ckcfg.resume if resume is None else resume
        self.resumed_from: str | None = None
        #: the ranks' collectives, once entered with several ranks
        self.dense_sync: DenseSync | None = None
        #: periodic and on-demand checkpoints into ``checkpoint_dir``, once entered
        self.checkpointer: Checkpointer | None = None
        #: backward and the dense step, once entered
        self.step: TrainStep | None = None
        self._dumped: list[dict[str, Any]] = []  # each dump_checkpoint's Checkpointer.summary()

    @property
    def steps(self) -> int:
        """Global steps taken (a resumed job counts on from its checkpoint's)."""
        return self.step.steps if self.step is not None else 0

    @property
    def backend(self) -> str | None:
        """The dense group's ``torch.distributed`` backend (None for a lone rank)."""
        return self.dense_sync.backend if self.dense_sync is not None else None

    def __enter__(self) -> TrainCtx:
        super().__enter__()
        try:
            loop = self._entered()
            if self.world_size > 1:
                self.dense_sync = join_dense_group(loop, self._model(), self.device, rank=self.rank,
                                                   world_size=self.world_size)
            if self.checkpoint_dir:
                every_batches, every_sec = self._every
                self.checkpointer = self._checkpointer(self.checkpoint_dir, every_batches=every_batches,
                                                       every_sec=every_sec)
            self.step = self._new_step(loop, loop.runtime.figures)
            if self.checkpoint_dir and self.resume:
                self._resume()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _model(self) -> torch.nn.Module:
        assert self.model is not None  # TrainCtx takes it as a required argument
        return self.model

    def _new_step(self, loop: RankLoop | None, figures: TrainingFigures) -> TrainStep:
        """This context's step over ``loop`` (None: no job behind it), counting into ``figures``."""
        return TrainStep(model=self._model(), dense_optimizer=self.dense_optimizer, device=self.device, loop=loop,
                         figures=figures, on_batch_error=self.on_batch_error, grad_wire_dtype=self._grad_wire_dtype,
                         mixed_precision=self.mixed_precision, clip_grad_norm=self.clip_grad_norm,
                         dense_sync=self.dense_sync, checkpointer=self.checkpointer)

    def _checkpointer(self, root: str | os.PathLike[str], every_batches: int = 0,
                      every_sec: float = 0.0) -> Checkpointer:
        cfg = self.global_config
        ckcfg, nn_cfg = cfg.common_config.checkpointing_config, cfg.nn_worker_config
        job = DenseJob(model=self._model(), optimizer=self.dense_optimizer, rank=self.rank,
                       world_size=self.world_size, device=self.device, job_name=cfg.common_config.job_name,
                       sync_mode=nn_cfg.sync_mode, embedding_staleness=nn_cfg.embedding_staleness,
                       dump_timeout=ckcfg.dump_timeout_sec, final_required=ckcfg.final_required)
        return Checkpointer(root, loop=self._entered(), job=job, dense_sync=self.dense_sync,
                            every_batches=every_batches, every_sec=every_sec, keep=ckcfg.keep)

    def _train_step(self) -> TrainStep:
        if self.step is None:
            raise RuntimeError("enter the TrainCtx first (with TrainCtx(...) as ctx)")
        return self.step

    def _resume(self) -> None:
        from persia_nats.common.checkpoint import latest_valid
        from persia_nats.common.storage import open_root, pull_newest
        from persia_nats.dense.checkpoint import load_dense

        assert self.checkpoint_dir is not None
        root = open_root(self.checkpoint_dir)
        if root.remote is not None:
            pull_newest(root)
        ckpt = latest_valid(root.local)
        if self.rank == 0:
            # the replicas chose their checkpoint at start, each from the files it reads: make it this one
            self._entered().align_ps(ckpt)
        if self.dense_sync is not None:
            self.dense_sync.barrier()
        if ckpt is None:
            log.info("no checkpoint in %s: training starts afresh", self.checkpoint_dir)
            return
        state = load_dense(ckpt, self._model(), self.dense_optimizer, map_location=self.device)
        self._train_step().resume_at(int(state.get("step", 0)))
        self.resumed_from = str(ckpt)
        log.info("resumed from %s at step %d", ckpt, self.steps)

    def dump_checkpoint(self, dst_dir: str | os.PathLike[str], final: bool = True) -> str | None:
        """Checkpoint the whole job into the root ``dst_dir`` (collective: every rank calls it).

        Returns the checkpoint's directory on rank 0, None on the others. The PS replicas write
        their shards themselves, so ``dst_dir`` must be a path they see too (inside their
        configured ``checkpoint_dir`` when they have one). Where the disk under ``dst_dir`` has less
        room than the newest checkpoint there took (25% margin), nothing is written.

        Raises:
            CheckpointError: on rank 0, the checkpoint failed, ``final`` is true (the checkpoint the job
                ends with) and ``checkpointing_config.final_required`` (the default) is set. Otherwise a
                failure returns None; either way :meth:`checkpoint_summary` reports it.
        """
        dumper = self._checkpointer(dst_dir)
        if self.checkpointer is not None:  # a periodic one still being written goes first
            self.checkpointer.wait()
        try:
            path = dumper.dump(self.steps, final=final)
        finally:
            self._dumped.append(dumper.summary())
        return str(path) if path is not None else None

    def job_account(self, min_trained_share: float | None = None) -> dict[str, Any]:
        """What became of every batch the job was given (collective: every rank calls it, after training).

        ``trained_once``, ``trained_more_than_once``, ``trained`` (steps, repeats included) and
        ``redelivered_not_retrained`` (redeliveries of batches already trained, acknowledged instead) sum every
        rank's; on rank 0 ``published``, ``dead_lettered`` (and ``dead_lettered_by_reason``), ``left`` and
        ``lost`` come from the ingestion stream (:mod:`~persia_nats.services.nn_worker.account`),
        ``overcounted`` the outcomes beyond the batches published (a batch counted twice), and
        ``failure`` is one line saying why the job must not exit 0, or None (the other ranks: always
        None). ``min_trained_share``: default ``data_loader_config.min_trained_share``.
        """
        from persia_nats.services.nn_worker.account import verdict

        loop = self._entered()
        rt = loop.runtime
        self.wait_for_gradients()  # a batch is trained once its gradients are applied and it is acknowledged
        seqs = rt.acks.trained_seqs
        local = [sum(1 for n in seqs.values() if n == 1), sum(1 for n in seqs.values() if n > 1),
                 sum(seqs.values()), rt.counters["batches_failed"], rt.counters["lookup_failures"],
                 rt.counters["grad_failures"], rt.counters["stream_redelivered_not_retrained"]]
        if self.dense_sync is not None:
            import torch.distributed as dist

            summed = torch.tensor(local, dtype=torch.float64)
            dist.all_reduce(summed)
            local = [int(x) for x in summed.tolist()]
        account: dict[str, Any] = dict(zip(("trained_once", "trained_more_than_once", "trained", "batches_failed",
                                            "lookup_failures", "grad_failures", "redelivered_not_retrained"),
                                           local, strict=True))
        account["failure"] = None
        stream = loop.stream_account() if self.rank == 0 else None
        if stream is not None:
            account.update(stream)
            unaccounted = (account["published"] - account["trained_once"] - account["trained_more_than_once"]
                           - account["dead_lettered"] - account["left"])
            account["lost"] = max(0, unaccounted)
            # more outcomes than batches: one batch counted twice (trained and dead-lettered), which can hide a
            # lost one; said, not failed on, as no batch is known lost
            account["overcounted"] = max(0, -unaccounted)
            if unaccounted < 0 and not account.get("stream_made_again"):  # made again: the counts mean nothing
                log.warning("job account: %d outcome(s) more than the %d batch(es) published: some batch was "
                            "counted twice (trained and dead-lettered?)", -unaccounted, account["published"])
            share = self.global_config.data_loader_config.min_trained_share if min_trained_share is None \
                else min_trained_share
            account["failure"] = verdict(account, share)
            if account["failure"] is not None:
                log.error("job failed its account: %s", account["failure"])
        return account

    def checkpoint_summary(self) -> dict[str, Any]:
        """Checkpoints taken and failed by this rank (rank 0 writes them all), periodic and explicit:
        ``{"taken", "failed", "failures": [{"step", "error"}], "last", "final"}``; ``final`` is the last
        :meth:`dump_checkpoint`'s ``{"path"}`` or ``{"error"}`` (None without one)."""
        parts = [*([self.checkpointer.summary()] if self.checkpointer is not None else []), *self._dumped]
        out: dict[str, Any] = {"taken": sum(p["taken"] for p in parts), "failed": sum(p["failed"] for p in parts),
                               "failures": [f for p in parts for f in p["failures"]][-5:],
                               "last": next((p["last"] for p in reversed(parts) if p["last"]), None), "final": None}
        if self._dumped:
            last = self._dumped[-1]
            out["final"] = {"error": last["failures"][-1]["error"]} if last["failed"] else {"path": last["last"]}
        return out

    def load_checkpoint(self, src_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """Load a checkpoint (or the newest valid one under a root): dense model and optimizer here,
        every PS replica its shard (resharded when the replica count changed). Returns its state."""
        from persia_nats.common.checkpoint import MANIFEST, CheckpointError, latest_valid, verify
        from persia_nats.dense.checkpoint import load_dense

        loop, step = self._entered(), self._train_step()
        path = Path(src_dir)
        if (path / MANIFEST).exists():
            ckpt: Path | None = path
            problems = verify(path)
            if problems:
                raise CheckpointError(f"{path}: " + "; ".join(problems))
        else:
            ckpt = latest_valid(path)  # verified already: no second hashing of every shard
        if ckpt is None:
            raise CheckpointError(f"no valid checkpoint in {src_dir}")
        state = load_dense(ckpt, self._model(), self.dense_optimizer, map_location=self.device)
        if self.rank == 0:
            loop.load_ps(ckpt)
        if self.dense_sync is not None:
            self.dense_sync.barrier()
        step.resume_at(int(state.get("step", 0)))
        return state

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self.checkpointer is not None:  # a periodic checkpoint being written is finished, not abandoned
                self.checkpointer.wait()
            super().__exit__(exc_type, exc, tb)
        finally:
            if self.dense_sync is not None:
                self.dense_sync.close()
                self.dense_sync = None

    def _ps_message(self) -> PsConfigure | None:
        msg = super()._ps_message() or PsConfigure()
        cfg = getattr(self.embedding_optimizer, "config", self.embedding_optimizer)
        return dataclasses.replace(msg, optimizer=cfg)

    def _mirror_optimizer(self) -> tuple[Any, float] | None:
        # what the PSs run once configured, for the hot-row gradients still in flight
        # (persia_nats.services.nn_worker.hot_rows); without embedding hyperparameters the PSs keep their defaults
        hyper = self.embedding_config if self.embedding_config is not None else EmbeddingHyperparams()
        cfg = getattr(self.embedding_optimizer, "config", self.embedding_optimizer)
        return (cfg, hyper.weight_bound)

    def _checkpoints_on_demand(self) -> bool:
        return bool(self.checkpoint_dir)

    def _took(self, batch: TrainingBatch, leaves: EmbeddingLeaves) -> None:
        self._train_step().took(batch, leaves)

    def forward(self, batch: TrainingBatch | PersiaBatch) -> Forward:
        """Run the model on a batch: returns ``(output, labels)``. With mixed precision the model runs under
        float16 autocast and its float16 outputs come back as float32. A batch the model raises on is dealt
        with as ``on_batch_error`` says (see the class)."""
        return self._train_step().forward(batch, lambda: super(TrainCtx, self).forward(batch))

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward, dense step, and the embedding gradients sent back (in the background)."""
        return self._train_step().backward(loss)

    def trained(self, batch: TrainingBatch) -> bool:
        """Whether :meth:`backward` ran for ``batch`` (the last batch it ran for)."""
        return self._train_step().trained(batch)

    def finish_batch(self, batch: TrainingBatch) -> None:
        """The training loop is done with ``batch``: when no backward ran for it, give back what its
        lookup holds and join the step without it. The DataLoader calls it."""
        self._train_step().finish_batch(batch)

    def checkpoint_while_waiting(self) -> None:
        """A lone rank waiting for its next batch is between steps: a checkpoint asked for is taken now
        (several ranks take it together in their idle step)."""
        self._train_step().while_waiting()

    def idle_step(self, done: bool = True) -> bool:
        """This rank has no batch for this step: join the step's collective with zero gradients. ``done``:
        it is out of batches for good (else it has none yet). False once every rank is out, which ends
        training on every rank. The DataLoader calls it."""
        return self._train_step().idle_step(done)

    def wait_for_gradients(self) -> None:
        """Block until every gradient sent so far has been applied (or reported as failed)."""
        self._entered().flush_grads()


def eval_ctx(*args: Any, **kwargs: Any) -> EmbeddingCtx:
    """An evaluation context: no gradients, and the PS never inserts unseen ids."""
    return EmbeddingCtx(PreprocessMode.EVAL, *args, **kwargs)


__all__ = ["BatchError", "EmbeddingCtx", "PreprocessMode", "TrainCtx", "current_ctx", "eval_ctx"]
