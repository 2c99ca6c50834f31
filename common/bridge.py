"""An asyncio loop on a background thread, for the synchronous user API (DataCtx, TrainCtx).

The training loop is plain synchronous PyTorch; the NATS traffic lives on this loop, so lookups
and gradient pushes run while the user's thread computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from persia_nats.common import taskdump

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # uvloop is optional (absent on Windows)
        return asyncio.new_event_loop()


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the kernel too (its first 15 bytes), where Linux allows it.

    Python keeps a thread's name to itself, so ``top -H``, ``ps -L`` and ``/proc/<pid>/task/*/comm``
    would show every thread under the process's name; with this they tell the I/O thread from the
    training thread and torch's workers. Best effort: elsewhere, or without libc, nothing happens.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


class LoopThread:
    """Owns an event loop running on a daemon thread until :meth:`close`."""

    def __init__(self, name: str = "persia-io") -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        taskdump.register(self.loop)  # dumped on SIGUSR1 where the entry point asked for it (taskdump.install)

    def _run(self) -> None:
        name_os_thread(self._thread.name)
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop without waiting for it. Calls made from one thread run in the
        order they were made, and before any coroutine that thread submits afterwards."""
        self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (re-raising its exception)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            # the same class as a TimeoutError the coroutine itself raised: only a pending future timed out here
            if fut.done():
                raise
            fut.cancel()
            raise TimeoutError(f"operation did not finish within {timeout}s") from None

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def _cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(_cancel_rest(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self.loop.close()
