"""The NN worker's tensors for a batch's embeddings: shared leaves for pooled slots of one shape."""

from __future__ import annotations

import numpy as np
import torch
from persia_nats.common.messages import SlotEmbedding
from persia_nats.core.rows import stacked_rows
from persia_nats.dense.tensors import embedding_tensors

CPU = torch.device("cpu")


def batch():
    rng = np.random.default_rng(0)
    return (SlotEmbedding("a", rng.normal(size=(4, 2)).astype(np.float16)),
            SlotEmbedding("r", rng.normal(size=(3, 2)).astype(np.float16), np.array([[0, -1], [2, 1], [-1, -1], [1, 1]],
                                                                                     np.int32)),
            SlotEmbedding("c", rng.normal(size=(4, 3)).astype(np.float32)),
            SlotEmbedding("b", rng.normal(size=(4, 2)).astype(np.float16)))


def test_inputs_are_the_slots_in_order_and_gradients_reach_each_slot():
    embs = batch()
    inputs, leaves = embedding_tensors(embs, CPU, requires_grad=True)
    assert [tuple(t.shape) for t in inputs] == [(4, 2), (4, 2, 3), (4, 3), (4, 2)]
    for e, t in zip((embs[0], embs[2], embs[3]), (inputs[0], inputs[2], inputs[3]), strict=True):
        assert t.dtype == torch.float32 and np.array_equal(t.detach().numpy(), e.emb.astype(np.float32))
    # a and b (same shape) share one leaf; the raw slot r and c have their own
    assert len(leaves.tensors) == 3 and leaves.where[0][0] == leaves.where[3][0]
    assert leaves.where[1][1] is None
    weights = [torch.full_like(t, float(i + 1)) for i, t in enumerate(inputs)]
    sum((w * t).sum() for w, t in zip(weights, inputs, strict=True)).backward()
    for i, (k, j) in enumerate(leaves.where):
        grad = leaves.tensors[k].grad if j is None else leaves.tensors[k].grad[j]
        if i == 1:  # raw: each distinct row gets the weight once per (unpadded) use
            assert grad[:, 0].tolist() == [2 * 1, 2 * 3, 2 * 1]
        else:
            assert torch.equal(grad, torch.full_like(grad, float(i + 1)))


def test_the_reply_arrays_are_copied_and_a_merged_array_is_taken_as_it_is():
    own = (SlotEmbedding("a", np.zeros((4, 2), np.float32)), SlotEmbedding("b", np.zeros((4, 2), np.float32)))
    inputs, _ = embedding_tensors(own, CPU)
    inputs[0].add_(1)
    assert not own[0].emb.any()  # arrays that are not one merged array are copied, never written
    merged = np.zeros((2, 4, 2), np.float32)
    assert stacked_rows([merged[0], merged[1]]) is merged
    assert stacked_rows([merged[1], merged[0]]) is not merged  # out of order: copied
    frozen = merged.copy()
    frozen.flags.writeable = False
    assert stacked_rows([frozen[0], frozen[1]]) is not frozen
    views = (SlotEmbedding("a", merged[0]), SlotEmbedding("b", merged[1]))
    (ta, tb), leaves = embedding_tensors(views, CPU, requires_grad=True)
    assert ta.data_ptr() == merged.ctypes.data and len(leaves.tensors) == 1
