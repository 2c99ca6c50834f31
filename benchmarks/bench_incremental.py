"""Incremental updates on one PS replica's store: what tracking, a delta's copy, its write and its apply cost.

One table (``--rows`` rows of width ``--dim``, Adagrad) trained with batches of ``--batch`` distinct ids drawn
uniformly from the table's keys (``--zipf``: Zipf(1.05)): a training lookup, then an update, as the PS's handlers
run them, until the tracker holds the delta's keys. Per buffer size
in ``--deltas`` (distinct keys per delta):

- ``track``: the milliseconds per update that :class:`KeyTracker` adds, against the update itself
  (``update ms``; the reference measured in the same run);
- ``cut ms``: taking the tracked keys (the PS does it between two requests);
- ``copy s``: :meth:`DeltaRows.copy_steps` to the end, the rows copied out of the store in steps of
  ``COPY_STEP_ROWS`` rows (a PS serves requests between the steps), against a plain ``np.take`` of as many
  rows and their state at random row numbers (``gather s``); ``step max ms``: its longest step, the longest a
  request waits for a delta;
- ``write s`` and ``MB``: :func:`write_delta` (a thread's work in the PS: the replica serves meanwhile), the
  bytes it wrote and its rate;
- ``apply s``: reading and hashing the delta and upserting its rows into a serving store holding the table
  (:func:`read_delta`, :func:`apply_delta`), as ``persia-launcher serve`` applies it (in 16,384-row steps).

Medians over ``--repeats``. Freshness end to end (a PS over NATS writing deltas, a server following them) is
measured by ``tests/integration/test_incremental.py -s -k freshness``.

    .venv/bin/python benchmarks/bench_incremental.py --rows 2000000 --deltas 10000 100000 1000000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from persia_nats.common.optim_config import AdagradConfig, SGDConfig  # noqa: E402
from persia_nats.core.store import EmbeddingStore, warm_up  # noqa: E402
from persia_nats.core.store_incremental import (  # noqa: E402
    DeltaRows,
    KeyTracker,
    apply_delta,
    delta_name,
    list_deltas,
    read_delta,
    read_delta_meta,
    write_delta,
)
from persia_nats.services.embedding_ps.incremental import COPY_STEP_ROWS  # noqa: E402
from persia_nats.services.serving.incremental import STEP_ROWS  # noqa: E402


def zipf_keys(rng: np.random.Generator, keys: np.ndarray, n: int) -> np.ndarray:
    ranks = np.minimum(rng.zipf(1.05, n) - 1, keys.shape[0] - 1)
    return np.unique(keys[ranks])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--deltas", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--zipf", action="store_true", help="Zipf(1.05) ids (default: uniform, every id distinct)")
    args = ap.parse_args()
    warm_up()
    rng = np.random.default_rng(1)
    dim = args.dim
    store = EmbeddingStore(args.rows, AdagradConfig(), initial_rows=args.rows)
    keys = rng.integers(1, 2**63, size=args.rows, dtype=np.uint64)
    for at in range(0, args.rows, 1 << 16):
        store.lookup(keys[at: at + (1 << 16)], dim, True)
    table = store.tables[dim]
    serving = EmbeddingStore(2**31 - 2, SGDConfig(lr=1.0), initial_rows=args.rows)
    serving.upsert(keys, dim, np.zeros((args.rows, dim), np.float32), None, "none")
    print(f"table: {len(table)} rows of width {dim} (Adagrad), {table.raw_bytes_per_row()} bytes a row; "
          f"batches of {args.batch} ids ({'Zipf 1.05' if args.zipf else 'uniform, distinct'})")
    header = (f"{'delta rows':>10} {'update ms':>9} {'track ms':>8} {'track %':>7} {'cut ms':>6} {'copy s':>6} "
              f"{'gather s':>8} {'copy/gather':>11} {'step max ms':>11} {'write s':>7} {'MB':>6} {'MB/s':>5} "
              f"{'apply s':>7} {'rows/s apply':>12}")
    print(header)
    for size in args.deltas:
        res: dict[str, list[float]] = {k: [] for k in ("update", "track", "cut", "copy", "gather", "step", "write",
                                                       "mb", "apply")}
        for _ in range(args.repeats):
            tracker = KeyTracker()
            update_s = track_s = 0.0
            steps = 0
            while tracker.distinct < size and steps < 10_000:
                ids = zipf_keys(rng, keys, args.batch) if args.zipf else rng.choice(keys, args.batch, replace=False)
                store.lookup(ids, dim, True)
                grads = rng.standard_normal((ids.shape[0], dim)).astype(np.float32)
                t = time.perf_counter()
                store.update(ids, grads)
                t2 = time.perf_counter()
                tracker.add(dim, ids)
                update_s += t2 - t
                track_s += time.perf_counter() - t2
                steps += 1
            res["update"].append(1e3 * update_s / steps)
            res["track"].append(1e3 * track_s / steps)
            # the cut (a PS does it between two requests), then the copy in steps
            t = time.perf_counter()
            taken = tracker.take()
            res["cut"].append(1e3 * (time.perf_counter() - t))
            delta = DeltaRows(delta_name(time.time_ns() // 1000), time.time(), "", dict(taken))
            longest, started = 0.0, time.perf_counter()
            t = started
            for _ in delta.copy_steps(store, COPY_STEP_ROWS):
                now = time.perf_counter()
                longest, t = max(longest, now - t), now
            res["copy"].append(time.perf_counter() - started)
            res["step"].append(1e3 * longest)
            # the reference: as many rows and their state gathered at random row numbers
            at = rng.choice(len(table), taken[dim].shape[0], replace=False)
            t = time.perf_counter()
            rows = np.take(table._emb, at, axis=0)
            state = np.take(table._state, at, axis=0)
            res["gather"].append(time.perf_counter() - t)
            del rows, state
            with tempfile.TemporaryDirectory(prefix="bench-inc-") as tmp:
                t = time.perf_counter()
                _, nbytes = write_delta(Path(tmp), delta, job="bench", replica_index=0, replica_size=1)
                res["write"].append(time.perf_counter() - t)
                res["mb"].append(nbytes / 1e6)
                src = list_deltas(Path(tmp))[0]
                t = time.perf_counter()
                apply_delta(serving, read_delta(src, read_delta_meta(src)), STEP_ROWS)
                res["apply"].append(time.perf_counter() - t)
            n = delta.rows
        med = {k: statistics.median(v) for k, v in res.items()}
        print(f"{n:>10} {med['update']:>9.2f} {med['track']:>8.3f} {100 * med['track'] / med['update']:>6.1f}% "
              f"{med['cut']:>6.1f} {med['copy']:>6.2f} {med['gather']:>8.2f} {med['copy'] / med['gather']:>11.2f} "
              f"{med['step']:>11.1f} {med['write']:>7.2f} {med['mb']:>6.1f} {med['mb'] / med['write']:>5.0f} "
              f"{med['apply']:>7.2f} {n / med['apply']:>12.0f}")


if __name__ == "__main__":
    main()
