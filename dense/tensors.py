"""The tensors a dense model takes, built from a batch's slot outputs: shared by the NN worker's
contexts (training, evaluation) and the inference service."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from persia_nats.common.messages import GatheredSlots, SlotEmbedding
from persia_nats.core.adjoint import LeafGrads
from persia_nats.core.rows import stacked_rows


def to_tensor(arr: np.ndarray, device: torch.device, own: bool = False) -> torch.Tensor:
    """``arr`` as a tensor on ``device``; copied unless ``own`` (memory nothing else holds or writes)."""
    # wire arrays are read-only views, and a caller's arrays stay the caller's: torch gets its own memory
    t = torch.from_numpy(arr if own else np.array(arr))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


@dataclass
class EmbeddingLeaves:
    """The autograd leaves of a batch's embeddings: the pooled slots of one shape share one leaf
    (k, batch, dim), so a step converts, moves and differentiates them as one tensor, not k."""

    #: the leaf tensors
    tensors: list[torch.Tensor] = field(default_factory=list)
    #: per slot, in the batch's order: (index into ``tensors``, row of a shared leaf or None)
    where: list[tuple[int, int | None]] = field(default_factory=list)
    #: the leaves that hold a gathered width's distinct rows (their slots gathered from them by the model's
    #: device): their gradients are the rows' own, already summed over every read
    rows: frozenset[int] = frozenset()


def embedding_tensors(embeddings: Sequence[SlotEmbedding], device: torch.device, requires_grad: bool = False,
                      gathered: Sequence[GatheredSlots] = ()) -> tuple[list[torch.Tensor], EmbeddingLeaves]:
    """(model inputs, autograd leaves). Raw slots become (batch, L, dim+1) with a mask channel.

    ``gathered``: widths whose slots are not in ``embeddings`` (:func:`persia_nats.core.lookup.expand_deferred`):
    each is one leaf of its distinct float32 rows on ``device``, its slots' inputs ``rows[index[k]]``
    gathered there, at their places among the batch's slots (``GatheredSlots.at``).

    The NN worker's contexts and the inference service both call this, so a served model sees exactly
    the tensors it was trained and evaluated on.
    """
    n = len(embeddings) + sum(len(g.slots) for g in gathered)
    inputs: list[torch.Tensor | None] = [None] * n
    where: list[tuple[int, int | None] | None] = [None] * n
    leaves = EmbeddingLeaves()
    taken = {pos for g in gathered for pos in g.at.tolist()}
    place = [pos for pos in range(n) if pos not in taken]  # the batch's position of each of ``embeddings``
    emb_at = dict(zip(place, embeddings, strict=True))
    for g in gathered:
        # rows made writable here are this batch's own (the merge's copy); a reply's are read-only views
        leaf = to_tensor(g.rows, device, own=bool(g.rows.flags.writeable)).float()
        if requires_grad:
            leaf.requires_grad_(True)
        k = len(leaves.tensors)
        leaves.tensors.append(leaf)
        index = to_tensor(np.ascontiguousarray(g.index, np.int32), device, own=g.index.dtype != np.int32)
        # one gather for every slot of the width; its backward sums each row's reads (index_add)
        out = leaf.index_select(0, index.view(-1)).view(len(g.slots), g.batch_size, g.dim)
        for j, (pos, view) in enumerate(zip(g.at.tolist(), out.unbind(0), strict=True)):
            inputs[pos] = view
            where[pos] = (k, j)
    leaves.rows = frozenset(range(len(leaves.tensors)))  # the gathered widths' leaves come first
    shared: dict[tuple[tuple[int, ...], str], list[int]] = {}
    for i, e in emb_at.items():
        if e.index is None:
            shared.setdefault((e.emb.shape, e.emb.dtype.str), []).append(i)
            continue
        # float32 leaves keep gradients exact; the wire's float16 is only a transport format
        leaf = to_tensor(e.emb, device).float()
        if requires_grad:
            leaf.requires_grad_(True)
        where[i] = (len(leaves.tensors), None)
        leaves.tensors.append(leaf)
        index = to_tensor(e.index, device).long()
        mask = (index >= 0).unsqueeze(-1)
        padded = torch.cat([torch.zeros(1, leaf.shape[1], device=device), leaf])
        picked = padded[index + 1]
        inputs[i] = torch.cat([picked, mask.to(picked.dtype)], dim=-1)
    for members in shared.values():
        leaf = to_tensor(stacked_rows([emb_at[i].emb for i in members]), device, own=True).float()
        if requires_grad:
            leaf.requires_grad_(True)
        k = len(leaves.tensors)
        leaves.tensors.append(leaf)
        # unbind: one backward node stacks the slots' gradients into the shared leaf's
        for j, (i, view) in enumerate(zip(members, leaf.unbind(0), strict=True)):
            inputs[i] = view
            where[i] = (k, j)
    leaves.where = where  # type: ignore[assignment]
    return inputs, leaves  # type: ignore[return-value]


def leaf_gradients(leaves: EmbeddingLeaves) -> LeafGrads:
    """The leaves' gradients after a backward, as float32 arrays on the CPU (zeros for a leaf the loss did not
    reach), with each one's largest magnitude and, on the CPU, their float16 conversion by torch.

    On a GPU the conversion is left to :func:`~persia_nats.core.adjoint.pack`'s own: the rank's loop packs,
    and a conversion on the device from there would queue behind the kernels this thread launches next (the
    dense step, the next batch), holding the loop until they ran. The peaks come in one transfer and the
    gradients into pinned memory, the copies this thread waits for anyway before the dense step."""
    grads = [(t.grad if t.grad is not None else torch.zeros_like(t)).detach() for t in leaves.tensors]
    if any(g.device.type != "cpu" for g in grads):
        peaks = torch.stack([g.abs().amax() if g.numel() else g.new_zeros(()) for g in grads]).float().tolist()
        return LeafGrads([_pinned_float32(g) for g in grads], peaks, leaves.where, None, rows=leaves.rows)
    peaks = [float(g.abs().max()) if g.numel() else 0.0 for g in grads]

    def scaled_half(k: int, scale: float) -> np.ndarray:
        return (grads[k] * scale).to(torch.float16).numpy()

    return LeafGrads([g.to(torch.float32).numpy() for g in grads], peaks, leaves.where, scaled_half,
                     rows=leaves.rows)


def _pinned_float32(t: torch.Tensor) -> np.ndarray:
    """A device tensor's values as a float32 array in pinned host memory (a direct copy, not a staged one)."""
    out = torch.empty(t.shape, dtype=torch.float32, pin_memory=True)
    out.copy_(t)
    return out.numpy()
