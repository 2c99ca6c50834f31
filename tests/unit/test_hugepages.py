"""Big arrays on transparent huge pages (persia_nats.core.hugepages), and plain numpy where there are none."""

from __future__ import annotations

import ctypes
import mmap
import platform
import sys
import time

import numpy as np
import pytest
from persia_nats.common.optim_config import AdagradConfig
from persia_nats.core import hugepages
from persia_nats.core.hugepages import (
    HUGE_PAGE,
    MAX_RESERVE,
    MIN_BYTES,
    huge_empty,
    huge_zeros,
    reserve,
    thp_mode,
    uses_huge_pages,
)
from persia_nats.core.store import EmbeddingTable

BIG = (MIN_BYTES // 64 + 3, 16)  # float32 rows of 64 B: just over the threshold, and not a whole number of pages
HUGE_HERE = sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def rss_kib(addr: int) -> int:
    """Rss (KiB) of the mapping of this process that holds ``addr``."""
    return _smaps_field(addr, "Rss:")


def resident_bytes(addr: int, length: int) -> int:
    """Bytes of ``[addr, addr + length)`` (page-aligned) resident in memory, by ``mincore``."""
    pages = length // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(addr, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


def huge_kib(addr: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds ``addr``."""
    return _smaps_field(addr, "AnonHugePages:")


def _smaps_field(addr: int, field: str) -> int:
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field:
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize(("text", "mode"), [
    ("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
    ("always madvise [never]\n", "never"), ("", ""),
])
def test_thp_mode_reads_the_bracketed_word(tmp_path, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    assert thp_mode(path) == mode


def test_thp_mode_without_the_file_is_empty(tmp_path):
    assert thp_mode(tmp_path / "missing") == ""


@pytest.mark.parametrize(("nbytes", "mode", "can_advise", "want"), [
    (MIN_BYTES, "madvise", True, True), (MIN_BYTES, "always", True, True),
    (MIN_BYTES - 1, "madvise", True, False),  # small arrays stay plain numpy
    (MIN_BYTES, "never", True, False), (MIN_BYTES, "", True, False),  # huge pages off, or no such file
    (MIN_BYTES, "madvise", False, False),  # no madvise on this platform
])
def test_which_arrays_get_huge_pages(nbytes, mode, can_advise, want):
    assert uses_huge_pages(nbytes, mode, can_advise) is want


@pytest.mark.parametrize("how", ["never", "no madvise"])
def test_fallback_is_plain_numpy(monkeypatch, how):
    if how == "never":
        monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    else:
        monkeypatch.delattr(hugepages.mmap, "MADV_HUGEPAGE", raising=False)
    a, z = huge_empty(BIG, np.float32), huge_zeros(BIG, np.float32)
    for arr in (a, z):
        assert arr.base is None and arr.shape == BIG and arr.dtype == np.float32 and arr.flags.writeable
    assert not z.any()


def test_small_arrays_are_plain_numpy():
    for arr in (huge_empty(1000, np.uint64), huge_zeros((10, 3), np.float32)):
        assert arr.base is None
    assert not huge_zeros((10, 3), np.float32).any()


def test_negative_shape_is_refused_as_numpy_does():
    with pytest.raises(ValueError, match="negative"):
        huge_empty((-1, 4), np.float32)


@pytest.mark.skipif(not HUGE_HERE, reason="needs Linux with transparent huge pages (always or madvise)")
def test_big_arrays_start_on_a_huge_page_and_get_huge_pages():
    a = huge_empty(BIG, np.float32)
    z = huge_zeros(BIG, np.float32)
    for arr in (a, z):
        assert isinstance(arr.base, np.ndarray) and arr.ctypes.data % HUGE_PAGE == 0
        assert arr.shape == BIG and arr.dtype == np.float32 and arr.flags.writeable and arr.flags.c_contiguous
    assert not z.any()
    a[:] = 1.5  # committed on first write
    assert float(a.sum()) == 1.5 * a.size
    assert huge_kib(a.ctypes.data) >= HUGE_PAGE // 1024, "the kernel gave the advised mapping no huge page"


@pytest.mark.skipif(not HUGE_HERE, reason="needs Linux with transparent huge pages (always or madvise)")
def test_structured_dtype_on_huge_pages():
    slot = np.dtype([("key", np.uint64), ("row", np.int32), ("stamp", np.uint32)])
    idx = huge_zeros(MIN_BYTES // slot.itemsize + 1, slot)
    assert idx.dtype == slot and idx.ctypes.data % HUGE_PAGE == 0 and not idx["row"].any()
    idx["row"] = -1
    assert (idx["row"] == -1).all() and not idx["key"].any()


def test_table_arrays_on_huge_pages_serve_and_round_trip():
    """A table big enough for huge pages (emb, state and index each past 4 MiB) through growth, lookups,
    updates and a checkpoint round trip; memory_bytes counts the live rows and the other arrays, not the
    mapping's slack."""
    rows = MIN_BYTES // 16  # the index too (24 B a row) is past 4 MiB
    t = EmbeddingTable(16, capacity=2 * rows, optimizer=AdagradConfig(lr=0.1), initial_rows=rows)
    ids = np.arange(1, rows + 1000, dtype=np.uint64)  # past initial_rows: one growth, which rehashes
    first = t.lookup(ids, train=True)
    assert len(t) == ids.shape[0] and t._emb.shape[0] == 2 * rows
    np.testing.assert_array_equal(t.lookup(ids, train=False), first)
    assert t.update(ids[:500], np.ones((500, 16), np.float32)) == 0
    arrays = (t._emb, t._state, t._index)
    if HUGE_HERE:
        assert all(a.ctypes.data % HUGE_PAGE == 0 for a in arrays)
    live_rows = len(t) * (t._emb[0].nbytes + t._state[0].nbytes)  # the rows past them are never committed
    assert t.memory_bytes() == live_rows + sum(a.nbytes for a in (t._index, t._meta, t._cand_keys, t._cand_stamps))
    assert t.allocated_row_bytes() == t._emb.nbytes + t._state.nbytes > live_rows
    back = EmbeddingTable(16, capacity=2 * rows, optimizer=AdagradConfig(lr=0.1), initial_rows=rows)
    back.load_state_dict(t.state_dict())
    np.testing.assert_array_equal(back.lookup(ids, train=False), t.lookup(ids, train=False))


LINUX_64 = sys.platform == "linux" and sys.maxsize > 2**32


@pytest.mark.skipif(not LINUX_64, reason="address-space reservations are made on 64-bit Linux only")
def test_a_reservation_commits_only_the_pages_written():
    """64 GiB reserved on a host with less memory: the kernel accepts it (not counted against its
    overcommit limit), it reads as zeros, and only the written front is resident."""
    space = reserve((1 << 30, 16), np.float32)
    assert space is not None and space.shape == (1 << 30, 16) and space.flags.writeable
    assert space.ctypes.data % HUGE_PAGE == 0
    front = space[: 1 << 16]  # 4 MiB of rows
    assert not front.any()
    front[:] = 2.0
    assert float(front.sum()) == 2.0 * front.size
    assert rss_kib(space.ctypes.data) <= 16 << 10, "more than the written rows' pages became resident"


def test_no_reservation_past_the_limit_or_of_nothing():
    assert reserve(MAX_RESERVE // 4 + 1, np.float32) is None
    assert reserve((0, 16), np.float32) is None
    assert reserve((10, 0), np.float32) is None


@pytest.mark.skipif(not LINUX_64, reason="address-space reservations are made on 64-bit Linux only")
def test_growth_widens_the_reserved_rows_in_place():
    """A growth keeps the rows where they are: the row arrays are views of one reservation."""
    t = EmbeddingTable(8, capacity=100_000, optimizer=AdagradConfig(lr=0.1), initial_rows=16)
    ids = np.arange(1, 5001, dtype=np.uint64)
    first = t.lookup(ids[:16], train=True)
    emb_at, state_at = t._emb.ctypes.data, t._state.ctypes.data
    t.lookup(ids, train=True)  # past 16 rows: nine growths
    assert t._emb.shape[0] == 8192 and (t._emb.ctypes.data, t._state.ctypes.data) == (emb_at, state_at)
    np.testing.assert_array_equal(t.lookup(ids[:16], train=False), first)


def test_without_a_reservation_growth_copies_every_row(monkeypatch):
    """Where the platform gives no reservation (strict overcommit, an address-space limit), the rows are
    copied into each larger array, with the same values as a reserved table."""
    ids = np.random.default_rng(4).integers(0, 2**64 - 1, 3000, dtype=np.uint64)
    reserved = EmbeddingTable(3, capacity=10_000, optimizer=AdagradConfig(lr=0.1), initial_rows=2)
    expected = reserved.lookup(ids, train=True)
    reserved.update(ids[:100], np.ones((100, 3), np.float32))
    monkeypatch.setattr("persia_nats.core.store.reserve", lambda shape, dtype: None)
    t = EmbeddingTable(3, capacity=10_000, optimizer=AdagradConfig(lr=0.1), initial_rows=2)
    np.testing.assert_array_equal(t.lookup(ids, train=True), expected)
    t.update(ids[:100], np.ones((100, 3), np.float32))
    assert t._emb_space is None and t._state_space is None and t._emb.shape[0] == 4096
    np.testing.assert_array_equal(t.lookup(ids, train=False), reserved.lookup(ids, train=False))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise through libc is Linux's here")
def test_a_background_commit_maps_every_page_and_changes_no_value():
    arr = huge_empty((4 * MIN_BYTES) // 8, np.int64)
    arr[:1000] = np.arange(1000)  # written before, and while the thread commits the rest
    thread = hugepages.commit_in_background(arr)
    assert thread is not None
    arr[-1000:] = -7
    thread.join(30)
    assert not thread.is_alive()
    assert (arr[:1000] == np.arange(1000)).all() and (arr[-1000:] == -7).all()
    assert (arr[1000:-1000] == 0).all()  # committed pages of an anonymous mapping read as zeros
    # every page is resident now, not only the two ends' written ones (a kernel older than 5.14 refuses the
    # advice: there the writes commit pages as before)
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    if (major, minor) >= (5, 14):
        assert rss_kib(arr.ctypes.data) >= arr.nbytes // 1024 * 9 // 10


@pytest.mark.skipif(not LINUX_64, reason="address-space reservations are made on 64-bit Linux only")
def test_a_table_commits_its_initial_rows_up_front_and_a_growth_s_rows_as_they_fill():
    """The first ``initial_rows`` rows are made resident by a thread as the table is made, before any is
    written; the rest of the reservation, up to the capacity, stays uncommitted."""
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    if (major, minor) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14")
    rows = 1 << 17  # 8 MiB of dim-16 rows
    t = EmbeddingTable(16, capacity=1 << 24, optimizer=AdagradConfig(lr=0.1), initial_rows=rows)
    start, size = t._emb.ctypes.data, t._emb.nbytes
    deadline = time.monotonic() + 30
    while resident_bytes(start, size) < size and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resident_bytes(start, size) == size
    # past the initial rows (and the huge page the last of them ends in) nothing is committed
    assert resident_bytes(start + size + HUGE_PAGE, 64 << 20) == 0
    assert not t._emb.any()  # committed, nothing written
    ids = np.arange(1, 1001, dtype=np.uint64)
    np.testing.assert_array_equal(t.lookup(ids, train=True), t.lookup(ids, train=False))


def test_no_background_commit_of_a_small_array():
    assert hugepages.commit_in_background(np.zeros(16)) is None
