"""What this host's kernel spends to commit memory a process touches for the first time, per GiB.

    .venv/bin/python benchmarks/bench_first_touch.py [--gib 1] [--idle 30] [--json]

A growing PS table writes rows, index slots and optimizer state into memory no one has touched (its
reservations, :mod:`core.hugepages`), and the page faults that commit it are charged to the PS as system
time. Their price depends on the host more than on this project: on a virtual machine whose host takes
back the memory its guest frees (virtio-balloon free page reporting), memory touched again after a pause
costs the host's work as well as the guest kernel's. This measures four cases, each the system CPU of
touching every 4 KiB of ``--gib`` GiB, in the order run:

- ``2 MiB pages, after an idle pause``: transparent huge pages (``MADV_HUGEPAGE``, as the PS's tables),
  after ``--idle`` seconds in which nothing on this host should touch memory;
- ``2 MiB pages, just freed``: the same again at once: memory the guest kernel still holds (the reference);
- ``4 KiB pages, just freed`` (``MADV_NOHUGEPAGE``);
- ``4 KiB pages, after an idle pause``.

The ratio is each case against ``2 MiB pages, just freed`` in the same run. ``benchmarks/RESULTS.md``
uses it to read the PS's system time in ``bench_e2e.py`` and ``bench_big_tables.py``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import resource
import time

import numpy as np


def touch_s(gib: float, huge: bool) -> tuple[float, float]:
    """(system CPU seconds, wall seconds) to write one byte in every 4 KiB of a fresh ``gib`` GiB mapping."""
    size = int(gib * (1 << 30))
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    pages = np.frombuffer(buf, np.uint8)
    before, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
    pages[::4096] = 1
    wall = time.perf_counter() - t0
    system = resource.getrusage(resource.RUSAGE_SELF).ru_stime - before
    del pages
    buf.close()
    return system, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="memory touched per case")
    p.add_argument("--idle", type=float, default=30.0, help="seconds of pause before the 'after an idle pause' cases")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    cases = [("2 MiB pages, after an idle pause", True, args.idle), ("2 MiB pages, just freed", True, 0.0),
             ("4 KiB pages, just freed", False, 0.0), ("4 KiB pages, after an idle pause", False, args.idle)]
    rows = []
    for name, huge, pause in cases:
        time.sleep(pause)
        system, wall = touch_s(args.gib, huge)
        rows.append({"case": name, "system_s_per_gib": system / args.gib, "wall_s_per_gib": wall / args.gib})
    ref = rows[1]["system_s_per_gib"]
    print(f"{'case':<36}{'system s/GiB':>14}{'wall s/GiB':>12}{'x just freed 2 MiB':>20}")
    for r in rows:
        ratio = r["system_s_per_gib"] / ref if ref > 0 else float("nan")
        r["ratio"] = ratio
        print(f"{r['case']:<36}{r['system_s_per_gib']:>14.2f}{r['wall_s_per_gib']:>12.2f}{ratio:>20.1f}")
    if args.json:
        print(json.dumps({"gib": args.gib, "idle_s": args.idle, "rows": rows}))


if __name__ == "__main__":
    main()
