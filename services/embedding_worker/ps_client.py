"""The embedding worker's view of the PS replicas: sharded lookups and updates (the replicas are found
with :func:`persia_nats.common.discovery.discover_replica_size`)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Collection, Mapping
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
from persia_nats.core.plan import spread_rows
from persia_nats.core.sharding import split_by_shard

log = logging.getLogger(__name__)

#: resends of a PS request that timed out, after the first try
TIMEOUT_RETRIES = 2


def _groups(dim: int, pos: np.ndarray | slice, half: bool, exact: Mapping[int, np.ndarray] | None
            ) -> list[tuple[int, np.ndarray | slice, bool]]:
    """One shard's request groups of width ``dim``: (dim, positions, half); with ``half`` the rows that
    ``exact`` masks form a float32 group of their own. Positions are a slice, indices, or, where the
    shard holds every row, a boolean mask (the other rows then arrive in one pass: ``spread_rows``)."""
    mask = exact.get(dim) if half and exact is not None else None
    if mask is None or not (sub := mask[pos]).any():
        return [(dim, pos, half)]
    if isinstance(pos, slice) and pos == slice(None):
        rest = ~mask
        return [(dim, mask, False)] + ([(dim, rest, True)] if rest.any() else [])
    where = np.arange(mask.shape[0])[pos] if isinstance(pos, slice) else pos
    rest = where[~sub]
    return [(dim, where[sub], False)] + ([(dim, rest, True)] if rest.shape[0] else [])


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

    async def lookup(self, distinct: Mapping[int, np.ndarray], train: bool,
                     versions: dict[int, np.ndarray] | None = None, half: Collection[int] = (),
                     exact: Mapping[int, np.ndarray] | None = None,
                     apart: dict[int, np.ndarray] | None = None) -> dict[int, np.ndarray]:
        """Rows for every distinct sign, (n, dim) float32 per dim, in the order of ``distinct``; read-only
        where a replica's float32 reply holds them all.

        ``versions``, when given, is filled with each row's PS version (int64 per dim; 0 from a
        replica that reports none): the version of the replica's store when the row was read.
        ``half``: the widths whose rows may travel as float16 (half the bytes), except the rows that
        ``exact`` masks (per dim, over ``distinct[dim]``), which travel as float32.

        ``apart``, when given, keeps the widths of ``half`` as they travelled: float16 (float32 where a
        replica had a row beyond float16's range), not widened, and as the reply's own array where one
        replica sent them all; the rows ``exact`` masks are zero there, and ``apart[dim]`` gets them as
        float32, in the mask's order.
        """
        keep = apart is not None
        out = {dim: np.empty((ids.shape[0], dim), dtype=np.float16 if keep and dim in half else np.float32)
               for dim, ids in distinct.items()}
        if versions is not None:
            versions.update({dim: np.zeros(ids.shape[0], dtype=np.int64) for dim, ids in distinct.items()})
        #: per width with rows kept apart, each distinct row's place among them (its rank in the mask)
        rank: dict[int, np.ndarray] = {}
        if apart is not None and exact is not None:
            for dim in half:
                mask = exact.get(dim)
                if mask is not None and dim in distinct:
                    rank[dim] = np.cumsum(mask) - 1
                    apart[dim] = np.empty((int(mask.sum()), dim), np.float32)
        #: per width kept as float16, the float32 groups a replica sent (rows beyond float16's range)
        wide: dict[int, list[tuple[np.ndarray | slice, np.ndarray]]] = {}
        per_shard = self._split(distinct)

        async def one(shard: int, parts: list[tuple[int, np.ndarray | slice]]) -> None:
            groups = [g for dim, pos in parts for g in _groups(dim, pos, dim in half, exact)]
            msg = PsLookup(tuple(PsLookupGroup(dim, distinct[dim][pos], h) for dim, pos, h in groups), train)
            raw = await self._request("lookup", shard, msg)
            try:
                reply = PsLookupReply.from_wire(raw)
            except BadRequest as exc:
                raise RemoteError(f"PS replica {shard} answered a malformed lookup reply: {exc}") from None
            if len(reply.groups) != len(groups):
                raise RemoteError(f"PS replica {shard} answered a malformed lookup reply")
            for (dim, pos, h), rows in zip(groups, reply.groups, strict=True):
                n = distinct[dim][pos].shape[0]
                if rows.shape != (n, dim) or (rows.dtype == np.float16 and not h):
                    raise RemoteError(f"PS replica {shard} answered {rows.dtype} {rows.shape} for "
                                      f"{n}x{dim}{' float32' if not h else ''}")
                if versions is not None:
                    versions[dim][pos] = reply.version
                if out[dim].dtype == np.float16 and not h:  # rows of ``exact``: zero in place, float32 apart
                    assert apart is not None and exact is not None
                    out[dim][pos] = 0
                    apart[dim][rank[dim][pos]] = rows
                elif out[dim].dtype == np.float16 and rows.dtype == np.float32:
                    wide.setdefault(dim, []).append((pos, rows))
                elif isinstance(pos, slice) and rows.dtype == out[dim].dtype:
                    out[dim] = rows  # the reply's own (read-only) array: every row, in order
                elif isinstance(pos, np.ndarray) and pos.dtype == np.bool_ and rows.dtype == out[dim].dtype:
                    spread_rows(out[dim], pos, rows)
                else:
                    out[dim][pos] = rows  # float16 widens to float32 exactly, in the copy

        await asyncio.gather(*(one(s, p) for s, p in per_shard.items()))
        for dim, parts in wide.items():
            widened = out[dim].astype(np.float32)
            for pos, rows in parts:
                widened[pos] = rows
            out[dim] = widened
        return out

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


