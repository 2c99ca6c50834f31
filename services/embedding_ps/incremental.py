"""A PS replica's incremental updates in training (``enable_incremental_update``): when, what, and the figures.

The replica tells :class:`DeltaWriter` the keys of every update it applied (:meth:`DeltaWriter.updated`).
A delta is due once more than ``incremental_buffer_size`` distinct keys wait, or once the oldest change
waited ``incremental_interval_sec``; its keys are taken at one moment (tracking starts again), its rows copied
out of the store in steps of :data:`COPY_STEP_ROWS` rows between the requests the replica goes on serving
(:meth:`~persia_nats.core.store_incremental.DeltaRows.copy_steps`; the steps take at most half of the event
loop's time), then written by a thread. Deltas are copied and written one at a time, in the order their keys
were taken, so a reader never finds a delta complete before an older one of the same replica that will
still complete. A delta that fails to write (a full disk) is removed and its keys tracked again, so the next
delta carries their rows. Format and layout: :mod:`persia_nats.core.store_incremental`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from persia_nats.common.checkpoint import checkpoint_number, list_checkpoints
from persia_nats.common.config import EmbeddingParameterServerConfig
from persia_nats.common.optim_config import to_wire
from persia_nats.core.store import EmbeddingStore
from persia_nats.core.store_incremental import (
    DeltaRows,
    KeyTracker,
    delta_name,
    last_time,
    prune_deltas,
    warm_up,
    write_delta,
)

__all__ = ["DeltaWriter"]

log = logging.getLogger(__name__)

#: rows a delta's copy reads a step (1 MiB of width-16 Adagrad rows), between two requests
COPY_STEP_ROWS = 8192


class DeltaWriter:
    """Tracks the keys a replica updates and writes them as deltas under ``incremental_dir/s<i>/``.

    Args:
        store: The replica's store.
        config: ``embedding_parameter_server_config`` (the buffer size, the interval, the directory).
        job: The job's name, written into every delta (a reader ignores another job's).
        replica_index: This replica.
        replica_size: Number of PS replicas.
        lock: The replica's store lock, held by each step of a delta's copy (a load holds it throughout).
        optimizer: Returns the store's optimizer (None before it is configured), written into each delta.
        checkpoint_root: The local checkpoint root, if any: after a checkpoint's cut, the deltas that no
            checkpoint kept there needs any more are deleted (:func:`prune_deltas`).
    """

    def __init__(self, store: EmbeddingStore, config: EmbeddingParameterServerConfig, job: str, replica_index: int,
                 replica_size: int, lock: asyncio.Lock, optimizer: Callable[[], Any],
                 checkpoint_root: Path | None = None) -> None:
        self.store = store
        self.root = Path(config.incremental_dir)
        self.buffer_size = config.incremental_buffer_size
        self.interval = config.incremental_interval_sec
        self.job, self.replica_index, self.replica_size = job, replica_index, replica_size
        self.tracker = KeyTracker()
        #: the full checkpoint the next delta follows ("" until one is dumped or loaded)
        self.follows = ""
        self._lock = lock
        self._optimizer = optimizer
        self._last_us = 0
        self._writes: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.deltas_written = self.rows_written = self.bytes_written = self.write_failures = 0
        self.rows_gone = 0
        self.last_created = 0.0  # wall time the newest written delta's copy began
        self.last_copy_seconds = self.longest_copy_step_seconds = 0.0
        self.last_write_seconds = 0.0
        self._generation = 0  # raised by every load: a copy under way is then abandoned
        self.checkpoint_root = checkpoint_root
        self._prune_due = False
        self.deltas_pruned = 0

    async def start(self) -> None:
        """Find the newest delta this replica wrote before (names only grow), and start the periodic check."""
        self._last_us = await asyncio.to_thread(last_time, self.root, self.replica_index)
        await asyncio.to_thread(warm_up)
        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        log.info("PS replica %d: incremental updates into %s (every %d distinct keys or %.1f s)", self.replica_index,
                 self.root / f"s{self.replica_index}", self.buffer_size, self.interval)

    async def close(self) -> None:
        """Stop the periodic check, write what is tracked as a last delta, and wait for the writes."""
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
            self._ticker = None
        self._take()
        if self._writes is not None:
            await asyncio.gather(self._writes, return_exceptions=True)

    # -- tracking ---------------------------------------------------------------------------------

    def updated(self, dim: int, ids: np.ndarray) -> None:
        """Track an applied update's keys; past the buffer, cut a delta now (no await: between two requests)."""
        self.tracker.add(dim, ids)
        if self.tracker.distinct > self.buffer_size and not self._writing():
            self._take()

    def reset(self, follows: str) -> None:
        """The store was replaced (a checkpoint loaded, its deltas applied): what was tracked no longer
        applies, and the next deltas follow ``follows``."""
        self.tracker.take()
        self.follows = follows
        self._generation += 1

    def dump_began(self, checkpoint: str) -> None:
        """A full checkpoint's T0, on the same step: the rows tracked so far become one last delta following
        the previous checkpoint, and the next deltas follow ``checkpoint``."""
        self._take()
        self.follows = checkpoint
        self._prune_due = self.checkpoint_root is not None

    # -- deltas -----------------------------------------------------------------------------------

    def _writing(self) -> bool:
        return self._writes is not None and not self._writes.done()

    def _take(self) -> DeltaRows | None:
        """Cut: the keys tracked so far become the next delta (O(keys); no await, so nothing changes the store
        meanwhile) and tracking starts again; its rows are copied and written after the previous delta's."""
        if not self.tracker:
            return None
        self._last_us = max(self._last_us + 1, time.time_ns() // 1000)
        delta = DeltaRows(delta_name(self._last_us), time.time(), self.follows, self.tracker.take())
        previous = self._writes
        self._writes = asyncio.get_running_loop().create_task(self._copy_and_write(previous, delta, self._generation))
        return delta

    async def _copy_and_write(self, previous: asyncio.Task[None] | None, delta: DeltaRows, generation: int) -> None:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        # the copy: bounded steps, each between two requests (holding the store lock the handlers take), and
        # at most half of the loop's time, as a checkpoint dump's steps
        delta.created, started = time.time(), time.perf_counter()
        longest = 0.0
        steps = delta.copy_steps(self.store, COPY_STEP_ROWS)
        while True:
            async with self._lock:
                if generation != self._generation:  # a checkpoint was loaded: these rows are no longer the store's
                    log.info("PS replica %d: incremental update %s abandoned: the store was replaced by a load",
                             self.replica_index, delta.name)
                    return
                step = time.perf_counter()
                done = next(steps, None) is None
                took = time.perf_counter() - step
            longest = max(longest, took)
            if done:
                break
            await asyncio.sleep(took)
        self.last_copy_seconds = time.perf_counter() - started
        self.longest_copy_step_seconds = max(self.longest_copy_step_seconds, longest)
        optimizer = self._optimizer()
        started = time.perf_counter()
        try:
            path, nbytes = await asyncio.to_thread(
                write_delta, self.root, delta, job=self.job, replica_index=self.replica_index,
                replica_size=self.replica_size, optimizer=None if optimizer is None else to_wire(optimizer))
        except Exception as exc:  # a full disk, a permission: the next delta carries these rows
            self.write_failures += 1
            self.tracker.put_back(delta.keys())
            log.error("PS replica %d: incremental update %s failed, its %d rows go into the next one: %s",
                      self.replica_index, delta.name, delta.rows, exc)
            return
        self.last_write_seconds = time.perf_counter() - started
        self.deltas_written += 1
        self.rows_written += delta.rows
        self.bytes_written += nbytes
        self.rows_gone += delta.gone
        self.last_created = delta.created
        log.info("PS replica %d wrote incremental update %s: %d rows, %d bytes; copied in %.2f s (longest step "
                 "%.1f ms), written in %.2f s", self.replica_index, path, delta.rows, nbytes, self.last_copy_seconds,
                 1e3 * longest, self.last_write_seconds)
        if self._prune_due:
            self._prune_due = False
            try:
                pruned = await asyncio.to_thread(self._prune)
            except OSError as exc:
                log.warning("PS replica %d: pruning old incremental updates failed: %s", self.replica_index, exc)
                return
            self.deltas_pruned += pruned

    def _prune(self) -> int:
        """Delete this replica's deltas older than every checkpoint kept in the root (a thread's work)."""
        assert self.checkpoint_root is not None
        kept = list_checkpoints(self.checkpoint_root)
        if not kept:
            return 0
        parsed = checkpoint_number(kept[-1].name)
        gone = prune_deltas(self.root, self.replica_index, parsed[0] if parsed is not None else 0)
        if gone:
            log.info("PS replica %d: deleted %d incremental updates older than checkpoint %s", self.replica_index,
                     len(gone), kept[-1].name)
        return len(gone)

    async def _tick(self) -> None:
        """Write a delta once the oldest tracked change waited ``interval`` (or the buffer filled meanwhile)."""
        step = min(1.0, max(0.02, self.interval / 8))
        while True:
            await asyncio.sleep(step)
            since = self.tracker.since
            due = since is not None and time.monotonic() - since >= self.interval
            if (due or self.tracker.distinct > self.buffer_size) and not self._writing():
                try:
                    self._take()
                except Exception:  # never let one failed copy end the checks
                    log.exception("PS replica %d: copying an incremental update failed", self.replica_index)

    def stats(self) -> dict[str, Any]:
        age = time.time() - self.last_created if self.last_created else -1.0
        return {"incremental_deltas_written": self.deltas_written, "incremental_rows_written": self.rows_written,
                "incremental_written_bytes": self.bytes_written, "incremental_write_failures": self.write_failures,
                "incremental_rows_gone": self.rows_gone, "incremental_deltas_pruned": self.deltas_pruned,
                "incremental_pending_keys": self.tracker.distinct,
                "incremental_last_delta_age_seconds": round(age, 3),
                "incremental_last_copy_seconds": round(self.last_copy_seconds, 6),
                "incremental_copy_step_max_seconds": round(self.longest_copy_step_seconds, 6),
                "incremental_last_write_seconds": round(self.last_write_seconds, 6)}
