"""PERSIA's Procfile line ``data_loader: python3 data_loader.py && cat``, made to work under honcho 2.

PERSIA keeps its data-loader entry alive with ``&& cat`` ("trick to block the data_loader to prevent
process exit before training done"): ``cat`` waits on a terminal forever. honcho 2 starts each Procfile
process from a ``multiprocessing.Process``, whose start-up replaces stdin with ``/dev/null``; so ``cat``
reads end-of-file at once and exits 0, and honcho, which stops every process as soon as one stops and
exits with that first one's status, ends the job with rc 0 before the NN workers have evaluated.

So a data-loader script whose parent shell will run ``cat`` next, on a stdin that is no terminal, does what
``cat`` was meant to: once its :class:`~persia.ctx.DataCtx` has delivered every batch and the script has
ended without an error, the process stays until it is signalled (honcho's SIGTERM when the NN worker
stops), so the job ends with the NN worker's status. Run through ``persia-launcher data-loader`` its
parent is the launcher, not a shell, and nothing changes (``--stay-alive`` does the same on purpose).

An uncaught exception after the ``DataCtx`` ends the process at once, as without ``&& cat``, so honcho
stops the job on it. Python does not tell exit hooks the status of a ``sys.exit(n)``: a script that
leaves that way after its ``DataCtx`` succeeded stays too (raise an exception instead).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys

#: ``sh -c "... && cat"``: the command ends by running a bare ``cat`` after the script succeeded
_AND_CAT = re.compile(r"&&\s*cat\s*$")
_registered: list[bool] = []  # one atexit hook per process, however many DataCtx ran


def parent_command(pid: int | None = None) -> list[str]:
    """The argv of process ``pid``'s parent (default: this process's); [] if it cannot be read."""
    ppid = os.getppid() if pid is None else pid
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        pass
    try:  # no /proc (macOS): ps prints the arguments joined, which is enough for the test below
        out = subprocess.run(["ps", "-o", "args=", "-p", str(ppid)], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.split() if out.returncode == 0 else []


def cat_follows(argv: list[str]) -> bool:
    """Whether ``argv`` is a shell running ``-c "... && cat"``."""
    return "-c" in argv[:-1] and bool(_AND_CAT.search(" ".join(argv[argv.index("-c") + 1:])))


def stay_if_cat_follows() -> None:
    """After a data loader delivered everything: when ``&& cat`` would end at once, stay at exit until signalled."""
    if _registered or sys.stdin is None or _isatty(sys.stdin.fileno()) or not cat_follows(parent_command()):
        return
    _registered.append(True)
    atexit.register(_stay)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except (OSError, ValueError):
        return False


def _stay() -> None:
    # the script ended with an uncaught error: exit with it, so the job stops on it as PERSIA's would
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        return
    print("persia: data loader done; staying until the job stops it (the Procfile runs `&& cat`, which would "
          "exit at once on the /dev/null stdin honcho gives it and stop the job before the NN workers end)",
          file=sys.stderr, flush=True)
    stop: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    while not stop:
        signal.pause()
