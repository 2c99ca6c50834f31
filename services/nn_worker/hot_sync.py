"""Hot rows kept in step across NN ranks: the rows the PSs publish after each update, and the
gradients every rank announces for the hot rows of its batches before the PS applies them."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from nats.aio.client import Client as NATS
from persia_nats.common.codec import pack, unpack_message
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import BatchRef, HotGrads, HotGradsGroup, HotRows
from persia_nats.common.optim_config import OptimizerConfig
from persia_nats.common.subjects import Subjects
from persia_nats.services.nn_worker.hot_rows import DEFAULT_MAX_BYTES, RowMirror
from persia_nats.services.nn_worker.waiting import wait_until

log = logging.getLogger(__name__)

#: how long, at most, a batch's hand-off waits for the other ranks' hot-row gradients of the step just
#: finished (see :meth:`HotRowSync.caught_up`)
HOT_GRADS_WAIT_S = 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class HotRowSettings:
    """A job with hot rows (``hot_row_min_count`` unset or > 0, not in sync mode): lookups ask for them,
    and every gradient push is announced, with or without hot rows in its batch, so the ranks'
    announcement counts stay their step counts."""

    #: ``nn_worker_config.hot_row_cache_bytes``
    max_bytes: int = DEFAULT_MAX_BYTES
    #: the job's embedding optimizer and weight bound, to apply the gradients still in flight to the
    #: copies; None (an evaluation context) applies none
    optimizer: tuple[OptimizerConfig, float] | None = None


class HotRowSync:
    """One rank's copies of the hot rows (:attr:`mirror`), kept fresh from the PSs' publications and
    the other ranks' announced gradients; without ``settings`` it subscribes to nothing and its mirror
    stays empty."""

    def __init__(self, nc: NATS, subjects: Subjects, *, rank: int, world_size: int, counters: Counter[str],
                 settings: HotRowSettings | None = None) -> None:
        self.nc = nc
        self.subjects = subjects
        self.rank = rank
        self.world_size = world_size
        self.counters = counters
        #: newest copies of hot rows (``embedding_worker_config.hot_row_min_count``)
        self.mirror = RowMirror(settings.max_bytes if settings is not None else DEFAULT_MAX_BYTES,
                                counters=counters, optimizer=settings.optimizer if settings is not None else None)
        self.enabled = settings is not None
        #: batches whose hot-row gradients this rank has announced
        self.sent = 0
        self._arrived = asyncio.Event()
        self._give_up_at = 0.0  # when the wait for other ranks' hot-row gradients in progress ends
        self._loop = asyncio.get_running_loop()
        self._subs: list[Any] = []

    async def start(self) -> None:
        # the PSs' rows and every other rank's gradients; not this rank's own (added to the mirror as
        # they are sent), which a subscription to hot.> would echo back, a message per step
        # none at all without hot rows: a job that never reads the mirror must not fill it
        hot_subjects = (self.subjects.hot_rows_all(), *(self.subjects.hot_grads(r) for r in range(self.world_size)
                                                        if r != self.rank)) if self.enabled else ()
        for subject in hot_subjects:
            self._subs.append(await self.nc.subscribe(subject, cb=self._on_hot))

    async def _on_hot(self, msg: Any) -> None:
        """Rows a PS replica published after an update (``hot.rows.<i>``), or another rank's gradients of
        hot rows (``hot.grads.<rank>``). Either order of a batch's two is right: gradients that arrive
        after their update's rows are known as applied (:meth:`RowMirror.add_pending`)."""
        kind = msg.subject[len(self.subjects.hot()) - 1:].split(".", 1)[0]
        try:
            if kind == "rows":
                self.mirror.on_published(HotRows.from_wire(unpack_message(msg.data)))
            elif kind == "grads":
                self.mirror.on_hot_grads(HotGrads.from_wire(unpack_message(msg.data)))
                self._arrived.set()
            else:
                raise BadRequest(f"unknown hot-row subject {msg.subject!r}")
        except Exception as exc:  # a cache refresh: counted and logged, the next lookup reads the row anyway
            # apart, since a bad publication points at a PS replica and bad gradients at another NN rank
            self.counters["hot_grads_bad" if kind == "grads" else "hot_publications_bad"] += 1
            log.warning("rank %d: ignored a message on %s: %s", self.rank, msg.subject, exc)

    async def publish_grads(self, ref: BatchRef, entry: Mapping[int, tuple[np.ndarray, np.ndarray]]) -> None:
        """Every rank learns of a batch's hot-row gradients (``entry``: per dim, ids and gradients) before
        the PS publishes the rows they update: this rank at once, the others by a message that goes out
        on this connection ahead of the gradient request."""
        update_id = f"{ref.worker}.{ref.ref}"  # how the embedding worker names the batch's PS update
        self.mirror.add_pending(update_id, entry)
        self.sent += 1
        groups = tuple(HotGradsGroup(dim, ids, g) for dim, (ids, g) in entry.items())
        try:
            await self.nc.publish(self.subjects.hot_grads(self.rank), pack(
                HotGrads(update_id, self.rank, self.sent, groups).to_wire()))
        except Exception as exc:  # the rows then reach the other ranks when the PS publishes them, a little later
            self.counters["hot_grads_unsent"] += 1
            log.warning("rank %d: could not publish the gradients of hot rows: %s", self.rank, exc)

    async def caught_up(self, timeout: float = HOT_GRADS_WAIT_S) -> None:
        """Wait (briefly) until every other rank has announced as many batches' hot-row gradients as this one.

        Ranks step together, so the other ranks' gradients of the step just finished are on their way;
        a batch handed out before they arrive would miss them. A rank that has run out of batches sends
        none, hence the time limit (counted in ``hot_grads_wait_timeouts``).
        """
        if self.world_size < 2 or not self.enabled or not self.sent:
            return
        started = self._loop.time()
        self._give_up_at = started + timeout
        try:
            if not await wait_until(lambda: all(self.mirror.sent_by.get(r, 0) >= self.sent
                                                for r in range(self.world_size) if r != self.rank),
                                    self._arrived, lambda: self._give_up_at):
                self.counters["hot_grads_wait_timeouts"] += 1
        finally:
            self.counters["hot_grads_wait_us"] += int((self._loop.time() - started) * 1e6)

    def hurry(self, timeout: float = HOT_GRADS_WAIT_S) -> None:
        """End the wait of :meth:`caught_up` in progress at most ``timeout`` seconds from now."""
        self._give_up_at = min(self._give_up_at, self._loop.time() + timeout)
        self._arrived.set()  # the waiter reads its deadline again

    async def close(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs = []


__all__ = ["HOT_GRADS_WAIT_S", "HotRowSettings", "HotRowSync"]
