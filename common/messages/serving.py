"""Inference subjects: ``serve.predict`` and ``serve.info``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from persia_nats.common.codec import array_from_wire, array_to_wire
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages.base import Message, get_field
from persia_nats.common.messages.batches import IdFeature, NamedArray, id_features_from_wire, named_list_from_wire

__all__ = ["PredictRequest", "PredictReply"]


@dataclass(frozen=True, slots=True)
class PredictRequest(Message):
    """``serve.predict``: a batch's id features and dense features (labels, if any, are ignored)."""

    subject = "serve.predict"

    features: tuple[IdFeature, ...]
    non_id: tuple[NamedArray, ...] = ()
    meta: bytes | None = None  # accepted, so a stream batch can be sent as it is, and ignored

    @property
    def batch_size(self) -> int:
        return self.features[0].batch_size

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"features": [f.to_wire() for f in self.features],
                               "non_id": [a.to_wire() for a in self.non_id]}
        if self.meta is not None:
            out["meta"] = self.meta
        return out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> PredictRequest:
        features = id_features_from_wire(obj.get("features"))
        batch_size = features[0].batch_size
        if batch_size == 0:
            raise BadRequest("features: the batch has no samples")
        non_id = named_list_from_wire(obj.get("non_id"), "non_id", batch_size)
        meta = obj.get("meta")
        if meta is not None and not isinstance(meta, bytes):
            raise BadRequest("meta: expected bytes or nil")
        return cls(features, non_id, meta)


@dataclass(frozen=True, slots=True)
class PredictReply(Message):
    """The model's output for the batch, float32 ``(batch_size, k)``, and the checkpoint that gave it."""

    subject = "serve.predict"
    kind = "reply"

    predictions: np.ndarray
    checkpoint: str

    def body(self) -> dict[str, Any]:
        return {"predictions": array_to_wire(self.predictions), "checkpoint": self.checkpoint}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> PredictReply:
        return cls(array_from_wire(obj.get("predictions"), "predictions", dtype="<f4", ndim=2),
                   get_field(obj, "checkpoint", str, ""))
