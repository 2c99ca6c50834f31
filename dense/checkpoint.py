"""The dense part of a checkpoint (the model, its optimizer, the training state), as the NN worker
writes it and as both the NN worker (resuming) and the inference service (serving) read it."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
from persia_nats.common import checkpoint as ck

MODEL_FILE = "dense/model.pt"
OPTIMIZER_FILE = "dense/optimizer.pt"
STATE_FILE = "state.json"


def torch_bytes(obj: Any) -> bytes:
    """``torch.save`` of ``obj``, as bytes for an atomic write."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load_dense(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
               map_location: Any = "cpu") -> dict[str, Any]:
    """Load the dense model (and optimizer) of a checkpoint verified by its manifest; returns state.json."""
    manifest = ck.read_manifest(ckpt)
    files = manifest["files"]
    for rel in (MODEL_FILE, STATE_FILE) + ((OPTIMIZER_FILE,) if optimizer is not None else ()):
        if rel not in files:
            raise ck.CheckpointError(f"{ckpt}: no {rel} in the manifest")
        ck.check_file(ckpt / rel, files[rel])
    # weights_only: a checkpoint is data; unpickling arbitrary objects from a shared volume would run code
    model.load_state_dict(torch.load(ckpt / MODEL_FILE, map_location=map_location, weights_only=True))
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(ckpt / OPTIMIZER_FILE, map_location=map_location, weights_only=True))
    return json.loads((ckpt / STATE_FILE).read_bytes())
