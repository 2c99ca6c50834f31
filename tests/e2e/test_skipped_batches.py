"""A training loop that leaves batches out (no backward: a non-finite loss it drops, say) neither hangs
the job nor leaks: every skipped batch gives back its staleness permit and its slot at the embedding
worker, and the NN ranks keep their collectives paired, ending on the same dense weights. Before
TrainCtx handled it, a rank that skipped more batches than its staleness bound waited forever, and two
ranks skipping different steps paired one rank's all-reduce with the other's barrier."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.procs import ADULT, Job, job_env, logged_figure, write_global_config

NN = Path(__file__).resolve().parent / "skipping_nn.py"


@pytest.mark.parametrize("mode, bound, nproc", [("sync", 1, 2), ("hybrid", 2, 2), ("hybrid", 2, 1)])
@pytest.mark.slow
def test_skipped_batches_neither_hang_nor_leak(nats_server, job_name, tmp_path, mode, bound, nproc):
    cfg = write_global_config(tmp_path / "global.yml", sync_mode=mode, embedding_staleness=bound)
    job = Job(job_env(nats_server.url, job_name, PERSIA_GLOBAL_CONFIG=str(cfg)), tmp_path)
    try:
        job.start_roles(NN, ADULT / "data_loader.py", nproc=nproc)
        assert job.wait("nn", timeout=240) == 0, job.dump_logs()
        lines = job.json_results("nn")
    finally:
        codes = job.stop_all()
    assert all(code == 0 for code in codes.values()), (codes, job.dump_logs())
    by_rank = {r["rank"]: r for r in lines}
    assert set(by_rank) == set(range(nproc)), lines
    assert sum(r["steps"] + r["skipped"] for r in lines) == 255  # every batch taken, trained or skipped
    assert len({r["dense_sha256"] for r in lines}) == 1
    for r in lines:
        c = r["counters"]
        assert r["skipped"] > bound and c["batches_skipped"] == r["skipped"], r
        # a skipped batch's empty push is applied like any other: nothing failed, nothing held
        assert c["grads_applied"] == r["steps"] + r["skipped"] and not c.get("grad_failures"), r
    assert logged_figure(job.log("ew0"), "stopped", "grads_applied") == 255
