"""Index growth: doubled indexes built ahead in steps against the rebuild at once, measured in the same run.

A table (width ``--dim``, Adagrad, capacity ``--rows``, starting at ``rows / 16`` allocated rows) fills
through training lookups of ``--batch`` ids, half unseen, the rest Zipf(1.05) over what it holds, until
it is full, so its index doubles four times. Each mode fills its own table from the same batches, turns
alternating:

- ``rebuild``: the whole index rebuilt at once when the rows run out (the reference);
- ``ahead``: the doubled index copied in bounded steps after each lookup from 7/8 full, entries changed
  behind the copy's cursor mirrored into it, swapped in when the rows run out.

Columns: the longest lookup (wall and CPU ms), the median, ids per second over the fill, the doublings
built ahead. Medians over ``--turns`` turns a mode; ``max / ref`` against the rebuild's longest lookup.

    .venv/bin/python benchmarks/bench_growth.py --rows 1000000 10000000
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


def fill(rows: int, dim: int, batch: int, ahead: bool) -> dict[str, float]:
    table = EmbeddingTable(dim, rows, AdagradConfig(lr=0.05), initial_rows=rows // 16)
    table._incremental = ahead
    rng = np.random.default_rng(rows)
    fresh, lat, cpu, ids_done = 1, [], [], 0
    began = time.perf_counter()
    while len(table) < rows:
        held = max(1, fresh - 1)
        old = (np.minimum(rng.zipf(1.05, batch // 2), held).astype(np.uint64)) * _SCATTER
        new = np.arange(fresh, fresh + batch // 2, dtype=np.uint64) * _SCATTER
        fresh += batch // 2
        ids = rng.permutation(np.concatenate([old, new]))
        t, c = time.perf_counter(), time.thread_time()
        table.lookup(ids, True)
        lat.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
        ids_done += batch
    took = time.perf_counter() - began
    return {"max_ms": 1e3 * max(lat), "max_cpu_ms": 1e3 * max(cpu), "median_ms": 1e3 * statistics.median(lat),
            "ids_per_s": ids_done / took, "ahead": table.growths_built_ahead}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=2)
    args = ap.parse_args()
    out = []
    for rows in args.rows:
        res: dict[str, list[dict[str, float]]] = {"rebuild": [], "ahead": []}
        for turn in range(args.turns):
            for mode in (("rebuild", "ahead") if turn % 2 == 0 else ("ahead", "rebuild")):
                res[mode].append(fill(rows, args.dim, args.batch, mode == "ahead"))
        out.append((rows, {m: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for m, runs in res.items()}))
    print(f"\nfill to capacity from 1/16 (4 doublings), dim {args.dim} (Adagrad), batch {args.batch}, half unseen; "
          f"medians of {args.turns} turns a mode")
    print(f"{'rows':>11} {'mode':>8} {'max ms':>8} {'max CPU ms':>10} {'median ms':>9} {'ids/s':>10} {'ahead':>5} "
          f"{'max / ref':>9} {'rate / ref':>10}")
    for rows, r in out:
        ref = r["rebuild"]
        for mode in ("rebuild", "ahead"):
            m = r[mode]
            print(f"{rows:>11,} {mode:>8} {m['max_ms']:>8.1f} {m['max_cpu_ms']:>10.1f} {m['median_ms']:>9.2f} "
                  f"{m['ids_per_s']:>10,.0f} {m['ahead']:>5.0f} {m['max_ms'] / ref['max_ms']:>9.3f} "
                  f"{m['ids_per_s'] / ref['ids_per_s']:>10.2f}")


if __name__ == "__main__":
    main()
