"""Serving follows a running job's incremental updates (``enable_incremental_update``).

A server's snapshot is a full checkpoint plus the deltas applied to it since (:mod:`persia_nats.core.store_incremental`
for their format). The server holds every row in one store, so it reads the deltas of every PS replica,
whatever their count. Each poll (``incremental_poll_interval_sec``) lists ``incremental_dir``: the complete
deltas not applied yet, of this job, following the snapshot's checkpoint or a later one, are read and
hashed in a worker thread, then written into the served store on the event loop in steps of
:data:`STEP_ROWS` rows, with the requests that arrive meanwhile answered between the steps (each row is
written whole: a request reads every row before or after a step, and a delta's rows may land over
several steps). Within one replica's directory deltas are applied in the order they were written; an
incomplete one holds the later ones back until it completes, unless a later one of the same replica is
complete already (the replica writes one delta at a time, so that one never will): it is then passed by,
logged once.

What a snapshot has applied, and how fresh its rows are, is its :class:`AppliedDeltas`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from persia_nats.common.checkpoint import CheckpointError
from persia_nats.core.store import EmbeddingStore
from persia_nats.core.store_incremental import (
    DeltaSource,
    apply_steps,
    follows_number,
    list_deltas,
    read_delta,
    read_delta_meta,
)

__all__ = ["STEP_ROWS", "AppliedDeltas", "DeltaFollower"]

log = logging.getLogger(__name__)

#: rows written into the served store between two looks at the requests (~ a few ms of upserts)
STEP_ROWS = 1 << 14


@dataclass
class AppliedDeltas:
    """The deltas applied to one snapshot, and its freshness."""

    #: ``s<j>/inc_<time>`` of every delta applied (or passed by)
    applied: set[str] = field(default_factory=set)
    deltas: int = 0
    rows: int = 0
    #: the newest applied delta's name and the wall time its rows were copied on its PS
    newest: str = ""
    newest_created: float = 0.0
    #: wall time the newest delta was applied here
    applied_at: float = 0.0

    def note(self, src: DeltaSource, meta: dict[str, Any], rows: int) -> None:
        self.applied.add(src.rel)
        self.deltas += 1
        self.rows += rows
        if float(meta["created"]) >= self.newest_created:
            self.newest, self.newest_created = src.name, float(meta["created"])
        self.applied_at = time.time()

    def figures(self) -> dict[str, Any]:
        age = time.time() - self.newest_created if self.newest_created else -1.0
        return {"incremental_deltas_applied": self.deltas, "incremental_rows_applied": self.rows,
                "incremental_newest_delta": self.newest, "incremental_delta_age_seconds": round(age, 3),
                "incremental_applied_timestamp_seconds": round(self.applied_at, 3)}


class DeltaFollower:
    """Finds and applies the deltas of job ``job`` under ``root`` to a snapshot's store.

    Args:
        root: ``incremental_dir``.
        job: The job's name (deltas of another job are ignored).
    """

    def __init__(self, root: Path, job: str) -> None:
        self.root = Path(root)
        self.job = job
        self._passed: set[str] = set()  # incomplete deltas passed by (logged once)
        self.failures = 0

    def ready(self, base: str, done: AppliedDeltas) -> list[tuple[DeltaSource, dict[str, Any]]]:
        """The complete deltas to apply next to a snapshot of checkpoint ``base``, oldest first (a thread's work)."""
        by_replica: dict[int, list[DeltaSource]] = {}
        for src in list_deltas(self.root):
            by_replica.setdefault(src.replica_dir, []).append(src)
        floor = follows_number(base)
        out = []
        for sources in by_replica.values():
            for k, src in enumerate(sources):
                if src.rel in done.applied:
                    continue
                if not src.complete:
                    if not any(later.complete for later in sources[k + 1:]):
                        break  # being written: the later ones wait for it
                    if src.rel not in self._passed:
                        self._passed.add(src.rel)
                        log.warning("incremental update %s is incomplete and a later one is complete: passed by",
                                    src.path)
                    continue
                try:
                    meta = read_delta_meta(src)
                except CheckpointError as exc:
                    self._skip(src, done, exc.description)
                    continue
                if meta.get("job") != self.job or follows_number(meta["follows"]) < floor:
                    done.applied.add(src.rel)  # another job's, or older than the checkpoint: never applies
                    continue
                out.append((src, meta))
        return sorted(out, key=lambda item: (item[0].time_us, item[0].replica_dir))

    def _skip(self, src: DeltaSource, done: AppliedDeltas, why: str) -> None:
        self.failures += 1
        done.applied.add(src.rel)
        log.warning("incremental update %s skipped: %s", src.path, why)

    def apply_now(self, store: EmbeddingStore, base: str, done: AppliedDeltas) -> int:
        """Apply every ready delta at once (a snapshot being built aside, in a thread); returns the deltas."""
        n = 0
        for src, meta in self.ready(base, done):
            try:
                rows = read_delta(src, meta)
            except CheckpointError as exc:
                self._skip(src, done, exc.description)
                continue
            try:
                written = sum(apply_steps(store, rows, 1 << 62))
            except CheckpointError as exc:
                self._skip(src, done, exc.description)
                continue
            done.note(src, meta, written)
            n += 1
        return n

    async def apply_live(self, store: EmbeddingStore, base: str, done: AppliedDeltas) -> int:
        """Apply the ready deltas to a store being served: read in a thread, written in steps on the event loop."""
        n = 0
        for src, meta in await asyncio.to_thread(self.ready, base, done):
            try:
                rows = await asyncio.to_thread(read_delta, src, meta)
            except CheckpointError as exc:
                self._skip(src, done, exc.description)
                continue
            written = 0
            try:
                for step in apply_steps(store, rows, STEP_ROWS):
                    written += step
                    await asyncio.sleep(0)  # the requests waiting meanwhile are answered between steps
            except CheckpointError as exc:  # a width this store refuses: the rows written so far stay
                self._skip(src, done, exc.description)
                continue
            done.note(src, meta, written)
            n += 1
        if n:
            log.info("applied %d incremental updates, the newest %s (%.2f s old)", n, done.newest,
                     time.time() - done.newest_created)
        return n
