"""The embedding worker's own CPU per batch, piece by piece, on bench_e2e's batches (no NATS, no PS).

    .venv/bin/python benchmarks/bench_plan.py [--batch-size 4096] [--batches 24] [--in-flight 5] [--json]

Times, as CPU (``time.process_time``, the best of several passes over the same batches), what the
embedding worker does with every training batch besides moving bytes: planning it (``make_plan``),
the automatic hot rows (the batches in flight counted: ``InFlightReads.hot``, ``add`` and
``remove``, and ``hot_occurrences``) and pooling the looked-up rows (``pool_dim``). Two pieces have a
reference measured in the same run: ``make_plan`` against planning the same batch one slot at a time
with ``np.unique`` (the way it was planned before), and the dedup inside it against ``np.unique``.
The batches are bench_e2e's: 26 single-id slots of Zipf ids over 1e6 per slot, dim 16.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "e2e"))

import numpy as np  # noqa: E402
from bench_setup import SLOTS, make_batches  # noqa: E402
from persia_nats.common.config import load_embedding_config  # noqa: E402
from persia_nats.common.messages import IdFeature  # noqa: E402
from persia_nats.core import plan as P  # noqa: E402
from persia_nats.services.embedding_worker import hot_window  # noqa: E402


def slot_by_slot(features: list[IdFeature], cfg) -> P.BatchPlan:  # noqa: ANN001
    """The reference: every slot planned alone, one ``np.unique`` per dim, each slot's arrays copied out."""
    partial = [P._slot_occurrences(f, cfg) for f in features]
    signs = np.concatenate([s for _, s in partial])
    uniq, inv = np.unique(signs, return_inverse=True)
    slots, start = [], 0
    for plan, s in partial:
        slots.append(P.SlotPlan(plan.name, plan.dim, plan.raw, inv[start:start + s.shape[0]].astype(np.int64),
                                plan.target, plan.scale, plan.n_targets, plan.index))
        start += s.shape[0]
    bs = features[0].batch_size
    pooled = P.PooledDim(tuple(range(len(slots))), np.concatenate([s.inv for s in slots]),
                         np.concatenate([s.target + k * bs for k, s in enumerate(slots)]),
                         np.concatenate([s.scale for s in slots]), np.array([s.inv.shape[0] for s in slots]))
    return P.BatchPlan(bs, tuple(slots), {slots[0].dim: uniq}, {slots[0].dim: pooled})


def best_cpu(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        fn()
        best = min(best, time.process_time() - started)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=24)
    ap.add_argument("--in-flight", type=int, default=5, help="batches in flight while the hot rows are chosen")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    bs, n = args.batch_size, args.batches
    cfg = load_embedding_config(ROOT / "examples" / "synthetic" / "config" / "embedding_config.yml")
    feats = [[IdFeature(s, np.ascontiguousarray(ids[:, i]).astype(np.uint64), np.ones(bs, np.int32))
              for i, s in enumerate(SLOTS)] for ids, _, _ in make_batches(n, bs)]
    P.warm_up()
    hot_window.warm_up()
    plans = [P.make_plan(f, cfg) for f in feats]
    signs = [np.concatenate([P._slot_occurrences(x, cfg)[1] for x in f]) for f in feats]
    dim = plans[0].slots[0].dim
    rows = [np.random.default_rng(k).standard_normal((p.distinct[dim].shape[0], dim)).astype(np.float32)
            for k, p in enumerate(plans)]
    chosen: list[dict[int, np.ndarray] | None] = []

    def window(pieces: dict[str, float]) -> None:
        w = hot_window.InFlightReads(1000, 3600.0)
        chosen.clear()
        for k, p in enumerate(plans):
            t0 = time.process_time()
            hot = w.hot(p)
            t1 = time.process_time()
            w.add(k, p)
            t2 = time.process_time()
            if hot:
                P.hot_occurrences(p, hot)
            t3 = time.process_time()
            if k >= args.in_flight:
                w.remove(k - args.in_flight)
            t4 = time.process_time()
            chosen.append(hot)
            if k < args.in_flight:  # filling the window (and growing its table): not the steady state
                continue
            for name, t in (("hot", t1 - t0), ("add", t2 - t1), ("hot_occurrences", t3 - t2), ("remove", t4 - t3)):
                pieces[name] = pieces.get(name, 0.0) + t

    best_window: dict[str, float] = {}
    for _ in range(args.repeats):
        pieces: dict[str, float] = {}
        window(pieces)
        if not best_window or sum(pieces.values()) < sum(best_window.values()):
            best_window = pieces

    def pool_all() -> None:
        for p, r, hot in zip(plans, rows, chosen, strict=True):
            P.pool_dim(p, dim, r, hot.get(dim) if hot else None)

    reps = args.repeats
    steady = n - args.in_flight
    figures = {  # name: (CPU seconds a batch, reference seconds a batch or None)
        "make_plan": (best_cpu(lambda: [P.make_plan(f, cfg) for f in feats], reps) / n,
                      best_cpu(lambda: [slot_by_slot(f, cfg) for f in feats], reps) / n),
        "  of which the dedup": (best_cpu(lambda: [P.unique_inverse(s) for s in signs], reps) / n,
                                 best_cpu(lambda: [np.unique(s, return_inverse=True) for s in signs], reps) / n),
        **{f"window: {k}": (v / steady, None) for k, v in best_window.items()},
        "pool_dim": (best_cpu(pool_all, reps) / n, None),
    }
    hot_rows = np.mean([sum(int(m.sum()) for m in h.values()) for h in chosen if h] or [0])
    per = bs / 1e6  # seconds a batch -> us a sample
    print(f"batch {bs}, {len(SLOTS)} slots, {np.mean([p.distinct[dim].shape[0] for p in plans]):.0f} distinct rows "
          f"a batch, {args.in_flight} batches in flight, {hot_rows:.0f} hot rows a batch; CPU, best of {reps}")
    print(f"{'piece':28s} {'ms/batch':>9s} {'us/sample':>10s} {'reference us':>13s} {'ratio':>6s}")
    out = {}
    for name, (t, ref) in figures.items():
        ratio = f"{t / ref:6.2f}" if ref else ""
        refs = f"{ref / per:13.3f}" if ref else ""
        print(f"{name:28s} {t * 1e3:9.3f} {t / per:10.3f} {refs:>13s} {ratio:>6s}")
        out[name.strip()] = {"us_per_sample": t / per, "reference_us_per_sample": ref / per if ref else None}
    total = sum(t for k, (t, _) in figures.items() if not k.startswith("  "))
    print(f"{'total':28s} {total * 1e3:9.3f} {total / per:10.3f}")
    if args.json:
        print(json.dumps({"batch_size": bs, "pieces": out}))


if __name__ == "__main__":
    main()
