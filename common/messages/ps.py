"""Embedding parameter server subjects: ``ps.<i>.lookup``, ``update``, ``configure``, ``checkpoint`` and ``info``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from persia_nats.common.codec import all_finite, array_from_wire, array_to_wire
from persia_nats.common.errors import BadRequest, ConfigError
from persia_nats.common.messages.base import Message, always_sent, get_field, list_field, map_at, opt_field
from persia_nats.common.optim_config import (
    EmbeddingHyperparams,
    OptimizerConfig,
    hyperparams_from_wire,
    hyperparams_to_wire,
    optimizer_from_wire,
    to_wire,
)

__all__ = ["MAX_DIM", "MAX_DIMS", "MAX_PATH_CHARS", "PsLookupGroup", "PsLookup", "PsLookupReply", "PsUpdateGroup",
           "PsUpdate", "PsUpdateReply", "PsConfigure", "PsCheckpoint", "PsCheckpointReply", "PsInfoReply"]

#: the widest embedding a PS stores
MAX_DIM = 4096
#: distinct embedding widths one job may configure
MAX_DIMS = 64
MAX_PATH_CHARS = 4096
_MAX_ID_CHARS = 256


def _dim(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM:
        raise BadRequest(f"{where}: expected an int in 1..{MAX_DIM}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class PsLookupGroup:
    """The signs of one embedding width to read; ``half``: the rows may come back as float16."""

    dim: int
    ids: np.ndarray  # uint64 (n,)
    half: bool = False

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dim": self.dim, "ids": array_to_wire(self.ids)}
        if self.half:  # absent means false: a float32 lookup's request carries no flag
            out["half"] = True
        return out

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> PsLookupGroup:
        g = map_at(obj, where)
        dim = _dim(g.get("dim"), f"{where}.dim")
        ids = array_from_wire(g.get("ids"), f"{where}.ids", dtype="<u8", ndim=1)
        return cls(dim, ids, opt_field(g, "half", bool, where, False))


@dataclass(frozen=True, slots=True)
class PsLookup(Message):
    """embedding worker -> PS replica: rows of its shard; a training lookup inserts unseen ids."""

    subject = "ps.<i>.lookup"

    groups: tuple[PsLookupGroup, ...]
    train: bool = False

    def body(self) -> dict[str, Any]:
        return {"train": self.train, "groups": [g.to_wire() for g in self.groups]}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> PsLookup:
        train = opt_field(obj, "train", bool, "", False)
        groups = tuple(PsLookupGroup.from_wire(g, f"groups[{k}]") for k, g in enumerate(list_field(obj, "groups")))
        return cls(groups, train)


@dataclass(frozen=True, slots=True)
class PsLookupReply(Message):
    """The rows of each requested group, in order, and the replica's version when they were read."""

    subject = "ps.<i>.lookup"
    kind = "reply"

    groups: tuple[np.ndarray, ...]  # (len(ids), dim) each: float32, or float16 where the group asked for half
    version: int = always_sent(0)

    def body(self) -> dict[str, Any]:
        return {"groups": [array_to_wire(r) for r in self.groups], "version": self.version}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> PsLookupReply:
        groups = tuple(array_from_wire(g, f"groups[{k}]", dtype=("<f4", "<f2"), ndim=2)
                       for k, g in enumerate(list_field(obj, "groups")))
        return cls(groups, get_field(obj, "version", int, ""))


#: the range of ``PsUpdateGroup.scale``: powers of two, so scaling is exact in float32
_MIN_SCALE, _MAX_SCALE = 2.0 ** -100, 2.0 ** 100


@dataclass(frozen=True, slots=True)
class PsUpdateGroup:
    """Gradients of rows of one width; ``publish``: positions in ``ids`` whose new values go to ``hot.rows``.

    The gradients are ``grads / scale``: float16 gradients of an embedding worker are scaled by a power
    of two that brings the largest of them near float16's top, so the small ones keep their digits.
    A scaled group travels as ``scaled_grads`` with ``scale``, never as ``grads``: no reader can take
    scaled gradients for plain ones and apply them ``scale`` times too large.
    """

    ids: np.ndarray  # uint64 (n,)
    grads: np.ndarray  # float32 or float16 (n, dim)
    publish: np.ndarray | None = None  # int64
    scale: float = 1.0

    @property
    def dim(self) -> int:
        return int(self.grads.shape[1])

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ids": array_to_wire(self.ids)}
        if self.scale == 1.0:
            out["grads"] = array_to_wire(self.grads)
        else:
            out.update(scaled_grads=array_to_wire(self.grads), scale=self.scale)
        if self.publish is not None:
            out["publish"] = array_to_wire(self.publish)
        return out

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> PsUpdateGroup:
        g = map_at(obj, where)
        ids = array_from_wire(g.get("ids"), f"{where}.ids", dtype="<u8", ndim=1)
        scale = 1.0
        key = "grads"
        if g.get("scaled_grads") is not None:
            if g.get("grads") is not None:
                raise BadRequest(f"{where}: both grads and scaled_grads")
            key, scale = "scaled_grads", float(get_field(g, "scale", (int, float), where))
            if not _MIN_SCALE <= scale <= _MAX_SCALE or math.frexp(scale)[0] != 0.5:
                raise BadRequest(f"{where}.scale: expected a power of two in 2**-100..2**100, got {scale!r}")
        grads = array_from_wire(g.get(key), f"{where}.{key}", dtype=("<f4", "<f2"), ndim=2)
        if grads.shape[0] != ids.shape[0]:
            raise BadRequest(f"{where}: {ids.shape[0]} ids but gradients of shape {list(grads.shape)}")
        _dim(grads.shape[1], f"{where}.{key}")
        if not all_finite(grads):
            raise BadRequest(f"{where}.{key}: non-finite values")
        publish = None
        if g.get("publish") is not None:
            publish = array_from_wire(g["publish"], f"{where}.publish", dtype="<i8", ndim=1)
            if publish.size and (int(publish.min()) < 0 or int(publish.max()) >= ids.shape[0]):
                raise BadRequest(f"{where}.publish: positions must lie in 0..{ids.shape[0] - 1}")
        return cls(ids, grads, publish, scale)


def _short_str(obj: Mapping[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and (not isinstance(value, str) or len(value) > _MAX_ID_CHARS):
        raise BadRequest(f"{key}: expected a string of at most {_MAX_ID_CHARS} characters or nil")
    return value


@dataclass(frozen=True, slots=True)
class PsUpdate(Message):
    """embedding worker -> PS replica: apply gradients; ``update_id`` makes a resend harmless."""

    subject = "ps.<i>.update"

    groups: tuple[PsUpdateGroup, ...]
    update_id: str | None = None
    batch: str | None = None

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"update_id": self.update_id, "groups": [g.to_wire() for g in self.groups]}
        if self.batch is not None:
            out["batch"] = self.batch
        return out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> PsUpdate:
        update_id, batch = _short_str(obj, "update_id"), _short_str(obj, "batch")
        groups = tuple(PsUpdateGroup.from_wire(g, f"groups[{k}]") for k, g in enumerate(list_field(obj, "groups")))
        return cls(groups, update_id, batch)


@dataclass(frozen=True, slots=True)
class PsUpdateReply(Message):
    subject = "ps.<i>.update"
    kind = "reply"

    missing: int = always_sent(0)
    duplicate: bool = False

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"missing": self.missing}
        if self.duplicate:
            out["duplicate"] = True
        return out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> PsUpdateReply:
        return cls(get_field(obj, "missing", int, ""), opt_field(obj, "duplicate", bool, "", False))


def _dims(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_DIMS or any(
            isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_DIM for d in raw):
        raise BadRequest(f"dims: expected a list of 1..{MAX_DIMS} ints in 1..{MAX_DIM}")
    return tuple(sorted(set(raw)))


@dataclass(frozen=True, slots=True)
class PsConfigure(Message):
    """The embedding optimizer (NN worker), the hyperparameters (NN worker) and the widths (embedding
    worker) a replica serves; each part is optional, and once set may only be sent again unchanged."""

    subject = "ps.<i>.configure"

    optimizer: OptimizerConfig | None = None
    hyper: EmbeddingHyperparams | None = None
    dims: tuple[int, ...] | None = None

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.optimizer is not None:
            out["optimizer"] = to_wire(self.optimizer)
        if self.hyper is not None:
            out["hyper"] = hyperparams_to_wire(self.hyper)
        if self.dims is not None:
            out["dims"] = list(self.dims)
        return out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> PsConfigure:
        try:
            optimizer = optimizer_from_wire(obj["optimizer"]) if obj.get("optimizer") is not None else None
            hyper = hyperparams_from_wire(obj["hyper"]) if obj.get("hyper") is not None else None
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
        return cls(optimizer, hyper, _dims(obj["dims"]) if obj.get("dims") is not None else None)


@dataclass(frozen=True, slots=True)
class PsCheckpoint(Message):
    """NN rank 0 -> PS replica: ``dump`` the rows into a partial checkpoint, or ``load`` a final one."""

    subject = "ps.<i>.checkpoint"

    action: str
    dir: str

    def body(self) -> dict[str, Any]:
        return {"action": self.action, "dir": self.dir}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> PsCheckpoint:
        action = obj.get("action")
        if action not in ("dump", "load"):
            raise BadRequest(f"action: expected 'dump' or 'load', got {action!r}")
        raw = obj.get("dir")
        if not isinstance(raw, str) or not raw or len(raw) > MAX_PATH_CHARS or "\x00" in raw:
            raise BadRequest(f"dir: expected a non-empty path of at most {MAX_PATH_CHARS} characters")
        return cls(action, raw)


@dataclass(frozen=True, slots=True)
class PsCheckpointReply(Message):
    """``rows`` written (dump) or now held (load); a dump lists its ``files``, a load names the ``checkpoint``."""

    subject = "ps.<i>.checkpoint"
    kind = "reply"

    rows: int
    files: Mapping[str, Mapping[str, Any]] | None = None
    checkpoint: str | None = None

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rows": self.rows}
        if self.files is not None:
            out["files"] = {k: dict(v) for k, v in self.files.items()}
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint
        return out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> PsCheckpointReply:
        return cls(get_field(obj, "rows", int, ""), opt_field(obj, "files", Mapping, ""),
                   opt_field(obj, "checkpoint", str, ""))


@dataclass(frozen=True, slots=True)
class PsInfoReply(Message):
    """What a replica is: its index and the replica count, whether configured, its table figures."""

    subject = "ps.<i>.info"
    kind = "reply"

    replica_index: int
    replica_size: int
    configured: bool = always_sent(False)
    stats: Mapping[str, Any] | None = always_sent(None)
    loaded_checkpoint: str = always_sent("")
    #: serving lookups now; a replica answers from its start, so a long checkpoint load shows as alive, not ready
    ready: bool = always_sent(True)
    waiting_for: str = always_sent("")  # what keeps it from being ready ("" once ready)

    def body(self) -> dict[str, Any]:
        return {"replica_index": self.replica_index, "replica_size": self.replica_size,
                "configured": self.configured, "loaded_checkpoint": self.loaded_checkpoint,
                "stats": dict(self.stats or {}), "ready": self.ready, "waiting_for": self.waiting_for}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> PsInfoReply:
        index = get_field(obj, "replica_index", int, "")
        size = get_field(obj, "replica_size", int, "")
        if size < 1 or not 0 <= index < size:
            raise BadRequest(f"replica_index {index} of replica_size {size}")
        return cls(index, size, get_field(obj, "configured", bool, ""), get_field(obj, "stats", Mapping, ""),
                   get_field(obj, "loaded_checkpoint", str, ""), get_field(obj, "ready", bool, ""),
                   get_field(obj, "waiting_for", str, ""))
