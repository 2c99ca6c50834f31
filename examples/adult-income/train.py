"""NN worker of the adult-income example: trains one pass, evaluates on adult.test.

Ends by printing one JSON line: test_auc, test_logloss, train_samples, samples_per_s, wall_s,
max_staleness, account (what became of every batch: TrainCtx.job_account), checkpoints, failures; then
exits non-zero with one line when the job lost a batch, trained too few, or its final checkpoint failed.
Rank 0 also writes the training curve as a PNG (CURVE_PNG, default runs/adult-income-training.png;
needs matplotlib). Environment: EMBEDDING_STALENESS (default: from
global_config.yml), FORWARD_BUFFER (batches looked up ahead of training, default 10), SEED,
FINAL_CHECKPOINT=1 (checkpoint the trained job into the checkpoint root before evaluating, for serving),
MIXED_PRECISION=0 (on a GPU, train in float32 instead of float16 autocast). Each rank trains on a GPU of its
own where the host has one per rank (persia.env.get_device_id), else on the CPU (PERSIA_SHARE_GPUS=1: on a
GPU shared with other ranks).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from adult_data import batches, load_split  # noqa: E402
from metrics import auc, log_loss  # noqa: E402
from model import DNN  # noqa: E402
from persia_batches import make_batch  # noqa: E402
from persia_nats.common.checkpoint import CheckpointError  # noqa: E402

from persia.ctx import TrainCtx, eval_ctx  # noqa: E402
from persia.data import DataLoader, IterableDataset, StreamingDataset  # noqa: E402
from persia.embedding.optim import Adagrad  # noqa: E402
from persia.env import get_device_id, get_rank  # noqa: E402
from persia.logger import configure_logging  # noqa: E402

log = logging.getLogger("adult-income")
SEED = int(os.environ.get("SEED", "0"))
# one GPU per local rank when there are enough (NCCL all-reduce, mixed precision), else the CPU (gloo)
DEVICE_ID = get_device_id()
STALENESS = int(os.environ["EMBEDDING_STALENESS"]) if os.environ.get("EMBEDDING_STALENESS") else None
FORWARD_BUFFER = int(os.environ.get("FORWARD_BUFFER", "10"))
MIXED_PRECISION = os.environ.get("MIXED_PRECISION", "1") != "0"


class TestSet(IterableDataset):
    def __init__(self, batch_size: int = 1024) -> None:
        super().__init__()
        self.split = load_split("test")
        self.batch_size = batch_size

    def __iter__(self):
        for ids, dense, labels in batches(self.split, self.batch_size):
            yield make_batch(ids, dense, labels, requires_grad=False)


def train(model: torch.nn.Module) -> dict:
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    embedding_optimizer = Adagrad(lr=1e-2, initial_accumulator_value=1e-2)
    loss_fn = torch.nn.BCELoss()
    samples = steps = 0
    losses = []
    with TrainCtx(model=model, embedding_optimizer=embedding_optimizer, dense_optimizer=dense_optimizer,
                  device_id=DEVICE_ID, mixed_precision=MIXED_PRECISION) as ctx:
        loader = DataLoader(StreamingDataset(10), forward_buffer_size=FORWARD_BUFFER, embedding_staleness=STALENESS)
        start = None
        for batch in loader:
            if start is None:
                start = time.perf_counter()  # throughput counts from the first batch, not from start-up
            output, labels = ctx.forward(batch)
            loss = loss_fn(output, labels[0])
            ctx.backward(loss)
            samples += output.shape[0]
            steps += 1
            losses.append(loss.item())
            if steps % 50 == 0:
                log.info("step %d loss=%.4f samples/s=%.0f staleness=%d max_staleness=%d", steps, losses[-1],
                         samples / (time.perf_counter() - start), loader.gate.inflight, loader.gate.max_inflight)
        ctx.wait_for_gradients()
        elapsed = time.perf_counter() - start if start is not None else 0.0
        # what became of every batch the job was given: a job that lost data must not exit 0
        account = ctx.job_account()
        failures = [account["failure"]] if account["failure"] else []
        if os.environ.get("FINAL_CHECKPOINT") == "1" and ctx.checkpoint_dir:
            try:
                ctx.dump_checkpoint(ctx.checkpoint_dir)  # the trained job, e.g. for `persia-launcher serve`
            except CheckpointError as exc:  # checkpointing_config.final_required: the job fails, after its result
                failures.append(exc.description)
        state = b"".join(t.detach().cpu().numpy().tobytes() for t in model.state_dict().values())
        return {"train_samples": samples, "steps": steps, "samples_per_s": samples / max(elapsed, 1e-9),
                "train_s": elapsed, "max_staleness": loader.gate.max_inflight if loader.gate else 0,
                "staleness_bound": loader.gate.bound if loader.gate else None,
                "losses": losses,
                "loss_first": float(np.mean(losses[:20])) if losses else None,
                "loss_last": float(np.mean(losses[-20:])) if losses else None,
                "counters": dict(ctx.runtime.counters), "rank": get_rank(), "device": str(ctx.device),
                "mixed_precision": ctx.mixed_precision, "backend": ctx.backend,
                "dense_sha256": hashlib.sha256(state).hexdigest(), "account": account,
                "checkpoints": ctx.checkpoint_summary(), "failures": failures}


def evaluate(model: torch.nn.Module) -> dict:
    scores, targets = [], []
    with eval_ctx(model=model, device_id=DEVICE_ID) as ctx:
        for batch in DataLoader(TestSet()):
            output, labels = ctx.forward(batch)
            scores.append(output.float().cpu().numpy().ravel())
            targets.append(labels[0].cpu().numpy().ravel())
        y, p = np.concatenate(targets), np.concatenate(scores)
        result = {"test_auc": auc(y, p), "test_logloss": log_loss(y, p)}
        ctx.report(**result)  # persia_nn_worker_test_auc on the rank's metrics endpoint
    return {**result, "test_samples": int(y.shape[0])}


def plot_curve(result: dict, path: str) -> None:
    """The training loss (moving average over 20 steps) with the final test AUC, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed; no training curve written (pip install matplotlib)")
        return
    losses = np.asarray(result["losses"])
    if losses.size == 0:  # a worker restarted after the last batch trains nothing: nothing to draw
        log.info("no training steps in this run; no training curve written")
        return
    window = min(20, len(losses))
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid") if window else losses
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(np.arange(len(losses)), losses, color="0.8", lw=0.8, label="loss per step")
    ax.plot(np.arange(window - 1, len(losses)), smooth, color="C0", label=f"moving average ({window} steps)")
    ax.set_xlabel("step (batch of 128)")
    ax.set_ylabel("BCE loss")
    ax.set_title(f"adult-income: test AUC {result.get('test_auc', float('nan')):.4f}, "
                 f"max staleness {result['max_staleness']}")
    ax.legend()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    log.info("training curve written to %s", path)


def main() -> None:
    configure_logging(os.environ.get("LOG_LEVEL", "info"), role="nn-worker", rank=get_rank())
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    wall = time.perf_counter()
    model = DNN(dense_dim=5)
    result = train(model)
    if get_rank() == 0:
        result.update(evaluate(model))
    if get_rank() == 0:
        plot_curve(result, os.environ.get("CURVE_PNG", "runs/adult-income-training.png"))
    result["wall_s"] = time.perf_counter() - wall
    result["cpu_s"] = time.process_time()
    del result["losses"]
    print(json.dumps(result), flush=True)
    if result["failures"]:
        sys.exit(f"job failed: {'; '.join(result['failures'])}")


if __name__ == "__main__":
    main()
