"""TrainCtx's policy for an error in the model's forward or backward (nn_worker_config.on_batch_error).

Only the policy, on batches already looked up: no job is entered (the context's step runs over no loop).
Skipping in a running job (the batch given back, the ranks in step, the stream batch dead-lettered) is
tests/e2e/test_bad_batches.py's.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from persia_nats.common.config import GlobalConfig, NNWorkerConfig
from persia_nats.common.env import Env
from persia_nats.common.messages import NamedArray, SlotEmbedding, StreamAck
from persia_nats.services.nn_worker.ctx import BatchError, TrainCtx
from persia_nats.services.nn_worker.figures import TrainingFigures
from persia_nats.services.nn_worker.runtime import TrainingBatch

from persia.embedding.optim import SGD


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        raise RuntimeError("no gradient for this one")


class Model(torch.nn.Module):
    def __init__(self, fail: str = "") -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2 + 4, 1)
        self.fail = fail

    def forward(self, non_id, embeddings):  # noqa: ANN001, ANN201
        if self.fail == "forward":
            raise ValueError("shapes cannot be multiplied")
        out = torch.sigmoid(self.linear(torch.cat([non_id[0], embeddings[0]], dim=1)))
        return _RaiseInBackward.apply(out) if self.fail == "backward" else out


def ctx_for(policy: str, fail: str) -> TrainCtx:
    model = Model(fail)
    ctx = TrainCtx(SGD(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1), model=model, on_batch_error=policy,
                   env=Env(), global_config=GlobalConfig(nn_worker_config=NNWorkerConfig()))
    ctx.step = ctx._new_step(None, TrainingFigures())  # the step entering makes, with no job behind it
    return ctx


def batch(stream: bool) -> TrainingBatch:
    ack = StreamAck("$JS.ACK.s.c.1.42.42.0.0", 42) if stream else None
    return TrainingBatch(batch_id=7, non_id=(NamedArray("x", np.ones((3, 2), np.float32)),),
                         labels=(NamedArray("y", np.ones((3, 1), np.float32)),),
                         embeddings=(SlotEmbedding("a", np.ones((3, 4), np.float32)),), requires_grad=True,
                         batch_size=3, ack=ack)


@pytest.mark.parametrize("stage", ["forward", "backward"])
@pytest.mark.parametrize("policy, stream", [("stop", True), ("auto", False)])
def test_stop_ends_the_loop_naming_the_batch(policy, stream, stage):
    ctx = ctx_for(policy, stage)
    where = "batch 7 (stream sequence 42)" if stream else "batch 7:"
    with pytest.raises(BatchError, match=rf"{re.escape(where)}.*{stage} raised") as err:
        output, labels = ctx.forward(batch(stream))
        ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
    assert f"on_batch_error: {policy}" in str(err.value)


@pytest.mark.parametrize("stage", ["forward", "backward"])
@pytest.mark.parametrize("policy, stream", [("skip", False), ("auto", True)])
def test_skip_marks_the_batch_failed_and_trains_nothing(policy, stream, stage):
    ctx = ctx_for(policy, stage)
    b = batch(stream)
    before = [p.detach().clone() for p in ctx.model.parameters()]
    output, labels = ctx.forward(b)
    assert output.shape == labels[0].shape  # a stand-in after a failed forward: the loss still computes
    loss = torch.nn.functional.binary_cross_entropy(output, labels[0])
    assert ctx.backward(loss) is loss
    assert not ctx.trained(b)  # the DataLoader gives it back (TrainCtx.finish_batch) with its error
    assert b.extra["error"].startswith(f"{stage} raised")
    assert ctx.step.figures.counters["batches_failed"] == 1
    assert all(torch.equal(p, q) for p, q in zip(before, ctx.model.parameters(), strict=True))
    assert all(p.grad is None for p in ctx.model.parameters())
