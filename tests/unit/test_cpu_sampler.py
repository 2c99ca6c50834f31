"""bench_e2e's CPU accounting: a process tree's CPU split by thread kind adds up and never goes back, and its
system time is a share of it."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "e2e"))

from cpu import CpuSampler  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# when told to, burns a fixed amount of CPU (not of wall time) in a named thread and in the main thread,
# says so, then waits to be told to exit: the sampler reads it alive
CHILD = """
import sys, threading, time
from persia_nats.common.bridge import name_os_thread
sys.stdin.readline()

def burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass

def worker():
    name_os_thread("burner")
    burn(0.4)

t = threading.Thread(target=worker)
t.start()
t.join()
burn(0.2)
print("done", flush=True)
sys.stdin.readline()
"""


def test_a_tree_splits_by_thread_kind_and_an_ended_thread_keeps_its_time():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with CpuSampler({"job": child.pid}, interval=0.02, threads_of=("job",)) as sampler:
            while len(sampler.times) < 2:
                time.sleep(0.01)
            start = sampler.times[-1]  # before the child burns anything, however slowly it started
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "done"
            time.sleep(0.1)  # samples after the burner thread ended
            end = sampler.times[-2]
        spent = sampler.between(start, end)
    finally:
        child.communicate("\n", timeout=30)
    tick = 0.02  # the kernel counts CPU in clock ticks
    # a sample that falls between the burner thread's start and its naming itself counts a tick or two as
    # unnamed (seen on a loaded machine): the same thread's time, under the kind it had then
    unnamed = spent.pop("job/unnamed", 0.0)
    assert unnamed <= 2 * tick, spent
    spent["job/burner"] += unnamed
    assert spent["job/burner"] == pytest.approx(0.4, abs=0.1)  # it ended before `end`: its time is held
    assert spent["job/main"] >= 0.2 - tick
    assert set(spent) == {"job", "job:sys", "job/burner", "job/main"}
    assert 0.0 <= spent["job:sys"] <= spent["job"] + tick  # the kernel's share of the same time
    # the kinds are the threads of the one process: together they are the process's time
    assert spent["job/burner"] + spent["job/main"] == pytest.approx(spent["job"], abs=3 * tick)
