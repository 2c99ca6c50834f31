"""The user's batch types (PERSIA's ``persia.embedding.data``), validated as PERSIA documents.

``IDTypeFeature`` takes PERSIA's list-of-arrays form and stores it jagged (values + lengths), so a
batch becomes wire messages without a per-sample copy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import MAX_BATCH_SIZE, IdFeature, IngestRequest, NamedArray

_NDARRAY_DTYPES = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                   np.float16, np.float32, np.float64)


def _skip_checks() -> bool:
    return os.environ.get("PERSIA_SKIP_CHECK_DATA", "") == "1"


def _name_first(cls: str, name: object, data: Any) -> tuple[str, Any]:
    """``(name, data)`` from PERSIA's order or the reverse one some of its examples use, told apart by type."""
    if not isinstance(name, str) and isinstance(data, str):
        name, data = data, name
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls} takes a non-empty str name and the ids, in either order ({cls}(name, data) or "
                        f"{cls}(data, name)); got {type(name).__name__} and {type(data).__name__}")
    if isinstance(data, str):
        raise TypeError(f"{cls} {name!r}: data must be the ids (np.uint64 arrays), got the str {data!r}")
    return name, data


class IDTypeFeature:
    """Variable-length ids per sample: ``data[i]`` is a 1-D uint64 array (possibly empty).

    Args:
        name: the slot name, as in ``embedding_config.yml``.
        data: one uint64 array per sample.
    """

    def __init__(self, name: str, data: Sequence[np.ndarray] | np.ndarray) -> None:
        name, data = _name_first(type(self).__name__, name, data)
        if isinstance(data, np.ndarray) and data.ndim == 2:
            data = list(data)
        if not _skip_checks():
            for i, x in enumerate(data):
                if not isinstance(x, np.ndarray) or x.dtype != np.uint64 or x.ndim != 1:
                    got = f"{x.dtype}, ndim {x.ndim}" if isinstance(x, np.ndarray) else type(x).__name__
                    raise TypeError(f"IDTypeFeature {name!r}: sample {i} must be a 1-D np.uint64 array, got {got}")
        self.name = name
        lengths = np.fromiter((len(x) for x in data), dtype=np.int32, count=len(data))
        values = np.concatenate(data).astype(np.uint64, copy=False) if len(data) else np.empty(0, np.uint64)
        self._feature = IdFeature(name, values, lengths)

    @property
    def batch_size(self) -> int:
        return self._feature.batch_size

    @property
    def jagged(self) -> IdFeature:
        return self._feature

    @classmethod
    def from_jagged(cls, name: str, values: np.ndarray, lengths: np.ndarray) -> IDTypeFeature:
        """Build from the flat form directly (no per-sample arrays)."""
        values = np.asarray(values)
        lengths = np.asarray(lengths)
        if values.dtype != np.uint64 or values.ndim != 1:
            raise TypeError(f"IDTypeFeature {name!r}: values must be a 1-D np.uint64 array, got {values.dtype}")
        if lengths.ndim != 1 or (lengths.size and lengths.min() < 0) or int(lengths.sum()) != values.shape[0]:
            raise ValueError(f"IDTypeFeature {name!r}: lengths must be non-negative and sum to len(values)")
        obj = cls.__new__(cls)
        obj.name = name
        obj._feature = IdFeature(name, values, lengths.astype(np.int32))
        return obj


class IDTypeFeatureWithSingleID(IDTypeFeature):
    """Exactly one id per sample: ``data`` is a 1-D uint64 array (checked once, cheap)."""

    def __init__(self, name: str, data: np.ndarray) -> None:
        name, data = _name_first(type(self).__name__, name, data)
        if not isinstance(data, np.ndarray) or data.dtype != np.uint64 or data.ndim != 1:
            got = f"{data.dtype} with ndim {data.ndim}" if isinstance(data, np.ndarray) else type(data).__name__
            raise TypeError(f"IDTypeFeatureWithSingleID {name!r}: data must be a 1-D np.uint64 array, got {got}")
        self.name = name
        self._feature = IdFeature(name, data, np.ones(data.shape[0], dtype=np.int32))


class _NdarrayData:
    _default_name = "anonymous"

    def __init__(self, data: np.ndarray, name: str | None = None) -> None:
        if not isinstance(data, np.ndarray):
            raise TypeError(f"{type(self).__name__} data must be an np.ndarray, got {type(data).__name__}")
        if data.ndim < 1:
            raise ValueError(f"{type(self).__name__} data needs at least one dimension (the batch)")
        if data.dtype.type not in _NDARRAY_DTYPES:
            raise TypeError(f"{type(self).__name__} dtype {data.dtype} is not supported "
                            f"(use bool, int8-64, uint8-64, float16/32/64)")
        self.data = data
        self.name = name or self._default_name

    @property
    def batch_size(self) -> int:
        return int(self.data.shape[0])


class NonIDTypeFeature(_NdarrayData):
    """A dense feature: any supported dtype, first dimension = batch."""

    _default_name = "non_id_type_feature_anonymous"


class Label(_NdarrayData):
    """A label: any supported dtype, first dimension = batch."""

    _default_name = "label_anonymous"


class PersiaBatch:
    """One batch: id features (at least one), dense features, labels and optional meta bytes.

    Raises:
        ValueError: parts disagree on the batch size, the size exceeds 65535, or no id feature.
        RuntimeError: ``requires_grad=True`` without labels (PERSIA's behaviour).
    """

    def __init__(
        self,
        id_type_features: Sequence[IDTypeFeature],
        non_id_type_features: Sequence[NonIDTypeFeature] | None = None,
        labels: Sequence[Label] | None = None,
        batch_size: int | None = None,
        requires_grad: bool = True,
        meta: bytes | None = None,
    ) -> None:
        if not id_type_features:
            raise ValueError("PersiaBatch needs at least one id type feature")
        non_id_type_features = list(non_id_type_features or [])
        labels = list(labels or [])
        if requires_grad and not labels:
            raise RuntimeError("PersiaBatch with requires_grad=True needs at least one Label")
        sizes = {f"id feature {f.name!r}": f.batch_size for f in id_type_features}
        sizes.update({f"non-id feature {f.name!r}": f.batch_size for f in non_id_type_features})
        sizes.update({f"label {f.name!r}": f.batch_size for f in labels})
        if batch_size is None:
            batch_size = next(iter(sizes.values()))
        wrong = {k: v for k, v in sizes.items() if v != batch_size}
        if wrong:
            raise ValueError(f"batch size mismatch: expected {batch_size}, got {wrong}")
        if batch_size > MAX_BATCH_SIZE:
            raise ValueError(f"batch size {batch_size} exceeds the maximum {MAX_BATCH_SIZE}")
        names = [f.name for f in id_type_features]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate id feature names in {names}")
        if meta is not None and not isinstance(meta, bytes):
            raise TypeError("meta must be bytes")
        self.id_type_features = list(id_type_features)
        self.non_id_type_features = non_id_type_features
        self.labels = labels
        self.batch_size = batch_size
        self.requires_grad = requires_grad
        self.meta = meta

    def ingest_request(self) -> IngestRequest:
        return IngestRequest(tuple(f.jagged for f in self.id_type_features), self.requires_grad)

    def non_id_wire(self) -> tuple[NamedArray, ...]:
        return tuple(NamedArray(f.name, f.data) for f in self.non_id_type_features)

    def labels_wire(self) -> tuple[NamedArray, ...]:
        return tuple(NamedArray(f.name, f.data) for f in self.labels)


#: a dense feature's or label's dtype and its shape after the batch dimension
ArraySpec = tuple[np.dtype, tuple[int, ...]]


def _spec(a: NamedArray) -> ArraySpec:
    return a.data.dtype, tuple(a.data.shape[1:])


def _describe(spec: ArraySpec) -> str:
    return f"{spec[0].str} {list(spec[1])}"


class BatchSchema:
    """What every batch of a job carries: all configured slots, and named dense features and labels.

    The dense features and labels (names, dtypes, shapes after the batch dimension) come from
    ``data_loader_config`` or, left out there, from the first batch that *trained* (:meth:`confirm`,
    which the NN worker calls once a batch's backward ran): admitting a batch never fixes them, so no
    batch a client publishes decides the job's schema before the model has accepted it, and a batch the
    model fails on fixes nothing. Once fixed, every batch must match them, in any order: :meth:`admit`
    hands them back in the schema's order, so the model sees each input where it expects it whatever
    order a client sent. A batch refused changes nothing.

    Args:
        slots: the configured slot names (None: not checked here, the embedding worker checks them).
        non_id / labels: declared specs by name, in the model's order (None: fixed by :meth:`confirm`).
    """

    def __init__(self, slots: Sequence[str] | None = None, non_id: dict[str, ArraySpec] | None = None,
                 labels: dict[str, ArraySpec] | None = None) -> None:
        self.slots = tuple(slots) if slots is not None else None
        self.non_id = non_id
        self.labels = labels

    @classmethod
    def from_config(cls, slots: Sequence[str] | None, data_loader_config: Any) -> BatchSchema:
        """From ``embedding_config.yml``'s slots and ``data_loader_config.non_id_features`` / ``labels``."""
        def specs(declared: Any) -> dict[str, ArraySpec] | None:
            return {k: (np.dtype(v.dtype), tuple(v.shape)) for k, v in declared.items()} if declared else None

        return cls(slots, specs(data_loader_config.non_id_features), specs(data_loader_config.labels))

    def check_slots(self, names: Sequence[str]) -> None:
        """Refuse id features without every configured slot, or with one not configured."""
        if self.slots is None:
            return
        unknown = [n for n in names if n not in self.slots]
        if unknown:
            raise BadRequest(f"features: unknown slot {unknown[0]!r} (configured: {', '.join(self.slots)})")
        present = set(names)
        missing = [s for s in self.slots if s not in present]
        if missing:
            raise BadRequest(f"features: slot {missing[0]!r} is missing ({len(missing)} of the {len(self.slots)} "
                             f"configured slots are; every batch carries all of them)")

    def admit(self, non_id: Sequence[NamedArray], labels: Sequence[NamedArray], requires_grad: bool
              ) -> tuple[tuple[NamedArray, ...], tuple[NamedArray, ...]]:
        """``non_id`` and ``labels`` in the schema's order, or BadRequest naming the first field that differs.

        Fixes nothing: what is not declared or confirmed yet is not checked. Labels are required of
        training batches only (an evaluation batch may carry none).
        """
        non_id_out = _ordered("non_id", non_id, self.non_id, required=True)
        labels_out = _ordered("labels", labels, self.labels, required=requires_grad)
        return non_id_out, labels_out

    @property
    def fixed(self) -> bool:
        """Whether both the dense features and the labels are declared or confirmed."""
        return self.non_id is not None and self.labels is not None

    def confirm(self, non_id: Sequence[NamedArray], labels: Sequence[NamedArray]) -> bool:
        """A training batch with these dense features and labels trained: fix what is not fixed yet from
        it. Returns whether anything was fixed (a batch that did not fit was refused by :meth:`admit`)."""
        changed = False
        if self.non_id is None:
            self.non_id = {a.name: _spec(a) for a in non_id}
            changed = True
        if self.labels is None and labels:
            self.labels = {a.name: _spec(a) for a in labels}
            changed = True
        return changed

    def describe(self) -> str:
        """The dense features and labels, as a log line shows them."""
        def part(specs: dict[str, ArraySpec] | None) -> str:
            return "unset" if specs is None else ", ".join(f"{k} {_describe(v)}" for k, v in specs.items()) or "none"

        return f"non_id: {part(self.non_id)}; labels: {part(self.labels)}"


def _ordered(where: str, arrays: Sequence[NamedArray], specs: dict[str, ArraySpec] | None, required: bool
             ) -> tuple[NamedArray, ...]:
    by_name = {a.name: a for a in arrays}
    if len(by_name) != len(arrays):
        names = [a.name for a in arrays]
        raise BadRequest(f"{where}({next(n for n in names if names.count(n) > 1)}): given twice")
    if specs is None:
        return tuple(arrays)
    extra = [a.name for a in arrays if a.name not in specs]
    if extra:
        raise BadRequest(f"{where}({extra[0]}): not in the job's schema (expected {', '.join(specs) or 'none'})")
    if not arrays and not required:
        return ()
    for name, spec in specs.items():
        a = by_name.get(name)
        if a is None:
            raise BadRequest(f"{where}({name}): missing (the job's schema has {', '.join(specs)})")
        if _spec(a) != spec:
            raise BadRequest(f"{where}({name}): {_describe(_spec(a))} after the batch dimension, "
                             f"but the job's schema has {_describe(spec)}")
    return tuple(by_name[n] for n in specs)
