"""How throughput grows with NN workers, embedding workers and PS replicas, and cost with table size.

    .venv/bin/python benchmarks/bench_scale.py [--counts 1,2,4] [--sizes 1000000,10000000,100000000] [--json]

Part 1 runs the bench_e2e pipeline (synthetic Criteo-like batches, batch 1024, hybrid mode) from a
base of one of each role, raising one role's count at a time; the ratio is samples/s against the base
measured in the same run. On this 2-core machine every added process competes for the same two
cores, so these figures show overheads, not the scaling a cluster would see.

Part 2 fills one PS table of each size (dim 8, Adagrad) and times training lookups and Adagrad updates
of Zipf-distributed ids, against the smallest size in the same run. A PNG plots both parts.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
from bench_e2e import run_pipeline  # noqa: E402
from bench_ps import fill_table, make_batches, rate, vm_status  # noqa: E402

from tests.natsserver import start_nats_server  # noqa: E402

BATCH = 1024


def scale_roles(counts: list[int], samples: int) -> list[dict]:
    server = start_nats_server()
    rows = []
    try:
        batches = max(10, samples // BATCH)
        base = run_pipeline(server.url, BATCH, batches, 1)["samples_per_s"]
        rows.append({"role": "base", "count": 1, "samples_per_s": base, "ratio": 1.0})
        for role in ("nn_workers", "embedding_workers", "ps_replicas"):
            for n in counts:
                if n == 1:
                    continue
                kw = {"nn_workers": {"nproc": n}, "embedding_workers": {"workers": n},
                      "ps_replicas": {"ps_replicas": n}}[role]
                kw.setdefault("ps_replicas", 1)
                sps = run_pipeline(server.url, BATCH, batches, **kw)["samples_per_s"]
                rows.append({"role": role, "count": n, "samples_per_s": sps, "ratio": sps / base})
    finally:
        server.stop()
    return rows


def scale_table(sizes: list[int], dim: int) -> list[dict]:
    rows = []
    for n in sizes:
        table, fill_s = fill_table(n, dim, n, initial_rows=n)
        batches = make_batches("zipf", n, 26_624, 20, seed=1)
        lookup = rate(lambda ids, _k, t=table: t.lookup(ids, train=True), batches)
        grads = np.full((batches[0].shape[0], dim), 0.01, np.float32)
        update = rate(lambda ids, _k, t=table, g=grads: t.update(ids, g), batches)
        rss = vm_status()["VmRSS"]
        rows.append({"rows": n, "fill_s": fill_s, "lookup_rows_per_s": lookup, "update_rows_per_s": update,
                     "memory_bytes": table.memory_bytes(), "rss_bytes": rss})
        del table
        gc.collect()
    base = rows[0]
    for r in rows:
        r["lookup_ratio"] = r["lookup_rows_per_s"] / base["lookup_rows_per_s"]
        r["update_ratio"] = r["update_rows_per_s"] / base["update_rows_per_s"]
    return rows


def plot(roles: list[dict], tables: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    base = roles[0]["samples_per_s"]
    for role, marker in (("nn_workers", "o"), ("embedding_workers", "s"), ("ps_replicas", "^")):
        pts = [(1, base)] + [(r["count"], r["samples_per_s"]) for r in roles if r["role"] == role]
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=role.replace("_", " "))
    a.set_xlabel("count (others at 1)")
    a.set_ylabel("samples/s")
    a.set_title("pipeline, batch 1024, 2 cores")
    a.legend()
    xs = [t["rows"] for t in tables]
    b.plot(xs, [t["lookup_rows_per_s"] / 1e6 for t in tables], marker="o", label="train lookup")
    b.plot(xs, [t["update_rows_per_s"] / 1e6 for t in tables], marker="s", label="Adagrad update")
    b.set_xscale("log")
    b.set_xlabel("table rows (dim 8)")
    b.set_ylabel("M rows/s")
    b.set_title("PS store vs table size")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="1,2,4")
    parser.add_argument("--sizes", default="1000000,10000000,100000000")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--samples", type=int, default=100_000, help="timed samples per pipeline run")
    parser.add_argument("--plot", default=str(ROOT / "benchmarks" / "scaling.png"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    roles = scale_roles([int(x) for x in args.counts.split(",")], args.samples)
    tables = scale_table([int(x) for x in args.sizes.split(",")], args.dim)
    print(f"{'role':<20}{'count':>6}{'samples/s':>12}{'x base':>8}")
    for r in roles:
        print(f"{r['role']:<20}{r['count']:>6}{r['samples_per_s']:>12.0f}{r['ratio']:>8.2f}")
    print(f"\n{'table rows':>12}{'fill s':>8}{'lookup M/s':>12}{'x':>6}{'update M/s':>12}{'x':>6}{'memory GiB':>12}")
    for t in tables:
        print(f"{t['rows']:>12}{t['fill_s']:>8.1f}{t['lookup_rows_per_s'] / 1e6:>12.1f}{t['lookup_ratio']:>6.2f}"
              f"{t['update_rows_per_s'] / 1e6:>12.1f}{t['update_ratio']:>6.2f}{t['memory_bytes'] / 2**30:>12.2f}")
    plot(roles, tables, args.plot)
    print(f"plot: {args.plot}; {time.perf_counter() - start:.0f} s")
    if args.json:
        print(json.dumps({"roles": roles, "tables": tables}))


if __name__ == "__main__":
    main()
