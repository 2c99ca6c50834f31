"""The push the rank's loop makes of a trained batch's leaf gradients (``step.packed_push``): the wire's parts
of :func:`persia_nats.core.adjoint.pack`, with the batch's ref, permit and acknowledgement; and, where packing
raises, an empty push marked failed and counted, so that the batch's lookup is still given back."""

from __future__ import annotations

import numpy as np
from persia_nats.common.messages import BatchRef, NamedArray, SlotEmbedding, StreamAck
from persia_nats.core.adjoint import LeafGrads, pack
from persia_nats.services.nn_worker.figures import TrainingFigures
from persia_nats.services.nn_worker.runtime import TrainingBatch
from persia_nats.services.nn_worker.step import packed_push


def _batch() -> TrainingBatch:
    return TrainingBatch(batch_id=7, non_id=(NamedArray("x", np.ones((3, 2), np.float32)),),
                         labels=(NamedArray("y", np.ones((3, 1), np.float32)),),
                         embeddings=(SlotEmbedding("a", np.ones((3, 4), np.float32)),
                                     SlotEmbedding("b", np.ones((3, 4), np.float32))),
                         requires_grad=True, batch_size=3, ack=StreamAck("$JS.ACK.s.c.1.42.42.0.0", 42),
                         ref=BatchRef("ew0", 11))


def _leaves() -> LeafGrads:
    stacked = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) / 64  # both slots in one leaf
    return LeafGrads([stacked], [float(np.abs(stacked).max())], [(0, 0), (0, 1)])


def test_the_push_carries_packs_parts_and_the_batchs_bookkeeping():
    figures, batch, leaves = TrainingFigures(), _batch(), _leaves()
    push = packed_push(batch, leaves, 4.0, np.dtype(np.float16), figures)
    parts = pack(batch.embeddings, batch.gathered, batch.hot, leaves, 4.0, np.dtype(np.float16))
    assert push.ref == BatchRef("ew0", 11) and push.ack == batch.ack and push.batch_id == 7 and push.failed is None
    assert [g.name for g in push.grads] == ["a", "b"] and push.loss_scale == parts.loss_scale
    for got, want in zip(push.grads, parts.grads, strict=True):
        assert got.grad.dtype == np.float16 and np.array_equal(got.grad, want.grad)
    assert push.hot_loss_scale == 4.0 and "grad_failures" not in figures.counters


def test_a_failed_packing_still_pushes_to_give_the_lookup_back(caplog):
    figures, batch = TrainingFigures(), _batch()
    wrong = LeafGrads([np.ones((3, 4), np.float32)], [1.0], [(0, None)])  # one slot's leaf for a batch of two
    with caplog.at_level("ERROR"):
        push = packed_push(batch, wrong, 1.0, np.dtype(np.float16), figures)
    assert push.grads == () and push.ref == BatchRef("ew0", 11) and push.ack == batch.ack and push.batch_id == 7
    assert push.failed is not None and push.failed.startswith("packing its gradients raised ValueError")
    assert figures.counters["grad_failures"] == 1
    assert "batch 7: packing its embedding gradients failed" in caplog.text
