"""Single-process reference trainer for the synthetic example's ``ratings`` and ``ids`` cases (plain
PyTorch, no PERSIA services): what sync mode is held against.

The same batches in the same order (cases.py, ``SEED``, ``BATCH_SIZE``, ``TRAIN_BATCHES``), the same
``MLP`` as train.py, one ``nn.EmbeddingBag(mode="sum", sparse=True)`` per slot initialised
uniform(-0.01, 0.01) and trained with ``torch.optim.Adagrad`` (``EMBEDDING_LR``, initial
accumulator 1e-2, eps 1e-10), the dense model with Adam 1e-3, BCE loss; test AUC and log loss on the
case's held-out stream (``TEST_SAMPLES``). The ``criteo`` case's 26 million rows are too many for one
process here; ``benchmarks/e2e/reference.py`` is its single-process counterpart.

    SYNTHETIC_CASE=ids .venv/bin/python examples/synthetic/reference.py --seed 0 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from cases import case_batch, case_test_batches  # noqa: E402
from persia_batches import RunSettings, case_from_env  # noqa: E402
from train import EMBEDDING_DIM, EMBEDDING_LR, EVAL_BATCH_SIZE, MLP, auc, log_loss  # noqa: E402


def _bag_input(v: np.ndarray | list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    lists = [v[i : i + 1] for i in range(v.shape[0])] if isinstance(v, np.ndarray) else v
    offsets = np.cumsum([0] + [x.shape[0] for x in lists[:-1]])
    return torch.from_numpy(np.concatenate(lists).astype(np.int64)), torch.from_numpy(offsets)


def _forward(model: MLP, bags: torch.nn.ModuleList, ids: dict, dense: np.ndarray | None) -> torch.Tensor:
    emb = [bag(*_bag_input(ids[name])) for bag, name in zip(bags, ids, strict=True)]
    return model([] if dense is None else [torch.from_numpy(dense)], emb)


def _ps_rows(slot: str, vocab: int) -> np.ndarray:
    """The rows ids 0..vocab-1 of ``slot`` start at on the PS (uniform(-0.01, 0.01), seeded by the id)."""
    from persia_nats.common.config import load_embedding_config
    from persia_nats.common.optim_config import EmbeddingHyperparams
    from persia_nats.core.store import EmbeddingTable

    ecfg = load_embedding_config(case_from_env().embedding_config)
    keys = np.arange(vocab, dtype=np.uint64) | np.uint64(ecfg.prefix_of(slot))
    table = EmbeddingTable(EMBEDDING_DIM, capacity=vocab, hyper=EmbeddingHyperparams(-0.01, 0.01))
    return table.lookup(keys, train=True).copy()


def train_and_evaluate(seed: int, ps_init: bool = False) -> dict:
    case, s = case_from_env(), RunSettings.from_env()
    if case.name == "criteo":
        raise SystemExit("the criteo case has 26 million rows: use benchmarks/e2e/reference.py")
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.sparse.check_sparse_tensor_invariants.disable()  # explicit opt-out: silences a per-run warning
    model = MLP()
    bags = torch.nn.ModuleList(torch.nn.EmbeddingBag(v, EMBEDDING_DIM, mode="sum", sparse=True) for v in case.vocab)
    for name, bag in zip(case.slots, bags, strict=True):
        if ps_init:
            bag.weight.data = torch.from_numpy(_ps_rows(name, bag.weight.shape[0]))
        else:
            torch.nn.init.uniform_(bag.weight, -0.01, 0.01)
    emb_opt = torch.optim.Adagrad(bags.parameters(), lr=EMBEDDING_LR, initial_accumulator_value=1e-2, eps=1e-10)
    dense_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    started, samples = time.perf_counter(), 0
    for i in range(s.train_batches):
        ids, dense, labels = case_batch(case.name, i, s.batch_size, seed)
        loss = torch.nn.functional.binary_cross_entropy(_forward(model, bags, ids, dense), torch.from_numpy(labels))
        emb_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        emb_opt.step()
        dense_opt.step()
        samples += labels.shape[0]
    train_s = time.perf_counter() - started
    scores, targets = [], []
    model.eval()
    with torch.no_grad():
        for ids, dense, labels in case_test_batches(case.name, s.test_samples, EVAL_BATCH_SIZE):
            scores.append(_forward(model, bags, ids, dense).numpy().ravel())
            targets.append(labels.ravel())
    y, p = np.concatenate(targets), np.concatenate(scores)
    return {"test_auc": auc(y, p), "test_logloss": log_loss(y, p), "train_samples": samples,
            "samples_per_s": samples / train_s, "train_s": train_s, "case": case.name, "seed": seed,
            "ps_init": ps_init}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=int(os.environ.get("SEED", "0")))
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    p.add_argument("--ps-init", action="store_true",
                   help="start every row where the PS starts it (seeded by the id, the same for every seed) instead "
                        "of torch's uniform draw, so a comparison with a job differs in nothing but the system")
    args = p.parse_args(argv)
    r = train_and_evaluate(args.seed, args.ps_init)
    print(f"test AUC {r['test_auc']:.4f}  log loss {r['test_logloss']:.4f}  {r['samples_per_s']:.0f} samples/s")
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
