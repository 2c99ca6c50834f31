"""One training step of an NN rank, from the model's output to the dense optimizer's step.

:class:`TrainStep` reads in the order a step runs: :meth:`~TrainStep.backward` runs the dense backward,
takes the embedding leaves' gradients, hands them to the rank's loop without waiting
(:meth:`RankLoop.send_grads <persia_nats.services.nn_worker.rank_loop.RankLoop.send_grads>`), which packs
them into the wire's parts there (:func:`packed_push`, over :func:`persia_nats.core.adjoint.pack`) and
pushes them, and runs the dense step (the all-reduce over the ranks, clipping, the optimizer, a periodic
checkpoint's turn). Beside it sits what happens to a batch the model raised on
(``nn_worker_config.on_batch_error``) or the loop took and trained nothing on: it is given back with an
empty push, and the rank still joins the step.

:class:`~persia_nats.services.nn_worker.ctx.TrainCtx` is the user's API over it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from persia_nats.common.config import BatchErrorPolicy
from persia_nats.core.adjoint import pack
from persia_nats.dense.tensors import EmbeddingLeaves, LeafGrads, leaf_gradients, to_tensor
from persia_nats.services.nn_worker.checkpoint import Checkpointer
from persia_nats.services.nn_worker.dense_sync import DenseSync
from persia_nats.services.nn_worker.figures import TrainingFigures
from persia_nats.services.nn_worker.rank_loop import RankLoop
from persia_nats.services.nn_worker.runtime import GradPush, TrainingBatch

log = logging.getLogger(__name__)

#: what the model's forward returns: ``(output, labels)``
Forward = tuple[Any, list[torch.Tensor] | None]


def packed_push(batch: TrainingBatch, grads: LeafGrads, loss_scale: float, wire_dtype: np.dtype[Any],
                figures: TrainingFigures) -> GradPush:
    """``batch``'s push: its leaf gradients packed into the wire's parts (:func:`~persia_nats.core.adjoint.pack`).
    Where packing raises, an empty push marked failed, counted in ``grad_failures``: a push must still go,
    since it gives back what the batch's lookup holds and settles its stream acknowledgement."""
    assert batch.ref is not None
    try:
        parts = pack(batch.embeddings, batch.gathered, batch.hot, grads, loss_scale, wire_dtype)
    except Exception as exc:
        figures.count("grad_failures")
        log.exception("batch %d: packing its embedding gradients failed; they are not applied", batch.batch_id)
        return GradPush(ref=batch.ref, permit=batch.permit, ack=batch.ack, batch_id=batch.batch_id,
                        failed=f"packing its gradients raised {type(exc).__name__}: {exc}"[:500])
    return GradPush(ref=batch.ref, grads=parts.grads, loss_scale=parts.loss_scale, rows=parts.rows,
                    gathered_hot=parts.gathered_hot, permit=batch.permit, ack=batch.ack, batch_id=batch.batch_id,
                    hot=batch.hot, hot_grads=parts.hot_grads, hot_loss_scale=loss_scale)


class BatchError(RuntimeError):
    """The model's forward or backward raised on a batch and ``on_batch_error`` says stop."""


def _float32(output: Any) -> Any:
    """A model's output (a tensor, or a tuple or list of them) with float16 tensors as float32."""
    if isinstance(output, torch.Tensor):
        return output.float() if output.dtype == torch.float16 else output
    if isinstance(output, tuple) and hasattr(output, "_fields"):  # a named tuple
        return type(output)(*(_float32(o) for o in output))
    if isinstance(output, (tuple, list)):
        return type(output)(_float32(o) for o in output)
    return output


class TrainStep:
    """The step of one rank: its dense optimizer, the ranks' collectives, and the batch it trains.

    ``loop`` None: no job behind it (a unit test of the policy; batches looked up nowhere). ``dense_sync``:
    the ranks' collectives, None for a lone rank. ``checkpointer``: takes its turn after each step.
    """

    def __init__(self, *, model: torch.nn.Module, dense_optimizer: torch.optim.Optimizer, device: torch.device,
                 loop: RankLoop | None, figures: TrainingFigures, on_batch_error: BatchErrorPolicy,
                 grad_wire_dtype: np.dtype[Any], mixed_precision: bool = False, clip_grad_norm: float | None = None,
                 dense_sync: DenseSync | None = None, checkpointer: Checkpointer | None = None) -> None:
        self.model = model
        self.dense_optimizer = dense_optimizer
        self.device = device
        self.loop = loop
        self.figures = figures
        self.on_batch_error = on_batch_error
        self.grad_wire_dtype = grad_wire_dtype
        self.mixed_precision = mixed_precision
        self.clip_grad_norm = clip_grad_norm
        self.dense_sync = dense_sync
        self.checkpointer = checkpointer
        self.grad_scaler = torch.amp.GradScaler("cuda") if mixed_precision else None
        #: global steps taken (idle ones, where some rank had a batch, included)
        self.steps = 0
        self._last: tuple[TrainingBatch, EmbeddingLeaves] | None = None  # forward ran, backward not yet
        self._trained: TrainingBatch | None = None  # the last batch backward() ran for

    def resume_at(self, steps: int) -> None:
        self.steps = steps

    # -- forward ------------------------------------------------------------------------------------

    def took(self, batch: TrainingBatch, leaves: EmbeddingLeaves) -> None:
        """The model's input for ``batch`` was made, with ``leaves`` for its embedding gradients."""
        self._last = (batch, leaves)

    def forward(self, batch: TrainingBatch | Any, run: Callable[[], Forward]) -> Forward:
        """``run()`` (the model's forward on ``batch``) under this step's precision and batch-error policy.
        With mixed precision the model runs under float16 autocast and its float16 outputs come back as
        float32, so the loss computed from them runs in full precision (``BCELoss`` refuses float16 output
        against float32 labels, and autocast leaves losses outside its region on purpose)."""
        try:
            if self.mixed_precision:
                with torch.autocast("cuda", dtype=torch.float16):
                    output, labels = run()
                return _float32(output), labels
            return run()
        except Exception as exc:
            if not isinstance(batch, TrainingBatch):
                raise
            self._failed(batch, exc, "forward")
            if self._last is None or self._last[0] is not batch:
                self._last = (batch, EmbeddingLeaves())
            return self._stand_in(batch)

    # -- backward and the step ----------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward, leaf gradients, hand off (the loop packs them), dense step."""
        if self._last is None:
            raise RuntimeError("backward() needs a forward() on a training batch first")
        batch, leaves = self._last
        self._last = None
        if "error" in batch.extra:  # its forward failed: the DataLoader gives it back (finish_batch)
            return loss
        scaled = self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss
        try:
            scaled.backward()
        except Exception as exc:
            self.dense_optimizer.zero_grad(set_to_none=True)  # what the failed backward left half-done
            self._failed(batch, exc, "backward")
            return loss
        self._trained = batch
        with self.figures.host_work():
            self.figures.set_loss(loss.detach())
            if batch.requires_grad and self.loop is not None:
                self.loop.confirm_schema(batch)
            loss_scale = float(self.grad_scaler.get_scale()) if self.grad_scaler is not None else 1.0
            if batch.ref is not None:  # looked up directly (ref None): nothing on the worker waits for its gradients
                self._hand_off(batch, leaf_gradients(leaves), loss_scale)
        self.dense_step()
        return scaled

    def _hand_off(self, batch: TrainingBatch, grads: LeafGrads, loss_scale: float) -> None:
        """Give ``batch``'s leaf gradients to the loop, without waiting for it: the loop packs them into the
        wire's parts and pushes them while this thread runs the dense step, and it still creates the push
        before anything this thread submits later. Packing is most of the training thread's own work a
        step (its float16 conversions and the gathered rows' sums); the loop's thread does it beside the
        model instead of before the all-reduce."""
        assert self.loop is not None and batch.ref is not None
        wire_dtype, figures = self.grad_wire_dtype, self.figures
        self.loop.send_grads(lambda: packed_push(batch, grads, loss_scale, wire_dtype, figures))

    def dense_step(self, has_batch: bool = True, done: bool = False) -> bool:
        """All-reduce and apply the dense gradients; False, with nothing changed, when no rank had a batch.
        ``done``: this rank is out of batches (see :meth:`idle_step`)."""
        if self.dense_sync is not None and self.dense_sync.allreduce_grads(has_batch, done) == 0:
            if self.checkpointer is not None:  # every rank got the same 0: all are between steps, together
                self.checkpointer.when_idle(self.steps)
            return False
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.dense_optimizer)
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.dense_optimizer)
            self.grad_scaler.update()
        else:
            self.dense_optimizer.step()
        self.dense_optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        if self.checkpointer is not None:
            self.checkpointer.after_step(self.steps)
        return True

    # -- batches that trained nothing ---------------------------------------------------------------

    def _failed(self, batch: TrainingBatch, exc: Exception, stage: str) -> None:
        """The model's ``stage`` raised on ``batch``: BatchError under the ``stop`` policy, else mark it
        failed (the DataLoader then gives it back, see :meth:`finish_batch`)."""
        name = f"batch {batch.batch_id}" + (f" (stream sequence {batch.ack.seq})" if batch.ack is not None else "")
        error = f"{stage} raised {type(exc).__name__}: {exc}"
        if self.on_batch_error == "stop" or (self.on_batch_error == "auto" and batch.ack is None):
            raise BatchError(f"{name}: {error} (nn_worker_config.on_batch_error: {self.on_batch_error}; "
                             "'skip' trains on without it)") from exc
        batch.extra["error"] = " ".join(error.split())[:500]
        failed = self.figures.count("batches_failed")
        log.warning("%s skipped: %s (batches failed so far: %d)", name, error, failed)

    def _stand_in(self, batch: TrainingBatch) -> Forward:
        """What ``forward`` returns for a failed batch: zeros shaped like its first label, and its labels."""
        labels = [to_tensor(a.data, self.device) for a in batch.labels] or None
        shape = tuple(labels[0].shape) if labels else (batch.batch_size, 1)
        return torch.zeros(shape, device=self.device, requires_grad=True), labels

    def trained(self, batch: TrainingBatch) -> bool:
        """Whether :meth:`backward` ran for ``batch`` (the last batch it ran for)."""
        return self._trained is batch

    def finish_batch(self, batch: TrainingBatch) -> None:
        """The training loop is done with ``batch``: when no backward ran for it, give back what its lookup
        holds and join the step without it."""
        if self._trained is batch:
            return
        # its lookup holds a staleness permit and a slot at the embedding worker until gradients come: an
        # empty gradient push gives both back and acknowledges the batch, changing no embedding
        if self._last is not None and self._last[0] is batch:
            self._last = None
        if batch.ref is not None and batch.requires_grad:
            assert self.loop is not None
            self.figures.count("batches_skipped")
            push = GradPush(ref=batch.ref, permit=batch.permit, ack=batch.ack, batch_id=batch.batch_id,
                            failed=batch.extra.get("error"))
            self.loop.send_grads(lambda: push)
        if self.dense_sync is not None:  # the ranks' collectives stay paired, as a rank out of batches keeps them
            self.idle_step(done=False)

    def idle_step(self, done: bool = True) -> bool:
        """This rank has no batch this step (``done``: it is out of batches; else it skipped one): join the
        step's collective with zero gradients. False once every rank is out, which ends training on every
        rank."""
        self.dense_optimizer.zero_grad(set_to_none=True)
        self.dense_step(has_batch=False, done=done)
        return self.dense_sync is not None and self.dense_sync.running > 0

    def while_waiting(self) -> None:
        """A lone rank waiting for its next batch is between steps: a checkpoint asked for is taken now
        (several ranks take it together in their idle step, :meth:`dense_step`)."""
        if self.checkpointer is not None and self.dense_sync is None:
            self.checkpointer.when_idle(self.steps)
