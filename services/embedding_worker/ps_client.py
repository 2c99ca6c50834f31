"""The embedding worker's view of the PS replicas: discovery, sharded lookups and updates."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
from nats.aio.client import Client as NATS

from common.codec import WIRE_VERSION, array_from_wire, array_to_wire
from common.errors import RemoteError
from common.rpc import request, request_with_retry
from common.sharding import split_by_shard
from common.subjects import Subjects

log = logging.getLogger(__name__)


async def discover_replica_size(nc: NATS, subjects: Subjects, timeout: float, deadline: float) -> int:
    """Ask replica 0 how many replicas there are, then check every replica agrees.

    Waits (with backoff, up to ``deadline`` seconds) for replicas that are not up yet, so start-up
    order does not matter.
    """
    info = await request_with_retry(nc, subjects.ps(0, "info"), {"v": WIRE_VERSION}, timeout, deadline)
    size = info.get("replica_size")
    if not isinstance(size, int) or size < 1:
        raise RemoteError(f"PS replica 0 reported a bad replica_size {size!r}")
    for i in range(1, size):
        other = await request_with_retry(nc, subjects.ps(i, "info"), {"v": WIRE_VERSION}, timeout, deadline)
        if other.get("replica_size") != size or other.get("replica_index") != i:
            raise RemoteError(f"PS replica {i} reports index {other.get('replica_index')} of "
                              f"{other.get('replica_size')}, expected {i} of {size}")
    return size


class PsClient:
    """Fans requests out to the PS replicas concurrently; ids are sharded by a stable hash."""

    def __init__(self, nc: NATS, subjects: Subjects, replica_size: int, timeout: float) -> None:
        self._nc = nc
        self._subjects = subjects
        self.replica_size = replica_size
        self._timeout = timeout

    def _split(self, distinct: Mapping[int, np.ndarray]) -> dict[int, list[tuple[int, np.ndarray]]]:
        """shard -> [(dim, positions within distinct[dim])]."""
        per_shard: dict[int, list[tuple[int, np.ndarray]]] = {}
        for dim, ids in distinct.items():
            for shard, positions in split_by_shard(ids, self.replica_size):
                per_shard.setdefault(shard, []).append((dim, positions))
        return per_shard

    async def lookup(self, distinct: Mapping[int, np.ndarray], train: bool) -> dict[int, np.ndarray]:
        """Rows for every distinct sign, (n, dim) float32 per dim, in the order of ``distinct``."""
        out = {dim: np.empty((ids.shape[0], dim), dtype=np.float32) for dim, ids in distinct.items()}
        per_shard = self._split(distinct)

        async def one(shard: int, parts: list[tuple[int, np.ndarray]]) -> None:
            msg = {"v": WIRE_VERSION, "train": train,
                   "groups": [{"dim": dim, "ids": array_to_wire(distinct[dim][pos])} for dim, pos in parts]}
            reply = await request(self._nc, self._subjects.ps(shard, "lookup"), msg, self._timeout)
            groups = reply.get("groups")
            if not isinstance(groups, list) or len(groups) != len(parts):
                raise RemoteError(f"PS replica {shard} answered a malformed lookup reply")
            for (dim, pos), emb in zip(parts, groups, strict=True):
                rows = array_from_wire(emb, f"ps[{shard}].groups", dtype="<f4", ndim=2)
                if rows.shape != (pos.shape[0], dim):
                    raise RemoteError(f"PS replica {shard} answered shape {rows.shape} for {pos.shape[0]}x{dim}")
                out[dim][pos] = rows

        await asyncio.gather(*(one(s, p) for s, p in per_shard.items()))
        return out

    async def update(self, distinct: Mapping[int, np.ndarray], grads: Mapping[int, np.ndarray],
                     update_id: str | None = None) -> int:
        """Push per-row gradients to the replicas; returns how many ids the PSs no longer held.

        ``update_id`` makes a retry safe: a replica that already applied it answers without
        applying it again.
        """
        per_shard = self._split({d: distinct[d] for d in grads})

        async def one(shard: int, parts: list[tuple[int, np.ndarray]]) -> int:
            msg = {"v": WIRE_VERSION, "update_id": update_id, "groups": [
                {"ids": array_to_wire(distinct[dim][pos]), "grads": array_to_wire(grads[dim][pos])}
                for dim, pos in parts]}
            reply = await request(self._nc, self._subjects.ps(shard, "update"), msg, self._timeout)
            missing = reply.get("missing", 0)
            return missing if isinstance(missing, int) else 0

        results = await asyncio.gather(*(one(s, p) for s, p in per_shard.items()))
        return int(sum(results))

    async def configure(self, message: dict[str, Any]) -> None:
        """Send the same configuration to every replica."""
        await asyncio.gather(*(request(self._nc, self._subjects.ps(i, "configure"), message, self._timeout)
                               for i in range(self.replica_size)))


