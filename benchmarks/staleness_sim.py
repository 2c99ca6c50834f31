"""The synthetic study's staleness effect without the distributed system: one process, numpy + torch.

Used by benchmarks/RESULTS.md ("Convergence") to tell the algorithm's behaviour from the
implementation's. It replays the synthetic example (examples/synthetic: same stream, same MLP, same
optimizers and initialisation ranges) the way hybrid training runs it with 2 NN ranks:

- 2 simulated ranks step together; at step s rank r trains batch 2s + r;
- each rank's embeddings are read ``k`` steps before they are used (``k = 0`` is sync), as the NN
  worker's lookahead under ``embedding_staleness = k`` does;
- the dense MLP is synchronous: both batches' gradients averaged, one Adam step (lr 1e-3);
- each batch's embedding gradients (per-id sums of its mean-loss gradient) are applied per batch with
  PERSIA-order Adagrad, as the PS does (step with the accumulator from before the gradient, then
  ``acc += g * g``; initial accumulator 0.01; weights clipped to +-10; init uniform(-0.01, 0.01)).

    .venv/bin/python benchmarks/staleness_sim.py --k 0 4 12 --lr 0.1 --batches 400
    .venv/bin/python benchmarks/staleness_sim.py --k 4 --hot 260     # the 260 hottest rows read fresh
    .venv/bin/python benchmarks/staleness_sim.py --k 12 --hot 260 --hot-lag 2   # ... missing 2 steps

Prints one line per k: the test AUC and log loss on the example's 20,480 held-out rows, and the AUC
at each quarter of the run.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "synthetic"))

from synthetic_data import N_DENSE, N_SLOTS, make_batch_arrays, test_batches  # noqa: E402

_spec = importlib.util.spec_from_file_location("adult_metrics", ROOT / "examples" / "adult-income" / "metrics.py")
_metrics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_metrics)

DIM = 16


def simulate(k: int, lr: float, n_batches: int, batch_size: int = 512, seed: int = 0, test_samples: int = 20480,
             hot: int = 0, scale_by_staleness: bool = False, hot_lag: int = 0) -> tuple[float, float, list[float]]:
    """``hot``: that many of the most frequent rows are read fresh when their batch trains (as if kept
    on the NN workers and updated synchronously), or, with ``hot_lag`` L, as they were L steps
    earlier (the gradients of the last L steps of both ranks not yet applied); ``scale_by_staleness``:
    a row's step is divided by (updates it missed + 1) / 2 when that exceeds 1 (2 ranks miss one
    update of each other's in sync)."""
    torch.manual_seed(seed)
    train = [make_batch_arrays(i, batch_size, seed) for i in range(n_batches)]
    test = list(test_batches(test_samples, 1024))
    offsets = (np.arange(N_SLOTS, dtype=np.uint64) << np.uint64(40))[None, :]  # one id space per slot
    keys = np.unique(np.concatenate([(ids + offsets).ravel() for ids, _, _ in train + test]))
    rows = [np.searchsorted(keys, ids + offsets) for ids, _, _ in train + test]
    emb = np.random.default_rng(seed + 1).uniform(-0.01, 0.01, (len(keys), DIM)).astype(np.float32)
    acc = np.full_like(emb, 0.01)
    version = np.zeros(len(keys), np.int64)  # updates applied per row
    is_hot = np.zeros(len(keys), bool)
    if hot:
        counts = np.bincount(np.concatenate([r.ravel() for r in rows[:n_batches]]), minlength=len(keys))
        is_hot[np.argsort(-counts)[:hot]] = True
    mlp = torch.nn.Sequential(torch.nn.Linear(N_SLOTS * DIM + N_DENSE, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    dense_opt = torch.optim.Adam(mlp.parameters(), lr=1e-3)

    def apply(r: np.ndarray, g: np.ndarray, read_version: np.ndarray) -> None:
        uniq, inv = np.unique(r.ravel(), return_inverse=True)
        grad = np.zeros((len(uniq), DIM), np.float32)
        np.add.at(grad, inv, g.reshape(-1, DIM))
        step = np.ones((len(uniq), 1), np.float32)
        if scale_by_staleness:
            missed = version[uniq] - read_version[uniq]
            step[:, 0] = 1.0 / np.maximum(1.0, (missed + 1) / 2)
        emb[uniq] = np.clip(emb[uniq] - lr * step * grad / np.sqrt(acc[uniq] + 1e-10), -10, 10)
        acc[uniq] += grad * grad
        version[uniq] += 1

    def evaluate() -> tuple[float, float]:
        with torch.no_grad():
            p = np.concatenate([
                torch.sigmoid(mlp(torch.cat([torch.from_numpy(emb[rows[n_batches + j]].reshape(len(y), -1)),
                                             torch.from_numpy(d)], 1))).numpy().ravel()
                for j, (_, d, y) in enumerate(test)])
        y = np.concatenate([y.ravel() for _, _, y in test])
        return _metrics.auc(y, p), _metrics.log_loss(y, p)

    steps = n_batches // 2
    looked_up: dict[int, list[np.ndarray]] = {}
    read_versions: dict[int, np.ndarray] = {}

    def lookup(s: int) -> None:
        if s < steps:
            looked_up[s] = [emb[rows[2 * s + r]].copy() for r in range(2)]
            read_versions[s] = version.copy() if scale_by_staleness else version

    for s in range(k):
        lookup(s)
    hot_index = np.flatnonzero(is_hot)
    hot_history: list[np.ndarray] = []  # hot rows at the start of each of the last hot_lag + 1 steps
    curve = []
    for s in range(steps):
        lookup(s + k)
        values = looked_up.pop(s)
        read_version = read_versions.pop(s)
        if hot:
            hot_history = [*hot_history[-hot_lag:], emb[hot_index].copy()] if hot_lag else [emb[hot_index]]
            then = hot_history[0]
            for r in range(2):
                fresh = is_hot[rows[2 * s + r]]
                values[r][fresh] = then[np.searchsorted(hot_index, rows[2 * s + r][fresh])]
        dense_opt.zero_grad()
        emb_grads = []
        for r in range(2):
            _, dense, labels = train[2 * s + r]
            e = torch.from_numpy(values[r]).requires_grad_(True)
            out = torch.sigmoid(mlp(torch.cat([e.reshape(batch_size, -1), torch.from_numpy(dense)], 1)))
            loss = torch.nn.functional.binary_cross_entropy(out, torch.from_numpy(labels)) / 2  # all-reduce mean
            loss.backward()
            emb_grads.append(e.grad.numpy() * 2)  # each rank sends its own mean-loss gradient
        dense_opt.step()
        for r in range(2):
            apply(rows[2 * s + r], emb_grads[r], read_version)
        if (s + 1) % max(steps // 4, 1) == 0:
            curve.append(round(evaluate()[0], 4))
    auc, logloss = evaluate()
    return auc, logloss, curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, nargs="+", default=[0, 1, 4, 12], help="lookahead steps per rank (0 = sync)")
    p.add_argument("--lr", type=float, default=0.1, help="embedding Adagrad learning rate")
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hot", type=int, default=0, help="most frequent rows read fresh at use time (0: none)")
    p.add_argument("--hot-lag", type=int, default=0, help="steps of updates the --hot rows miss when read")
    p.add_argument("--scale-by-staleness", action="store_true", help="divide a row's step by its missed updates")
    args = p.parse_args()
    torch.set_num_threads(1)
    base = None
    for k in args.k:
        auc, logloss, curve = simulate(k, args.lr, args.batches, seed=args.seed, hot=args.hot,
                                       scale_by_staleness=args.scale_by_staleness, hot_lag=args.hot_lag)
        base = auc if k == 0 else base
        gap = f" gap vs k=0 {100 * (auc - base) / base:+.2f}%" if base is not None and k else ""
        print(f"k={k} lr={args.lr} batches={args.batches} seed={args.seed}: test auc={auc:.4f} "
              f"logloss={logloss:.4f}{gap} quarters={curve}", flush=True)


if __name__ == "__main__":
    main()
