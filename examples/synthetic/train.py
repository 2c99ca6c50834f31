"""NN worker of the synthetic Criteo-like example: trains one pass, evaluates on the held-out stream.

Ends by printing one JSON line: test_auc, test_logloss, test_samples (rank 0 only), train_samples,
steps, samples_per_s, train_s, eval_during_train_s, wall_s, rank, max_staleness, loss_first,
loss_last, counters, and ``auc_curve``: ``[[samples_seen, auc], ...]`` on the first CURVE_SAMPLES
held-out rows, measured on rank 0 before training, CURVE_POINTS times during it, and at the end
(samples_seen counts every rank's samples: rank 0's times the world size, as ranks step together).

Evaluating during training is safe: direct lookups never insert ids or take a staleness permit.
``samples_per_s`` leaves out the time rank 0 spent on those evaluations (``eval_during_train_s``).

Environment: SEED, BATCH_SIZE, TRAIN_BATCHES, TEST_SAMPLES, CURVE_SAMPLES, CURVE_POINTS,
SYNTHETIC_CASE (see persia_batches.py); EMBEDDING_LR (Adagrad's learning rate on the PS, default 0.1);
EMBEDDING_STALENESS (default: from global_config.yml's nn_worker_config); FORWARD_BUFFER
(batches looked up ahead of the training loop, default 10); MIXED_PRECISION=0 (on a GPU, train in
float32 instead of float16 autocast). Each rank trains on a GPU of its own where the host has one per
rank (persia.env.get_device_id), else on the CPU (PERSIA_SHARE_GPUS=1: on a GPU shared with other
ranks).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from cases import case_test_batches  # noqa: E402
from persia_batches import RunSettings, case_from_env, make_batch  # noqa: E402

from persia.ctx import TrainCtx, eval_ctx  # noqa: E402
from persia.data import DataLoader, IterableDataset, StreamingDataset  # noqa: E402
from persia.embedding import EmbeddingConfig  # noqa: E402
from persia.embedding.optim import Adagrad  # noqa: E402
from persia.env import get_device_id, get_rank  # noqa: E402
from persia.logger import configure_logging  # noqa: E402


def _load_metrics():
    """The adult example's numpy-only AUC and log loss (loaded by path: both examples have a model.py)."""
    spec = importlib.util.spec_from_file_location("adult_metrics", HERE.parent / "adult-income" / "metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_metrics = _load_metrics()
auc, log_loss = _metrics.auc, _metrics.log_loss

log = logging.getLogger("synthetic")
SETTINGS = RunSettings.from_env()
CASE = case_from_env()
STALENESS = int(os.environ["EMBEDDING_STALENESS"]) if os.environ.get("EMBEDDING_STALENESS") else None
EMBEDDING_LR = float(os.environ.get("EMBEDDING_LR", "0.1"))
FORWARD_BUFFER = int(os.environ.get("FORWARD_BUFFER", "10"))
EMBEDDING_DIM = 16
DEVICE_ID = get_device_id()
MIXED_PRECISION = os.environ.get("MIXED_PRECISION", "1") != "0"
EVAL_BATCH_SIZE = 1024


class MLP(torch.nn.Module):
    """concat(slot embeddings (26 for criteo), dense (13, if any)) -> 256 -> 128 -> 1, ReLU between, sigmoid
    out. The single-process reference (reference.py) trains the same model."""

    def __init__(self, num_slots: int = len(CASE.slots), embedding_dim: int = EMBEDDING_DIM,
                 dense_dim: int = CASE.n_dense):
        super().__init__()
        self.num_slots = num_slots
        self.dense_dim = dense_dim
        self.net = torch.nn.Sequential(
            torch.nn.Linear(num_slots * embedding_dim + dense_dim, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 128), torch.nn.ReLU(),
            torch.nn.Linear(128, 1),
        )

    def forward(self, non_id_tensors: list[torch.Tensor], embedding_tensors: list[torch.Tensor]) -> torch.Tensor:
        if len(embedding_tensors) != self.num_slots:
            raise ValueError(f"expected {self.num_slots} embedding tensors, got {len(embedding_tensors)}")
        dense = [non_id_tensors[0].float()] if self.dense_dim else []
        x = torch.cat([t.float() for t in embedding_tensors] + dense, dim=1)
        return torch.sigmoid(self.net(x))


class TestSet(IterableDataset):
    def __init__(self, n_samples: int) -> None:
        super().__init__()
        self.n_samples = n_samples

    def __iter__(self):
        for ids, dense, labels in case_test_batches(CASE.name, self.n_samples, EVAL_BATCH_SIZE):
            yield make_batch(ids, dense, labels, requires_grad=False)


def _curve_auc(ctx: TrainCtx, model: torch.nn.Module, subset: list) -> float:
    """AUC of the current model on ``subset`` (PersiaBatches), through direct lookups."""
    scores, targets = [], []
    model.eval()
    try:
        with torch.no_grad():
            for batch in subset:
                non_id, emb, labels = ctx.prepare_features(ctx.get_embedding_from_data(batch))
                scores.append(model(non_id, emb).float().cpu().numpy().ravel())
                targets.append(labels[0].cpu().numpy().ravel())
    finally:
        model.train()
    return auc(np.concatenate(targets), np.concatenate(scores))


def train(model: torch.nn.Module) -> dict:
    s = SETTINGS
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    embedding_optimizer = Adagrad(lr=EMBEDDING_LR, initial_accumulator_value=1e-2)
    loss_fn = torch.nn.BCELoss()
    rank = get_rank()
    subset = []
    if rank == 0 and s.curve_points > 0 and s.curve_samples > 0:
        subset = [make_batch(ids, dense, labels, requires_grad=False)
                  for ids, dense, labels in case_test_batches(CASE.name, s.curve_samples, EVAL_BATCH_SIZE)]
    samples = steps = 0
    losses: list[float] = []
    curve: list[list[float]] = []
    eval_s = 0.0
    with TrainCtx(model=model, embedding_optimizer=embedding_optimizer, dense_optimizer=dense_optimizer,
                  embedding_config=EmbeddingConfig(emb_initialization=(-0.01, 0.01)), device_id=DEVICE_ID,
                  mixed_precision=MIXED_PRECISION) as ctx:
        world = ctx.world_size
        every = max(1, math.ceil(s.train_batches / world / max(s.curve_points, 1)))
        loader = DataLoader(StreamingDataset(10), forward_buffer_size=FORWARD_BUFFER, embedding_staleness=STALENESS)
        start = time.perf_counter()  # the other ranks start here too and wait for this first evaluation
        if subset:
            curve.append([0, _curve_auc(ctx, model, subset)])
            ctx.report(eval_auc=curve[-1][1])
            eval_s += time.perf_counter() - start
        for batch in loader:
            output, labels = ctx.forward(batch)
            loss = loss_fn(output, labels[0])
            ctx.backward(loss)
            samples += output.shape[0]
            steps += 1
            losses.append(loss.item())
            if subset and steps % every == 0 and steps * world < s.train_batches:
                t = time.perf_counter()
                curve.append([samples * world, _curve_auc(ctx, model, subset)])
                ctx.report(eval_auc=curve[-1][1])  # persia_nn_worker_eval_auc on rank 0's metrics endpoint
                eval_s += time.perf_counter() - t
            if steps % 50 == 0:
                log.info("step %d loss=%.4f staleness=%d max_staleness=%d", steps, losses[-1],
                         loader.gate.inflight if loader.gate else 0, loader.gate.max_inflight if loader.gate else 0)
        ctx.wait_for_gradients()
        elapsed = time.perf_counter() - start
        return {"train_samples": samples, "steps": steps, "world_size": world,
                "samples_per_s": samples / max(elapsed - eval_s, 1e-9), "train_s": elapsed,
                "eval_during_train_s": eval_s,
                "max_staleness": loader.gate.max_inflight if loader.gate else 0,
                "staleness_bound": loader.gate.bound if loader.gate else None,
                "loss_first": float(np.mean(losses[:20])) if losses else None,
                "loss_last": float(np.mean(losses[-20:])) if losses else None,
                "counters": dict(ctx.runtime.counters), "rank": rank, "auc_curve": curve, "device": str(ctx.device),
                "mixed_precision": ctx.mixed_precision, "backend": ctx.backend}


def evaluate(model: torch.nn.Module, curve_samples: int) -> dict:
    scores, targets = [], []
    with eval_ctx(model=model, device_id=DEVICE_ID) as ctx:
        for batch in DataLoader(TestSet(SETTINGS.test_samples)):
            output, labels = ctx.forward(batch)
            scores.append(output.float().cpu().numpy().ravel())
            targets.append(labels[0].cpu().numpy().ravel())
    y, p = np.concatenate(targets), np.concatenate(scores)
    out = {"test_auc": auc(y, p), "test_logloss": log_loss(y, p), "test_samples": int(y.shape[0])}
    if curve_samples:
        out["curve_final_auc"] = auc(y[:curve_samples], p[:curve_samples])
    return out


def main() -> None:
    configure_logging(os.environ.get("LOG_LEVEL", "info"), role="nn-worker", rank=get_rank())
    torch.manual_seed(SETTINGS.seed)
    torch.set_num_threads(1)
    wall = time.perf_counter()
    model = MLP()
    result = train(model)
    if get_rank() == 0:
        result.update(evaluate(model, SETTINGS.curve_samples if result["auc_curve"] else 0))
        if "curve_final_auc" in result:
            result["auc_curve"].append([result["train_samples"] * result["world_size"],
                                        result.pop("curve_final_auc")])
    result["wall_s"] = time.perf_counter() - wall
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
