"""Hot rows, publishes rather than requests: ``hot.rows.<i>`` (PS replica -> NN ranks) and
``hot.grads.<rank>`` (NN rank -> the other ranks)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from persia_nats.common.codec import array_from_wire, array_to_wire
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages.base import Message, always_sent, is_int

__all__ = ["HotRowsGroup", "HotRows", "HotGradsGroup", "HotGrads"]


@dataclass(frozen=True, slots=True)
class HotRowsGroup:
    """Rows of one width after an update: values, optimizer state, and the ids the replica no longer held."""

    ids: np.ndarray  # uint64 (n,)
    rows: np.ndarray  # float32 (n, dim)
    state: np.ndarray | None = always_sent(None)  # float32 (n, k); a reader takes a map without it
    gone: np.ndarray | None = None  # uint64

    def to_wire(self) -> dict[str, Any]:
        out = {"ids": array_to_wire(self.ids), "rows": array_to_wire(self.rows)}
        if self.state is not None:
            out["state"] = array_to_wire(self.state)
        if self.gone is not None and self.gone.size:
            out["gone"] = array_to_wire(self.gone)
        return out

    @classmethod
    def from_wire(cls, g: Any, where: str) -> HotRowsGroup:
        if not isinstance(g, Mapping):
            raise BadRequest(f"published rows: {where}: expected a map")
        ids = array_from_wire(g.get("ids"), f"{where}.ids", dtype="<u8", ndim=1)
        rows = array_from_wire(g.get("rows"), f"{where}.rows", dtype="<f4", ndim=2)
        state = None
        if g.get("state") is not None:
            state = array_from_wire(g.get("state"), f"{where}.state", dtype="<f4", ndim=2)
        gone = None
        if g.get("gone") is not None:
            gone = array_from_wire(g.get("gone"), f"{where}.gone", dtype="<u8", ndim=1)
        if rows.shape[0] != ids.shape[0] or rows.shape[1] < 1 or (
                state is not None and state.shape[0] != ids.shape[0]):
            raise BadRequest(f"published rows: {where}: {ids.shape[0]} ids, rows {list(rows.shape)}")
        return cls(ids, rows, state, gone)


@dataclass(frozen=True, slots=True)
class HotRows(Message):
    """PS replica ``replica`` applied update ``update_id`` (the update's ``batch`` name); the rows it asked for."""

    subject = "hot.rows.<i>"

    replica: int
    version: int
    update_id: str | None = field(metadata={"absent_when_default": True})  # nil: an update without a name
    groups: tuple[HotRowsGroup, ...]

    def body(self) -> dict[str, Any]:
        return {"replica": self.replica, "version": self.version, "update_id": self.update_id,
                "groups": [g.to_wire() for g in self.groups]}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> HotRows:
        version, groups, update_id = obj.get("version"), obj.get("groups"), obj.get("update_id")
        replica = obj.get("replica", -1)
        if not is_int(version) or not is_int(replica) or not isinstance(groups, list) \
                or not (update_id is None or isinstance(update_id, str)):
            raise BadRequest("published rows: expected ints 'replica' and 'version', a list 'groups' "
                             "and a str 'update_id'")
        return cls(replica, version, update_id,
                   tuple(HotRowsGroup.from_wire(g, f"groups[{k}]") for k, g in enumerate(groups)))


@dataclass(frozen=True, slots=True)
class HotGradsGroup:
    """Gradients of the hot rows of one width."""

    dim: int
    ids: np.ndarray  # uint64 (n,)
    grads: np.ndarray  # float32 (n, dim)

    def to_wire(self) -> dict[str, Any]:
        return {"dim": self.dim, "ids": array_to_wire(self.ids), "grads": array_to_wire(self.grads)}

    @classmethod
    def from_wire(cls, g: Any, where: str) -> HotGradsGroup:
        if not isinstance(g, Mapping) or isinstance(g.get("dim"), bool) or not isinstance(g.get("dim"), int):
            raise BadRequest(f"hot gradients: {where}: expected a map with an int 'dim'")
        dim: int = g["dim"]
        ids = array_from_wire(g.get("ids"), f"{where}.ids", dtype="<u8", ndim=1)
        grads = array_from_wire(g.get("grads"), f"{where}.grads", dtype="<f4", ndim=2)
        if grads.shape != (ids.shape[0], dim):
            raise BadRequest(f"hot gradients: {where}: {ids.shape[0]} ids of dim {dim}, "
                             f"gradients {list(grads.shape)}")
        return cls(dim, ids, grads)


@dataclass(frozen=True, slots=True)
class HotGrads(Message):
    """NN rank ``rank``'s gradients of a batch's hot rows (its ``seq``-th such message), before it sends
    them to the embedding worker; ``update_id`` is the batch's name, ``<worker>.<ref>``."""

    subject = "hot.grads.<rank>"

    update_id: str
    rank: int
    seq: int
    groups: tuple[HotGradsGroup, ...]

    def body(self) -> dict[str, Any]:
        return {"update_id": self.update_id, "rank": self.rank, "seq": self.seq,
                "groups": [g.to_wire() for g in self.groups]}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> HotGrads:
        update_id, rank, seq, groups = obj.get("update_id"), obj.get("rank"), obj.get("seq"), obj.get("groups")
        if not isinstance(update_id, str) or not isinstance(groups, list) or not is_int(rank) or not is_int(seq):
            raise BadRequest("hot gradients: expected a str 'update_id', ints 'rank' and 'seq', a list 'groups'")
        parsed = tuple(HotGradsGroup.from_wire(g, f"groups[{k}]") for k, g in enumerate(groups))
        dims = [g.dim for g in parsed]
        if len(set(dims)) != len(dims):
            raise BadRequest("hot gradients: a dim given twice")
        return cls(update_id, rank, seq, parsed)
