"""``kill -USR1`` on a process running a LoopThread prints its pending asyncio tasks, where the entry point asked."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.procs import ROOT

SCRIPT = """
import asyncio, sys, threading, time
from persia_nats.common import taskdump
from persia_nats.common.bridge import LoopThread

taskdump.install()  # what an entry point does (run_service, python -m persia.script)

running = threading.Event()

async def waiting_for_a_reply_that_never_comes():
    running.set()
    await asyncio.Event().wait()

io = LoopThread("probe")
io.submit(waiting_for_a_reply_that_never_comes())
running.wait(10)  # submit only schedules it: the task exists once it has started on the loop's thread
print("ready", flush=True)
time.sleep(30)
"""


def _dump_after_sigusr1(proc: subprocess.Popen[str]) -> str:
    """Send SIGUSR1 once the process is ready; its stderr up to the end of the dump (read, not slept on)."""
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGUSR1)
    err = []
    for line in proc.stderr:  # a process killed by the signal closes the pipe, ending the loop
        err.append(line)
        if line.startswith("===== end of tasks"):
            break
    time.sleep(0.2)
    assert proc.poll() is None, "".join(err)  # the signal did not end the process
    return "".join(err)


def test_sigusr1_lists_every_pending_task_with_its_frames():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        err = _dump_after_sigusr1(proc)
    finally:
        proc.kill()
        proc.communicate(timeout=10)
    assert "===== asyncio tasks of pid" in err
    assert "waiting_for_a_reply_that_never_comes" in err
    assert "===== end of tasks" in err


def test_the_nn_worker_launcher_passes_sigusr1_to_its_ranks_and_lives_on(tmp_path):
    from tests.procs import launcher_cmd

    script = tmp_path / "rank.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + SCRIPT)
    proc = subprocess.Popen(launcher_cmd("nn-worker", str(script), "--nproc-per-node", "1"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        err = _dump_after_sigusr1(proc)  # the launcher forwarded it instead of dying of it
    finally:
        proc.terminate()
        proc.communicate(timeout=20)
    assert "waiting_for_a_reply_that_never_comes" in err


def test_the_library_installs_no_signal_handler():
    """Entering the training API (its LoopThread) leaves every signal to the program that imports it."""
    probe = """
import signal
from persia_nats.common.bridge import LoopThread
watched = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
before = [signal.getsignal(s) for s in watched]
io = LoopThread("probe")
print(before == [signal.getsignal(s) for s in watched])
io.close()
"""
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True", done.stdout + done.stderr
