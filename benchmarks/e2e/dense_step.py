"""The NN worker's dense step against the reference's, in one process, same model, same threads.

    .venv/bin/python benchmarks/e2e/dense_step.py [--threads 1,2] [--rounds 5] [--batch-size 4096]

bench_e2e charges the NN worker its whole process; this separates the part the reference pays too.
Per thread count, taking turns round by round (the machine may be shared), CPU microseconds
(``time.process_time``: every thread of the process) per sample of:

- ``reference step``: reference.py's whole step (EmbeddingBag lookup, MLP, Adagrad and Adam);
- ``reference dense``: its dense part alone, the MLP's forward, backward into the (batch, 416)
  embedding input, and Adam;
- ``nn dense``: the NN worker's dense part as ``TrainCtx`` runs it: the batch's float32 stack of
  slot outputs (what the hot-row merge hands over) made a leaf by ``embedding_tensors``, unbound into
  the slots, concatenated by the model with the dense features, backward into the leaf, the
  dense optimizer's step;
- ``nn dense, float16``: the same from the wire's float16 slot outputs (a job without hot rows),
  so the stacking and float16 -> float32 conversion are inside.

The ratio column is each against ``reference dense`` from the same rounds; medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_setup import DENSE_LR, DIM, EMBEDDING_LR, N_SLOTS, make_batches, mlp  # noqa: E402
from persia_nats.common.messages import SlotEmbedding  # noqa: E402
from persia_nats.dense.tensors import embedding_tensors  # noqa: E402
from reference import VOCAB, training_step  # noqa: E402

STEPS = 8  # steps per timed stretch


def steps(batch_size: int, n: int) -> dict[str, Callable[[int], None]]:
    """One step function per contender; each takes the batch index."""
    data = make_batches(n, batch_size)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    # the NN worker's inputs: rows as the embedding worker sends them (float16) and as the hot-row
    # merge hands them on (one float32 array, slot by slot)
    wire = [[(rng.standard_normal((batch_size, DIM)) * 0.01).astype(np.float16) for _ in range(N_SLOTS)]
            for _ in range(n)]
    merged = [np.stack(w).astype(np.float32) for w in wire]
    table = torch.nn.EmbeddingBag(N_SLOTS * VOCAB, DIM, mode="sum", sparse=True)
    torch.nn.init.uniform_(table.weight, -0.01, 0.01)
    ref_model, nn_model = mlp(torch), mlp(torch)
    nn_model.load_state_dict(ref_model.state_dict())
    sparse_opt = torch.optim.Adagrad(table.parameters(), lr=EMBEDDING_LR, initial_accumulator_value=1e-2)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=DENSE_LR)
    nn_opt = torch.optim.Adam(nn_model.parameters(), lr=DENSE_LR)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    emb_in = [torch.from_numpy(m.transpose(1, 0, 2).reshape(batch_size, N_SLOTS * DIM).copy()) for m in merged]

    train = training_step(table, ref_model, sparse_opt, ref_opt, batch_size)

    def reference_step(i: int) -> None:  # reference.py's own step
        train(*data[i])

    def reference_dense(i: int) -> None:
        _, dense, labels = data[i]
        emb = emb_in[i].detach().requires_grad_(True)
        out = ref_model(torch.cat([emb, torch.from_numpy(dense)], dim=1))
        loss = loss_fn(out, torch.from_numpy(labels))
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()

    def nn_dense(rows: list[list[np.ndarray]]) -> Callable[[int], None]:
        def step(i: int) -> None:  # TrainCtx.forward / backward / _dense_step, without the gradient push
            _, dense, labels = data[i]
            slots = [SlotEmbedding(f"s{k}", r) for k, r in enumerate(rows[i])]
            inputs, _ = embedding_tensors(slots, torch.device("cpu"), requires_grad=True)
            out = nn_model(torch.cat([*inputs, torch.from_numpy(np.array(dense))], dim=1))
            loss_fn(out, torch.from_numpy(np.array(labels))).backward()
            nn_opt.step()
            nn_opt.zero_grad(set_to_none=True)
        return step

    return {"reference step": reference_step, "reference dense": reference_dense,
            "nn dense": nn_dense([list(m) for m in merged]), "nn dense, float16": nn_dense(wire)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=lambda x: [int(t) for t in x.split(",")], default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4096)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    fns = steps(args.batch_size, STEPS)
    print(f"{'threads':>7} {'step':<20} {'CPU us/sample':>14} {'wall us/sample':>15} {'x reference dense':>18}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for f in fns.values():  # warm-up: allocator, kernels, optimizer state
            for i in range(2):
                f(i)
        cpu: dict[str, list[float]] = {k: [] for k in fns}
        wall: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.rounds):
            for name, f in fns.items():
                c, w = time.process_time(), time.perf_counter()
                for i in range(STEPS):
                    f(i)
                cpu[name].append((time.process_time() - c) / (STEPS * args.batch_size) * 1e6)
                wall[name].append((time.perf_counter() - w) / (STEPS * args.batch_size) * 1e6)
        base = statistics.median(cpu["reference dense"])
        for name in fns:
            c = statistics.median(cpu[name])
            print(f"{threads:>7} {name:<20} {c:>14.2f} {statistics.median(wall[name]):>15.2f} {c / base:>18.2f}")


if __name__ == "__main__":
    main()
