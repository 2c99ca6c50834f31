"""glibc's allocator, set for processes that make and drop a batch's megabytes many times a second.

By default glibc gives an allocation of 128 KiB or more (a threshold it raises, up to 32 MiB, as such
blocks are freed) its own fresh pages from the kernel, and hands free memory at the top of its heap
back once more than twice that threshold has gathered there. Every role here builds multi-megabyte
buffers per batch and drops them milliseconds later: message payloads and the NATS client's copies of
them, msgpack output, numpy temporaries. Each new buffer then takes a page fault for every 4 KiB it
touches: publishing one 1.5 MB message took 700 faults and 1.45 ms of CPU, against none and 0.41 ms
with the settings below (``benchmarks/bench_publish.py``), which keep such buffers in the heap and the
freed memory for the next batch. The cost is memory: up to :data:`TRIM_THRESHOLD` of free heap stays
with the process (per glibc arena: the main thread's and one per thread that allocates).

``PERSIA_MALLOC=default`` leaves glibc's own behaviour (``tuned``, or unset, applies these), as does
any ``glibc.malloc`` setting in ``GLIBC_TUNABLES`` (the user's own choice wins). Elsewhere than glibc
nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

from persia_nats.common.errors import ConfigError

log = logging.getLogger(__name__)

#: blocks below this come from the heap and are reused; above it each gets its own pages (glibc's
#: largest allowed value on 64-bit Linux)
MMAP_THRESHOLD = 32 << 20
#: free memory at the top of the heap kept for reuse before glibc hands it back
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def tune_malloc() -> bool:
    """Apply the settings above to this process; True if they took effect.

    Raises:
        ConfigError: ``PERSIA_MALLOC`` is neither ``tuned`` nor ``default``.
    """
    choice = os.environ.get("PERSIA_MALLOC", "").strip().lower() or "tuned"
    if choice not in ("tuned", "default"):
        raise ConfigError(f"PERSIA_MALLOC={os.environ['PERSIA_MALLOC']!r}: expected 'tuned' or 'default'")
    if choice == "default":
        return False
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        gnu = libc.gnu_get_libc_version  # glibc only: musl's mallopt accepts and ignores everything
    except (OSError, AttributeError):
        return False
    gnu.restype = ctypes.c_char_p
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    log.debug("glibc %s malloc: mmap threshold %d MiB, trim threshold %d MiB: %s", gnu().decode(),
              MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20, "set" if ok else "refused")
    return ok


__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_malloc"]
