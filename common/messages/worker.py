"""Embedding worker subjects: ``ew.<worker>.lookup``, ``ew.lookup_direct``'s reply, ``ew.<worker>.grad``
and ``ew.<worker>.info``. (``ew.ingest`` and the ``ew.lookup_direct`` request are in
:mod:`persia_nats.common.messages.batches`.)"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from persia_nats.common.codec import array_from_wire, array_to_wire
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages.base import Message, always_sent, get_field, map_at, name_field, opt_field

__all__ = ["SlotEmbedding", "embeddings_from_wire", "GatheredSlots", "HotGroup", "HotPart", "SlotGradient",
           "RowGradient", "GradRequest", "slot_order",
           "EwLookup", "EwLookupReply", "LookupDirectReply", "GradReply"]

_F32_TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)
#: the range of ``RowGradient.scale``: what a PS accepts (``PsUpdateGroup.scale``), since it passes on as it is
_MIN_SCALE, _MAX_SCALE = 2.0 ** -100, 2.0 ** 100


@dataclass(frozen=True, slots=True)
class EwLookup(Message):
    """NN worker -> the embedding worker holding a batch: its embeddings (the batch leaves the buffer)."""

    subject = "ew.<worker>.lookup"

    ref: int
    train: bool = True
    hot: bool = True
    #: the requester takes the slots of a width whose every output is one PS row as those rows, once
    #: each, and where each slot reads them (``gathered`` of the reply)
    gather: bool = False

    def body(self) -> dict[str, Any]:
        out = {"ref": self.ref, "train": self.train, "hot": self.hot}
        if self.gather:
            out["gather"] = True
        return out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> EwLookup:
        return cls(get_field(obj, "ref", int, ""), opt_field(obj, "train", bool, "", True),
                   opt_field(obj, "hot", bool, "", True), opt_field(obj, "gather", bool, "", False))


@dataclass(frozen=True, slots=True)
class SlotEmbedding:
    """The embeddings of one slot for a batch.

    ``pooled``: ``emb`` is (batch, dim). ``raw``: ``emb`` holds the slot's distinct rows
    (n_distinct, dim) and ``index`` (batch, sample_fixed_size) int32 points into them, -1 = padding.
    """

    name: str
    emb: np.ndarray
    index: np.ndarray | None = None

    @property
    def is_raw(self) -> bool:
        return self.index is not None

    def to_wire(self) -> dict[str, Any]:
        out = {"name": self.name, "emb": array_to_wire(self.emb)}
        if self.index is not None:
            out["index"] = array_to_wire(self.index)
        return out

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> SlotEmbedding:
        if not isinstance(obj, Mapping):
            raise BadRequest(f"{where}: expected a map")
        name = name_field(obj, where)
        emb = array_from_wire(obj.get("emb"), f"{where}.emb", dtype=("<f2", "<f4"), ndim=2)
        index = None
        if obj.get("index") is not None:
            index = array_from_wire(obj["index"], f"{where}.index", dtype="<i4", ndim=2)
        return cls(name, emb, index)


def embeddings_from_wire(obj: Any, where: str = "embeddings") -> tuple[SlotEmbedding, ...]:
    if not isinstance(obj, list):
        raise BadRequest(f"{where}: expected a list")
    return tuple(SlotEmbedding.from_wire(x, f"{where}[{i}]") for i, x in enumerate(obj))


@dataclass(frozen=True, slots=True)
class GatheredSlots:
    """Pooled slots of one width whose every output is one PS row, sent as the distinct rows they read,
    once each: slot ``slots[k]``'s output (batch, dim) is ``rows[index[k]]``. ``at[k]``: the slot's
    position among all the batch's slots (those in ``embeddings`` fill the rest, in order)."""

    dim: int
    rows: np.ndarray  # float16 or float32 (n, dim)
    slots: tuple[str, ...]
    at: np.ndarray  # int32 (k,)
    index: np.ndarray  # uint16 or int32 (k, batch), into rows
    #: positions in ``rows`` of the hot rows (zero there), in the order of the reply's hot group of this dim
    hot_at: np.ndarray | None = None  # int32 (h,)

    @property
    def batch_size(self) -> int:
        return int(self.index.shape[1])

    def to_wire(self) -> dict[str, Any]:
        out = {"dim": self.dim, "rows": array_to_wire(self.rows), "slots": list(self.slots),
               "at": array_to_wire(self.at), "index": array_to_wire(self.index)}
        if self.hot_at is not None:
            out["hot_at"] = array_to_wire(self.hot_at)
        return out

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> GatheredSlots:
        if not isinstance(obj, Mapping) or not isinstance(obj.get("slots"), list):
            raise BadRequest(f"{where}: expected a map with a list 'slots'")
        dim = get_field(obj, "dim", int, where)
        rows = array_from_wire(obj.get("rows"), f"{where}.rows", dtype=("<f2", "<f4"), ndim=2)
        slots = tuple(name_field({"name": n}, f"{where}.slots[{i}]") for i, n in enumerate(obj["slots"]))
        at = array_from_wire(obj.get("at"), f"{where}.at", dtype="<i4", ndim=1)
        index = array_from_wire(obj.get("index"), f"{where}.index", dtype=("<u2", "<i4"), ndim=2)
        if dim < 1 or rows.shape[1] != dim:
            raise BadRequest(f"{where}: rows {list(rows.shape)} for dim {dim}")
        if not len(slots) == at.shape[0] == index.shape[0]:
            raise BadRequest(f"{where}: {len(slots)} slots, {at.shape[0]} positions and {index.shape[0]} index rows")
        if index.size and (int(index.min()) < 0 or int(index.max()) >= rows.shape[0]):
            raise BadRequest(f"{where}.index: outside the {rows.shape[0]} rows")
        hot_at = None
        if obj.get("hot_at") is not None:
            hot_at = array_from_wire(obj["hot_at"], f"{where}.hot_at", dtype="<i4", ndim=1)
            if hot_at.size and (int(hot_at.min()) < 0 or int(hot_at.max()) >= rows.shape[0]):
                raise BadRequest(f"{where}.hot_at: outside the {rows.shape[0]} rows")
        return cls(dim, rows, slots, at, index, hot_at)


def slot_order(embeddings: Sequence[SlotEmbedding], gathered: Sequence[GatheredSlots]) -> tuple[str, ...]:
    """Every slot of a reply in order, gathered or not (:meth:`EwLookupReply.slot_names`), from its slots
    ``embeddings`` and its ``gathered`` widths."""
    return _slot_order(embeddings, gathered, "gathered")


def _slot_order(embeddings: Sequence[SlotEmbedding], gathered: Sequence[GatheredSlots], where: str
                ) -> tuple[str, ...]:
    """The names of all the batch's slots in order: gathered ones at their ``at``, the others in turn."""
    n = len(embeddings) + sum(len(g.slots) for g in gathered)
    order: list[str | None] = [None] * n
    for g in gathered:
        for name, pos in zip(g.slots, g.at.tolist(), strict=True):
            if not 0 <= pos < n or order[pos] is not None:
                raise BadRequest(f"{where}: slot {name!r} at position {pos}, outside 0..{n - 1} or taken twice")
            order[pos] = name
    rest = iter(embeddings)
    names = tuple(name if name is not None else next(rest).name for name in order)
    if len(set(names)) != n:
        raise BadRequest(f"{where}: a slot is named twice")
    sizes = {g.batch_size for g in gathered} | {e.emb.shape[0] for e in embeddings if not e.is_raw}
    if len(sizes) > 1:
        raise BadRequest(f"{where}: slots of different batch sizes {sorted(sizes)}")
    return names


@dataclass(frozen=True, slots=True)
class HotGroup:
    """Hot rows of one embedding dim as a lookup read them: PS ids, values and the PS versions read."""

    dim: int
    ids: np.ndarray  # uint64 (n,)
    rows: np.ndarray  # float32 (n, dim)
    versions: np.ndarray  # int64 (n,)

    def to_wire(self) -> dict[str, Any]:
        return {"dim": self.dim, "ids": array_to_wire(self.ids), "rows": array_to_wire(self.rows),
                "versions": array_to_wire(self.versions)}

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> HotGroup:
        if not isinstance(obj, Mapping):
            raise BadRequest(f"{where}: expected a map")
        dim = get_field(obj, "dim", int, where)
        ids = array_from_wire(obj.get("ids"), f"{where}.ids", dtype="<u8", ndim=1)
        rows = array_from_wire(obj.get("rows"), f"{where}.rows", dtype="<f4", ndim=2)
        versions = array_from_wire(obj.get("versions"), f"{where}.versions", dtype="<i8", ndim=1)
        if dim < 1 or rows.shape != (ids.shape[0], dim) or versions.shape != ids.shape:
            raise BadRequest(f"{where}: {ids.shape[0]} ids of dim {dim} with rows {list(rows.shape)} "
                             f"and {versions.shape[0]} versions")
        return cls(dim, ids, rows, versions)


@dataclass(frozen=True, slots=True)
class HotPart:
    """The hot rows a training lookup returned apart from the pooled sums (``hot`` of the reply).

    Slot ``slots[k]`` has ``counts[k]`` hot occurrences, stored one after another in ``inv``,
    ``target`` and ``scale``; its full output is its ``emb`` plus, for each occurrence p,
    ``scale[p] * groups[group[k]].rows[inv[p]]`` added to row ``target[p]``. The NN worker adds the
    newest copy of each row it holds instead of the lookup's (:mod:`persia_nats.services.nn_worker.hot_rows`).
    """

    groups: tuple[HotGroup, ...]
    slots: tuple[str, ...]
    group: np.ndarray  # int32 (n_slots,), into groups
    counts: np.ndarray  # int32 (n_slots,)
    inv: np.ndarray  # uint16 or int32 (sum(counts),), into the slot's group's rows
    target: np.ndarray  # uint16 or int32, a row of the slot's emb
    # absent on the wire when every scale is 1 (sum pooling)
    scale: np.ndarray = field(metadata={"absent_when_default": True})  # float32

    def group_of(self, dim: int) -> HotGroup | None:
        """The group of width ``dim``, if any."""
        return next((g for g in self.groups if g.dim == dim), None)

    def to_wire(self) -> dict[str, Any]:
        # most batches fit uint16 indexes and sum pooling has every scale 1: a third of the bytes
        small = max(int(self.inv.max(initial=0)), int(self.target.max(initial=0))) < 1 << 16
        index = np.uint16 if small else np.int32
        out = {"groups": [g.to_wire() for g in self.groups], "slots": list(self.slots),
               "group": array_to_wire(self.group), "counts": array_to_wire(self.counts),
               "inv": array_to_wire(self.inv.astype(index, copy=False)),
               "target": array_to_wire(self.target.astype(index, copy=False))}
        if not (self.scale == 1).all():
            out["scale"] = array_to_wire(self.scale)
        return out

    @classmethod
    def from_wire(cls, obj: Any, embeddings: Sequence[SlotEmbedding], where: str = "hot",
                  gathered: Sequence[GatheredSlots] = ()) -> HotPart:
        """Parse and check against the reply's ``embeddings`` and ``gathered`` slots: every index must land
        inside them."""
        if not isinstance(obj, Mapping) or not isinstance(obj.get("groups"), list) \
                or not isinstance(obj.get("slots"), list):
            raise BadRequest(f"{where}: expected a map with lists 'groups' and 'slots'")
        groups = tuple(HotGroup.from_wire(g, f"{where}.groups[{i}]") for i, g in enumerate(obj["groups"]))
        slots = tuple(obj["slots"])
        group = array_from_wire(obj.get("group"), f"{where}.group", dtype="<i4", ndim=1)
        counts = array_from_wire(obj.get("counts"), f"{where}.counts", dtype="<i4", ndim=1)
        inv = array_from_wire(obj.get("inv"), f"{where}.inv", dtype=("<u2", "<i4"), ndim=1).astype(np.int32)
        target = array_from_wire(obj.get("target"), f"{where}.target", dtype=("<u2", "<i4"), ndim=1).astype(np.int32)
        scale = np.ones(inv.shape[0], np.float32) if obj.get("scale") is None else \
            array_from_wire(obj.get("scale"), f"{where}.scale", dtype="<f4", ndim=1)
        by_name = {e.name: e.emb.shape for e in embeddings if not e.is_raw}
        by_name.update({name: (g.batch_size, g.dim) for g in gathered for name in g.slots})
        pooled = [by_name.get(n) if isinstance(n, str) else None for n in slots]
        if any(e is None for e in pooled) or len(set(slots)) != len(slots):
            raise BadRequest(f"{where}.slots: every name must be a distinct pooled slot of the reply")
        if group.shape != (len(slots),) or counts.shape != (len(slots),) or (counts < 0).any() \
                or int(counts.sum()) != inv.shape[0] or not inv.shape == target.shape == scale.shape:
            raise BadRequest(f"{where}: group and counts need one entry per slot, and inv, target and scale "
                             "one per counted occurrence")
        if ((group < 0) | (group >= len(groups))).any():
            raise BadRequest(f"{where}.group: outside the {len(groups)} groups")
        emb_shape = np.array([e for e in pooled if e is not None], np.int64).reshape(-1, 2)
        wrong = np.flatnonzero(np.array([g.dim for g in groups], np.int64)[group] != emb_shape[:, 1])
        if wrong.size:
            k = int(wrong[0])
            raise BadRequest(f"{where}.group[{k}]: dim {groups[int(group[k])].dim}, but slot {slots[k]!r} "
                             f"has dim {emb_shape[k, 1]}")
        if inv.size:
            rows_of = np.array([g.ids.shape[0] for g in groups], np.int64)[group]
            if ((inv < 0) | (inv >= np.repeat(rows_of, counts))).any():
                raise BadRequest(f"{where}.inv: outside the rows of its slot's group")
            if ((target < 0) | (target >= np.repeat(emb_shape[:, 0], counts))).any():
                raise BadRequest(f"{where}.target: outside the rows of its slot")
        return cls(groups, slots, group, counts, inv, target, scale)


@dataclass(frozen=True, slots=True)
class SlotGradient:
    """NN worker -> embedding worker: d(loss)/d(embedding) for one slot, shaped like its ``emb``."""

    name: str
    grad: np.ndarray

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "grad": array_to_wire(self.grad)}


@dataclass(frozen=True, slots=True)
class RowGradient:
    """NN worker -> embedding worker: the gradient of each row of a width that came gathered
    (:class:`GatheredSlots`), its slots' gradients summed per row, times ``scale`` (a power of two; the
    request's ``loss_scale`` applies to ``grads`` only).
    ``skipped``: slots left out of the sums because their gradient was not finite."""

    dim: int
    grad: np.ndarray  # float16 or float32 (n, dim), like the gathered rows
    scale: float = 1.0
    skipped: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dim": self.dim, "grad": array_to_wire(self.grad), "scale": self.scale}
        if self.skipped:
            out["skipped"] = list(self.skipped)
        return out

    @classmethod
    def from_wire(cls, raw: Any, where: str) -> RowGradient:
        obj = map_at(raw, where)
        dim = get_field(obj, "dim", int, where)
        grad = array_from_wire(obj.get("grad"), f"{where}.grad", dtype=("<f2", "<f4"), ndim=2)
        scale = obj.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not _MIN_SCALE <= scale <= _MAX_SCALE \
                or math.frexp(scale)[0] != 0.5:
            raise BadRequest(f"{where}.scale: expected a power of two in 2**-100..2**100, got {scale!r}")
        skipped = obj.get("skipped", [])
        if not isinstance(skipped, list) or not all(isinstance(n, str) for n in skipped):
            raise BadRequest(f"{where}.skipped: expected a list of slot names")
        if dim < 1 or grad.shape[1] != dim:
            raise BadRequest(f"{where}: gradient {list(grad.shape)} for dim {dim}")
        return cls(dim, grad, float(scale), tuple(skipped))


@dataclass(frozen=True, slots=True)
class GradRequest(Message):
    """NN worker -> embedding worker: the gradients of a batch looked up for training: ``grads`` per slot,
    ``rows`` per gathered width (:class:`RowGradient`)."""

    subject = "ew.<worker>.grad"

    ref: int
    grads: tuple[SlotGradient, ...]
    loss_scale: float = 1.0
    extra: Mapping[str, Any] = field(default_factory=dict)
    rows: tuple[RowGradient, ...] = ()

    def body(self) -> dict[str, Any]:
        out = {"ref": self.ref, "grads": [g.to_wire() for g in self.grads], "loss_scale": self.loss_scale}
        if self.rows:
            out["rows"] = [r.to_wire() for r in self.rows]
        return out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> GradRequest:
        ref = get_field(obj, "ref", int, "grad")
        loss_scale = obj.get("loss_scale", 1.0)
        # gradients are divided by it in float32: outside float32's normal range it rounds to 0 or inf there
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, int | float) \
                or not _F32_TINY <= loss_scale <= _F32_MAX:
            raise BadRequest(f"loss_scale: expected a number in float32's normal range "
                             f"[{_F32_TINY:.3g}, {_F32_MAX:.3g}], got {loss_scale!r}")
        raw = obj.get("grads")
        if not isinstance(raw, list):
            raise BadRequest("grads: expected a list")
        grads = []
        for i, g in enumerate(raw):
            if not isinstance(g, Mapping):
                raise BadRequest(f"grads[{i}]: expected a map")
            name = name_field(g, f"grads[{i}]")
            grads.append(SlotGradient(name, array_from_wire(g.get("grad"), f"grads[{i}]({name}).grad",
                                                            dtype=("<f2", "<f4"), ndim=2)))
        rows = obj.get("rows", [])
        if not isinstance(rows, list):
            raise BadRequest("rows: expected a list")
        return cls(ref, tuple(grads), float(loss_scale),
                   rows=tuple(RowGradient.from_wire(r, f"rows[{i}]") for i, r in enumerate(rows)))


@dataclass(frozen=True, slots=True)
class EwLookupReply(Message):
    """The embeddings of a looked-up batch, in the order of its ingested features; ``hot`` apart."""

    subject = "ew.<worker>.lookup"
    kind = "reply"

    ref: int
    embeddings: tuple[SlotEmbedding, ...]
    hot: HotPart | None = None
    #: the slots sent as their distinct rows (asked for with ``EwLookup.gather``), apart from ``embeddings``
    gathered: tuple[GatheredSlots, ...] = ()

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ref": self.ref, "embeddings": [e.to_wire() for e in self.embeddings]}
        if self.hot is not None:
            out["hot"] = self.hot.to_wire()
        if self.gathered:
            out["gathered"] = [g.to_wire() for g in self.gathered]
        return out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> EwLookupReply:
        embeddings = embeddings_from_wire(obj.get("embeddings"))
        raw_gathered = obj.get("gathered", [])
        if not isinstance(raw_gathered, list):
            raise BadRequest("gathered: expected a list")
        gathered = tuple(GatheredSlots.from_wire(g, f"gathered[{i}]") for i, g in enumerate(raw_gathered))
        if gathered:
            _slot_order(embeddings, gathered, "gathered")
        raw = obj.get("hot")
        hot = None if raw is None else HotPart.from_wire(raw, embeddings, gathered=gathered)
        for i, g in enumerate(gathered):
            if g.hot_at is None:
                continue
            group = hot.group_of(g.dim) if hot is not None else None
            if group is None or group.ids.shape[0] != g.hot_at.shape[0]:
                raise BadRequest(f"gathered[{i}].hot_at: {g.hot_at.shape[0]} hot rows of dim {g.dim}, but the reply's "
                                 f"hot part has {'no group of that dim' if group is None else group.ids.shape[0]}")
        return cls(get_field(obj, "ref", int, ""), embeddings, hot, gathered)

    def slot_names(self) -> tuple[str, ...]:
        """Every slot of the batch, in order, gathered or not."""
        return slot_order(self.embeddings, self.gathered)


@dataclass(frozen=True, slots=True)
class LookupDirectReply(Message):
    """Embeddings of id features read without buffering (``ew.lookup_direct``)."""

    subject = "ew.lookup_direct"
    kind = "reply"

    embeddings: tuple[SlotEmbedding, ...]

    def body(self) -> dict[str, Any]:
        return {"embeddings": [e.to_wire() for e in self.embeddings]}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> LookupDirectReply:
        return cls(embeddings_from_wire(obj.get("embeddings")))


@dataclass(frozen=True, slots=True)
class GradReply(Message):
    """Gradients applied: the slots skipped as non-finite, and the ids the PSs no longer held."""

    subject = "ew.<worker>.grad"
    kind = "reply"

    ref: int
    skipped: tuple[str, ...] = always_sent(())
    missing: int = always_sent(0)

    def body(self) -> dict[str, Any]:
        return {"ref": self.ref, "skipped": list(self.skipped), "missing": self.missing}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> GradReply:
        skipped = get_field(obj, "skipped", list, "")
        if not all(isinstance(s, str) for s in skipped):
            raise BadRequest("skipped: expected a list of str")
        return cls(get_field(obj, "ref", int, ""), tuple(skipped), get_field(obj, "missing", int, ""))
