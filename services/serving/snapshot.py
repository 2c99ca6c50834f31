"""One checkpoint loaded for serving, and the pure path from a request to its predictions.

A :class:`Snapshot` holds, in one process, every embedding row of a checkpoint (all its PS shards
merged into one :class:`~persia_nats.core.store.EmbeddingStore`, read as a single replica
of one, whatever replica count wrote them) and the dense model with the checkpoint's weights, in
eval mode. A newer checkpoint becomes a new snapshot, so a request that started on one finishes on
it. Only incremental updates change a snapshot in place: with ``enable_incremental_update`` its rows
are overwritten by the deltas the PS replicas write after its checkpoint
(:mod:`persia_nats.services.serving.incremental`), row by row between requests, never its model.

:func:`predict` is what a training job's ``eval_ctx`` does, minus NATS: the embedding worker's
plan and pooling (:func:`~persia_nats.core.plan.make_plan`,
:func:`~persia_nats.core.plan.slot_outputs`), an eval lookup (unknown ids read as zeros,
nothing is inserted), the embeddings rounded as the embedding workers send them
(``embedding_worker_config.wire_dtype``, float16 by default), the NN worker's tensors
(:func:`~persia_nats.dense.tensors.embedding_tensors`), then the model under
``torch.inference_mode``. A served model therefore sees the inputs it was evaluated on in
training, and the service's answers equal an offline evaluation of the same checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from persia_nats.common.checkpoint import CheckpointError, checkpoint_number, read_manifest, verify
from persia_nats.common.config import EmbeddingConfig
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import IdFeature, PredictRequest, SlotEmbedding
from persia_nats.common.optim_config import SGDConfig
from persia_nats.core.plan import make_plan, slot_outputs, to_wire_dtype
from persia_nats.core.store import EmbeddingStore
from persia_nats.core.store_checkpoint import load_store
from persia_nats.dense.checkpoint import load_dense
from persia_nats.dense.tensors import embedding_tensors
from persia_nats.services.serving.incremental import AppliedDeltas
from persia_nats.services.serving.model import ModelFactory

__all__ = ["PredictRequest", "Snapshot", "load_snapshot", "predict"]

log = logging.getLogger(__name__)

#: rows per embedding width a serving store may hold: the largest capacity whose index keeps 32-bit
#: slots. Capacity only bounds; the arrays are sized to the rows the checkpoint holds.
SERVING_CAPACITY = 2**31 - 2
_CPU = torch.device("cpu")


@dataclass(frozen=True, eq=False)
class Snapshot:
    """A checkpoint ready to serve: its rows, its model, and where it came from."""

    path: Path
    number: int
    store: EmbeddingStore
    model: torch.nn.Module
    step: int | None
    loaded_at: float
    #: the incremental updates applied to its rows since it was loaded
    deltas: AppliedDeltas = field(default_factory=AppliedDeltas)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def rows(self) -> int:
        return len(self.store)

    def rows_per_dim(self) -> dict[str, int]:
        return {str(dim): len(table) for dim, table in sorted(self.store.tables.items())}


def load_snapshot(ckpt: str | Path, make_model: ModelFactory) -> Snapshot:
    """Read a final checkpoint into a :class:`Snapshot`, all or nothing.

    Args:
        ckpt: A final checkpoint directory (``ROOT/ckpt-N``).
        make_model: Builds the (untrained) dense model; its weights come from ``dense/model.pt``
            (``torch.load(weights_only=True)``: nothing is unpickled).

    Raises:
        CheckpointError: The checkpoint is torn, corrupt or malformed, or its weights do not fit
            the model.
    """
    ckpt = Path(ckpt)
    problems = verify(ckpt)
    if problems:
        raise CheckpointError(f"{ckpt}: " + "; ".join(problems))
    manifest = read_manifest(ckpt)
    parsed = checkpoint_number(ckpt.name)
    number = parsed[0] if parsed is not None else int(manifest["number"])
    store = EmbeddingStore(SERVING_CAPACITY)
    load_store(store, ckpt, 0, 1, manifest["files"], check_sums=False)
    # Serving never updates a row: a stateless optimizer frees the optimizer state loaded with them.
    store.set_optimizer(SGDConfig(lr=1.0))
    model = make_model()
    try:
        state = load_dense(ckpt, model, None, map_location=_CPU)
    except (RuntimeError, ValueError, KeyError) as exc:  # weights of another shape or architecture
        raise CheckpointError(f"{ckpt}: the dense weights do not fit the model: {exc}") from None
    model.eval()
    for dim in store.tables:  # compile (or load from numba's cache) the eval lookup now, not at a request
        store.lookup(np.zeros(1, np.uint64), dim, train=False)
    step = state.get("step", manifest.get("step"))
    return Snapshot(ckpt, number, store, model, int(step) if isinstance(step, int) else None, time.time())


def predict(snap: Snapshot, ecfg: EmbeddingConfig, features: Sequence[IdFeature], non_id: Sequence[np.ndarray],
            wire_dtype: np.dtype | type = np.float16) -> np.ndarray:
    """The model's output for one batch, as float32 ``(batch, k)``; reads ``snap`` and changes nothing.

    Args:
        snap: The loaded checkpoint.
        ecfg: The embedding config (slots, feature groups, hash stacks) the job trained with.
        features: The batch's id features, in any order: the model takes them in ``ecfg``'s.
        non_id: The dense features, in the order the model takes them.
        wire_dtype: The precision the embedding workers sent embeddings in while training
            (``embedding_worker_config.wire_dtype``).

    Raises:
        BadRequest: An unknown slot, the model refused the batch (a missing slot, a dense
            feature of the wrong width), or its output is not finite: nothing was changed.
    """
    plan = make_plan(features, ecfg)
    rows = {dim: snap.store.lookup(signs, dim, train=False) for dim, signs in plan.distinct.items()}
    dtype = np.dtype(wire_dtype)
    embeddings = [SlotEmbedding(slot.name, to_wire_dtype(out, dtype), slot.index)
                  for slot, out in zip(plan.slots, slot_outputs(plan, rows), strict=True)]
    emb, _ = embedding_tensors(embeddings, _CPU)
    dense = [torch.from_numpy(np.array(a)) for a in non_id]  # wire arrays are read-only views
    try:
        with torch.inference_mode():
            out = snap.model(dense, emb)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise BadRequest(f"the model refused the batch: {type(exc).__name__}: {exc}"[:1000]) from None
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__}, not a tensor")
    batch = plan.batch_size
    if out.ndim == 0 or out.shape[0] != batch:
        raise TypeError(f"the model returned shape {tuple(out.shape)} for a batch of {batch}")
    result = np.ascontiguousarray(out.detach().reshape(batch, -1).float().numpy())
    if not np.isfinite(result).all():
        # finite inputs of extreme magnitude (3e38, say) overflow inside the model: a NaN is no prediction
        raise BadRequest(f"the model's output is not finite (NaN or Inf) for {int((~np.isfinite(result)).sum())} "
                         "value(s) of this batch: are the inputs of a sane magnitude?")
    return result
