"""The embedding worker's view of the PS replicas: sharded lookups and updates (the replicas are found
with :func:`persia_nats.common.discovery.discover_replica_size`)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from nats.aio.client import Client as NATS
from persia_nats.common.errors import BadRequest, NoResponders, RemoteError, RequestTimeout
from persia_nats.common.messages import (
    PsConfigure,
    PsLookup,
    PsLookupGroup,
    PsLookupReply,
    PsUpdate,
    PsUpdateGroup,
    PsUpdateReply,
)
from persia_nats.common.rpc import request, request_with_retry
from persia_nats.common.subjects import Subjects
from persia_nats.core.lookup import RowAnswer, RowRequest
from persia_nats.core.sharding import split_by_shard

log = logging.getLogger(__name__)

#: resends of a PS request that timed out, after the first try
TIMEOUT_RETRIES = 2


class PsClient:
    """Fans requests out to the PS replicas concurrently; ids are sharded by a stable hash."""

    def __init__(self, nc: NATS, subjects: Subjects, replica_size: int, timeout: float,
                 restart_grace: float = 15.0, timeout_retries: int = TIMEOUT_RETRIES,
                 counters: Counter[str] | None = None) -> None:
        self._nc = nc
        self._subjects = subjects
        self.replica_size = replica_size
        self._timeout = timeout
        #: how long a replica that answers nobody (restarting, loading its checkpoint) is waited for
        self.restart_grace = restart_grace
        #: times a request that timed out is sent again before its error goes to the caller
        self.timeout_retries = timeout_retries
        #: ``ps_timeouts_retried`` / ``ps_timeouts_failed``: what the timeouts came to (the service's counters)
        self.counters: Counter[str] = counters if counters is not None else Counter()

    async def _request(self, kind: str, shard: int, msg: PsLookup | PsUpdate) -> Mapping[str, Any]:
        """``msg`` to replica ``shard``, sent again after a timeout (bounded, logged, counted).

        A replica paused past the timeout (an index rebuild, a long GC, a frozen VM) answers late, not
        never: giving up at once turns its pause into a failed batch. A lookup is a read (unseen ids it
        inserts are inserted once) and an update carries its ``update_id``, so a resend is harmless.
        """
        subject = self._subjects.ps(shard, kind)
        attempt = 0
        while True:
            try:
                return await request_with_retry(self._nc, subject, msg, self._timeout, self.restart_grace,
                                                retry_on=(NoResponders,))
            except RequestTimeout:
                if attempt >= self.timeout_retries:
                    self.counters["ps_timeouts_failed"] += 1
                    log.error("PS replica %d: %s timed out %d time(s) (%gs each); giving up, the caller's batch "
                              "fails and is retried or given back by its sender", shard, kind, attempt + 1,
                              self._timeout)
                    raise
                attempt += 1
                self.counters["ps_timeouts_retried"] += 1
                log.warning("PS replica %d: %s timed out after %gs; sending it again (%d of %d)", shard, kind,
                            self._timeout, attempt, self.timeout_retries)

    def _split(self, distinct: Mapping[int, np.ndarray]) -> dict[int, list[tuple[int, np.ndarray | slice]]]:
        """shard -> [(dim, positions within distinct[dim])]; with one replica, all of them as ``slice(None)``:
        the arrays then travel as they are, not copied out by their positions and back."""
        if self.replica_size == 1:
            return {0: [(dim, slice(None)) for dim, ids in distinct.items() if ids.shape[0]]}
        per_shard: dict[int, list[tuple[int, np.ndarray | slice]]] = {}
        for dim, ids in distinct.items():
            for shard, positions in split_by_shard(ids, self.replica_size):
                per_shard.setdefault(shard, []).append((dim, positions))
        return per_shard

    async def lookup(self, distinct: Mapping[int, np.ndarray], train: bool) -> dict[int, np.ndarray]:
        """Rows for every distinct sign, (n, dim) float32 per dim, in the order of ``distinct``; read-only
        where a replica's reply holds them all."""
        dims = list(distinct)
        answers = await self.fetch([RowRequest(dim, distinct[dim], False) for dim in dims], train)
        return {dim: a.rows for dim, a in zip(dims, answers, strict=True)}

    async def fetch(self, requests: Sequence[RowRequest], train: bool) -> list[RowAnswer]:
        """The rows each request asks for (:func:`persia_nats.core.lookup.row_requests`): its ids sharded, one
        group per request in each replica's message, the replies' rows scattered back into the request's
        order, with the version each replica read them at."""
        if self.replica_size == 1:
            per_shard = {0: [(i, slice(None)) for i, r in enumerate(requests) if r.ids.shape[0]]}
        else:
            per_shard = {}
            for i, r in enumerate(requests):
                for shard, positions in split_by_shard(r.ids, self.replica_size):
                    per_shard.setdefault(shard, []).append((i, positions))
        parts: list[list[tuple[np.ndarray | slice, np.ndarray]]] = [[] for _ in requests]
        versions = [np.zeros(r.ids.shape[0], np.int64) for r in requests]

        async def one(shard: int, items: list[tuple[int, np.ndarray | slice]]) -> None:
            groups = [(requests[i], pos) for i, pos in items]
            msg = PsLookup(tuple(PsLookupGroup(r.dim, r.ids[pos], r.half) for r, pos in groups), train)
            raw = await self._request("lookup", shard, msg)
            try:
                reply = PsLookupReply.from_wire(raw)
            except BadRequest as exc:
                raise RemoteError(f"PS replica {shard} answered a malformed lookup reply: {exc}") from None
            if len(reply.groups) != len(groups):
                raise RemoteError(f"PS replica {shard} answered a malformed lookup reply")
            for (i, pos), (r, _), rows in zip(items, groups, reply.groups, strict=True):
                n = r.ids[pos].shape[0]
                if rows.shape != (n, r.dim) or (rows.dtype == np.float16 and not r.half):
                    raise RemoteError(f"PS replica {shard} answered {rows.dtype} {rows.shape} for "
                                      f"{n}x{r.dim}{' float32' if not r.half else ''}")
                versions[i][pos] = reply.version
                parts[i].append((pos, rows))

        await asyncio.gather(*(one(s, p) for s, p in per_shard.items()))
        return [RowAnswer(_scatter(r, p), v) for r, p, v in zip(requests, parts, versions, strict=True)]

    async def update(self, distinct: Mapping[int, np.ndarray], grads: Mapping[int, np.ndarray],
                     update_id: str | None = None, publish: Mapping[int, np.ndarray] | None = None,
                     batch: str | None = None, scales: Mapping[int, float] | None = None) -> int:
        """Push per-row gradients to the replicas; returns how many ids the PSs no longer held.

        ``update_id`` makes a retry safe: a replica that already applied it answers without
        applying it again. ``publish``: per dim, a mask over ``distinct[dim]`` of the rows whose
        new values the replicas publish on ``hot.rows.<i>`` once the update is applied, naming the
        update by ``batch`` (``<worker>.<ref>``, which NN ranks know) rather than by its secret id.
        ``scales``: per dim, the power of two ``grads[dim]`` is multiplied by (1 where not given).
        """
        per_shard = self._split({d: distinct[d] for d in grads})

        def group(dim: int, pos: np.ndarray | slice) -> PsUpdateGroup:
            mask = publish.get(dim) if publish is not None else None
            chosen = np.flatnonzero(mask[pos]).astype(np.int64) if mask is not None and mask[pos].any() else None
            return PsUpdateGroup(distinct[dim][pos], grads[dim][pos], chosen, scales.get(dim, 1.0) if scales else 1.0)

        async def one(shard: int, parts: list[tuple[int, np.ndarray | slice]]) -> int:
            msg = PsUpdate(tuple(group(dim, pos) for dim, pos in parts), update_id, batch)
            # the update_id makes a resend harmless; "no responders" means it was not even delivered
            raw = await self._request("update", shard, msg)
            try:
                return PsUpdateReply.from_wire(raw).missing
            except BadRequest:  # applied; only the count of missing ids is lost
                log.warning("PS replica %d answered a malformed update reply", shard)
                return 0

        results = await asyncio.gather(*(one(s, p) for s, p in per_shard.items()))
        return int(sum(results))

    async def configure(self, message: PsConfigure) -> None:
        """Send the same configuration to every replica."""
        await asyncio.gather(*(request(self._nc, self._subjects.ps(i, "configure"), message, self._timeout)
                               for i in range(self.replica_size)))


def _scatter(request: RowRequest, parts: Sequence[tuple[np.ndarray | slice, np.ndarray]]) -> np.ndarray:
    """A request's rows from its parts (positions, rows) per replica: the reply's own array where one sent
    them all; float16 where every part is, else float32 (float16 widens exactly in the copy)."""
    if len(parts) == 1 and isinstance(parts[0][0], slice):
        return parts[0][1]
    half = bool(parts) and all(rows.dtype == np.float16 for _, rows in parts)
    out = np.empty((request.ids.shape[0], request.dim), np.float16 if half else np.float32)
    for pos, rows in parts:
        out[pos] = rows
    return out
