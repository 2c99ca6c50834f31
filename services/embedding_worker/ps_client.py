"""The embedding worker's view of the PS replicas: discovery, sharded lookups and updates."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
from nats.aio.client import Client as NATS
from persia_nats.common.discovery import discover, replica_indexes
from persia_nats.common.errors import BadRequest, NoResponders, PeersMissing, RemoteError, RequestTimeout
from persia_nats.common.messages import (
    Empty,
    PsConfigure,
    PsInfoReply,
    PsLookup,
    PsLookupGroup,
    PsLookupReply,
    PsUpdate,
    PsUpdateGroup,
    PsUpdateReply,
)
from persia_nats.common.rpc import request, request_with_retry
from persia_nats.common.sharding import split_by_shard
from persia_nats.common.subjects import Subjects

log = logging.getLogger(__name__)


PS_ROLE = "embedding-parameter-server"


def _agreed_size(known: Mapping[int, int]) -> int | None:
    """The replica count every known replica reports (None while none is known)."""
    sizes = set(known.values())
    if len(sizes) > 1:
        raise RemoteError(f"PS replicas disagree on the replica count: {dict(sorted(known.items()))} (index: size)")
    if not sizes:
        return None
    size = sizes.pop()
    if size < 1 or max(known) >= size:
        raise RemoteError(f"PS replicas report indexes {sorted(known)} of a replica count {size}")
    return size


async def _probe_info(nc: NATS, subjects: Subjects, index: int, timeout: float) -> int | None:
    """An unregistered (older) replica: its replica_size from ``ps.<i>.info``, or None when absent."""
    try:
        raw = await request(nc, subjects.ps(index, "info"), Empty(), min(timeout, 1.0))
    except (NoResponders, RequestTimeout):
        return None
    try:
        info = PsInfoReply.from_wire(raw)
    except BadRequest as exc:  # its answer, not our request, is malformed
        raise RemoteError(f"PS replica {index} answered a malformed info reply: {exc}") from None
    if info.replica_index != index:
        raise RemoteError(f"PS replica {index} reports index {info.replica_index!r} of {info.replica_size!r}")
    return info.replica_size


async def discover_replica_size(nc: NATS, subjects: Subjects, timeout: float, deadline: float) -> int:
    """How many PS replicas the job has, once every one of them is up and they all agree.

    Replicas are found through the NATS services API (``$SRV.INFO.persia-ps``, filtered by job:
    :mod:`persia_nats.common.discovery`); each reports its ``replica_index`` and ``replica_size`` in its
    metadata. A replica that is not registered (an older build) is asked on ``ps.<i>.info``
    instead. Waits with backoff, up to ``deadline`` seconds, so start-up order does not matter.

    Raises:
        PeersMissing: not every replica was up within ``deadline`` seconds.
        RemoteError: the replicas disagree on their count, or report an impossible index.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    delay = 0.05
    log.info("waiting for every %s replica of job %r (giving up after %gs)", PS_ROLE, subjects.job, deadline)
    known: dict[int, int] = {}  # replica index -> the replica count it reports

    def complete(found: list[dict[str, Any]]) -> bool:
        sizes = {i["replica_size"] for i in found} | set(known.values())
        return len(sizes) == 1 and None not in sizes and \
            set(range(int(next(iter(sizes))))) <= replica_indexes(found) | known.keys()

    while True:
        found = await discover(nc, subjects.job, PS_ROLE, timeout=max(min(0.25, end - loop.time()), 0.01),
                               enough=complete)
        known.update({i["replica_index"]: i["replica_size"] for i in found if i["replica_size"] is not None})
        size = _agreed_size(known)
        for index in [0] if size is None else [i for i in range(size) if i not in known]:
            probed = await _probe_info(nc, subjects, index, timeout)
            if probed is not None:
                known[index] = probed
        size = _agreed_size(known)
        if size is not None and set(range(size)) <= known.keys():
            return size
        if loop.time() + delay > end:
            raise PeersMissing(f"not every PS replica ({PS_ROLE}) of job {subjects.job!r} was up within "
                               f"{deadline:g}s: found indexes {sorted(known)} of {size if size is not None else '?'}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


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


