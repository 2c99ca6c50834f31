"""The embedding worker's view of the PS replicas: sharded lookups and updates (the replicas are found
with :func:`persia_nats.common.discovery.discover_replica_size`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import numpy as np
from nats.aio.client import Client as NATS
from persia_nats.common.errors import BadRequest, NoResponders, RemoteError
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
from persia_nats.core.sharding import split_by_shard

log = logging.getLogger(__name__)


class PsClient:
    """Fans requests out to the PS replicas concurrently; ids are sharded by a stable hash."""

    def __init__(self, nc: NATS, subjects: Subjects, replica_size: int, timeout: float,
                 restart_grace: float = 15.0) -> None:
        self._nc = nc
        self._subjects = subjects
        self.replica_size = replica_size
        self._timeout = timeout
        #: how long a replica that answers nobody (restarting, loading its checkpoint) is waited for
        self.restart_grace = restart_grace

    def _split(self, distinct: Mapping[int, np.ndarray]) -> dict[int, list[tuple[int, np.ndarray]]]:
        """shard -> [(dim, positions within distinct[dim])]."""
        per_shard: dict[int, list[tuple[int, np.ndarray]]] = {}
        for dim, ids in distinct.items():
            for shard, positions in split_by_shard(ids, self.replica_size):
                per_shard.setdefault(shard, []).append((dim, positions))
        return per_shard

    async def lookup(self, distinct: Mapping[int, np.ndarray], train: bool,
                     versions: dict[int, np.ndarray] | None = None) -> dict[int, np.ndarray]:
        """Rows for every distinct sign, (n, dim) float32 per dim, in the order of ``distinct``.

        ``versions``, when given, is filled with each row's PS version (int64 per dim; 0 from a
        replica that reports none): the version of the replica's store when the row was read.
        """
        out = {dim: np.empty((ids.shape[0], dim), dtype=np.float32) for dim, ids in distinct.items()}
        if versions is not None:
            versions.update({dim: np.zeros(ids.shape[0], dtype=np.int64) for dim, ids in distinct.items()})
        per_shard = self._split(distinct)

        async def one(shard: int, parts: list[tuple[int, np.ndarray]]) -> None:
            msg = PsLookup(tuple(PsLookupGroup(dim, distinct[dim][pos]) for dim, pos in parts), train)
            raw = await request_with_retry(self._nc, self._subjects.ps(shard, "lookup"), msg, self._timeout,
                                           self.restart_grace, retry_on=(NoResponders,))
            try:
                reply = PsLookupReply.from_wire(raw)
            except BadRequest as exc:
                raise RemoteError(f"PS replica {shard} answered a malformed lookup reply: {exc}") from None
            if len(reply.groups) != len(parts):
                raise RemoteError(f"PS replica {shard} answered a malformed lookup reply")
            for (dim, pos), rows in zip(parts, reply.groups, strict=True):
                if rows.shape != (pos.shape[0], dim):
                    raise RemoteError(f"PS replica {shard} answered shape {rows.shape} for {pos.shape[0]}x{dim}")
                out[dim][pos] = rows
                if versions is not None:
                    versions[dim][pos] = reply.version

        await asyncio.gather(*(one(s, p) for s, p in per_shard.items()))
        return out

    async def update(self, distinct: Mapping[int, np.ndarray], grads: Mapping[int, np.ndarray],
                     update_id: str | None = None, publish: Mapping[int, np.ndarray] | None = None,
                     batch: str | None = None) -> int:
        """Push per-row gradients to the replicas; returns how many ids the PSs no longer held.

        ``update_id`` makes a retry safe: a replica that already applied it answers without
        applying it again. ``publish``: per dim, a mask over ``distinct[dim]`` of the rows whose
        new values the replicas publish on ``hot.rows.<i>`` once the update is applied, naming the
        update by ``batch`` (``<worker>.<ref>``, which NN ranks know) rather than by its secret id.
        """
        per_shard = self._split({d: distinct[d] for d in grads})

        def group(dim: int, pos: np.ndarray) -> PsUpdateGroup:
            mask = publish.get(dim) if publish is not None else None
            chosen = np.flatnonzero(mask[pos]).astype(np.int64) if mask is not None and mask[pos].any() else None
            return PsUpdateGroup(distinct[dim][pos], grads[dim][pos], chosen)

        async def one(shard: int, parts: list[tuple[int, np.ndarray]]) -> int:
            msg = PsUpdate(tuple(group(dim, pos) for dim, pos in parts), update_id, batch)
            # the update_id makes a resend harmless; "no responders" means it was not even delivered
            raw = await request_with_retry(self._nc, self._subjects.ps(shard, "update"), msg, self._timeout,
                                           self.restart_grace, retry_on=(NoResponders,))
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


