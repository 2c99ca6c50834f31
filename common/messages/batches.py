"""Batches: ``ew.ingest`` (its request and reply), ``nn.<rank>.batch`` and the stream's batch message.

Sparse id features travel in a flat jagged form, like TorchRec's KeyedJaggedTensor, one entry per
feature (slot)::

    # slot "user_id", batch of 3 samples: [1000, 1001]  []  [1024]
    values:  uint64 [1000, 1001, 1024]
    lengths: int32  [2, 0, 1]

A slot with exactly one id per sample (most of a Criteo-like batch) leaves ``lengths`` out: it would
be a third of the slot's bytes and say nothing. Decoded, it gets the same all-ones ``lengths``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from persia_nats.common.codec import all_finite, array_from_wire, array_to_wire
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages.base import (
    MAX_BATCH_SIZE,
    MAX_NAME_LEN,
    TOKEN,
    Message,
    always_sent,
    check_batch_size,
    get_field,
    name_field,
)

__all__ = ["MAX_BATCH_SIZE", "MAX_NAME_LEN", "IdFeature", "id_features_from_wire", "NamedArray", "named_list_from_wire",
           "IngestRequest", "BatchRef", "IngestReply", "StreamAck", "ACK_PREFIX", "NNBatch", "StreamBatch", "StreamEnd",
           "check_sequence_of", "BatchBounds"]


@lru_cache(maxsize=16)
def single_lengths(batch_size: int) -> np.ndarray:
    """The ``lengths`` of a slot with one id per sample: shared and read-only, like a decoded array."""
    ones = np.ones(batch_size, np.int32)
    ones.flags.writeable = False
    return ones


@dataclass(frozen=True, slots=True)
class IdFeature:
    """One id feature (slot) of a batch in jagged form: ``values`` uint64, ``lengths`` int32.

    ``lengths`` is left out on the wire when every sample has exactly one id (:attr:`single`).
    """

    name: str
    values: np.ndarray
    lengths: np.ndarray = field(metadata={"absent_when_default": True})

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def single(self) -> bool:
        """Whether every sample has exactly one id (then ``lengths`` does not travel)."""
        lengths = self.lengths
        return lengths is single_lengths(lengths.shape[0]) or (
            lengths.shape[0] == self.values.shape[0] and not (lengths != 1).any())

    def to_wire(self) -> dict[str, Any]:
        if self.single:
            return {"name": self.name, "values": array_to_wire(self.values)}
        return {"name": self.name, "values": array_to_wire(self.values), "lengths": array_to_wire(self.lengths)}

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> IdFeature:
        if not isinstance(obj, Mapping):
            raise BadRequest(f"{where}: expected a map, got {type(obj).__name__}")
        name = name_field(obj, where)
        values = array_from_wire(obj.get("values"), f"{where}({name}).values", dtype="<u8", ndim=1)
        if obj.get("lengths") is None:
            # one id per sample: the batch size is the number of values, checked against the other slots
            # (and against the limit first, before the lengths are made)
            if values.shape[0] > MAX_BATCH_SIZE:
                raise BadRequest(f"{where}({name}): {values.shape[0]} values without lengths (one id per sample), "
                                 f"more samples than a batch holds ({MAX_BATCH_SIZE})")
            return cls(name, values, single_lengths(values.shape[0]))
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
    # the batch size is what a slot with lengths says, else what most slots without them say, so the
    # slot named below is the one that miscounts (a slot without lengths has as many samples as values)
    explicit = [f.batch_size for f, o in zip(feats, obj, strict=True) if o.get("lengths") is not None]
    size = explicit[0] if explicit else Counter(f.batch_size for f in feats).most_common(1)[0][0]
    for i, f in enumerate(feats):
        if f.batch_size != size:
            how = "values (one id per sample: no lengths)" if obj[i].get("lengths") is None else "lengths"
            raise BadRequest(f"{where}[{i}]({f.name}): {f.batch_size} {how}, but the batch size is {size}: "
                             "id features disagree on batch size")
    check_batch_size(size, where)
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
        name = name_field(obj, where)
        data = array_from_wire(obj.get("data"), f"{where}({name}).data")
        if data.ndim < 1:
            raise BadRequest(f"{where}({name}).data: needs at least one dimension (the batch)")
        # one NaN in a dense feature or label poisons the dense model of every rank at the next all-reduce
        if data.dtype.kind == "f" and not all_finite(data):
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
class BatchBounds:
    """What one batch may hold (``data_loader_config.max_batch_*``): bytes, samples and distinct ids.

    Checked where a batch enters the job (the stream loader, ``ew.ingest``) before anything buffers it:
    every distinct id of a training batch may become a new row on a PS, so the distinct ids bound the
    rows one batch can insert.
    """

    max_bytes: int
    max_samples: int
    max_distinct_ids: int

    def check_bytes(self, nbytes: int, where: str = "batch") -> None:
        if nbytes > self.max_bytes:
            raise BadRequest(f"{where}: {nbytes} bytes, more than data_loader_config.max_batch_bytes "
                             f"({self.max_bytes})")

    def check(self, features: Sequence[IdFeature], where: str = "features") -> None:
        """BadRequest naming the bound a batch's id features exceed."""
        samples = features[0].batch_size if features else 0
        if samples > self.max_samples:
            raise BadRequest(f"{where}: {samples} samples, more than data_loader_config.max_batch_samples "
                             f"({self.max_samples})")
        # the total is an upper bound of the distinct ids: only a batch above the bound pays for np.unique
        if sum(int(f.values.shape[0]) for f in features) <= self.max_distinct_ids:
            return
        distinct = sum(int(np.unique(f.values).shape[0]) for f in features)
        if distinct > self.max_distinct_ids:
            raise BadRequest(f"{where}: {distinct} distinct ids (summed over slots), more than "
                             f"data_loader_config.max_batch_distinct_ids ({self.max_distinct_ids})")


#: the longest a sender may ask a full buffer to hold its batch (``wait``): beyond it, it should ask again
MAX_WAIT_S = 600.0


def wait_from_wire(obj: Mapping[str, Any], where: str = "wait") -> float:
    """The optional ``wait`` of a batch request: seconds the sender lets a full receiver hold it, 0 when absent."""
    wait = obj.get("wait")
    if wait is None:
        return 0.0
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= MAX_WAIT_S:
        raise BadRequest(f"{where}: expected seconds in 0..{MAX_WAIT_S:g} or nil, got {wait!r}")
    return float(wait)


@dataclass(frozen=True, slots=True)
class IngestRequest(Message):
    """data loader -> embedding worker: buffer these id features and answer a :class:`BatchRef`.

    Also the request of ``ew.lookup_direct`` (where ``requires_grad`` and ``wait`` are ignored).
    ``wait``: how long a full worker may hold the request until room frees, in seconds; the sender's
    request timeout must exceed it (0, or left out, as older senders do: refused with Busy at once).
    """

    subject = "ew.ingest"

    features: tuple[IdFeature, ...]
    requires_grad: bool = True
    wait: float = 0.0

    @property
    def batch_size(self) -> int:
        return self.features[0].batch_size

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"features": [f.to_wire() for f in self.features], "requires_grad": self.requires_grad}
        if self.wait:
            out["wait"] = self.wait
        return out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> IngestRequest:
        feats = id_features_from_wire(obj.get("features"))
        requires_grad = obj.get("requires_grad", True)
        if not isinstance(requires_grad, bool):
            raise BadRequest("requires_grad: expected bool")
        return cls(feats, requires_grad, wait_from_wire(obj))


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
        worker = get_field(obj, "worker", str, where)
        if not TOKEN.match(worker):
            raise BadRequest(f"{where}.worker: {worker[:64]!r} is not a worker id (letters, digits, '_' and '-')")
        ref = get_field(obj, "ref", int, where)
        return cls(worker, ref)


@dataclass(frozen=True, slots=True)
class IngestReply(Message):
    """The ``ew.ingest`` reply: which worker holds the batch, under which key."""

    subject = "ew.ingest"
    kind = "reply"

    worker: str
    ref: int

    @property
    def batch_ref(self) -> BatchRef:
        return BatchRef(self.worker, self.ref)

    def body(self) -> dict[str, Any]:
        return self.batch_ref.to_wire()

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> IngestReply:
        ref = BatchRef.from_wire(obj)
        return cls(ref.worker, ref.ref)


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
    delivered: int = always_sent(1)
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
        subject = get_field(obj, "subject", str, where)
        # only JetStream acknowledgements: a batch must not make the NN worker publish anywhere else
        if not subject.startswith(ACK_PREFIX) or len(subject) > 512 or any(c.isspace() for c in subject):
            raise BadRequest(f"{where}.subject: expected a JetStream ack subject ({ACK_PREFIX}...)")
        seq = get_field(obj, "seq", int, where)
        delivered = get_field(obj, "delivered", int, where)
        if seq < 1 or delivered < 1:
            raise BadRequest(f"{where}: seq and delivered must be >= 1")
        wait = obj.get("wait")
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int | float)
                                 or not 0.5 <= wait <= 86400):
            raise BadRequest(f"{where}.wait: expected seconds in 0.5..86400 or nil")
        return cls(subject, seq, delivered, float(wait) if wait is not None else None)


ACK_PREFIX = "$JS.ACK."


@dataclass(frozen=True, slots=True)
class NNBatch(Message):
    """data loader -> NN worker: the non-id part of a batch plus the ref to its id features."""

    subject = "nn.<rank>.batch"

    batch_id: int
    batch_size: int
    ref: BatchRef
    non_id: tuple[NamedArray, ...] = ()
    labels: tuple[NamedArray, ...] = ()
    requires_grad: bool = True
    meta: bytes | None = None
    ack: StreamAck | None = None
    #: how long a rank whose incoming buffer is full may hold the batch until room frees (seconds)
    wait: float = 0.0

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
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
        if self.wait:
            out["wait"] = self.wait
        return out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> NNBatch:
        batch_id = get_field(obj, "batch_id", int, "batch")
        batch_size = check_batch_size(obj.get("batch_size"), "batch")
        ref = BatchRef.from_wire(obj.get("ref"))
        non_id, labels, requires_grad, meta = _dense_part(obj, batch_size)
        ack = StreamAck.from_wire(obj["ack"]) if obj.get("ack") is not None else None
        return cls(batch_id, batch_size, ref, non_id, labels, requires_grad, meta, ack, wait_from_wire(obj))


@dataclass(frozen=True, slots=True)
class StreamBatch(Message):
    """A batch as any client publishes it on the ingestion stream (``persia.<job>.batches``).

    The id features in jagged form (as ``ew.ingest`` takes them), the dense features and labels (as
    ``nn.<rank>.batch`` takes them), ``requires_grad`` and ``meta``: one map holds the whole batch.
    """

    subject = "batches"

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

    def body(self) -> dict[str, Any]:
        return {"features": [f.to_wire() for f in self.features],
                "non_id": [a.to_wire() for a in self.non_id], "labels": [a.to_wire() for a in self.labels],
                "requires_grad": self.requires_grad, "meta": self.meta}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> StreamBatch:
        features = id_features_from_wire(obj.get("features"))
        return cls(features, *_dense_part(obj, features[0].batch_size))


@dataclass(frozen=True, slots=True)
class StreamEnd(Message):
    """The end marker on the ingestion stream: every batch published before it is the whole job."""

    subject = "batches"

    end: bool = True

    @staticmethod
    def is_end(obj: Mapping[str, Any]) -> bool:
        """Whether a stream message is the end marker (then decoded by :meth:`from_wire`) rather than a batch."""
        return "end" in obj

    def body(self) -> dict[str, Any]:
        return {"end": True}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> StreamEnd:
        if obj.get("end") is not True:
            raise BadRequest(f"end: expected true (the end marker is {{v: 1, end: true}}), got {obj.get('end')!r}")
        return cls()


def check_sequence_of(values: Sequence[Any], kind: type, where: str) -> None:
    for i, v in enumerate(values):
        if not isinstance(v, kind):
            raise BadRequest(f"{where}[{i}]: expected {kind.__name__}, got {type(v).__name__}")
