"""Wire messages: frozen dataclasses with ``to_wire()`` / ``from_wire()``.

``from_wire`` validates untrusted maps and raises :class:`~persia_nats.common.errors.BadRequest` naming the
field; it ignores unknown fields (the open-world rule NATS uses) so a newer peer can add fields
without breaking an older one. Every map carries ``v`` (see :data:`persia_nats.common.codec.WIRE_VERSION`).

Sparse id features travel in a flat jagged form, like TorchRec's KeyedJaggedTensor, one entry per
feature (slot)::

    # slot "user_id", batch of 3 samples: [1000, 1001]  []  [1024]
    values:  uint64 [1000, 1001, 1024]
    lengths: int32  [2, 0, 1]
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from persia_nats.common.codec import WIRE_VERSION, array_from_wire, array_to_wire
from persia_nats.common.errors import BadRequest

#: PERSIA's limit: one batch holds at most this many samples.
MAX_BATCH_SIZE = 65535
MAX_NAME_LEN = 256
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_F32_TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)


def _get(obj: Mapping[str, Any], key: str, types: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise BadRequest(f"{where}: missing field {key!r}")
    value = obj[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BadRequest(f"{where}.{key}: expected {_names(types)}, got bool")
    if not isinstance(value, types):
        raise BadRequest(f"{where}.{key}: expected {_names(types)}, got {type(value).__name__}")
    return value


def _names(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in ts)


def _name(obj: Mapping[str, Any], where: str) -> str:
    name: str = _get(obj, "name", str, where)
    if not name or len(name) > MAX_NAME_LEN:
        raise BadRequest(f"{where}.name: must be 1..{MAX_NAME_LEN} characters")
    return name


def _batch_size(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BATCH_SIZE:
        raise BadRequest(f"{where}: batch_size must be an int in 0..{MAX_BATCH_SIZE}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class IdFeature:
    """One id feature (slot) of a batch in jagged form: ``values`` uint64, ``lengths`` int32."""

    name: str
    values: np.ndarray
    lengths: np.ndarray

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "values": array_to_wire(self.values), "lengths": array_to_wire(self.lengths)}

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> IdFeature:
        if not isinstance(obj, Mapping):
            raise BadRequest(f"{where}: expected a map, got {type(obj).__name__}")
        name = _name(obj, where)
        values = array_from_wire(obj.get("values"), f"{where}({name}).values", dtype="<u8", ndim=1)
        lengths = array_from_wire(obj.get("lengths"), f"{where}({name}).lengths", dtype="<i4", ndim=1)
        if lengths.size and int(lengths.min()) < 0:
            raise BadRequest(f"{where}({name}).lengths: negative length")
        total = int(lengths.sum(dtype=np.int64))
        if total != values.shape[0]:
            raise BadRequest(f"{where}({name}): lengths sum to {total} but there are {values.shape[0]} values")
        return cls(name, values, lengths)


def id_features_from_wire(obj: Any, where: str = "features") -> tuple[IdFeature, ...]:
    """Decode a list of id features that must share one batch size and have distinct names."""
    if not isinstance(obj, list) or not obj:
        raise BadRequest(f"{where}: expected a non-empty list of id features")
    feats = tuple(IdFeature.from_wire(f, f"{where}[{i}]") for i, f in enumerate(obj))
    sizes = {f.batch_size for f in feats}
    if len(sizes) != 1:
        raise BadRequest(f"{where}: id features disagree on batch size: {sorted(sizes)}")
    _batch_size(sizes.pop(), where)
    names = [f.name for f in feats]
    if len(set(names)) != len(names):
        raise BadRequest(f"{where}: duplicate feature names {sorted({n for n in names if names.count(n) > 1})}")
    return feats


@dataclass(frozen=True, slots=True)
class NamedArray:
    """A dense feature or a label: any dtype the codec allows, first dimension = batch."""

    name: str
    data: np.ndarray

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "data": array_to_wire(self.data)}

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> NamedArray:
        if not isinstance(obj, Mapping):
            raise BadRequest(f"{where}: expected a map, got {type(obj).__name__}")
        name = _name(obj, where)
        data = array_from_wire(obj.get("data"), f"{where}({name}).data")
        if data.ndim < 1:
            raise BadRequest(f"{where}({name}).data: needs at least one dimension (the batch)")
        # one NaN in a dense feature or label poisons the dense model of every rank at the next all-reduce
        if data.dtype.kind == "f" and not np.isfinite(data).all():
            raise BadRequest(f"{where}({name}).data: non-finite values (NaN or Inf)")
        return cls(name, data)


def named_list_from_wire(obj: Any, where: str, batch_size: int) -> tuple[NamedArray, ...]:
    """Dense features or labels: a list (or nil) of named arrays whose first dimension is ``batch_size``."""
    if obj is None:
        return ()
    if not isinstance(obj, list):
        raise BadRequest(f"{where}: expected a list, got {type(obj).__name__}")
    out = tuple(NamedArray.from_wire(x, f"{where}[{i}]") for i, x in enumerate(obj))
    for a in out:
        if a.data.shape[0] != batch_size:
            raise BadRequest(f"{where}({a.name}): batch dimension {a.data.shape[0]} != batch_size {batch_size}")
    return out


def _dense_part(obj: Mapping[str, Any], batch_size: int
                ) -> tuple[tuple[NamedArray, ...], tuple[NamedArray, ...], bool, bytes | None]:
    """``non_id``, ``labels``, ``requires_grad`` and ``meta`` of a batch map, validated."""
    requires_grad = obj.get("requires_grad", True)
    if not isinstance(requires_grad, bool):
        raise BadRequest("requires_grad: expected bool")
    labels = named_list_from_wire(obj.get("labels"), "labels", batch_size)
    if requires_grad and not labels:
        raise BadRequest("labels: a batch with requires_grad needs at least one label")
    meta = obj.get("meta")
    if meta is not None and not isinstance(meta, bytes):
        raise BadRequest("meta: expected bytes or nil")
    return named_list_from_wire(obj.get("non_id"), "non_id", batch_size), labels, requires_grad, meta


@dataclass(frozen=True, slots=True)
class IngestRequest:
    """data loader -> embedding worker: buffer these id features and answer a :class:`BatchRef`."""

    features: tuple[IdFeature, ...]
    requires_grad: bool = True

    @property
    def batch_size(self) -> int:
        return self.features[0].batch_size

    def to_wire(self) -> dict[str, Any]:
        return {"v": WIRE_VERSION, "features": [f.to_wire() for f in self.features],
                "requires_grad": self.requires_grad}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> IngestRequest:
        feats = id_features_from_wire(obj.get("features"))
        requires_grad = obj.get("requires_grad", True)
        if not isinstance(requires_grad, bool):
            raise BadRequest("requires_grad: expected bool")
        return cls(feats, requires_grad)


@dataclass(frozen=True, slots=True)
class BatchRef:
    """Where a batch's id features wait: the embedding worker's id and its buffer key."""

    worker: str
    ref: int

    def to_wire(self) -> dict[str, Any]:
        return {"worker": self.worker, "ref": self.ref}

    @classmethod
    def from_wire(cls, obj: Any, where: str = "ref") -> BatchRef:
        if not isinstance(obj, Mapping):
            raise BadRequest(f"{where}: expected a map, got {type(obj).__name__}")
        worker = _get(obj, "worker", str, where)
        if not _TOKEN.match(worker):
            raise BadRequest(f"{where}.worker: {worker[:64]!r} is not a worker id (letters, digits, '_' and '-')")
        ref = _get(obj, "ref", int, where)
        return cls(worker, ref)


@dataclass(frozen=True, slots=True)
class StreamAck:
    """Where a batch that came from the ingestion stream is acknowledged once it is trained.

    ``subject`` is the JetStream message's reply subject (``$JS.ACK.…``): the NN worker publishes
    ``+ACK`` there after the batch's gradients are applied, or ``-NAK`` when they could not be, so
    the stream redelivers it. ``seq`` is the stream sequence and ``delivered`` the delivery count;
    ``wait`` is the consumer's ack wait in seconds, so the holder knows how often to say it is still
    working on the batch (:mod:`persia_nats.common.acks`).
    """

    subject: str
    seq: int
    delivered: int = 1
    wait: float | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"subject": self.subject, "seq": self.seq, "delivered": self.delivered}
        if self.wait is not None:
            out["wait"] = self.wait
        return out

    @classmethod
    def from_wire(cls, obj: Any, where: str = "ack") -> StreamAck:
        if not isinstance(obj, Mapping):
            raise BadRequest(f"{where}: expected a map, got {type(obj).__name__}")
        subject = _get(obj, "subject", str, where)
        # only JetStream acknowledgements: a batch must not make the NN worker publish anywhere else
        if not subject.startswith(ACK_PREFIX) or len(subject) > 512 or any(c.isspace() for c in subject):
            raise BadRequest(f"{where}.subject: expected a JetStream ack subject ({ACK_PREFIX}...)")
        seq = _get(obj, "seq", int, where)
        delivered = _get(obj, "delivered", int, where)
        if seq < 1 or delivered < 1:
            raise BadRequest(f"{where}: seq and delivered must be >= 1")
        wait = obj.get("wait")
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int | float)
                                 or not 0.5 <= wait <= 86400):
            raise BadRequest(f"{where}.wait: expected seconds in 0.5..86400 or nil")
        return cls(subject, seq, delivered, float(wait) if wait is not None else None)


ACK_PREFIX = "$JS.ACK."


@dataclass(frozen=True, slots=True)
class NNBatch:
    """data loader -> NN worker: the non-id part of a batch plus the ref to its id features."""

    batch_id: int
    batch_size: int
    ref: BatchRef
    non_id: tuple[NamedArray, ...] = ()
    labels: tuple[NamedArray, ...] = ()
    requires_grad: bool = True
    meta: bytes | None = None
    ack: StreamAck | None = None

    def to_wire(self) -> dict[str, Any]:
        out = {
            "v": WIRE_VERSION,
            "batch_id": self.batch_id,
            "batch_size": self.batch_size,
            "ref": self.ref.to_wire(),
            "non_id": [a.to_wire() for a in self.non_id],
            "labels": [a.to_wire() for a in self.labels],
            "requires_grad": self.requires_grad,
            "meta": self.meta,
        }
        if self.ack is not None:
            out["ack"] = self.ack.to_wire()
        return out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> NNBatch:
        batch_id = _get(obj, "batch_id", int, "batch")
        batch_size = _batch_size(obj.get("batch_size"), "batch")
        ref = BatchRef.from_wire(obj.get("ref"))
        non_id, labels, requires_grad, meta = _dense_part(obj, batch_size)
        ack = StreamAck.from_wire(obj["ack"]) if obj.get("ack") is not None else None
        return cls(batch_id, batch_size, ref, non_id, labels, requires_grad, meta, ack)


@dataclass(frozen=True, slots=True)
class StreamBatch:
    """A batch as any client publishes it on the ingestion stream (``persia.<job>.batches``).

    The id features in jagged form (as ``ew.ingest`` takes them), the dense features and labels (as
    ``nn.<rank>.batch`` takes them), ``requires_grad`` and ``meta``: one map holds the whole batch.
    """

    features: tuple[IdFeature, ...]
    non_id: tuple[NamedArray, ...] = ()
    labels: tuple[NamedArray, ...] = ()
    requires_grad: bool = True
    meta: bytes | None = None

    @property
    def batch_size(self) -> int:
        return self.features[0].batch_size

    def ingest_request(self) -> IngestRequest:
        return IngestRequest(self.features, self.requires_grad)

    def to_wire(self) -> dict[str, Any]:
        return {"v": WIRE_VERSION, "features": [f.to_wire() for f in self.features],
                "non_id": [a.to_wire() for a in self.non_id], "labels": [a.to_wire() for a in self.labels],
                "requires_grad": self.requires_grad, "meta": self.meta}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> StreamBatch:
        features = id_features_from_wire(obj.get("features"))
        return cls(features, *_dense_part(obj, features[0].batch_size))


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
        name = _name(obj, where)
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
        dim = _get(obj, "dim", int, where)
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
    scale: np.ndarray  # float32

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
    def from_wire(cls, obj: Any, embeddings: Sequence[SlotEmbedding], where: str = "hot") -> HotPart:
        """Parse and check against the reply's ``embeddings``: every index must land inside them."""
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
        by_name = {e.name: e for e in embeddings}
        pooled = [by_name.get(n) if isinstance(n, str) else None for n in slots]
        if any(e is None or e.is_raw for e in pooled) or len(set(slots)) != len(slots):
            raise BadRequest(f"{where}.slots: every name must be a distinct pooled slot of the reply")
        if group.shape != (len(slots),) or counts.shape != (len(slots),) or (counts < 0).any() \
                or int(counts.sum()) != inv.shape[0] or not inv.shape == target.shape == scale.shape:
            raise BadRequest(f"{where}: group and counts need one entry per slot, and inv, target and scale "
                             "one per counted occurrence")
        if ((group < 0) | (group >= len(groups))).any():
            raise BadRequest(f"{where}.group: outside the {len(groups)} groups")
        emb_shape = np.array([e.emb.shape for e in pooled if e is not None], np.int64).reshape(-1, 2)
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
class GradRequest:
    ref: int
    grads: tuple[SlotGradient, ...]
    loss_scale: float = 1.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"v": WIRE_VERSION, "ref": self.ref, "grads": [g.to_wire() for g in self.grads],
                "loss_scale": self.loss_scale}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> GradRequest:
        ref = _get(obj, "ref", int, "grad")
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
            name = _name(g, f"grads[{i}]")
            grads.append(SlotGradient(name, array_from_wire(g.get("grad"), f"grads[{i}]({name}).grad",
                                                            dtype=("<f2", "<f4"), ndim=2)))
        return cls(ref, tuple(grads), float(loss_scale))


def check_sequence_of(values: Sequence[Any], kind: type, where: str) -> None:
    for i, v in enumerate(values):
        if not isinstance(v, kind):
            raise BadRequest(f"{where}[{i}]: expected {kind.__name__}, got {type(v).__name__}")
