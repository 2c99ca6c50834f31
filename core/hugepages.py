"""Big numpy arrays on transparent huge pages (2 MiB), for random access over gigabytes.

A random row in a table of gigabytes otherwise misses the TLB on nearly every access and pays a page
walk on top of its cache miss. Linux hands out huge pages to anonymous memory only where the kernel's
transparent huge pages are on: always, or in ``madvise`` mode (a common default) for mappings advised
with ``MADV_HUGEPAGE``. :func:`huge_empty` and :func:`huge_zeros` map the memory themselves and ask,
and start the array on a 2 MiB boundary, so its rows sit on cache lines and its first and last
megabytes are huge too (``np.empty`` starts 16 bytes into its block). They return ordinary writable
numpy arrays. Pages are committed when first written, as with ``np.empty``; the last huge page of an
array may commit up to 2 MiB past its end.

Arrays under :data:`MIN_BYTES`, platforms without ``madvise`` (not Linux) and hosts with huge pages
``never`` get plain ``np.empty`` / ``np.zeros``: the same values, only the page size differs.

:func:`reserve` maps address space for an array that grows in place: the store reserves its row arrays
for a table's whole capacity, so that growing commits only the pages its new rows touch, and neither
copies the rows nor holds them twice for a moment.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import platform
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["HUGE_PAGE", "MAX_RESERVE", "MIN_BYTES", "commit_in_background", "huge_empty", "huge_zeros", "reserve",
           "thp_mode", "uses_huge_pages"]

HUGE_PAGE = 2 << 20
#: Smaller arrays stay plain numpy: a few huge pages at most, not worth a mapping of their own.
MIN_BYTES = 2 * HUGE_PAGE
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: The most address space one :func:`reserve` takes (16 TiB: an x86-64 process has 128 TiB).
MAX_RESERVE = 1 << 44
# Python's mmap module names MAP_NORESERVE only from 3.13; Linux's value on the 64-bit CPUs it runs on.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux"
                         and platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64") else 0)


# madvise's MADV_POPULATE_WRITE (Linux 5.14): commit a range's pages as writes would, changing no byte.
# Python's mmap module names it only from 3.13; an older kernel refuses it (EINVAL) and nothing happens.
_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE


@functools.cache
def _madvise() -> Any:
    """libc's madvise through ctypes, which lets go of the interpreter lock for the call; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def commit_in_background(arr: np.ndarray) -> threading.Thread | None:
    """Commit ``arr``'s memory from a thread of its own, leaving every value as it is; the thread, or None
    where nothing was started (not Linux, an array under :data:`MIN_BYTES`).

    A page fault on memory the host has taken back can cost far more than the write that takes it: 8-12
    s/GiB on some VMs against 0.1-0.2 on bare metal (``bench_first_touch.py``). The store commits here a
    new table's initial rows and each doubled index (made whole at once, filled in steps by the lookups),
    so that their faults are off the replica's event loop. The thread holds ``arr``, so its memory stays
    mapped until the call returns; a write racing the commit is safe (the kernel only maps the page, writing
    nothing)."""
    madvise = _madvise() if arr.nbytes >= MIN_BYTES else None
    if madvise is None:
        return None
    addr = arr.ctypes.data
    start = -(-addr // _PAGE) * _PAGE
    length = (addr + arr.nbytes - start) // _PAGE * _PAGE
    if length <= 0:
        return None

    # ``arr`` among the arguments keeps its mapping alive until the thread has run
    thread = threading.Thread(target=_commit, args=(madvise, start, length, arr), name="persia-commit", daemon=True)
    thread.start()
    return thread


def _commit(madvise: Any, start: int, length: int, _arr: np.ndarray) -> None:
    madvise(start, length, _MADV_POPULATE_WRITE)  # a refusal changes nothing: writes commit the pages as before


def thp_mode(path: Path = _THP_ENABLED) -> str:
    """The kernel's transparent huge page mode: ``always``, ``madvise``, ``never``, or ``""`` where
    the file is missing or unreadable (not Linux, or a kernel without them)."""
    try:
        words = path.read_text().split()
    except OSError:
        return ""
    return next((w[1:-1] for w in words if w.startswith("[") and w.endswith("]")), "")


def uses_huge_pages(nbytes: int, mode: str, can_advise: bool) -> bool:
    """Whether an array of ``nbytes`` gets its own huge-page mapping, given the kernel's mode and
    whether this platform has ``MADV_HUGEPAGE``."""
    return nbytes >= MIN_BYTES and can_advise and mode in ("always", "madvise")


def _nbytes(shape: int | tuple[int, ...], dtype: np.dtype[Any]) -> int:
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(int(d) < 0 for d in dims):
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    return int(np.prod(dims, dtype=np.int64)) * dtype.itemsize


def _mapped(shape: int | tuple[int, ...], dtype: np.dtype[Any], nbytes: int, flags: int = 0,
            huge: bool = True) -> np.ndarray:
    # One huge page more than asked, to start the array on a 2 MiB boundary: the slack is address
    # space only (never written, never committed). The array keeps the mapping alive through its base.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    if huge:
        buf.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(buf, np.uint8)
    skip = -raw.ctypes.data % HUGE_PAGE
    out: np.ndarray = raw[skip : skip + nbytes].view(dtype).reshape(shape)
    return out


def reserve(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray | None:
    """Address space for ``np.empty(shape, dtype)`` that commits memory only where it is written, or
    None where this platform cannot promise that (not Linux, an unknown ``MAP_NORESERVE``, more than
    :data:`MAX_RESERVE` bytes, or a kernel that refuses the mapping, as in strict overcommit mode).

    Unwritten pages read as zeros and cost nothing: an array reserved for its largest size and used
    from the front holds only what its used rows' pages hold. The mapping is not counted against the
    kernel's overcommit limit (``MAP_NORESERVE``), so a table's capacity may exceed the host's memory
    as long as its live rows do not. Huge pages and the 2 MiB start as :func:`huge_empty` where those
    apply."""
    dtype = np.dtype(dtype)
    nbytes = _nbytes(shape, dtype)
    if not _MAP_NORESERVE or not 0 < nbytes <= MAX_RESERVE or not hasattr(mmap, "MAP_ANONYMOUS"):
        return None
    try:
        return _mapped(shape, dtype, nbytes, _MAP_NORESERVE, huge=_wanted(nbytes))
    except OSError:
        return None


def _wanted(nbytes: int) -> bool:
    # the size first: small arrays never read the mode file
    return nbytes >= MIN_BYTES and uses_huge_pages(nbytes, thp_mode(), hasattr(mmap, "MADV_HUGEPAGE"))


def huge_empty(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """``np.empty(shape, dtype)``, on huge pages from a 2 MiB boundary where :func:`uses_huge_pages` allows."""
    dtype = np.dtype(dtype)
    nbytes = _nbytes(shape, dtype)
    return _mapped(shape, dtype, nbytes) if _wanted(nbytes) else np.empty(shape, dtype)


def huge_zeros(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """``np.zeros(shape, dtype)``, as :func:`huge_empty` (a fresh anonymous mapping reads as zeros)."""
    dtype = np.dtype(dtype)
    nbytes = _nbytes(shape, dtype)
    return _mapped(shape, dtype, nbytes) if _wanted(nbytes) else np.zeros(shape, dtype)
