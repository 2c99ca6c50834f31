"""``persia-launcher checkpoint`` on an idle job (NN ranks waiting for batches) answers at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from persia_nats.common import checkpoint as ck

from tests.chaos import ChaosJob
from tests.natsserver import start_nats_server
from tests.procs import ADULT, ROOT, launcher_cmd


def _ready(job: ChaosJob, deadline_s: float = 180) -> None:
    """Every NN rank has joined (``health nn-worker``) and so waits for batches: nothing is published."""
    deadline = time.monotonic() + deadline_s
    while subprocess.run(launcher_cmd("health", "nn-worker"), env=job.env, cwd=ROOT, capture_output=True,
                         timeout=60).returncode != 0:
        assert time.monotonic() < deadline and job.procs["nn"].proc.poll() is None, job.dump_logs()
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_checkpoint_asked_of_an_idle_job_is_taken_at_once(tmp_path, ranks):
    """One rank waits for its next batch alone; two step idle together: each takes the checkpoint there,
    at the step it is at, instead of at a next step that no batch brings."""
    server = start_nats_server()
    job = ChaosJob(server, f"idle{uuid.uuid4().hex[:8]}", tmp_path, ps=1, checkpoint_every=0)
    try:
        job.add("ps0", "embedding-parameter-server", "--replica-index", "0", "--replica-size", "1")
        job.add("ew0", "embedding-worker", "--replica-index", "0", "--replica-size", "1")
        job.add("nn", "nn-worker", str(ADULT / "train.py"), "--nproc-per-node", str(ranks))
        job.add("loader", "data-loader", "--from-stream")
        _ready(job)
        started = time.monotonic()
        asked = subprocess.run(launcher_cmd("checkpoint", "--timeout", "120"), env=job.env, cwd=ROOT,
                               capture_output=True, text=True, timeout=180)
        took = time.monotonic() - started
        assert asked.returncode == 0, asked.stderr + job.dump_logs()
        # the command's own start included; before, it waited out its whole --timeout
        assert took < 30, (took, asked.stderr)
        first = Path(asked.stdout.strip())
        # asked again with its output piped into a reader that has gone: answered, and quiet about it
        read, write = os.pipe()
        os.close(read)
        try:
            quiet = subprocess.Popen(launcher_cmd("checkpoint", "--timeout", "120"), env=job.env, cwd=ROOT,
                                     stdout=write, stderr=subprocess.PIPE, text=True)
        finally:
            os.close(write)
        _, err = quiet.communicate(timeout=180)
        assert quiet.returncode == 128 + signal.SIGPIPE and err == "", err
        nn_log = job.log("nn")
    finally:
        job.stop_all()
        server.stop()
    assert ck.verify(first) == [] and first.parent == tmp_path / "checkpoints"
    assert json.loads((first / "state.json").read_text())["step"] == 0  # nothing trained: step 0's state
    assert len(ck.list_checkpoints(tmp_path / "checkpoints")) == 2
    assert nn_log.count("taking the checkpoint asked for while waiting for batches") == 2 * ranks, nn_log[-3000:]
