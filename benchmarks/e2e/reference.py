"""bench_e2e's single-process reference: EmbeddingBag(sparse=True) + the same MLP, same data, same optimizers.

    reference.py [threads] [cpu|cuda|cuda-all]

``cpu`` runs everything on the CPU. ``cuda`` puts the MLP on the GPU and keeps the table and its
Adagrad on the CPU, where the pipeline keeps them (the PS); ``cuda-all`` puts the table on the GPU
too, which only a table that fits in one GPU's memory allows. All three train in float32.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_setup import DENSE_LR, DIM, EMBEDDING_LR, N_SLOTS, make_batches, mlp, peak_rss_mb, settings  # noqa: E402

VOCAB = 1_000_000


Step = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def training_step(table: torch.nn.EmbeddingBag, model: torch.nn.Module, sparse_opt: torch.optim.Optimizer,
                  dense_opt: torch.optim.Optimizer, batch_size: int) -> Step:
    """One training step of the reference on a batch (ids, dense, labels): also what
    ``dense_step.py`` times against the NN worker's dense step. The table and the model may sit on
    different devices; each step moves the pooled embeddings to the model's and the gradients back."""
    loss_fn = torch.nn.BCEWithLogitsLoss()
    at = table.weight.device
    to = next(model.parameters()).device
    offsets = torch.from_numpy(np.arange(N_SLOTS, dtype=np.int64) * VOCAB).to(at)

    def step(ids: np.ndarray, dense: np.ndarray, labels: np.ndarray) -> None:
        idx = (torch.from_numpy(ids.astype(np.int64)).to(at) + offsets).reshape(-1)
        per_bag = torch.arange(0, idx.shape[0], dtype=torch.int64, device=at)
        emb = table(idx, per_bag).reshape(batch_size, N_SLOTS * DIM).to(to)
        out = model(torch.cat([emb, torch.from_numpy(dense).to(to)], dim=1))
        loss = loss_fn(out, torch.from_numpy(labels).to(to))
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        sparse_opt.step()
        dense_opt.step()

    return step


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    where = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    if where not in ("cpu", "cuda", "cuda-all"):
        raise SystemExit(f"device {where!r}: expected cpu, cuda or cuda-all")
    if where != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"device {where!r} needs CUDA, and torch sees no GPU")
    dense_at = torch.device("cuda" if where != "cpu" else "cpu")
    table_at = torch.device("cuda" if where == "cuda-all" else "cpu")
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    torch.manual_seed(0)
    batch_size, n, warmup = settings()
    data = make_batches(n + warmup, batch_size)
    table = torch.nn.EmbeddingBag(N_SLOTS * VOCAB, DIM, mode="sum", sparse=True, device=table_at)
    torch.nn.init.uniform_(table.weight, -0.01, 0.01)
    model = mlp(torch).to(dense_at)
    sparse_opt = torch.optim.Adagrad(table.parameters(), lr=EMBEDDING_LR, initial_accumulator_value=1e-2)
    dense_opt = torch.optim.Adam(model.parameters(), lr=DENSE_LR)
    train = training_step(table, model, sparse_opt, dense_opt, batch_size)
    samples, start = 0, None
    for step, (ids, dense, labels) in enumerate(data):
        if step == warmup:
            if dense_at.type == "cuda":
                torch.cuda.synchronize()
            start, cpu_start, samples = time.perf_counter(), time.process_time(), 0
        train(ids, dense, labels)
        samples += batch_size
    if dense_at.type == "cuda":
        torch.cuda.synchronize()  # the GPU's queue of steps counts: timing stops when the last step is done
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(json.dumps({"role": "reference", "samples_per_s": samples / elapsed, "cpu_us_per_sample": cpu / samples * 1e6,
                      "peak_rss_mb": peak_rss_mb(), "device": where}))


if __name__ == "__main__":
    main()
