"""How throughput grows with NN workers, embedding workers and PS replicas, and cost with table size.

    .venv/bin/python benchmarks/bench_scale.py [--counts 1,2,4] [--sizes 1000000,10000000,100000000] [--json]
        [--roles nn_workers,embedding_workers,ps_replicas,sparse,all] [--batch 1024]

Part 1 runs the bench_e2e pipeline (synthetic Criteo-like batches, hybrid mode) from a base of one of
each role, raising one role's count at a time (``sparse`` raises embedding workers and PS replicas
together, ``all`` NN ranks, embedding workers and PS replicas together); the ratio is samples/s against
the base measured in the same run, and each row says how much of the time the NN ranks waited for
looked-up batches (the rest they trained: low waits mean the dense side bounds, high waits the sparse
side) and each role's CPU a sample. On a 2-core machine every added process competes for the same two
cores, so these figures show overheads, not the scaling a cluster would see. Where there is a GPU the NN
ranks train on it; more ranks than GPUs share them (``PERSIA_SHARE_GPUS=1``, all-reducing with gloo, as
NCCL refuses two ranks on one GPU). ``--sizes ''`` skips part 2.

Part 2 fills one PS table of each size (dim 8, Adagrad) and times training lookups and Adagrad updates
of Zipf-distributed ids, against the smallest size in the same run. A PNG plots both parts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
from bench_e2e import run_pipeline  # noqa: E402
from bench_ps import fill_table, make_batches, rate, vm_status  # noqa: E402

from tests.natsserver import start_nats_server  # noqa: E402

BATCH = 1024


ROLES = ("nn_workers", "embedding_workers", "ps_replicas", "sparse", "all")


def scale_roles(counts: list[int], samples: int, roles: Sequence[str] = ROLES[:3], batch: int = BATCH
                ) -> list[dict]:
    server = start_nats_server()
    rows = []
    try:
        batches = max(10, samples // batch)

        def one(**kw: int) -> dict:
            r = run_pipeline(server.url, batch, batches, nats_pid=server.proc.pid, share_gpus=True,
                             **{"ps_replicas": 1} | kw)
            return {"samples_per_s": r["samples_per_s"], "nn_device": r["nn_device"],
                    "nn_wait_share": r["nn_wait_share"], "cpu_us_per_sample": r["cpu_us_per_sample"]}

        base = one()
        rows.append({"role": "base", "count": 1, **base, "ratio": 1.0})
        for role in roles:
            for n in counts:
                if n == 1:
                    continue
                kw = {"nn_workers": {"nproc": n}, "embedding_workers": {"workers": n},
                      "ps_replicas": {"ps_replicas": n}, "sparse": {"workers": n, "ps_replicas": n},
                      "all": {"nproc": n, "workers": n, "ps_replicas": n}}[role]
                r = one(**kw)
                rows.append({"role": role, "count": n, **r, "ratio": r["samples_per_s"] / base["samples_per_s"]})
                print(f"run: {role} {n}: {r['samples_per_s']:.0f} samples/s (base {base['samples_per_s']:.0f})",
                      flush=True)
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
    if not rows:
        return rows
    base = rows[0]
    for r in rows:
        r["lookup_ratio"] = r["lookup_rows_per_s"] / base["lookup_rows_per_s"]
        r["update_ratio"] = r["update_rows_per_s"] / base["update_rows_per_s"]
    return rows


def plot(roles: list[dict], tables: list[dict], path: str, batch: int = BATCH) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    base = roles[0]["samples_per_s"]
    for role, marker in (("nn_workers", "o"), ("embedding_workers", "s"), ("ps_replicas", "^"), ("sparse", "d"),
                         ("all", "*")):
        pts = [(1, base)] + [(r["count"], r["samples_per_s"]) for r in roles if r["role"] == role]
        if len(pts) == 1:
            continue
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=role.replace("_", " "))
    a.set_xlabel("count (others at 1)")
    a.set_ylabel("samples/s")
    a.set_title(f"pipeline, batch {batch}, {os.cpu_count()} cores, NN on {roles[0]['nn_device']}")
    a.legend()
    if not tables:
        b.set_visible(False)
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
    parser.add_argument("--roles", default="nn_workers,embedding_workers,ps_replicas",
                        help=f"which counts to raise, of {','.join(ROLES)} (sparse: embedding workers and PS "
                             "replicas together; all: NN ranks too)")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--sizes", default="1000000,10000000,100000000")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--samples", type=int, default=100_000, help="timed samples per pipeline run")
    parser.add_argument("--plot", default=str(ROOT / "benchmarks" / "scaling.png"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    wanted = [r for r in args.roles.split(",") if r]
    if unknown := sorted(set(wanted) - set(ROLES)):
        parser.error(f"--roles: unknown {', '.join(unknown)}; choose from {', '.join(ROLES)}")
    roles = scale_roles([int(x) for x in args.counts.split(",")], args.samples, wanted, args.batch)
    tables = scale_table([int(x) for x in args.sizes.split(",") if x], args.dim)
    print(f"batch {args.batch}, {os.cpu_count()} cores, NN worker on {roles[0]['nn_device']}")
    print(f"{'role':<20}{'count':>6}{'samples/s':>12}{'x base':>8}{'nn waits':>10}{'nn on':>8}   "
          "CPU us a sample by role")
    for r in roles:
        cpu = " ".join(f"{k}={v:.1f}" for k, v in r["cpu_us_per_sample"].items())
        print(f"{r['role']:<20}{r['count']:>6}{r['samples_per_s']:>12.0f}{r['ratio']:>8.2f}"
              f"{r['nn_wait_share']:>10.0%}{r['nn_device']:>8}   {cpu}")
    print(f"\n{'table rows':>12}{'fill s':>8}{'lookup M/s':>12}{'x':>6}{'update M/s':>12}{'x':>6}{'memory GiB':>12}")
    for t in tables:
        print(f"{t['rows']:>12}{t['fill_s']:>8.1f}{t['lookup_rows_per_s'] / 1e6:>12.1f}{t['lookup_ratio']:>6.2f}"
              f"{t['update_rows_per_s'] / 1e6:>12.1f}{t['update_ratio']:>6.2f}{t['memory_bytes'] / 2**30:>12.2f}")
    plot(roles, tables, args.plot, args.batch)
    print(f"plot: {args.plot}; {time.perf_counter() - start:.0f} s")
    if args.json:
        print(json.dumps({"roles": roles, "tables": tables}))


if __name__ == "__main__":
    main()
