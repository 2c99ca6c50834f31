"""``kill -USR1 <pid>`` writes every asyncio task's stack of the process to stderr.

A wedged service is usually a coroutine waiting on something that never comes; thread dumps
(``py-spy dump``) show only the event loop idling in ``select``. This lists, for every loop the
process runs (a service's own, the training API's background loop), each pending task with the
frames it is suspended in.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import sys
import threading
import weakref
from typing import Any

_loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def format_tasks(loop: asyncio.AbstractEventLoop) -> str:
    out = io.StringIO()
    tasks = asyncio.all_tasks(loop)
    out.write(f"--- loop {id(loop):#x}: {len(tasks)} task(s)\n")
    for task in sorted(tasks, key=lambda t: t.get_name()):
        out.write(f"task {task.get_name()} {task.get_coro()!r}\n")
        for frame in task.get_stack():
            code = frame.f_code
            out.write(f"    {code.co_filename}:{frame.f_lineno} in {code.co_name}\n")
    return out.getvalue()


def _safe_format(loop: asyncio.AbstractEventLoop) -> str:
    # the loop keeps running in its own thread while this reads it: a diagnostic must never raise
    # into the interrupted main thread and end the process it was asked to describe
    try:
        return format_tasks(loop)
    except Exception as exc:
        return f"(tasks of loop {id(loop):#x} unavailable: {type(exc).__name__}: {exc})\n"


def _on_signal(signum: int, frame: Any) -> None:
    text = "".join(_safe_format(loop) for loop in list(_loops) if not loop.is_closed())
    sys.stderr.write(f"===== asyncio tasks of pid {os.getpid()}\n{text}===== end of tasks\n")
    sys.stderr.flush()


def register(loop: asyncio.AbstractEventLoop) -> None:
    """Include ``loop`` in the dump (once an entry point has called :func:`install`)."""
    _loops.add(loop)


def install() -> None:
    """Handle SIGUSR1 with the dump. For entry points only (:func:`~persia_nats.common.service.run_service`,
    ``python -m persia.script``): signal handlers belong to the program, not to a library it imports."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
        return
    # already ours, or the application has its own use for it
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
        return
    signal.signal(signal.SIGUSR1, _on_signal)
