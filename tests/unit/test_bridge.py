import sys
import threading
from pathlib import Path

import pytest
from persia_nats.common.bridge import LoopThread, name_os_thread

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")


def comm(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


async def _native_id() -> int:
    return threading.get_native_id()


@linux
def test_the_loop_thread_is_named_in_the_kernel_and_the_caller_is_not():
    before = comm(threading.get_native_id())
    io = LoopThread("persia-nn-3")
    try:
        tid = io.run(_native_id())
        assert tid != threading.get_native_id()
        assert comm(tid) == "persia-nn-3"
        assert comm(threading.get_native_id()) == before
    finally:
        io.close()


@linux
def test_a_long_name_keeps_its_first_15_bytes():
    names = []

    def run() -> None:
        name_os_thread("persia-a-very-long-thread-name")
        names.append(comm(threading.get_native_id()))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert names == ["persia-a-very-l"]
