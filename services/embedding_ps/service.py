"""Embedding parameter server replica: serves lookups and updates of its shard of the rows.

Handlers (see ``docs/protocol.md``): ``ps.<i>.lookup``, ``ps.<i>.update``, ``ps.<i>.configure``,
``ps.<i>.info``. They run one at a time (the store is not shared between tasks), so updates
apply in arrival order.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
from nats.aio.client import Client as NATS

from common.codec import WIRE_VERSION, array_from_wire, array_to_wire
from common.config import GlobalConfig
from common.errors import BadRequest, ConfigError
from common.optim_config import hyperparams_from_wire, optimizer_from_wire
from common.service import Service
from common.subjects import Subjects
from services.embedding_ps.store import EmbeddingStore

log = logging.getLogger(__name__)

MAX_DIM = 4096
#: far more than can be in flight: a retry arrives within seconds of the original
APPLIED_IDS_KEPT = 100_000


def _str_keys(obj: Any) -> Any:
    """msgpack maps on this wire have string keys only (decoders run with strict_map_key)."""
    if isinstance(obj, dict):
        return {str(k): _str_keys(v) for k, v in obj.items()}
    return obj


def _groups(msg: Mapping[str, Any]) -> list[Any]:
    groups = msg.get("groups")
    if not isinstance(groups, list):
        raise BadRequest("groups: expected a list")
    return groups


class EmbeddingParameterServer(Service):
    role = "embedding-parameter-server"

    def __init__(self, nc: NATS, global_config: GlobalConfig, replica_index: int = 0, replica_size: int = 1) -> None:
        super().__init__(nc)
        if not 0 <= replica_index < replica_size:
            raise ConfigError(f"replica index {replica_index} is outside 0..{replica_size - 1}")
        self.replica_index = replica_index
        self.replica_size = replica_size
        self.subjects = Subjects(global_config.common_config.job_name)
        self.store = EmbeddingStore(global_config.embedding_parameter_server_config.capacity)
        self.configured = False
        # ids of recently applied updates, so a retried update is applied once
        self._applied: OrderedDict[str, None] = OrderedDict()
        self.duplicate_updates = 0

    async def start(self) -> None:
        s, i = self.subjects, self.replica_index
        await self.rpc.add(s.ps(i, "lookup"), self._on_lookup, concurrent=False)
        await self.rpc.add(s.ps(i, "update"), self._on_update, concurrent=False)
        await self.rpc.add(s.ps(i, "configure"), self._on_configure, concurrent=False)
        await self.rpc.add(s.ps(i, "info"), self._on_info, concurrent=False)
        await self.serve_status(s.status(), i, f"ps-{i}")
        log.info("PS replica %d of %d serving", i, self.replica_size)

    async def _on_lookup(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        train = msg.get("train", False)
        if not isinstance(train, bool):
            raise BadRequest("train: expected bool")
        requests = []
        for k, g in enumerate(_groups(msg)):
            if not isinstance(g, Mapping):
                raise BadRequest(f"groups[{k}]: expected a map")
            dim = g.get("dim")
            if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= MAX_DIM:
                raise BadRequest(f"groups[{k}].dim: expected an int in 1..{MAX_DIM}, got {dim!r}")
            requests.append((array_from_wire(g.get("ids"), f"groups[{k}].ids", dtype="<u8", ndim=1), dim))
        # validated everything first: a bad group later in the list must not insert rows for earlier ones
        rows = [self.store.lookup(ids, dim, train) for ids, dim in requests]
        return {"v": WIRE_VERSION, "groups": [array_to_wire(r) for r in rows]}

    async def _on_update(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        update_id = msg.get("update_id")
        if update_id is not None and (not isinstance(update_id, str) or len(update_id) > 256):
            raise BadRequest("update_id: expected a string of at most 256 characters or nil")
        if update_id is not None and update_id in self._applied:
            self.duplicate_updates += 1
            return {"v": WIRE_VERSION, "missing": 0, "duplicate": True}
        updates = []
        for k, g in enumerate(_groups(msg)):
            if not isinstance(g, Mapping):
                raise BadRequest(f"groups[{k}]: expected a map")
            ids = array_from_wire(g.get("ids"), f"groups[{k}].ids", dtype="<u8", ndim=1)
            grads = array_from_wire(g.get("grads"), f"groups[{k}].grads", dtype=("<f4", "<f2"), ndim=2)
            if grads.shape[0] != ids.shape[0] or not 1 <= grads.shape[1] <= MAX_DIM:
                raise BadRequest(f"groups[{k}]: {ids.shape[0]} ids but gradients of shape {list(grads.shape)}")
            grads = grads.astype(np.float32)
            if not np.isfinite(grads).all():
                raise BadRequest(f"groups[{k}].grads: non-finite values")
            updates.append((ids, grads))
        missing = sum(self.store.update(ids, grads) for ids, grads in updates)
        if update_id is not None:
            self._applied[update_id] = None
            if len(self._applied) > APPLIED_IDS_KEPT:
                self._applied.popitem(last=False)
        return {"v": WIRE_VERSION, "missing": int(missing)}

    async def _on_configure(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        try:
            optimizer = optimizer_from_wire(msg["optimizer"]) if msg.get("optimizer") is not None else None
            hyper = hyperparams_from_wire(msg["hyper"]) if msg.get("hyper") is not None else None
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
        if hyper is not None:
            self.store.set_hyper(hyper)
        if optimizer is not None:
            self.store.set_optimizer(optimizer)
            self.configured = True
        log.info("PS replica %d configured: optimizer=%s hyper=%s", self.replica_index, optimizer, hyper)
        return {"v": WIRE_VERSION, "ok": True}

    def stats(self) -> dict[str, Any]:
        st = self.store.stats()
        return {"replica": self.replica_index, "configured": self.configured,
                "duplicate_updates": self.duplicate_updates,
                **{k: v for k, v in st.items() if isinstance(v, int | float)}}

    async def _on_info(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        return {"v": WIRE_VERSION, "replica_index": self.replica_index, "replica_size": self.replica_size,
                "configured": self.configured, "stats": _str_keys(self.store.stats())}
