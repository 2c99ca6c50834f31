"""PS embedding store throughput and memory against plain numpy / torch arrays, measured side by side.

One full table of ``--rows`` rows (keys ``0..rows-1``, so key k sits in row k, as in the plain arrays)
with Adagrad state; batches of ``--batch-ids`` ids drawn Zipf(1.1) over the keys and/or uniformly,
the Zipf ranks scattered over the keys by a fixed bijection (hot rows lie all over the table, in the
store and in the plain arrays alike). Each repeat times every contender over the same batches, in
turn, and the table shows the median over ``--repeats`` repeats:

- ``lookup train`` / ``lookup eval``: :meth:`EmbeddingTable.lookup`, against the plain gathers
  ``np.take(emb, ids, axis=0)`` and ``torch.index_select(emb, 0, ids)``.
- ``update adagrad``: :meth:`EmbeddingTable.update` (duplicate ids' gradients summed, one Adagrad step per
  row, weights clipped), against the same math on the plain arrays: numpy (``np.unique`` +
  ``np.add.at`` + fancy indexing) and torch (``torch.unique`` + ``index_add_`` + ``index_select`` /
  ``index_copy_``).
- ``lookup train, 10% unseen``: training lookups where one id in ten is new, each evicting the least
  recently used row (the table is full); run last, since it changes the table.

- ``np.take, 2 MiB pages from a 2 MiB boundary`` and ``np.take, 4 KiB pages``: the same gather on copies
  of the plain table, one allocated as the store allocates its arrays (:func:`core.hugepages.huge_empty`),
  one advised against huge pages; they show how much of the gap is page size and alignment and how much
  the store. numpy advises its own arrays of 4 MiB and more to use huge pages too, but they start 16
  bytes into a page, so a 64-byte row spans two cache lines; the store's rows sit on one.

``--plain-arrays store`` runs every plain contender on the store's own arrays (the gathers read its
vectors, the plain updates write its vectors and Adagrad state; key k sits in row k): no copy of the
table, so a table of 5x10^7 rows of dim 16 (7.6 GB) fits where four copies would not, and ``np.take``
reads the same pages as the store (the two page-size rows are left out). Two more rows split a store
lookup in its two passes, each timed alone: ``store probe pass`` (hash, index lines prefetched, probe,
rows noted: what the kernels do before copying) and ``store copy pass`` (:func:`core.table_kernels.copy_rows`
with the rows known). ``--cpu-time`` times every contender by its thread's CPU time instead of the wall
clock (on a shared host a turn then does not count other processes' time slices).

Ratios are store / plain, against the faster plain contender of each kind (the yardstick the issue's
floors apply to) and, for gathers, against ``np.take`` alone. torch runs one thread, as the store's kernels
do. Memory is ``memory_bytes() / len`` against the raw bytes of a row (key + vector + optimizer state).

    .venv/bin/python benchmarks/bench_ps.py                      # 10M x 16, Zipf and uniform
    .venv/bin/python benchmarks/bench_ps.py --dist zipf --json   # JSON line last
    .venv/bin/python benchmarks/bench_ps.py --capacity-check --rows 50000000 --dim 8
    .venv/bin/python benchmarks/bench_ps.py --small-pages    # the store on 4 KiB pages (huge pages off)
    .venv/bin/python benchmarks/bench_ps.py --rows 50000000 --dist zipf --plain-arrays store --cpu-time

``--capacity-check`` fills one table of ``--rows`` rows (default dim 8, Adagrad) through training
lookups, reports its memory (``memory_bytes``, VmRSS and peak VmHWM from /proc/self/status) and serves a
few lookup and update batches, to tell whether a given row count fits in one PS replica.

Every run also prints the table's ``memory_bytes`` against the growth of the process's RSS over the fill,
and how much of that RSS sits on huge pages (``AnonHugePages`` in /proc/self/smaps_rollup).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numba
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from persia_nats.common.optim_config import AdagradConfig, EmbeddingHyperparams  # noqa: E402
from persia_nats.core import hugepages  # noqa: E402
from persia_nats.core import table_kernels as tk  # noqa: E402
from persia_nats.core.hugepages import huge_empty  # noqa: E402
from persia_nats.core.store import EmbeddingTable, warm_up  # noqa: E402

ZIPF_A = 1.1
SCATTER = 0x9E3779B1  # odd prime multiplier: rank -> key bijection modulo the row count
FILL_BATCH = 1 << 20
CHURN = 0.1
CHURN_ROW = "store lookup train, 10% unseen (evicting)"
TAKE_HUGE = "np.take, 2 MiB pages from a 2 MiB boundary"
TAKE_SMALL = "np.take, 4 KiB pages"
PROBE_PASS = "store probe pass alone (rows noted)"
COPY_PASS = "store copy pass alone (rows known)"
_CLOCK = time.perf_counter  # what interleaved() times turns by (--cpu-time: time.thread_time)
CHUNK = 6  # batches each contender runs before the next takes its turn
_FLUSH = np.ones(8 << 20, np.uint64)  # 64 MiB: twice this machine's L3
_ORDER = random.Random(7)  # the contenders' order in each turn: shuffled, the same from run to run


def _rank_to_key(ranks: np.ndarray, rows: int) -> np.ndarray:
    """A fixed bijection of 0..rows-1 (the multiplier is a prime that divides no row count used here)."""
    mult = SCATTER % rows or 1
    while np.gcd(mult, rows) != 1:
        mult += 1
    return ((ranks.astype(np.uint64) * np.uint64(mult)) % np.uint64(rows)).astype(np.uint64)


def make_batches(dist: str, rows: int, batch: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        if dist == "uniform":
            ranks = rng.integers(0, rows, batch, dtype=np.int64)
        else:
            ranks = np.empty(0, np.int64)
            while ranks.shape[0] < batch:
                z = rng.zipf(ZIPF_A, 2 * batch)
                ranks = np.concatenate([ranks, z[z <= rows] - 1])
            ranks = ranks[:batch]
        out.append(_rank_to_key(ranks, rows))
    return out


def vm_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, and its RSS on transparent huge pages (AnonHugePages), in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) * 1024
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "AnonHugePages":
                out[name] = int(value.split()[0]) * 1024
    return out


@numba.njit(cache=False)
def _probe_pass(ids: np.ndarray, skey: np.ndarray, srow: np.ndarray, rows: np.ndarray) -> None:
    """The lookups' first pass alone, as an eval lookup runs it: each id's index lines prefetched
    ``tk._DA`` ids ahead, then its probe; its row (or -1) noted."""
    n = ids.shape[0]
    homes = tk.home_slots(ids, skey.shape[0])
    for i in range(-tk._DA, n):
        if i + tk._DA < n:
            tk.prefetch_probe(skey, homes[i + tk._DA])
        if i >= 0:
            rows[i] = tk.probe(skey, srow, ids[i], homes[i])[0]


@contextlib.contextmanager
def small_pages_only() -> Iterator[None]:
    """Arrays allocated inside get 4 KiB pages, as on a host with transparent huge pages ``never``: the
    store's allocator sees ``never``, and numpy stops advising its own big arrays to use huge pages."""
    numpy_advice = getattr(np._core.multiarray, "_set_madvise_hugepage", None)
    was = numpy_advice(False) if numpy_advice else None
    mode = hugepages.thp_mode
    hugepages.thp_mode = lambda *a: "never"  # type: ignore[assignment]
    try:
        yield
    finally:
        hugepages.thp_mode = mode  # type: ignore[assignment]
        if numpy_advice:
            numpy_advice(was)


def fill_table(rows: int, dim: int, capacity: int, initial_rows: int = 1024,
               small_pages: bool = False) -> tuple[EmbeddingTable, float]:
    with small_pages_only() if small_pages else contextlib.nullcontext():
        table = EmbeddingTable(dim, capacity, optimizer=AdagradConfig(lr=0.01), hyper=EmbeddingHyperparams(),
                               initial_rows=initial_rows)
        t0 = time.perf_counter()
        for lo in range(0, rows, FILL_BATCH):
            table.lookup(np.arange(lo, min(lo + FILL_BATCH, rows), dtype=np.uint64), train=True)
    return table, time.perf_counter() - t0


def rate(fn: Callable[[np.ndarray, int], object], batches: list[np.ndarray]) -> float:
    """Ids per second of ``fn`` over every batch (after one untimed warm-up call)."""
    fn(batches[0], 0)
    t0 = time.perf_counter()
    for k, ids in enumerate(batches):
        fn(ids, k)
    return sum(b.shape[0] for b in batches) / (time.perf_counter() - t0)


def interleaved(contenders: dict[str, Callable[[np.ndarray, int], object]], batches: list[np.ndarray],
                chunk: int = CHUNK) -> dict[str, float]:
    """Ids per second of each contender over every batch, taking turns chunk by chunk, so that a change in
    the machine's load (it is shared) hits every contender alike, in an order shuffled (seeded) every
    chunk. Each turn starts as a process doing only that work would be: the contender first runs once
    untimed on another batch, so that the address translations of its own arrays are cached, then a
    buffer of twice the L3 size is read, so that the rows of the batches it is timed on are not.

    Without the untimed run, which contender ran before which decided the result: the 4 KiB-page gather
    empties the TLB for whoever follows it, a contender that follows another on the same arrays finds it
    full, and the flush only reads 32 huge pages. Under the fixed rotation used before, the store's
    training lookups measured 0.85x the plain gather in one ordering and 0.65x in a shuffled one."""
    spent = dict.fromkeys(contenders, 0.0)
    for fn in contenders.values():
        fn(batches[0], 0)
    for lo in range(0, len(batches), chunk):
        names = list(contenders)
        _ORDER.shuffle(names)
        for name in names:
            fn = contenders[name]
            fn(batches[lo - 1], (lo - 1) % len(batches))
            _FLUSH.sum()
            t0 = _CLOCK()
            for k in range(lo, min(lo + chunk, len(batches))):
                fn(batches[k], k)
            spent[name] += _CLOCK() - t0
    total = sum(b.shape[0] for b in batches)
    return {name: total / t for name, t in spent.items()}


def small_pages(like: np.ndarray) -> np.ndarray | None:
    """A copy of ``like`` on 4 KiB pages (advised against huge pages), or None without madvise."""
    if not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return None
    buf = mmap.mmap(-1, like.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_NOHUGEPAGE)
    out = np.frombuffer(buf, like.dtype).reshape(like.shape)
    out[:] = like
    return out


class Plain:
    """The yardsticks: a plain (rows, dim) table and its Adagrad accumulator, in numpy and in torch."""

    def __init__(self, rows: int, dim: int, cfg: AdagradConfig, bound: float, torch_mod,
                 table: EmbeddingTable | None = None) -> None:
        """Arrays of their own, or with ``table`` the table's own row arrays (no copies, no page-size rows)."""
        if table is not None:
            self.emb, self.acc = table._emb[:rows], table._state[:rows]
        else:
            self.emb = np.random.default_rng(1).uniform(-0.01, 0.01, (rows, dim)).astype(np.float32)
            self.acc = np.full((rows, dim), cfg.initial_accumulator_value, np.float32)
        self.lr, self.eps, self.gsm = np.float32(cfg.lr), np.float32(cfg.eps), np.float32(cfg.g_square_momentum)
        self.bound = np.float32(bound)
        self.torch = torch_mod
        self.temb, self.tacc = torch_mod.from_numpy(self.emb), torch_mod.from_numpy(self.acc)
        self.emb_huge = self.emb_small = None
        if table is None:
            self.emb_huge = huge_empty(self.emb.shape, np.float32)
            self.emb_huge[:] = self.emb
            self.emb_small = small_pages(self.emb)

    def take(self, ids: np.ndarray) -> np.ndarray:
        return np.take(self.emb, ids.view(np.int64), axis=0)

    def index_select(self, tids) -> object:
        return self.torch.index_select(self.temb, 0, tids)

    def update_numpy(self, ids: np.ndarray, grads: np.ndarray) -> None:
        uniq, inv = np.unique(ids.view(np.int64), return_inverse=True)
        g = np.zeros((uniq.shape[0], grads.shape[1]), np.float32)
        np.add.at(g, inv, grads)
        w, a = self.emb[uniq], self.acc[uniq]
        self.emb[uniq] = np.clip(w - self.lr * g / np.sqrt(a + self.eps), -self.bound, self.bound)
        self.acc[uniq] = a * self.gsm + g * g

    def update_torch(self, tids, tgrads) -> None:
        torch = self.torch
        uniq, inv = torch.unique(tids, return_inverse=True)
        g = torch.zeros((uniq.shape[0], tgrads.shape[1]), dtype=torch.float32).index_add_(0, inv, tgrads)
        w, a = self.temb.index_select(0, uniq), self.tacc.index_select(0, uniq)
        self.temb.index_copy_(0, uniq, torch.clamp(w - self.lr * g / torch.sqrt(a + self.eps), -self.bound, self.bound))
        self.tacc.index_copy_(0, uniq, a * self.gsm + g * g)


def bench(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(1)
    rows, dim = args.rows, args.dim
    cfg = AdagradConfig(lr=0.01)
    bound = EmbeddingHyperparams().weight_bound
    global _CLOCK
    _CLOCK = time.thread_time if args.cpu_time else time.perf_counter
    t0 = time.perf_counter()
    warm_up()  # the kernels loaded (or compiled) before the RSS baseline, so the growth is the table's
    before = vm_status()
    table, fill_s = fill_table(rows, dim, capacity=rows, small_pages=args.small_pages)
    after = vm_status()
    memory = {"memory_bytes": table.memory_bytes(), "rss_growth": after["VmRSS"] - before["VmRSS"],
              "rss": after["VmRSS"], "huge": after.get("AnonHugePages", 0) - before.get("AnonHugePages", 0)}
    shared = args.plain_arrays == "store"
    plain = Plain(rows, dim, cfg, bound, torch, table if shared else None)
    mem_per_row = table.memory_bytes() / len(table)
    rows_known = [np.empty(args.batch_ids, np.int64)]  # the probe pass's rows
    copied = np.empty((args.batch_ids, dim), np.float32)  # the copy pass's output
    raw = table.raw_bytes_per_row()
    dists = ["zipf", "uniform"] if args.dist == "both" else [args.dist]
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal((args.batch_ids, dim)).astype(np.float32) * 0.01 for _ in range(args.batches)]
    tgrads = [torch.from_numpy(g) for g in grads]
    reps: dict[str, dict[str, list[float]]] = {}
    batches = {d: make_batches(d, rows, args.batch_ids, args.batches, seed=100 + i) for i, d in enumerate(dists)}
    for dist in dists:
        bs = batches[dist]
        tids = [torch.from_numpy(b.view(np.int64)) for b in bs]
        contenders: dict[str, Callable[[np.ndarray, int], object]] = {
            "np.take": lambda ids, k: plain.take(ids),
            "torch.index_select": lambda ids, k, tids=tids: plain.index_select(tids[k]),
            "store lookup eval": lambda ids, k: table.lookup(ids, train=False),
            "store lookup train": lambda ids, k: table.lookup(ids, train=True),
            "numpy adagrad": lambda ids, k: plain.update_numpy(ids, grads[k]),
            "torch adagrad": lambda ids, k, tids=tids: plain.update_torch(tids[k], tgrads[k]),
            "store update adagrad": lambda ids, k: table.update(ids, grads[k]),
        }
        if plain.emb_huge is not None:
            contenders[TAKE_HUGE] = lambda ids, k: np.take(plain.emb_huge, ids.view(np.int64), axis=0)
        if plain.emb_small is not None:
            contenders[TAKE_SMALL] = lambda ids, k: np.take(plain.emb_small, ids.view(np.int64), axis=0)
        contenders[PROBE_PASS] = lambda ids, k: _probe_pass(ids, table._skey, table._srow, rows_known[0])
        contenders[COPY_PASS] = lambda ids, k: tk.copy_rows(ids.view(np.int64), ids.shape[0], table._emb, copied)
        reps[dist] = {name: [] for name in contenders}
        for _ in range(args.repeats):
            for name, v in interleaved(contenders, bs).items():
                reps[dist][name].append(v)
    # Last, as it changes the table: one id in ten unseen, each evicting a row. The first evicting call
    # also scans the index for eviction candidates (about rows / 8 of them), timed on its own.
    first_evicting_s = {}
    for i, dist in enumerate(dists):
        fresh = iter(range(rows + (i << 40), 2**62))
        churn = []
        for b in batches[dist]:
            b = b.copy()
            pos = np.random.default_rng(int(b[0])).random(b.shape[0]) < CHURN
            b[pos] = np.fromiter(fresh, np.uint64, int(pos.sum()))
            churn.append(b)
        t1 = time.perf_counter()
        table.lookup(churn[0], train=True)
        first_evicting_s[dist] = time.perf_counter() - t1
        churned = {"np.take (churn turns)": lambda ids, k, bs=batches[dist]: plain.take(bs[k]),
                   CHURN_ROW: lambda ids, k: table.lookup(ids, train=True)}
        for _ in range(args.repeats):
            for name, v in interleaved(churned, churn).items():
                reps[dist].setdefault(name, []).append(v)
    results = {d: {name: statistics.median(v) for name, v in runs.items()} for d, runs in reps.items()}
    mem_per_row = max(mem_per_row, table.memory_bytes() / len(table))  # now with an eviction candidate list
    total_s = time.perf_counter() - t0
    return {"rows": rows, "dim": dim, "batch_ids": args.batch_ids, "fill_s": fill_s, "total_s": total_s,
            "mem_per_row": mem_per_row, "raw_per_row": raw, "results": results, "evictions": table.evictions,
            "repeats": reps, "first_evicting_s": first_evicting_s, "small_pages": args.small_pages,
            "memory": memory, "plain_arrays": args.plain_arrays, "cpu_time": args.cpu_time}


def ratios(runs: dict[str, list[float]]) -> dict[str, float]:
    """Median over repeats of each repeat's store / plain ratio (the plain side: the faster of numpy and torch)."""

    def med(store: str, *plain: str) -> float:
        return statistics.median(s / max(runs[p][k] for p in plain) for k, s in enumerate(runs[store]))

    out = {
        "lookup_train_ratio": med("store lookup train", "np.take", "torch.index_select"),
        "lookup_eval_ratio": med("store lookup eval", "np.take", "torch.index_select"),
        "update_ratio": med("store update adagrad", "numpy adagrad", "torch adagrad"),
        "lookup_churn_ratio": med(CHURN_ROW, "np.take (churn turns)"),
        "lookup_train_vs_take": med("store lookup train", "np.take"),
        "lookup_eval_vs_take": med("store lookup eval", "np.take"),
        "probe_pass_vs_take": med(PROBE_PASS, "np.take"),
        "copy_pass_vs_take": med(COPY_PASS, "np.take"),
    }
    if TAKE_HUGE in runs:
        out["take_huge_ratio"] = med(TAKE_HUGE, "np.take")
        out["lookup_train_vs_take_huge"] = med("store lookup train", TAKE_HUGE)
        out["lookup_eval_vs_take_huge"] = med("store lookup eval", TAKE_HUGE)
    if TAKE_SMALL in runs:
        out["take_small_ratio"] = med(TAKE_SMALL, "np.take")
    return out


def report(res: dict, as_json: bool) -> None:
    repeats = len(res["repeats"][next(iter(res["repeats"]))]["np.take"])
    print(f"PS store vs plain arrays: {res['rows']:,} rows x dim {res['dim']}, Adagrad, {res['batch_ids']:,} ids a"
          f" batch; M rows/s and store / plain, medians of {repeats} repeats (plain = the faster of numpy and torch)"
          + ("; the store's arrays on 4 KiB pages" if res["small_pages"] else "")
          + ("; the plain contenders on the store's own arrays" if res["plain_arrays"] == "store" else "")
          + ("; thread CPU time" if res["cpu_time"] else "; wall time"))
    dists = list(res["results"])
    rat = {d: ratios(res["repeats"][d]) for d in dists}
    ratio_of = {"store lookup train": "lookup_train_ratio", "store lookup eval": "lookup_eval_ratio",
                CHURN_ROW: "lookup_churn_ratio", "store update adagrad": "update_ratio",
                TAKE_HUGE: "take_huge_ratio", TAKE_SMALL: "take_small_ratio", PROBE_PASS: "probe_pass_vs_take",
                COPY_PASS: "copy_pass_vs_take"}
    print("| operation |" + "|".join(f" {d} M rows/s | {d} store/plain " for d in dists) + "|")
    print("|" + "---|" * (1 + 2 * len(dists)))
    for name in res["results"][dists[0]]:
        if name == "np.take (churn turns)":
            continue
        cells = []
        for d in dists:
            cells.append(f" {res['results'][d][name] / 1e6:.1f} ")
            of = " of np.take" if name in (TAKE_HUGE, TAKE_SMALL, PROBE_PASS, COPY_PASS) else ""
            cells.append(f" {rat[d][ratio_of[name]]:.2f}x{of} " if name in ratio_of else " ")
        print(f"| {name} |" + "|".join(cells) + "|")
    mem = res["mem_per_row"] / res["raw_per_row"]
    print(f"| memory per row (memory_bytes / len; full, with eviction candidates listed) | {res['mem_per_row']:.1f}"
          f" B | {mem:.3f}x of raw {res['raw_per_row']} B (key + vector + Adagrad state) |"
          + " |" * (2 * len(dists) - 2))
    take = "; ".join(f"{d} train {rat[d]['lookup_train_vs_take']:.2f}x, eval {rat[d]['lookup_eval_vs_take']:.2f}x"
                     for d in dists)
    print(f"store lookups against np.take alone: {take}")
    if TAKE_HUGE in res["repeats"][dists[0]]:
        huge = "; ".join(f"{d} train {rat[d]['lookup_train_vs_take_huge']:.2f}x,"
                         f" eval {rat[d]['lookup_eval_vs_take_huge']:.2f}x" for d in dists)
        print(f"store lookups against {TAKE_HUGE} (the same pages and alignment as the store's): {huge}")
    m, gib = res["memory"], 2**30
    print(f"memory after the fill: memory_bytes {m['memory_bytes'] / gib:.2f} GiB against the fill's RSS growth"
          f" {m['rss_growth'] / gib:.2f} GiB ({m['memory_bytes'] / max(1, m['rss_growth']):.3f}x; RSS"
          f" {m['rss'] / gib:.2f} GiB); on huge pages {m['huge'] / gib:.2f} GiB of the growth")
    first = ", ".join(f"{d} {v * 1e3:.0f} ms" for d, v in res["first_evicting_s"].items())
    print(f"first evicting call (one batch + the candidate scan): {first}; evictions {res['evictions']:,}; the"
          " evicting row's ratio is against np.take timed in turn with it")
    print(f"fill {res['rows']:,} rows: {res['fill_s']:.1f} s; whole run {res['total_s']:.0f} s")
    if as_json:
        first = dists[0]
        out = {**rat[first], "memory_ratio": mem, "dist": first, "rows": res["rows"], "dim": res["dim"],
               "small_pages": res["small_pages"], "plain_arrays": res["plain_arrays"], "cpu_time": res["cpu_time"],
               **{f"mem:{k}": v for k, v in res["memory"].items()},
               "mem_bytes_per_row": res["mem_per_row"], "raw_bytes_per_row": res["raw_per_row"]}
        for d in dists:
            out.update({f"{d}:{name} rows_per_s": v for name, v in res["results"][d].items()})
            out.update({f"{d}:{k}": v for k, v in rat[d].items()})
        print(json.dumps(out))


def capacity_check(args: argparse.Namespace) -> None:
    rows, dim = args.rows, args.dim
    gib = 2**30
    before = vm_status()
    table, fill_s = fill_table(rows, dim, capacity=rows, initial_rows=args.initial_rows, small_pages=args.small_pages)
    after = vm_status()
    mem = table.memory_bytes()
    print(f"capacity check: {rows:,} rows x dim {dim}, Adagrad, one table in one process"
          f" (initial_rows {args.initial_rows:,}{'; 4 KiB pages' if args.small_pages else ''})")
    print(f"| fill (training lookups, {FILL_BATCH:,} new ids a call) | {fill_s:.1f} s |"
          f" {rows / fill_s / 1e6:.2f} M rows/s |")
    print(f"| memory_bytes | {mem / gib:.2f} GiB | {mem / rows:.1f} B/row vs raw {table.raw_bytes_per_row()} B "
          f"({mem / rows / table.raw_bytes_per_row():.3f}x) |")
    print(f"| VmRSS after fill | {after['VmRSS'] / gib:.2f} GiB | before {before['VmRSS'] / gib:.2f} GiB |")
    print(f"| VmHWM (peak RSS) | {after['VmHWM'] / gib:.2f} GiB | a growth holds the old and new index at once |")
    batches = make_batches("zipf", rows, args.batch_ids, 8, seed=5)
    grads = np.random.default_rng(6).standard_normal((args.batch_ids, dim)).astype(np.float32) * 0.01
    for name, fn in (("lookup train", lambda ids, k: table.lookup(ids, train=True)),
                     ("lookup eval", lambda ids, k: table.lookup(ids, train=False)),
                     ("update adagrad", lambda ids, k: table.update(ids, grads))):
        print(f"| serve {name} (Zipf) | {rate(fn, batches) / 1e6:.1f} M rows/s | |")
    final = vm_status()
    print(f"| VmRSS after serving | {final['VmRSS'] / gib:.2f} GiB | peak {final['VmHWM'] / gib:.2f} GiB |")
    print(f"rows {len(table):,}, evictions {table.evictions:,}")
    if args.json:
        print(json.dumps({"rows": rows, "dim": dim, "memory_bytes": mem, "vm_rss": final["VmRSS"],
                          "vm_hwm": final["VmHWM"], "fill_s": fill_s}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=None, help="table rows (default 10M; capacity check 50M)")
    p.add_argument("--dim", type=int, default=None, help="embedding width (default 16; capacity check 8)")
    p.add_argument("--batch-ids", type=int, default=26624)
    p.add_argument("--batches", type=int, default=42, help="batches timed per contender and repeat (7 turns of 6)")
    p.add_argument("--dist", choices=["zipf", "uniform", "both"], default="both")
    p.add_argument("--repeats", type=int, default=5,
                   help="repeats, each timing every contender in turn; the table shows medians (on a shared "
                        "2-core host one repeat's store / plain ratio spread 10-15%% from the next)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line last")
    p.add_argument("--small-pages", action="store_true",
                   help="the store's arrays on 4 KiB pages, as where transparent huge pages are off")
    p.add_argument("--plain-arrays", choices=["copy", "store"], default="copy",
                   help="the plain contenders' arrays: copies of the table (and two more of its vectors, on 2 MiB "
                        "and 4 KiB pages), or the store's own (no copies: for tables too big to hold four times)")
    p.add_argument("--cpu-time", action="store_true", help="time turns by thread CPU time, not wall time")
    p.add_argument("--capacity-check", action="store_true", help="fill one big table and report its memory")
    p.add_argument("--initial-rows", type=int, default=1024,
                   help="capacity check: rows allocated up front (= --rows: no growth, so no growth peak)")
    args = p.parse_args()
    if args.capacity_check:
        args.rows = args.rows or 50_000_000
        args.dim = args.dim or 8
        capacity_check(args)
        return
    args.rows = args.rows or 10_000_000
    args.dim = args.dim or 16
    report(bench(args), args.json)


if __name__ == "__main__":
    main()
