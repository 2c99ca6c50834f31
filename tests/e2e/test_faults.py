"""Kill every role in turn with SIGKILL while a published stream trains: nothing is lost.

The long form is ``benchmarks/chaos.py``; the harness is ``tests/chaos.py``.
"""

from __future__ import annotations

import uuid

import pytest

from tests.chaos import run_job


@pytest.mark.slow
def test_every_role_killed_in_turn_loses_no_batch_and_keeps_the_auc(tmp_path):
    base = run_job(tmp_path / "calm", f"calm{uuid.uuid4().hex[:8]}", kills=())
    assert base["lost"] == 0 and base["trained"] == base["published"] == 255, base
    chaos = run_job(tmp_path / "chaos", f"chaos{uuid.uuid4().hex[:8]}",
                    kills=("ps", "embedding-worker", "nn-worker", "nats-server"))
    # every published batch was trained at least once; extra trainings are counted, not hidden
    assert chaos["published"] == 255 and chaos["trained"] == 255 and chaos["lost"] == 0, chaos
    # one restart per kill; a role caught starting up by the nats-server restart may also have exited
    # and been restarted by the supervisor, as compose or Kubernetes would
    by_kill = {n: r - chaos["restarted_after_failure"].count(n) for n, r in chaos["restarts"].items()}
    assert by_kill == {"ps0": 1, "ps1": 0, "ew0": 1, "nn": 1, "loader": 0}, chaos
    gap = (chaos["auc"] - base["auc"]) / base["auc"]
    assert abs(gap) <= 0.005, (chaos["auc"], base["auc"])
    log_nn = (tmp_path / "chaos" / "nn.log").read_text()
    assert "resumed from" in log_nn  # the restarted NN worker went on from the last checkpoint
    log_ps = (tmp_path / "chaos" / "ps0.log").read_text()
    assert "loaded" in log_ps and "from checkpoint" in log_ps  # and so did the restarted PS replica
