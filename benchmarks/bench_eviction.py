"""Eviction at capacity: candidate lists built ahead in steps against the whole-index rescan, same run.

One full table (``--rows`` rows of width ``--dim``, Adagrad) takes training lookups of ``--batch`` ids,
``--new`` of them unseen (each evicts the least recently used row), the rest Zipf(1.05) over the held
keys. The table switches between the two ways of listing eviction candidates, turn by turn
(``--turns`` turns of ``--requests`` lookups each, the same batches):

- ``rescan``: the list refilled by one pass over the whole index when it runs out (the reference);
- ``ahead``: the next list collected and sorted in bounded steps after each lookup while the current
  one still serves (:meth:`EmbeddingTable._step_next`).

Columns: the longest lookup (wall and CPU ms; on a shared machine wall time includes other processes'
turns), the median, lookups per second, and the refills in the turn (rescans, lists built ahead).
Medians over the turns of each mode; ``max / ref`` is the longest lookup against the rescan's.

    .venv/bin/python benchmarks/bench_eviction.py --rows 1000000 10000000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from persia_nats.common.optim_config import AdagradConfig  # noqa: E402
from persia_nats.core.store import EmbeddingTable  # noqa: E402

_SCATTER = np.uint64(0x9E3779B97F4A7C15)


def run(rows: int, dim: int, batch: int, new: float, requests: int, turns: int) -> dict[str, dict[str, float]]:
    table = EmbeddingTable(dim, rows, AdagradConfig(lr=0.05), initial_rows=rows)
    step = 1 << 20
    for start in range(0, rows, step):
        table.lookup((np.arange(start + 1, min(rows, start + step) + 1, dtype=np.uint64) * _SCATTER), True)
    rng = np.random.default_rng(rows)
    fresh = rows + 1
    n_new = int(batch * new)

    def batches() -> list[np.ndarray]:
        nonlocal fresh
        out = []
        for _ in range(requests):
            old = (np.minimum(rng.zipf(1.05, batch - n_new), rows).astype(np.uint64)) * _SCATTER
            unseen = np.arange(fresh, fresh + n_new, dtype=np.uint64) * _SCATTER
            fresh += n_new
            out.append(rng.permutation(np.concatenate([old, unseen])))
        return out

    res: dict[str, list[dict[str, float]]] = {"rescan": [], "ahead": []}
    for turn in range(turns):
        for mode in (("rescan", "ahead") if turn % 2 == 0 else ("ahead", "rescan")):
            table._incremental = mode == "ahead"
            table._reset_next()
            work = batches()
            lat, cpu = [], []
            built = table.lists_built_ahead
            began = time.perf_counter()
            for ids in work:
                t, c = time.perf_counter(), time.thread_time()
                table.lookup(ids, True)
                lat.append(time.perf_counter() - t)
                cpu.append(time.thread_time() - c)
            took = time.perf_counter() - began
            res[mode].append({"max_ms": 1e3 * max(lat), "max_cpu_ms": 1e3 * max(cpu),
                              "median_ms": 1e3 * statistics.median(lat), "per_s": len(work) / took,
                              "ahead": table.lists_built_ahead - built,
                              "refills": len(work) * n_new / max(1, rows // 8)})
    return {mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for mode, runs in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--new", type=float, default=0.5)
    ap.add_argument("--requests", type=int, default=0, help="lookups a turn (default: about 4 refills)")
    ap.add_argument("--turns", type=int, default=4)
    args = ap.parse_args()
    out = []
    for rows in args.rows:
        requests = args.requests or max(50, int(4 * (rows // 8) / (args.batch * args.new)))
        out.append((rows, requests, run(rows, args.dim, args.batch, args.new, requests, args.turns)))
    print(f"\nfull table x dim {args.dim} (Adagrad), batch {args.batch}, {args.new:.0%} unseen ids, "
          f"medians of {args.turns // 2} turns a mode")
    print(f"{'rows':>11} {'lookups':>8} {'mode':>7} {'max ms':>8} {'max CPU ms':>10} {'median ms':>9} "
          f"{'lookups/s':>9} {'refills':>7} {'ahead':>5} {'max / ref':>9} {'rate / ref':>10}")
    for rows, requests, res in out:
        ref = res["rescan"]
        for mode in ("rescan", "ahead"):
            m = res[mode]
            print(f"{rows:>11,} {requests:>8} {mode:>7} {m['max_ms']:>8.1f} {m['max_cpu_ms']:>10.1f} "
                  f"{m['median_ms']:>9.2f} {m['per_s']:>9.0f} {m['refills']:>7.1f} {m['ahead']:>5.0f} "
                  f"{m['max_ms'] / ref['max_ms']:>9.3f} {m['per_s'] / ref['per_s']:>10.2f}")


if __name__ == "__main__":
    main()
