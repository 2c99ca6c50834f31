"""bench_e2e's NN worker: trains the MLP on looked-up embeddings; times the batches after warm-up."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from bench_setup import DENSE_LR, EMBEDDING_LR, mlp, peak_rss_mb, settings  # noqa: E402

from persia.ctx import TrainCtx  # noqa: E402
from persia.data import DataLoader, StreamingDataset  # noqa: E402
from persia.embedding.optim import Adagrad  # noqa: E402
from persia.env import get_device_id  # noqa: E402


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = mlp(torch)

    def forward(self, non_id, embeddings):  # noqa: ANN001, ANN201
        return self.mlp(torch.cat([*embeddings, non_id[0]], dim=1))


def main() -> None:
    torch.set_num_threads(int(os.environ.get("BENCH_NN_THREADS", "1")))
    torch.manual_seed(0)
    _, n, warmup = settings()
    model = Model()
    loss_fn = torch.nn.BCEWithLogitsLoss()
    samples = steps = 0
    start = None
    # float32 on a GPU too unless asked: the reference trains in float32
    mixed = os.environ.get("BENCH_MIXED_PRECISION", "0") == "1"
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=EMBEDDING_LR),
                  dense_optimizer=torch.optim.Adam(model.parameters(), lr=DENSE_LR), device_id=get_device_id(),
                  mixed_precision=mixed) as ctx:
        on_gpu = ctx.device.type == "cuda"
        for batch in DataLoader(StreamingDataset(16), forward_buffer_size=16):
            if steps == warmup:
                if on_gpu:
                    torch.cuda.synchronize()
                start, wall_start = time.perf_counter(), time.time()
                samples = 0
                waited_before = ctx.runtime.figures.counters["train_wait_us"]
                host_before = ctx.runtime.figures.counters["train_host_cpu_us"]
            out, labels = ctx.forward(batch)
            ctx.backward(loss_fn(out, labels[0]))
            samples += out.shape[0]
            steps += 1
        ctx.wait_for_gradients()
        if on_gpu:
            torch.cuda.synchronize()
        if start is None:  # ranks share the batches: one may not get past the warm-up
            raise SystemExit(f"rank {ctx.rank} trained {steps} batches, no more than the {warmup} of its warm-up: "
                             "nothing was timed (give the benchmark more samples)")
        elapsed = time.perf_counter() - start
        # how long the training loop waited for looked-up batches while timed: cores the pipeline left idle
        waited = (ctx.runtime.figures.counters["train_wait_us"] - waited_before) / 1e6
        # the training thread's CPU in the runtime's own work (not the model, not the dense step)
        host = (ctx.runtime.figures.counters["train_host_cpu_us"] - host_before) / 1e6
    # wall-clock bounds of the timed stretch: bench_e2e charges every role's CPU inside them
    print(json.dumps({"role": "nn", "samples_per_s": samples / elapsed, "timed_samples": samples,
                      "timed_from": wall_start, "timed_to": wall_start + elapsed,
                      "steps": steps, "peak_rss_mb": peak_rss_mb(), "device": str(ctx.device),
                      "mixed_precision": ctx.mixed_precision,
                      "train_wait_s": waited, "train_host_cpu_s": host}), flush=True)


if __name__ == "__main__":
    main()
