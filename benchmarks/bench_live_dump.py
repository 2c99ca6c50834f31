"""A PS checkpoint dump while training goes on: the live dump against the stop-the-world one, same run.

One full table (``--rows`` rows of width ``--dim``, Adagrad; capacity = rows, so new ids evict) on an
asyncio loop, with a client task that sends training "requests" back to back as the PS's handlers run
them (a training lookup of ``--batch`` ids, Zipf(1.05) over twice the table's keys, then an update of
the same ids). Per repeat, each mode dumps the table once into a temporary directory while the client
runs:

- ``stopped``: the dump the PS ran before (:func:`dump_store_stopped` in a thread, holding the store
  lock the requests take), as the reference;
- ``live``: :meth:`LiveDump.run`, steps on the loop between requests;
- ``none``: no dump, for as long as the live dump took: the control (what the machine's other load
  and the requests themselves cost, with no dump at all).

Columns: the dump's seconds; the longest a request took during the dump (from when the client issued it
to its reply, so it includes waiting for the dump) and its median; requests done during the dump per
second, against the rate without a dump measured just before (``rate ratio``); the PS's RSS peak during
the dump above its RSS before (sampled every 5 ms), in MiB and as a share of the table's bytes
(``memory_bytes``); the rows saved as pre-images (live only); the dump's longest step on the loop, in
wall time and in CPU time (on a shared machine the wall time includes other processes' turns; for
``stopped`` both are the whole dump), the seconds of its steps on the loop and of its work in threads.
Medians over ``--repeats``; ``max ms / ref`` is the live dump's longest request against the stopped one's.

    .venv/bin/python benchmarks/bench_live_dump.py --rows 1000000 10000000 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from persia_nats.common.optim_config import AdagradConfig  # noqa: E402
from persia_nats.core.store import EmbeddingStore  # noqa: E402
from persia_nats.core.store_checkpoint import LiveDump, dump_store_stopped  # noqa: E402

_SCATTER = np.uint64(0x9E3779B97F4A7C15)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class RssPeak:
    """The highest RSS seen while it runs, sampled every 5 ms by a thread."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def make_batches(rows: int, batch: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ranks = np.minimum(rng.zipf(1.05, batch), rows).astype(np.uint64)
        out.append((ranks * _SCATTER) | np.uint64(1))  # hot keys all over the index; never 0
    return out


def fill(rows: int, dim: int) -> EmbeddingStore:
    store = EmbeddingStore(rows, AdagradConfig(lr=0.05), initial_rows=rows)
    step = 1 << 20
    for start in range(0, rows, step):
        ids = (np.arange(start + 1, min(rows, start + step) + 1, dtype=np.uint64) * _SCATTER) | np.uint64(1)
        store.lookup(ids, dim, True)
        store.update(ids, np.full((ids.shape[0], dim), 0.01, np.float32))
    return store


class Client:
    """Training requests back to back on the loop, each timed from issue to reply."""

    def __init__(self, store: EmbeddingStore, dim: int, batches: list[np.ndarray], lock: asyncio.Lock) -> None:
        self.store, self.dim, self.batches, self.lock = store, dim, batches, lock
        self.done: list[tuple[float, float]] = []  # (finish time, latency)
        self._stop = False
        self._grads = np.full((batches[0].shape[0], dim), 1e-3, np.float32)

    async def run(self) -> None:
        k = 0
        while not self._stop:
            ids = self.batches[k % len(self.batches)]
            k += 1
            issued = time.perf_counter()
            async with self.lock:
                self.store.lookup(ids, self.dim, True)
                self.store.update(ids, self._grads)
            now = time.perf_counter()
            self.done.append((now, now - issued))
            await asyncio.sleep(0)

    def stop(self) -> None:
        self._stop = True

    def window(self, start: float, end: float) -> list[float]:
        return [lat for t, lat in self.done if start <= t <= end]


async def one_dump(store: EmbeddingStore, dim: int, batches: list[np.ndarray], mode: str,
                   out: Path, idle_s: float = 0.0) -> dict[str, Any]:
    lock = asyncio.Lock()
    client = Client(store, dim, batches, lock)
    task = asyncio.create_task(client.run())
    await asyncio.sleep(1.0)  # the rate without a dump
    t0 = time.perf_counter()
    base = client.window(t0 - 0.8, t0)
    rss0 = rss_bytes()
    live: LiveDump | None = None
    with RssPeak() as peak:
        started = time.perf_counter()
        if mode == "stopped":
            async with lock:
                await asyncio.to_thread(dump_store_stopped, store, out, 0, 1)
        elif mode == "none":  # the control: as long as the live dump took, with no dump at all
            await asyncio.to_thread(out.mkdir, parents=True)
            await asyncio.sleep(idle_s)
        else:
            live = LiveDump(store, out, 0, 1)
            await live.run()
        ended = time.perf_counter()
    await asyncio.sleep(0.3)  # the requests that waited for the dump finish after it
    client.stop()
    await task
    during = client.window(started, ended + 0.3)
    shutil.rmtree(out)
    seconds = ended - started
    table_bytes = sum(t.memory_bytes() for t in store.tables.values())
    return {"dump_s": seconds, "max_ms": 1e3 * max(during, default=0.0),
            "median_ms": 1e3 * statistics.median(during) if during else 0.0,
            "rate_ratio": (len(client.window(started, ended)) / seconds) / (len(base) / 0.8),
            "rss_mib": (peak.peak - rss0) / 2**20, "rss_share": (peak.peak - rss0) / table_bytes,
            "preimages": 0 if live is None else live.preimages,
            "step_ms": 1e3 * (seconds if live is None else live.longest_step),
            "step_cpu_ms": 1e3 * (seconds if live is None else live.longest_step_cpu),
            "loop_s": seconds if live is None else live.step_seconds,
            "thread_s": 0.0 if live is None else live.thread_seconds}


async def bench(rows: int, dim: int, batch: int, repeats: int, tmp: Path) -> dict[str, dict[str, float]]:
    store = fill(rows, dim)
    batches = make_batches(rows, batch, 64, seed=rows)
    results: dict[str, list[dict[str, Any]]] = {"stopped": [], "live": [], "none": []}
    for r in range(repeats):
        for mode in (("stopped", "live") if r % 2 == 0 else ("live", "stopped")):
            results[mode].append(await one_dump(store, dim, batches, mode, tmp / f"{mode}-{r}"))
        results["none"].append(await one_dump(store, dim, batches, "none", tmp / f"none-{r}",
                                              results["live"][-1]["dump_s"]))
    return {mode: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for mode, runs in results.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    table = []
    with tempfile.TemporaryDirectory(prefix="bench_live_dump_") as tmp:
        for rows in args.rows:
            res = asyncio.run(bench(rows, args.dim, args.batch, args.repeats, Path(tmp)))
            table.append((rows, res))
    print(f"\nrows x dim {args.dim} (Adagrad), batch {args.batch}, medians of {args.repeats}")
    print(f"{'rows':>11} {'mode':>8} {'dump s':>7} {'max ms':>8} {'median ms':>9} {'rate ratio':>10} "
          f"{'RSS +MiB':>9} {'RSS +share':>10} {'pre-images':>10} {'step ms':>8} {'step CPU ms':>11} {'loop s':>7} "
          f"{'thread s':>8} "
          f"{'max ms / ref':>12}")
    for rows, res in table:
        ref = res["stopped"]["max_ms"]
        for mode in ("stopped", "live", "none"):
            m = res[mode]
            print(f"{rows:>11,} {mode:>8} {m['dump_s']:>7.2f} {m['max_ms']:>8.1f} {m['median_ms']:>9.2f} "
                  f"{m['rate_ratio']:>10.2f} {m['rss_mib']:>9.0f} {m['rss_share']:>10.1%} {m['preimages']:>10,.0f} "
                  f"{m['step_ms']:>8.1f} {m['step_cpu_ms']:>11.1f} {m['loop_s']:>7.2f} {m['thread_s']:>8.2f} "
                  f"{m['max_ms'] / ref:>12.3f}")
    if args.json:
        print(json.dumps({str(rows): res for rows, res in table}))


if __name__ == "__main__":
    main()
