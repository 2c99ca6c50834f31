"""Waiting on the event loop for a condition that other callbacks make true."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def wait_until(done: Callable[[], bool], changed: asyncio.Event, deadline: Callable[[], float]) -> bool:
    """Wait until ``done()``, checked again each time ``changed`` is set; False once the loop's clock
    passes ``deadline()`` (read again at each wake-up, so it may be moved meanwhile)."""
    loop = asyncio.get_running_loop()
    while not done():
        left = deadline() - loop.time()
        if left <= 0:
            return False
        changed.clear()
        try:
            await asyncio.wait_for(changed.wait(), left)
        except TimeoutError:
            pass
    return True
