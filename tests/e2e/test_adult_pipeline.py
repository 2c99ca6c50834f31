"""All roles as separate processes over a real nats-server, trained on the real adult data."""

from __future__ import annotations

import pytest

from tests.procs import ADULT, Job, job_env


def run_adult(nats_url: str, job_name: str, tmp_path, staleness: int, ps: int = 2, workers: int = 2) -> tuple:
    job = Job(job_env(nats_url, job_name, EMBEDDING_STALENESS=str(staleness)), tmp_path)
    try:
        for i in range(ps):
            job.start(f"ps{i}", "embedding-parameter-server", "--replica-index", str(i), "--replica-size", str(ps))
        for i in range(workers):
            job.start(f"ew{i}", "embedding-worker", "--replica-index", str(i), "--replica-size", str(workers))
        job.start("nn", "nn-worker", str(ADULT / "train.py"))
        job.start("loader", "data-loader", str(ADULT / "data_loader.py"))
        code = job.wait("nn", timeout=300)
        assert code == 0, job.dump_logs()
        assert job.wait("loader", timeout=30) == 0, job.dump_logs()
        result = job.json_result("nn")
    finally:
        codes = job.stop_all()
    return result, codes, job


@pytest.mark.parametrize("staleness", [1, 10])
def test_adult_trains_to_persia_auc_through_every_role(nats_server, job_name, tmp_path, staleness):
    result, codes, job = run_adult(nats_server.url, job_name, tmp_path, staleness)
    assert result["train_samples"] == 32561
    assert result["test_samples"] == 16281
    assert result["loss_last"] < result["loss_first"] * 0.85, result
    assert result["test_auc"] >= 0.89, result
    assert 1 <= result["max_staleness"] <= staleness, result
    assert result["counters"].get("grads_applied") == result["steps"], result
    assert not result["counters"].get("grad_failures") and not result["counters"].get("lookup_failures"), result
    # services drain and exit 0 on SIGTERM
    assert all(code == 0 for name, code in codes.items()), (codes, job.dump_logs())
