"""CPU time of process trees, sampled from /proc, read back over any wall-clock window.

bench_e2e charges each role the user + system CPU its processes (and their children, e.g. the NN
worker's rank processes) spent while the NN worker timed its batches, so start-up (imports, kernel
loading) and shutdown never enter a per-sample figure.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process plus its reaped children), or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its closing one
    fields = text[text.rindex(")") + 2:].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return int(fields[1]), (utime + stime + cutime + cstime) / _TICK


def tree_cpu_s(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds of each root's whole process tree, now.

    A child counts under its parent's tree while it runs, and in the parent's reaped-children time once
    waited for, so nothing is counted twice.
    """
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (s := _stat(int(entry))) is not None:
            stats[int(entry)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out = {}
    for role, root in roots.items():
        total, todo = 0.0, [root]
        while todo:
            pid = todo.pop()
            if pid in stats:
                total += stats[pid][1]
                todo += children.get(pid, [])
        out[role] = total
    return out


class CpuSampler:
    """Samples :func:`tree_cpu_s` every ``interval`` seconds in a thread; :meth:`between` interpolates."""

    def __init__(self, roots: dict[str, int], interval: float = 0.1) -> None:
        self.roots, self.interval = dict(roots), interval
        self.times: list[float] = []
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.times.append(time.time())
            self.samples.append(tree_cpu_s(self.roots))
            if self._stop.wait(self.interval):
                return

    def _at(self, t: float, role: str) -> float:
        i = bisect.bisect_left(self.times, t)
        if i <= 0 or i >= len(self.times):
            raise ValueError(f"{t} lies outside the sampled span {self.times[:1]}..{self.times[-1:]}")
        t0, t1 = self.times[i - 1], self.times[i]
        c0, c1 = self.samples[i - 1].get(role, 0.0), self.samples[i].get(role, 0.0)
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)

    def between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds each role spent from wall-clock ``start`` to ``end`` (``time.time()`` values)."""
        return {role: self._at(end, role) - self._at(start, role) for role in self.roots}
