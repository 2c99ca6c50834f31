"""PERSIA's data API on the NN side: ``StreamingDataset``, ``IterableDataset``, ``DataLoader``."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

from persia_nats.common.batch import PersiaBatch
from persia_nats.common.logs import figures
from persia_nats.common.messages import GatheredSlots
from persia_nats.services.nn_worker.ctx import EmbeddingCtx, PreprocessMode, TrainCtx, current_ctx
from persia_nats.services.nn_worker.progress import LiveLine
from persia_nats.services.nn_worker.runtime import EndOfStream, Pipeline, StalenessGate, TrainingBatch

log = logging.getLogger(__name__)


class StreamingDataset:
    """Batches sent by data loaders (``DataCtx.send_data``) to this NN rank.

    Args:
        buffer_size: batches received but not yet looked up; beyond it loaders are told "busy".
    """

    def __init__(self, buffer_size: int = 10) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self.buffer_size = buffer_size


class IterableDataset:
    """Batches this process produces itself: subclass and implement ``__iter__`` yielding PersiaBatch.

    Batches with ``requires_grad=False`` are looked up directly (eval: nothing is inserted). When
    several NN ranks train on an IterableDataset, each must yield the same number of batches (as with
    DDP); batches sent by data loaders (StreamingDataset) have no such constraint.
    """

    def __init__(self, buffer_size: int = 10) -> None:
        self.buffer_size = buffer_size

    def __iter__(self) -> Iterator[PersiaBatch]:
        raise NotImplementedError("subclass IterableDataset and yield PersiaBatch objects")


def _staleness_for(ctx: EmbeddingCtx, explicit: int | None) -> int | None:
    if explicit is not None:
        return explicit
    cfg = ctx.global_config.nn_worker_config
    if cfg.sync_mode == "sync":
        return 1
    if cfg.sync_mode == "async":
        return None
    return cfg.embedding_staleness


class DataLoader:
    """Iterate looked-up batches, ready for ``ctx.forward``.

    Args:
        dataset: a StreamingDataset (batches from data loaders) or an IterableDataset.
        forward_buffer_size: batches looked up ahead of the training loop.
        embedding_staleness: at most this many batches looked up but whose gradients are not yet
            applied (None: from ``nn_worker_config``: 1 in sync mode, ``embedding_staleness`` in
            hybrid mode, unbounded in async mode).
        ctx: the context to use (default: the innermost entered one).
        log_interval_s: seconds between progress log lines (samples/s and observed staleness).
        live_bar: draw a self-overwriting progress line on stderr (default: when stderr is a terminal).
    """

    #: how long a rank of several waits for its next batch before it joins the step without one
    FIRST_WAIT_S = 1.0
    #: while the other ranks train and this one has no batch, it joins each of their steps within this
    STARVED_WAIT_S = 0.02
    #: how often a lone rank waiting for its next batch looks for a checkpoint asked for meanwhile
    IDLE_CHECK_S = 0.5

    def __init__(self, dataset: StreamingDataset | IterableDataset, forward_buffer_size: int = 10,
                 timeout_ms: int = 600_000, num_workers: int = 10, reproducible: bool = False,
                 embedding_staleness: int | None = None, *, ctx: EmbeddingCtx | None = None,
                 log_interval_s: float = 10.0, live_bar: bool | None = None) -> None:
        if forward_buffer_size < 1:
            raise ValueError(f"forward_buffer_size must be >= 1, got {forward_buffer_size}")
        self.dataset = dataset
        self.forward_buffer_size = forward_buffer_size
        self.timeout_s = timeout_ms / 1000
        self.embedding_staleness = embedding_staleness
        self._ctx = ctx
        self.gate: StalenessGate | None = None
        self.log_interval_s = log_interval_s
        # a live bar only where a person watches a terminal; structured log lines everywhere
        self._live_bar = sys.stderr.isatty() if live_bar is None else live_bar
        self._last_bar = 0.0
        self.batches = self.samples = 0
        self._started: float | None = None
        self._last_log = 0.0

    @property
    def ctx(self) -> EmbeddingCtx:
        return self._ctx or current_ctx()

    def __iter__(self) -> Iterator[TrainingBatch]:
        if isinstance(self.dataset, StreamingDataset):
            return self._iter_stream()
        if isinstance(self.dataset, IterableDataset):
            return self._iter_local()
        raise TypeError(f"DataLoader needs a StreamingDataset or IterableDataset, got {type(self.dataset).__name__}")

    def _iter_stream(self) -> Iterator[TrainingBatch]:
        ctx = self.ctx
        loop = ctx._entered()
        train = ctx.preprocess_mode == PreprocessMode.TRAIN
        self.gate = StalenessGate(_staleness_for(ctx, self.embedding_staleness)) if train else None
        loop.runtime.serve_loader(gate=self.gate, incoming_limit=self.dataset.buffer_size)
        sync = train and ctx.global_config.nn_worker_config.sync_mode == "sync" and self.embedding_staleness is None
        pipeline = loop.open_pipeline(gate=self.gate, forward_buffer_size=self.forward_buffer_size, train=train,
                                      on_demand=sync)
        dense = getattr(ctx, "dense_sync", None)
        line = LiveLine() if self._live_bar else None
        try:
            with line if line is not None else contextlib.nullcontext():
                batches = self._lockstep(ctx, pipeline, dense, sync) if dense is not None else \
                    self._plain(ctx, pipeline)
                for item in loop.runtime.figures.host_timed(batches):
                    self._progress(item, line)
                    yield item
                if line is not None and self._started is not None:
                    line.end(self._bar_text(time.monotonic()))  # the final counts, not the last redraw's
            self._log_progress("done")
        finally:
            loop.close_pipeline(pipeline)

    def _plain(self, ctx: EmbeddingCtx, pipeline: Pipeline) -> Iterator[TrainingBatch]:
        while True:
            item = self._next_alone(ctx, pipeline)
            if isinstance(item, EndOfStream):
                return
            yield item
            _release_if_untrained(ctx, item)

    def _next_alone(self, ctx: EmbeddingCtx, pipeline: Pipeline) -> TrainingBatch | EndOfStream:
        """The next batch of a lone rank, within ``timeout_ms``. While it waits the rank is between steps:
        it takes a checkpoint asked for then (``persia-launcher checkpoint`` on an idle job answers at
        once), checking every :attr:`IDLE_CHECK_S`."""
        pending = ctx._entered().next_batch(pipeline)
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    return pending.result(max(0.0, min(self.IDLE_CHECK_S, left)))
                except concurrent.futures.TimeoutError:
                    if pending.done():  # the coroutine's own TimeoutError, not this wait's
                        raise
                    if left <= self.IDLE_CHECK_S:
                        raise TimeoutError(f"rank {ctx.rank} received no batch in {self.timeout_s:.0f} s "
                                           "(DataLoader timeout_ms)") from None
                if isinstance(ctx, TrainCtx):
                    ctx.checkpoint_while_waiting()
        finally:
            pending.cancel()  # a no-op once it is done

    def _progress(self, item: TrainingBatch, line: LiveLine | None) -> None:
        now = time.monotonic()
        if self._started is None:
            self._started = self._last_log = self._last_bar = now
        self.batches += 1
        self.samples += item.batch_size
        runtime = self.ctx.runtime
        if runtime is not None and now > self._started:
            runtime.figures.set_gauge("samples_per_second", self.samples / (now - self._started))
        if line is not None and now - self._last_bar >= 0.2:
            self._last_bar = now
            line.draw(self._bar_text(now))
        if now - self._last_log >= self.log_interval_s:
            self._last_log = now
            self._log_progress("progress")

    def _loss(self) -> float | None:
        runtime = self.ctx.runtime
        return None if runtime is None else runtime.figures.loss()

    def _bar_text(self, now: float) -> str:
        """The live line, for a person watching a terminal."""
        assert self._started is not None
        rate = self.samples / max(now - self._started, 1e-9)
        gate = self.gate
        stale = f"  staleness {gate.inflight}/{gate.bound if gate.bound else 'inf'}" if gate else ""
        loss = self._loss()
        shown = f"  loss {loss:.4f}" if loss is not None else ""
        return f"[persia] batches {self.batches:>7}  samples {self.samples:>10}  {rate:>9.0f}/s{shown}{stale}"

    def _log_progress(self, event: str) -> None:
        """A plain line (every ``log_interval_s`` and at the end): what a log collector or honcho shows."""
        if self._started is None:
            return
        elapsed = max(time.monotonic() - self._started, 1e-9)
        gate = self.gate
        loss = self._loss()
        log.info("training %s", event, extra=figures({
            "batches": self.batches, "samples": self.samples, "samples_per_s": round(self.samples / elapsed),
            "loss": None if loss is None else round(loss, 4), "staleness": gate.inflight if gate else 0,
            "max_staleness": gate.max_inflight if gate else 0, "bound": gate.bound if gate else None}))

    def _lockstep(self, ctx: TrainCtx, pipeline: Pipeline, dense: Any, sync: bool) -> Iterator[TrainingBatch]:
        """Global steps across ranks: each step every rank joins one collective, with a batch or without.

        A rank out of batches steps idle until every rank is done. A rank that has no batch *yet* waits
        :attr:`FIRST_WAIT_S`, then joins the step without one, and while the other ranks keep training
        it joins each of their steps within :attr:`STARVED_WAIT_S`: a rank waiting for a batch must not
        hold the others in their all-reduce, since what it waits for may sit behind their batches (a
        stream's end marker is delivered once every earlier batch is acknowledged, and redeliveries can
        leave one rank with all the rest). Its own wait for a batch stays bounded by ``timeout_ms``.
        """
        loop = ctx._entered()
        item: TrainingBatch | EndOfStream | None = None
        pending: concurrent.futures.Future[TrainingBatch | EndOfStream] | None = None
        starved_s, told = 0.0, 0.0
        try:
            while True:
                if sync:
                    # every rank's gradients for earlier batches are applied before any rank looks up
                    ctx.wait_for_gradients()
                    dense.barrier()
                if not isinstance(item, EndOfStream):
                    if pending is None:
                        pending = loop.next_batch(pipeline)
                    wait = self.STARVED_WAIT_S if starved_s and dense.active else self.FIRST_WAIT_S
                    try:
                        item = pending.result(wait)
                    except concurrent.futures.TimeoutError:
                        starved_s += wait
                        if starved_s >= self.timeout_s:
                            raise TimeoutError(f"rank {ctx.rank} received no batch in {self.timeout_s:.0f} s "
                                               "(DataLoader timeout_ms)") from None
                        if starved_s - told >= 10:
                            told = starved_s
                            log.info("rank %d has had no batch for %.0f s; stepping with the other ranks "
                                     "(%d trained at the last step)", ctx.rank, starved_s, dense.active)
                        ctx.idle_step(done=False)
                        continue
                    pending, starved_s, told = None, 0.0, 0.0
                if not isinstance(item, EndOfStream):
                    # the caller's backward() joins this step's all-reduce, with "I had a batch" in it
                    yield item
                    ctx.finish_batch(item)  # with no backward for it, it still joins the step, empty-handed
                elif not ctx.idle_step():
                    break
        finally:
            if pending is not None:
                pending.cancel()
        dense.broadcast_state()  # BatchNorm statistics differ per rank

    def _iter_local(self) -> Iterator[TrainingBatch]:
        ctx = self.ctx
        loop = ctx._entered()
        train = ctx.preprocess_mode == PreprocessMode.TRAIN
        for batch in self.dataset:
            req = batch.ingest_request()
            gathered: tuple[GatheredSlots, ...] = ()
            if train and batch.requires_grad:
                ref, emb, gathered = loop.ingest_and_lookup(req, timeout=self.timeout_s)
            else:
                ref, emb = None, loop.lookup_direct(req, timeout=self.timeout_s)
            item = TrainingBatch(batch_id=-1, non_id=batch.non_id_wire(), labels=batch.labels_wire(), embeddings=emb,
                                 requires_grad=batch.requires_grad and train, meta=batch.meta, ref=ref,
                                 batch_size=batch.batch_size, gathered=gathered,
                                 gathered_on_device=ctx.gather_on_device and bool(gathered))
            yield item
            _release_if_untrained(ctx, item)


def _release_if_untrained(ctx: EmbeddingCtx, item: TrainingBatch) -> None:
    """A training batch the loop ran no backward for gives back what its lookup holds (TrainCtx.finish_batch)."""
    if isinstance(ctx, TrainCtx) and item.requires_grad:
        ctx.finish_batch(item)
