"""Inference service: answers ``serve.predict`` from the newest valid checkpoint, reloading newer ones.

Handlers (see ``docs/protocol.md``, "Serving"): ``persia.<job>.serve.predict`` and
``persia.<job>.serve.info``, both in queue group ``serve`` so replicas share the load; plus the
status broadcast and the ``$SRV`` registration (``persia-serving``) every role has.

Reloading: every ``reload_interval`` seconds the checkpoint root is listed; a final checkpoint
numbered above the one served is verified (every file re-hashed against its manifest) and loaded
into a new :class:`~persia_nats.services.serving.snapshot.Snapshot` in a worker thread, while requests keep
being answered from the current one. The new snapshot replaces the old in one assignment on the
event loop, between requests' reads of it: a request uses the snapshot it started with, so none
ever sees half of a load. A checkpoint that fails (torn, corrupt, weights that do not fit the
model) is logged, counted and remembered, so it is not re-hashed at every poll; the next older one
still newer than the served one is tried instead. A rejected checkpoint whose files change (a copy
that was still in progress) is tried again.

Following a running job: with ``embedding_parameter_server_config.enable_incremental_update``, a
checkpoint is loaded with every delta written after it under ``incremental_dir``, and every
``incremental_poll_interval_sec`` the deltas written since are applied to the served rows, between
requests (:mod:`persia_nats.services.serving.incremental`). ``serve.info`` and the stats say how fresh
the rows are: ``incremental_delta_age_seconds`` (since the newest applied delta's copy began on its
PS) and ``incremental_applied_timestamp_seconds`` (when it was applied here).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from nats.aio.client import Client as NATS
from persia_nats.common.batch import BatchSchema
from persia_nats.common.checkpoint import checkpoint_number, list_checkpoints
from persia_nats.common.config import EmbeddingConfig, GlobalConfig
from persia_nats.common.errors import Busy
from persia_nats.common.messages import Empty, InfoReply, PredictReply, PredictRequest
from persia_nats.common.service import Service
from persia_nats.common.storage import open_root, pull_newest
from persia_nats.common.subjects import SERVE_QUEUE, Subjects
from persia_nats.core.plan import warm_up as pooling_warm_up
from persia_nats.core.store import warm_up as store_warm_up
from persia_nats.services.serving.incremental import DeltaFollower
from persia_nats.services.serving.model import ModelFactory
from persia_nats.services.serving.snapshot import Snapshot, load_snapshot, predict


async def _every(interval: float, step: Callable[[], Awaitable[object]], what: str) -> None:
    """Run ``step`` every ``interval`` seconds until cancelled; a failed one is logged, not the end of it."""
    while True:
        await asyncio.sleep(interval)
        try:
            await step()
        except Exception:  # a failed look must not end the polling
            log.exception("%s failed", what)


__all__ = ["InferenceService"]

log = logging.getLogger(__name__)

Fingerprint = tuple[tuple[str, int, int], ...]


def _fingerprint(ckpt: Path) -> Fingerprint:
    """Path, size and mtime of every file of a checkpoint: what must change for a rejected one to be retried."""
    out = []
    for path in ckpt.rglob("*"):
        try:
            st = path.stat()
        except OSError:
            continue
        if path.is_file():
            out.append((str(path.relative_to(ckpt)), st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


class InferenceService(Service):
    """Serves predictions of a dense model and its embeddings, read from a checkpoint root.

    Args:
        nc: The NATS connection.
        global_config: The job's config (job name; ``embedding_worker_config.wire_dtype``, the
            precision embeddings had in training).
        embedding_config: The job's ``embedding_config.yml``.
        make_model: Builds the dense model (:func:`persia_nats.services.serving.model.model_factory`).
        checkpoint_dir: The checkpoint root the training job writes.
        reload_interval: Seconds between looks for a newer checkpoint (0: never look again).
        replica_index: This server's index, for status and discovery.
        max_inflight: Requests handled at once; the rest wait in NATS' pending queue.
    """

    role = "serving"

    def __init__(self, nc: NATS, global_config: GlobalConfig, embedding_config: EmbeddingConfig,
                 make_model: ModelFactory, checkpoint_dir: str | Path, *, reload_interval: float = 10.0,
                 replica_index: int = 0, max_inflight: int = 64) -> None:
        super().__init__(nc, max_inflight=max_inflight)
        self.subjects = Subjects(global_config.common_config.job_name)
        self.ecfg = embedding_config
        # declared dense features come in the model's order whatever order a client sends (slots: make_plan)
        self.schema = BatchSchema.from_config(None, global_config.data_loader_config)
        self.make_model = make_model
        #: a path, or a URL mirrored into a local cache before each look (persia_nats.common.storage)
        self.storage = open_root(str(checkpoint_dir))
        self.root = self.storage.local
        self.reload_interval = reload_interval
        self.replica_index = replica_index
        self.instance = f"serve-{replica_index}-{uuid.uuid4().hex[:8]}"
        wire = global_config.embedding_worker_config.wire_dtype
        self.wire_dtype = np.dtype(np.float16 if wire == "float16" else np.float32)
        self.snapshot: Snapshot | None = None
        self.counters: Counter[str] = Counter()
        self.rejected: dict[str, tuple[Fingerprint, str]] = {}  # checkpoint name -> (its files, why)
        self._reload_lock = asyncio.Lock()
        self._reload_task: asyncio.Task[None] | None = None
        self._follow_task: asyncio.Task[None] | None = None
        self._started = time.time()
        ps_config = global_config.embedding_parameter_server_config
        #: the job's incremental updates, followed when enable_incremental_update is set (else None)
        self.follower: DeltaFollower | None = None
        self.follow_interval = ps_config.incremental_poll_interval_sec
        if ps_config.enable_incremental_update:
            self.follower = DeltaFollower(Path(ps_config.incremental_dir), global_config.common_config.job_name)

    async def start(self) -> None:
        # the first predict would otherwise compile (or load) the pooling and float16 kernels
        took = await asyncio.to_thread(pooling_warm_up)
        if self.follower is not None:  # applying a delta runs the store's training kernels
            took += await asyncio.to_thread(store_warm_up)
        log.info("%s: pooling kernels ready in %.1f s", self.instance, took)
        await self.reload()
        if self.snapshot is None:
            log.warning("no valid checkpoint in %s yet: predict answers 503 until one appears", self.root)
        s = self.subjects
        await self.rpc.add(s.serve_predict(), self._on_predict, queue=SERVE_QUEUE, request=PredictRequest)
        await self.rpc.add(s.serve_info(), self._on_info, queue=SERVE_QUEUE, request=Empty)
        await self.serve_status(s.status(), self.replica_index, self.instance)
        loop = asyncio.get_running_loop()
        if self.reload_interval > 0:
            self._reload_task = loop.create_task(
                _every(self.reload_interval, self.reload, f"looking for a newer checkpoint in {self.root}"))
        if self.follower is not None:
            root = self.follower.root
            self._follow_task = loop.create_task(
                _every(self.follow_interval, self.follow, f"applying the incremental updates in {root}"))
            log.info("following the incremental updates in %s every %.1f s", root, self.follow_interval)
        log.info("serving %s on %s", self.snapshot.name if self.snapshot else "nothing yet", s.serve_predict())

    async def teardown(self) -> None:
        for task in (self._reload_task, self._follow_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    # -- reloading ------------------------------------------------------------------------------

    async def follow(self) -> int:
        """Apply to the served rows the incremental updates written since; returns how many were applied."""
        if self.follower is None:
            return 0
        async with self._reload_lock:  # a reload swaps the snapshot only between two deltas
            snap = self.snapshot
            if snap is None:
                return 0
            return await self.follower.apply_live(snap.store, snap.name, snap.deltas)

    async def reload(self) -> bool:
        """Load the newest valid checkpoint newer than the one served, if any; True if one was swapped in."""
        async with self._reload_lock:
            current = self.snapshot.number if self.snapshot is not None else -1
            loaded, failures = await asyncio.to_thread(self._load_newer, current)
            self.counters["reload_failures"] += len(failures)
            for name, fingerprint, why in failures:
                self.rejected[name] = (fingerprint, why)
            if loaded is None:
                return False
            old, self.snapshot = self.snapshot, loaded  # the swap: one assignment, between requests
            if old is not None:
                self.counters["reloads"] += 1
            log.info("serving %s (step %s, %d rows)%s", loaded.name, loaded.step, loaded.rows,
                     f", replacing {old.name}" if old is not None else "")
            return True

    def _load_newer(self, current: int) -> tuple[Snapshot | None, list[tuple[str, Fingerprint, str]]]:
        """(The newest checkpoint above ``current`` that loads, failures on the way); runs in a thread."""
        failures = []
        if self.storage.remote is not None:
            pull_newest(self.storage)
        for ckpt in list_checkpoints(self.root):
            parsed = checkpoint_number(ckpt.name)
            if parsed is None or parsed[0] <= current:
                break  # newest first: nothing newer is left
            fingerprint = _fingerprint(ckpt)
            known = self.rejected.get(ckpt.name)
            if known is not None and known[0] == fingerprint:
                continue
            try:
                snap = load_snapshot(ckpt, self.make_model)
                if self.follower is not None:  # the deltas after it, before it is served
                    self.follower.apply_now(snap.store, snap.name, snap.deltas)
                return snap, failures
            except Exception as exc:  # corrupt, torn, or weights of another model: skip it, keep serving
                why = getattr(exc, "description", None) or f"{type(exc).__name__}: {exc}"
                log.warning("checkpoint %s rejected, still serving %s: %s", ckpt, self._serving_name(), why)
                failures.append((ckpt.name, fingerprint, why))
        return None, failures

    def _serving_name(self) -> str:
        return self.snapshot.name if self.snapshot is not None else "nothing"

    # -- handlers -------------------------------------------------------------------------------

    async def _on_predict(self, req: PredictRequest) -> PredictReply:
        snap = self.snapshot  # this request's snapshot, whatever a reload swaps in meanwhile
        if snap is None:
            raise Busy(f"no checkpoint loaded yet (none valid in {self.root}); retry later")
        # Inline on the event loop: measured faster than a hand-off to a thread (benchmarks/RESULTS.md).
        non_id, _ = self.schema.admit(req.non_id, (), requires_grad=False)
        out = predict(snap, self.ecfg, req.features, [a.data for a in non_id], self.wire_dtype)
        self.counters["predictions"] += 1
        self.counters["samples"] += req.batch_size
        return PredictReply(out, snap.name)

    def stats(self) -> dict[str, Any]:
        snap = self.snapshot
        return {"checkpoint": snap.name if snap else "", "step": snap.step if snap and snap.step is not None else -1,
                "rows": snap.rows if snap else 0, "predictions": self.counters["predictions"],
                "samples": self.counters["samples"], "reloads": self.counters["reloads"],
                "reload_failures": self.counters["reload_failures"],
                **(self._incremental_figures(snap) if self.follower is not None else {})}

    def _incremental_figures(self, snap: Snapshot | None) -> dict[str, Any]:
        assert self.follower is not None
        figures = snap.deltas.figures() if snap is not None else {
            "incremental_deltas_applied": 0, "incremental_rows_applied": 0, "incremental_newest_delta": "",
            "incremental_delta_age_seconds": -1.0, "incremental_applied_timestamp_seconds": 0.0}
        return {**figures, "incremental_delta_failures": self.follower.failures}

    async def _on_info(self, _req: Empty) -> InfoReply:
        snap = self.snapshot
        # any prediction client may ask: no server path (the root, or one in a rejection's reason) leaves here
        root = str(self.root).rstrip("/") if self.root else ""
        return InfoReply({"instance": self.instance, **self.stats(),
                          "rows_per_dim": snap.rows_per_dim() if snap else {},
                          "loaded_at": snap.loaded_at if snap else 0.0, "uptime_s": time.time() - self._started,
                          "rejected": {name: why.replace(root, "<checkpoint_dir>") if root else why
                                       for name, (_, why) in sorted(self.rejected.items())},
                          **self.rpc.summary()})
