"""Restarting PS replicas from a checkpoint: each replica reading what it keeps, against the old full verify.

Builds one checkpoint of ``--rows`` rows of width ``--dim`` with per-element Adagrad (136 bytes a row at
width 16: the default 7.5M rows are about 1 GB of table) written by 2 replicas through the PS's own
writer (:func:`dump_store`), then restarts it as 2 replicas and resharded as 3, each replica's load in a
process of its own, all started together (a barrier after imports and the kernels' warm-up), as PS
replicas restart. Two modes, alternating, in the same run:

- ``old`` (the reference): what a PS did before, :func:`verify` re-hashing every file of the manifest,
  then the loader of commit bdcc5e1 (``git show``: every shard read when the new count does not divide the
  old one, keys loaded, values and state copied out of mapped files) without sums;
- ``new``: ``verify(hash_files=False)`` (every listed file there at its size), then :func:`read_store`,
  reading only the shards that can hold the replica's rows, each file once, hashed as it is read.

Per replica: seconds from the start of the load to the rows installed, rows, bytes hashed, bytes read in
all passes (the old path's verify, then its loader's files, read whole or mapped and touched: counted
whole, since a replica's rows lie in every page), and peak RSS (VmHWM, the process's own). Per restart:
the slowest replica (the restart's time: the job waits for all), and ``new / old``: medians over
``--repeats``, and the best of them (on a shared machine, the run least disturbed by other processes).

    .venv/bin/python benchmarks/bench_restart.py --rows 7500000 --replicas 2 3 4 --repeats 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from persia_nats.common import checkpoint as ck  # noqa: E402
from persia_nats.common.optim_config import AdagradConfig  # noqa: E402
from persia_nats.core.sharding import shard_of  # noqa: E402
from persia_nats.core.store import EmbeddingStore  # noqa: E402
from persia_nats.core.store_checkpoint import LoadProgress, dump_store, read_store  # noqa: E402

#: the last commit of the loader this change replaced: the reference
OLD_LOADER = "bdcc5e1edd3c05844e63b97d8e4a52fdf2cf9daf"
OPTIMIZER = AdagradConfig(lr=0.05)
WRITERS = 2


def build(root: Path, rows: int, dim: int, seed: int = 0) -> Path:
    """A checkpoint of ``rows`` rows written by :data:`WRITERS` replicas, each holding the keys routed to it."""
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(1, 2**63, size=rows + rows // 100, dtype=np.uint64))[:rows]
    rng.shuffle(keys)
    owner = shard_of(keys, WRITERS)
    partial = ck.partial_dir(root, 1)
    files: dict[str, Any] = {}
    for j in range(WRITERS):
        mine = keys[owner == j]
        store = EmbeddingStore(len(mine) + 1, OPTIMIZER)
        store.lookup(mine[:1], dim, True)  # the table of this width, with its optimizer's kind of state
        sd = store.tables[dim].state_dict()
        n = len(mine)
        sd.update(keys=mine, emb=rng.standard_normal((n, dim), np.float32),
                  state=rng.random((n, sd["state"].shape[1]), np.float32))
        store.tables[dim].load_state_dict(sd)
        del sd
        files.update(dump_store(store, partial, j, WRITERS))
        del store
    return ck.finalize(partial, files)


def old_loader() -> Any:
    """The loader of :data:`OLD_LOADER`, imported from ``git show`` under a name of its own."""
    source = subprocess.run(["git", "show", f"{OLD_LOADER}:core/store_checkpoint.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_store_checkpoint.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_store_checkpoint", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
    return module


def old_bytes_read(files: dict[str, Any], size: int, replica: int, n: int) -> int:
    """What the old loader read after its verify: keys, values and state of every shard it opened."""
    opened = [j for j in range(size) if size % n or j % n == replica]
    return sum(int(d["size"]) for rel, d in files.items()
               if rel.endswith(".npy") and any(rel.startswith(f"ps/replica-{j}-of-{size}/") for j in opened))


def peak_rss() -> int:
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited from the parent across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def child(ckpt: Path, mode: str, replica: int, n: int) -> None:
    """One replica's load, after the parent's go: its figures as one JSON line on stdout."""
    from persia_nats.core.store import warm_up

    warm_up()
    old = old_loader() if mode == "old" else None
    store = EmbeddingStore(10**9, OPTIMIZER)
    print("ready", flush=True)
    sys.stdin.readline()
    started, cpu = time.perf_counter(), time.process_time()
    files = ck.read_manifest(ckpt)["files"]
    if old is not None:
        problems = ck.verify(ckpt)
        assert not problems, problems
        rows = old.load_store(store, ckpt, replica, n, files, check_sums=False)
        hashed = sum(int(d["size"]) for d in files.values())
        read = hashed + old_bytes_read(files, ck.read_manifest(ckpt)["ps_writers"], replica, n)  # two passes
    else:
        problems = ck.verify(ckpt, hash_files=False)
        assert not problems, problems
        progress = LoadProgress()
        rows = read_store(store, ckpt, replica, n, files, progress=progress).install(store)
        hashed, read = progress.hashed_bytes, progress.done
    took, cpu = time.perf_counter() - started, time.process_time() - cpu
    print(json.dumps({"mode": mode, "n": n, "replica": replica, "seconds": took, "cpu": cpu, "rows": rows,
                      "hashed": hashed,
                      "read": read, "rss_mib": peak_rss() / 2**20}),
          flush=True)


def restart(ckpt: Path, mode: str, n: int) -> list[dict[str, Any]]:
    """``n`` replicas loading ``ckpt`` in parallel processes, started at once."""
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(ckpt), mode, str(r), str(n)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(n)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=3600)
        assert p.returncode == 0, f"replica failed: {p.returncode}"
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=7_500_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 3], help="replica counts to restart as")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to build the checkpoint (default: a temporary one)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        ckpt, mode, replica, n = args.child
        child(Path(ckpt), mode, int(replica), int(n))
        return
    work = Path(tempfile.mkdtemp(prefix="bench_restart-", dir=args.dir))
    try:
        started = time.perf_counter()
        ckpt = build(work, args.rows, args.dim)
        manifest_path = ckpt / ck.MANIFEST
        manifest = json.loads(manifest_path.read_bytes())
        manifest["ps_writers"] = WRITERS  # for the old loader's byte count (an extra key: readers ignore it)
        manifest_path.write_text(json.dumps(manifest))
        total = sum(int(d["size"]) for d in manifest["files"].values())
        print(f"checkpoint of {args.rows:,} rows (width {args.dim}, Adagrad) by {WRITERS} replicas: "
              f"{total / 1e9:.2f} GB, built in {time.perf_counter() - started:.0f} s", flush=True)
        runs: dict[tuple[str, int], list[list[dict[str, Any]]]] = {}
        for _ in range(args.repeats):
            for n in args.replicas:
                for mode in ("old", "new"):
                    result = restart(ckpt, mode, n)
                    runs.setdefault((mode, n), []).append(result)
                    print(f"  {mode} as {n}: slowest replica {max(r['seconds'] for r in result):.2f} s", flush=True)
        report(runs, args.replicas, total)
        if args.json:
            print(json.dumps({f"{m}-{n}": v for (m, n), v in runs.items()}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(runs: dict[tuple[str, int], list[list[dict[str, Any]]]], counts: list[int], total: int) -> None:
    print("\n| replicas | mode | replica | seconds | CPU s | rows | GB hashed | GB read | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    slowest: dict[tuple[str, int], float] = {}
    for n in counts:
        for mode in ("old", "new"):
            repeats = runs[(mode, n)]
            slowest[(mode, n)] = statistics.median(max(r["seconds"] for r in rep) for rep in repeats)
            for k in range(n):
                mine = [rep[k] for rep in repeats]
                med = {key: statistics.median(r[key] for r in mine)
                       for key in ("seconds", "cpu", "hashed", "read", "rss_mib")}
                print(f"| {n} | {mode} | {k} | {med['seconds']:.2f} | {med['cpu']:.2f} | {mine[0]['rows']:,} "
                      f"| {med['hashed'] / 1e9:.2f} | {med['read'] / 1e9:.2f} | {med['rss_mib']:.0f} |")
    print(f"\ncheckpoint {total / 1e9:.2f} GB\n")
    # on a shared machine the best of the repeats is the one least disturbed by other processes
    print("| restart | old s (slowest replica) | new s (slowest replica) | new / old | best old s | best new s "
          "| best new / old | old CPU s (all) | new CPU s (all) | new / old (CPU) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in counts:
        old, new = slowest[("old", n)], slowest[("new", n)]
        best_old, best_new = (min(max(r["seconds"] for r in rep) for rep in runs[(m, n)]) for m in ("old", "new"))
        old_cpu, new_cpu = (statistics.median(sum(r["cpu"] for r in rep) for rep in runs[(m, n)])
                            for m in ("old", "new"))
        print(f"| {WRITERS} -> {n} | {old:.2f} | {new:.2f} | {new / old:.2f} | {best_old:.2f} | {best_new:.2f} "
              f"| {best_new / best_old:.2f} | {old_cpu:.2f} | {new_cpu:.2f} | {new_cpu / old_cpu:.2f} |")


if __name__ == "__main__":
    main()
