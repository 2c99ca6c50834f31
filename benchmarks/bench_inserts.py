"""CPU an id of the PS store's training lookup and update: ids all new (every lookup inserts) against ids all
held (every lookup hits), in one process (issue 42: throughput at 10^8 distinct ids against 10^6).

    .venv/bin/python benchmarks/bench_inserts.py [--rows 6000000] [--batch-ids 20480] [--dim 16]
        [--hit-batches 40] [--json]

What a PS replica does for each batch of ``benchmarks/bench_big_tables.py``'s ``distinct`` case: one
training lookup of ``--batch-ids`` ids (4096 samples x 10 slots / 2 replicas), then one Adagrad update of the
same ids, on one table of width ``--dim``. Cases, in order:

- ``new ids, growing``: uniform random 64-bit ids (all new) from an empty table (``initial_rows`` 1,024,
  its default) to ``--rows`` rows: inserts, index doublings built ahead, and the row and index pages
  committed as they are first written (what 10^8 distinct ids do).
- ``held ids, uniform`` / ``held ids, Zipf 1.1``: ids drawn from those inserted (what 10^6 distinct ids do
  once the table is full), uniformly and by Zipf(1.1) rank over them.
- ``new ids, rows committed``: a table allocated for ``2 x --rows`` rows whose row arrays and index were
  written once beforehand (the pages committed): inserts without first-touch page faults or growth.

CPU is the thread's user and system time (``getrusage(RUSAGE_THREAD)``), not the wall clock, so that other
processes on a shared host count less; the system time is mostly the kernel committing pages on first
write. The last column is each case's CPU an id (lookup + update) against ``held ids, uniform``, measured in
the same run.

To compare two versions of the store, run the benchmark from each tree (say the last commit's, extracted
with ``git archive``) one after the other, and compare the ratios as well as the figures: the ratios are
measured within one run each.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from persia_nats.common.optim_config import AdagradConfig  # noqa: E402
from persia_nats.core.store import EmbeddingStore, warm_up  # noqa: E402


def cpu() -> np.ndarray:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return np.array([r.ru_utime, r.ru_stime])


class Arm:
    """One store, and the CPU its lookups and updates took since the last :meth:`take`."""

    def __init__(self, dim: int, initial_rows: int = 1024) -> None:
        self.dim = dim
        # the capacity bench_big_tables.py gives a replica (no eviction)
        self.store = EmbeddingStore(40_000_000, AdagradConfig(), initial_rows=initial_rows)
        self.lookup = np.zeros(2)
        self.update = np.zeros(2)
        self.ids = 0

    def step(self, ids: np.ndarray, grads: np.ndarray) -> None:
        a = cpu()
        self.store.lookup(ids, self.dim, True)
        b = cpu()
        self.store.update(ids, grads)
        c = cpu()
        self.lookup += b - a
        self.update += c - b
        self.ids += ids.shape[0]

    def take(self) -> dict[str, float]:
        """ns of CPU an id since the last take: lookup user / system, update user / system."""
        n = max(self.ids, 1)
        out = {"lookup_usr": self.lookup[0] / n * 1e9, "lookup_sys": self.lookup[1] / n * 1e9,
               "update_usr": self.update[0] / n * 1e9, "update_sys": self.update[1] / n * 1e9,
               "rows": len(self.store)}
        self.lookup[:] = 0
        self.update[:] = 0
        self.ids = 0
        return out


def batch(rng: np.random.Generator, ids: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.ascontiguousarray(ids, np.uint64)
    grads = rng.standard_normal((ids.shape[0], dim), dtype=np.float32) * np.float32(0.01)
    ids.flags.writeable = False  # as the wire delivers them
    grads.flags.writeable = False
    return ids, grads


def run(args: argparse.Namespace) -> dict[str, Any]:
    warm_up()
    arm = Arm(args.dim)
    rng = np.random.default_rng(args.seed)
    results: dict[str, dict[str, float]] = {}
    inserted: list[np.ndarray] = []
    while len(arm.store) < args.rows:
        ids = rng.integers(1, 2**63, args.batch_ids, dtype=np.uint64)
        inserted.append(ids)
        arm.step(*batch(rng, ids, args.dim))
    results["new ids, growing"] = arm.take()
    held = np.concatenate(inserted)
    for _ in range(args.hit_batches):
        arm.step(*batch(rng, rng.choice(held, args.batch_ids), args.dim))
    results["held ids, uniform"] = arm.take()
    ranks = (rng.zipf(1.1, args.batch_ids * args.hit_batches) - 1) % held.shape[0]
    hot = held[rng.permutation(held.shape[0])[ranks]]  # hot ranks scattered over the table
    for k in range(args.hit_batches):
        arm.step(*batch(rng, hot[k * args.batch_ids:(k + 1) * args.batch_ids], args.dim))
    results["held ids, Zipf 1.1"] = arm.take()
    del arm, held, hot, inserted  # the grown table's memory goes before the committed one takes its own
    arm = Arm(args.dim, initial_rows=2 * args.rows)
    arm.store.lookup(np.array([2**63], np.uint64), args.dim, True)
    t = arm.store.tables[args.dim]
    t._emb[:] = 0  # commit the row and index pages
    t._state[:] = 0
    t._sstamp[:] = 0
    arm.take()
    for _ in range(max(args.hit_batches, args.rows // args.batch_ids // 2)):
        arm.step(*batch(rng, rng.integers(1, 2**63, args.batch_ids, dtype=np.uint64), args.dim))
    results["new ids, rows committed"] = arm.take()
    return {"rows": args.rows, "batch_ids": args.batch_ids, "dim": args.dim, "cases": results}


def report(res: dict[str, Any]) -> None:
    print(f"\nPS store, one table of dim {res['dim']} (Adagrad), batches of {res['batch_ids']:,} ids (a training "
          f"lookup, then an update), up to {res['rows']:,} rows; ns of thread CPU an id")
    print("| case | rows after | lookup user | lookup sys | update user | update sys | total "
          "| x held ids, uniform |")
    print("|---|---|---|---|---|---|---|---|")

    def total(r: dict[str, float]) -> float:
        return r["lookup_usr"] + r["lookup_sys"] + r["update_usr"] + r["update_sys"]

    ref = total(res["cases"]["held ids, uniform"])
    for case, r in res["cases"].items():
        print(f"| {case} | {r['rows']:,} | {r['lookup_usr']:.0f} | {r['lookup_sys']:.0f} "
              f"| {r['update_usr']:.0f} | {r['update_sys']:.0f} | {total(r):.0f} | {total(r) / ref:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=6_000_000)
    ap.add_argument("--batch-ids", type=int, default=20_480)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--hit-batches", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="a JSON line last")
    args = ap.parse_args()
    res = run(args)
    report(res)
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
