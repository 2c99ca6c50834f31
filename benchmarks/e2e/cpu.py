"""CPU time of process trees, sampled from /proc, read back over any wall-clock window.

bench_e2e charges each role the user + system CPU its processes (and their children, e.g. the NN
worker's rank processes) spent while the NN worker timed its batches, so start-up (imports, kernel
loading) and shutdown never enter a per-sample figure. Of each role's CPU it also keeps the kernel's share
(system time, as ``role:sys``: system calls, and page faults, which on some virtual machines cost far
more than the work they serve). For the roles it names, it also splits that
CPU by thread, as ``role/kind``: ``main`` (each process's first thread: the NN worker's training
loop), a thread's own name where it has one in the kernel (the NN worker's ``persia-nn-<rank>`` I/O
thread, torch's ``pt_autograd_<n>``), and ``unnamed`` for the rest (torch's OpenMP workers).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Collection

from thread_cpu import read_proc
from thread_cpu import threads as thread_times

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(parent pid, CPU seconds of the process plus its reaped children, the system time among them), or
    None once it is gone."""
    try:
        text = read_proc(f"/proc/{pid}/stat")
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its closing one
    fields = text[text.rindex(")") + 2:].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return int(fields[1]), (utime + stime + cutime + cstime) / _TICK, (stime + cstime) / _TICK


def _threads(pid: int) -> dict[str, float]:
    """CPU seconds of each of ``pid``'s threads, as ``kind/tid`` (see the module's docstring); threads that
    end while read are left out."""
    try:
        own = read_proc(f"/proc/{pid}/comm").strip()
        times = thread_times(pid)
    except OSError:  # the process ended
        return {}
    return {f"{'main' if tid == pid else (name if name != own else 'unnamed')}/{tid}": user + system
            for (tid, name), (user, system) in times.items()}


def tree_cpu_s(roots: dict[str, int], threads_of: Collection[str] = ()) -> dict[str, float]:
    """CPU seconds of each root's whole process tree, now, and their system time as ``role:sys``; for the
    roles in ``threads_of``, also of each of their live threads, as ``role/kind/tid``.

    A child counts under its parent's tree while it runs, and in the parent's reaped-children time once
    waited for, so nothing is counted twice.
    """
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (s := _stat(int(entry))) is not None:
            stats[int(entry)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out = {}
    for role, root in roots.items():
        total, system, todo = 0.0, 0.0, [root]
        while todo:
            pid = todo.pop()
            if pid in stats:
                total += stats[pid][1]
                system += stats[pid][2]
                todo += children.get(pid, [])
                if role in threads_of:
                    out.update({f"{role}/{k}": t for k, t in _threads(pid).items()})
        out[role] = total
        out[f"{role}:sys"] = system
    return out


class CpuSampler:
    """Samples :func:`tree_cpu_s` every ``interval`` seconds in a thread; :meth:`between` interpolates.

    A sample reads every process's stat file (about 3 ms of CPU on a quiet host, more with the threads
    split): at 10 a second that took 3-10% of a core from the job it measured, which on 2 cores is the
    job's, not the reference's. Half a second apart, linear interpolation still places a window's ends
    well within a run's tens of seconds; :attr:`own_cpu_s` is what sampling cost."""

    def __init__(self, roots: dict[str, int], interval: float = 0.5, threads_of: Collection[str] = ()) -> None:
        self.roots, self.interval, self.threads_of = dict(roots), interval, tuple(threads_of)
        #: CPU seconds the sampling thread itself spent
        self.own_cpu_s = 0.0
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
            self._sample()
            if self._stop.wait(self.interval):
                # one more as the sampler stops: the span reaches the exit, not up to an interval short of it
                # (a window ending just before the exit would otherwise fall outside it)
                self._sample()
                return

    def _sample(self) -> None:
        self.times.append(time.time())
        began = time.thread_time()
        sample = tree_cpu_s(self.roots, self.threads_of)
        self.own_cpu_s += time.thread_time() - began
        if self.samples:
            # a thread's time vanishes when it ends (a process's goes to its parent's reaped children's):
            # hold its last reading, so that a kind's sum never goes back
            for k, v in self.samples[-1].items():
                if "/" in k:
                    sample.setdefault(k, v)
        self.samples.append(sample)

    def _at(self, t: float, role: str) -> float:
        i = bisect.bisect_left(self.times, t)
        if i <= 0 or i >= len(self.times):
            raise ValueError(f"{t} lies outside the sampled span {self.times[:1]}..{self.times[-1:]}")
        t0, t1 = self.times[i - 1], self.times[i]
        c0, c1 = self.samples[i - 1].get(role, 0.0), self.samples[i].get(role, 0.0)
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)

    def between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds each role spent from wall-clock ``start`` to ``end`` (``time.time()`` values), its
        system time as ``role:sys``, and each ``role/kind`` of thread of the roles split by thread."""
        out = {k: self._at(end, k) - self._at(start, k) for r in self.roots for k in (r, f"{r}:sys")}
        for k in sorted({k for s in self.samples for k in s if "/" in k}):
            kind = k.rsplit("/", 1)[0]
            out[kind] = out.get(kind, 0.0) + self._at(end, k) - self._at(start, k)
        return out
