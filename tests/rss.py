"""Resident memory (RSS) of role processes, sampled in the background from ``/proc`` (Linux).

A role started with ``start_new_session=True`` leads a process group of its own; the group holds the
launcher and every process it started (the NN worker's ranks), so sampling a group finds the
children without knowing how the launcher starts them. Each process is sampled on its own and
labelled ``<role>`` (the group leader) or ``<role>/<script>`` (a child, by its script's file name).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def rss_bytes(pid: int) -> int | None:
    """``VmRSS`` of ``pid`` in bytes, None once it has exited (or for a zombie, which has none)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def _pgrp(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ')'
    return int(stat[stat.rindex(")") + 2:].split()[2])


def _label(role: str, pid: int, leader: int) -> str:
    if pid == leader:
        return role
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"{role}/{pid}"
    # the user's script: `python train.py`, or `python -m persia.script train.py` as the launcher runs it
    words = [a.decode(errors="replace") for a in argv[1:] if a and not a.startswith(b"-")]
    script = next((w for w in words if w.endswith(".py")), words[0] if words else str(pid))
    return f"{role}/{os.path.basename(script)}"


@dataclass
class RssSampler:
    """Samples the RSS of every process of ``groups`` (role -> pgid) and of ``pids`` (role -> pid).

    ``samples`` holds ``(monotonic time, {label: rss bytes})`` every ``interval_s`` until :meth:`stop`.
    """

    groups: dict[str, int]
    pids: dict[str, int] = field(default_factory=dict)
    interval_s: float = 0.2
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def sample(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for role, pid in self.pids.items():
            rss = rss_bytes(pid)
            if rss:
                out[role] = rss
        # one pass over /proc for every group at once
        wanted = {pgid: role for role, pgid in self.groups.items()}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            pid = int(d)
            pgid = _pgrp(pid)
            if pgid in wanted:
                rss = rss_bytes(pid)
                if rss:
                    out[_label(wanted[pgid], pid, pgid)] = rss
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            s = self.sample()
            with self._lock:
                self.samples.append((t, s))
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t)))

    def window(self, t0: float, t1: float = float("inf")) -> list[tuple[float, dict[str, int]]]:
        with self._lock:
            return [(t, s) for t, s in self.samples if t0 <= t <= t1]

    def peak(self, t0: float = 0.0, t1: float = float("inf")) -> dict[str, int]:
        """The largest RSS of each process between ``t0`` and ``t1``."""
        out: dict[str, int] = {}
        for _, s in self.window(t0, t1):
            for k, v in s.items():
                out[k] = max(v, out.get(k, 0))
        return out

    def latest(self, before: float = float("inf")) -> dict[str, int]:
        """The last sample taken at or before ``before``."""
        with self._lock:
            for t, s in reversed(self.samples):
                if t <= before:
                    return dict(s)
        return {}


def mb(n: float) -> str:
    return f"{n / 2**20:.1f}"
