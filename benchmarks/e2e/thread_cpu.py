"""CPU seconds of each thread of a running process over a stretch of wall-clock time.

    .venv/bin/python benchmarks/e2e/thread_cpu.py PID [SECONDS]

For splitting the NN worker's CPU during a bench_e2e run: its training thread (the one whose id is
the process id), the torch/OpenMP worker threads that share the dense model's kernels with it, and
the ``persia-nn-<rank>`` I/O thread (lookups, hot-row merge, gradient pushes). The I/O thread names
itself in the kernel; other Python threads show under the process's name (``py-spy dump -p PID``
prints each Python thread's id beside its name, and the threads it does not list are torch's OpenMP
workers). py-spy shows which code runs but counts a thread waiting on a lock or a barrier as busy;
the kernel's per-thread counters here are CPU only. bench_e2e prints this split for every run
(``cpu.CpuSampler``'s ``threads_of``).
"""

from __future__ import annotations

import argparse
import os
import time

_TICK = os.sysconf("SC_CLK_TCK")


def read_proc(path: str) -> str:
    """A /proc file's text, read in one system call (pathlib's read_text costs several times as much)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096).decode()
    finally:
        os.close(fd)


def threads(pid: int) -> dict[tuple[int, str], tuple[float, float]]:
    """(thread id, name) -> (user, system) CPU seconds so far; threads that end while read are left out."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = read_proc(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[(int(tid), name)] = (int(fields[11]) / _TICK, int(fields[12]) / _TICK)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("seconds", type=float, nargs="?", default=15.0)
    args = parser.parse_args()
    before, start = threads(args.pid), time.perf_counter()
    time.sleep(args.seconds)
    after, wall = threads(args.pid), time.perf_counter() - start
    spent = {k: (u - before.get(k, (0.0, 0.0))[0], s - before.get(k, (0.0, 0.0))[1]) for k, (u, s) in after.items()}
    total = sum(u + s for u, s in spent.values())
    print(f"{'thread':>8} {'name':<18} {'CPU s':>7} {'user':>6} {'system':>7} {'share':>6} {'of a core':>10}")
    for (tid, name), (u, s) in sorted(spent.items(), key=lambda kv: -sum(kv[1])):
        if u + s > 0:
            cpu = u + s
            print(f"{tid:>8} {name:<18} {cpu:>7.2f} {u:>6.2f} {s:>7.2f} {cpu / total:>6.1%} {cpu / wall:>10.1%}")
    print(f"{'':>8} {'all':<18} {total:>7.2f} over {wall:.1f} s")


if __name__ == "__main__":
    main()
