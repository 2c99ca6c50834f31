"""Checkpoints of a live job: on demand and by time; a restarted job resumes from them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from persia_nats.common import checkpoint as ck

from tests.chaos import ChaosJob, Publisher
from tests.natsserver import start_nats_server
from tests.procs import launcher_cmd


@pytest.mark.slow
def test_on_demand_and_timed_checkpoints_of_a_training_job(tmp_path):
    server = start_nats_server()
    job = ChaosJob(server, f"ckpt{uuid.uuid4().hex[:8]}", tmp_path, ps=2, checkpoint_every=0, checkpoint_every_sec=2.0)
    publisher = Publisher(server.url, job.job, rate=15.0)
    try:
        job.start_roles()
        threading.Thread(target=lambda: asyncio.run(publisher.run()), daemon=True).start()
        root = tmp_path / "checkpoints"
        deadline = time.monotonic() + 120
        while not ck.list_checkpoints(root):  # nobody asked yet: this one is taken because 2 s went by
            assert time.monotonic() < deadline and job.procs["nn"].proc.poll() is None, job.dump_logs()
            time.sleep(0.1)
        timed = ck.list_checkpoints(root)[0]
        asked = subprocess.run(launcher_cmd("checkpoint", "--timeout", "60"), env=job.env, capture_output=True,
                               text=True, timeout=120)
        assert asked.returncode == 0, asked.stderr + job.dump_logs()
        on_demand = asked.stdout.strip()
        assert job.wait("nn", 300) == 0, job.dump_logs()
    finally:
        job.stop_all()
        server.stop()
    # on demand: answered with a newer checkpoint than the timed one (pruning may have removed it since)
    assert ck.checkpoint_number(Path(on_demand).name)[0] > ck.checkpoint_number(timed.name)[0]
    names = [p.name for p in ck.list_checkpoints(root)]
    assert 1 <= len(names) <= 3, names  # pruned to `keep`
    state = json.loads((ck.list_checkpoints(root)[0] / "state.json").read_text())
    assert state["ps_replicas"] == 2 and state["sync_mode"] == "hybrid" and state["stream"]["stream"]
    for ckpt in ck.list_checkpoints(root):
        assert ck.verify(ckpt) == []
        files = ck.read_manifest(ckpt)["files"]
        assert {"dense/model.pt", "dense/optimizer.pt", "state.json"} <= set(files)
        assert any(f.startswith("ps/replica-0-of-2/") for f in files)
        assert any(f.startswith("ps/replica-1-of-2/") for f in files)
    steps = [json.loads((c / "state.json").read_text())["step"] for c in ck.list_checkpoints(root)]
    assert steps == sorted(steps, reverse=True) and steps[-1] > 0
