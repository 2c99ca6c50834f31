"""All roles as separate processes over a real nats-server, trained on the real adult data."""

from __future__ import annotations

import json
import os

import pytest

from tests.procs import ADULT, Job, job_env, logged_figure, write_global_config


def run_adult(nats_url: str, job_name: str, tmp_path, staleness: int, ps: int = 2, workers: int = 2,
              sparse_policy: str | None = None) -> tuple:
    job = Job(job_env(nats_url, job_name, EMBEDDING_STALENESS=str(staleness)), tmp_path)
    try:
        job.start_roles(ADULT / "train.py", ADULT / "data_loader.py", ps=ps, workers=workers,
                        sparse_env=None if sparse_policy is None else {"PERSIA_CPU_POLICY": sparse_policy})
        code = job.wait("nn", timeout=300)
        assert code == 0, job.dump_logs()
        assert job.wait("loader", timeout=30) == 0, job.dump_logs()
        result = job.json_result("nn")
        if sparse_policy is not None:  # the services still run: every thread of theirs took the policy
            policy = {"idle": os.SCHED_IDLE, "batch": os.SCHED_BATCH}[sparse_policy]
            for name in [f"ps{i}" for i in range(ps)] + [f"ew{i}" for i in range(workers)]:
                pid = job.procs[name].pid
                assert {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")} == {policy}, name
    finally:
        codes = job.stop_all()
    return result, codes, job


# staleness 10 as the Procfile's job runs it: its sparse roles idle on the cores they share
@pytest.mark.parametrize(("staleness", "sparse_policy"), [(1, None), (10, "idle")])
@pytest.mark.slow
def test_adult_trains_to_persia_auc_through_every_role(nats_server, job_name, tmp_path, staleness, sparse_policy):
    result, codes, job = run_adult(nats_server.url, job_name, tmp_path, staleness, sparse_policy=sparse_policy)
    assert result["train_samples"] == 32561
    assert result["test_samples"] == 16281
    assert result["loss_last"] < result["loss_first"] * 0.85, result
    assert result["test_auc"] >= 0.89, result
    assert 1 <= result["max_staleness"] <= staleness, result
    assert result["counters"].get("grads_applied") == result["steps"], result
    assert not result["counters"].get("grad_failures") and not result["counters"].get("lookup_failures"), result
    # services drain and exit 0 on SIGTERM
    assert all(code == 0 for name, code in codes.items()), (codes, job.dump_logs())
    # the workers' own count of looked-up-but-unapplied batches respects the bound too
    for ew in ("ew0", "ew1"):
        assert logged_figure(job.log(ew), "stopped", "max_staleness") <= staleness


def run_ranks(nats_url: str, job_name: str, tmp_path, nproc: int, ps: int = 1, **env: str) -> tuple:
    """Adult with ``nproc`` NN ranks and ``ps`` PS replicas, ``env`` added to the job's environment: (each
    rank's JSON result, exit codes, the job)."""
    job = Job(job_env(nats_url, job_name, **env), tmp_path)
    try:
        job.start_roles(ADULT / "train.py", ADULT / "data_loader.py", ps=ps, nproc=nproc)
        assert job.wait("nn", timeout=300) == 0, job.dump_logs()
        lines = [json.loads(x) for x in job.log("nn").splitlines() if x.startswith("{")]
    finally:
        codes = job.stop_all()
    return lines, codes, job


@pytest.mark.slow
def test_two_nn_workers_train_one_model_with_identical_dense_weights(nats_server, job_name, tmp_path):
    lines, _, _ = run_ranks(nats_server.url, job_name, tmp_path, 2, ps=2, EMBEDDING_STALENESS="4")
    by_rank = {r["rank"]: r for r in lines}
    assert set(by_rank) == {0, 1}, lines
    # the loader alternates batches between ranks: 255 batches, 128 + 127, none dropped
    assert by_rank[0]["steps"] + by_rank[1]["steps"] == 255
    assert by_rank[0]["train_samples"] + by_rank[1]["train_samples"] == 32561
    assert by_rank[0]["dense_sha256"] == by_rank[1]["dense_sha256"]
    assert by_rank[0]["test_auc"] >= 0.885, by_rank[0]
    for r in lines:
        assert r["max_staleness"] <= 4
        assert r["counters"]["grads_applied"] == r["steps"]


def run_two_ranks(nats_url: str, job_name: str, tmp_path, global_config) -> tuple:
    """Adult with 2 NN ranks under ``global_config``: (each rank's JSON result, exit codes, the job)."""
    return run_ranks(nats_url, job_name, tmp_path, 2, PERSIA_GLOBAL_CONFIG=str(global_config))


@pytest.mark.parametrize("mode, bound", [("sync", 1), ("hybrid", 3), ("async", None)])
@pytest.mark.slow
def test_sync_modes_with_two_nn_workers(nats_server, job_name, tmp_path, mode, bound):
    """The staleness bound holds at the embedding worker: lookups minus applied <= k x world size."""
    cfg = write_global_config(tmp_path / "global.yml", sync_mode=mode, embedding_staleness=bound or 10)
    lines, codes, job = run_two_ranks(nats_server.url, job_name, tmp_path, cfg)
    assert codes["ew0"] == 0
    max_seen = logged_figure(job.log("ew0"), "stopped", "max_staleness")
    if bound is not None:
        assert 1 <= max_seen <= bound * 2, max_seen
    assert sum(r["steps"] for r in lines) == 255
    auc = next(r["test_auc"] for r in lines if r["rank"] == 0)
    assert auc >= 0.885, lines


@pytest.mark.parametrize("mode, bound, gather", [("hybrid", 16, "auto"), ("sync", 1, "auto"), ("hybrid", 16, "device")])
@pytest.mark.slow
def test_hot_rows_with_two_nn_workers(nats_server, job_name, tmp_path, mode, bound, gather):
    """Hot rows through every role: published by the PS, announced between the ranks, added when a batch
    trains; and not asked for at all in sync mode, whose lookups already read every applied update.
    ``device``: the gathered widths built by a gather in the model's graph (here on the CPU), their hot rows
    merged into their distinct rows first."""
    cfg = write_global_config(tmp_path / "global.yml", {"hot_row_min_count": 4}, sync_mode=mode,
                              embedding_staleness=bound, embedding_gather=gather)
    lines, codes, job = run_two_ranks(nats_server.url, job_name, tmp_path, cfg)
    assert all(code == 0 for code in codes.values()), (codes, job.dump_logs())
    by_rank = {r["rank"]: r for r in lines}
    assert sum(r["steps"] for r in lines) == 255 and by_rank[0]["dense_sha256"] == by_rank[1]["dense_sha256"]
    assert by_rank[0]["test_auc"] >= 0.885, by_rank[0]
    published = logged_figure(job.log("ps0"), "stopped", "rows_published")
    # a worker's counters are logged once they count something
    hot_rows = logged_figure(job.log("ew0"), "stopped", "hot_rows") if "hot_rows=" in job.log("ew0") else 0
    for r in lines:
        c = r["counters"]
        assert c["grads_applied"] == r["steps"] and not c.get("grad_failures") and not c.get("hot_grads_failed"), c
        if mode == "sync":
            assert not c.get("hot_batches") and not c.get("hot_grads") and not c.get("hot_publications"), c
        else:
            # every batch of adult reads some row 4 times or more; each was trained with the newest copies,
            # corrected by gradients still in flight from both ranks
            assert c["hot_batches"] == r["steps"] and c["hot_rows_fresher"] > 0 and c["hot_row_corrections"] > 0, c
            assert c["hot_grads"] >= r["steps"] and c["hot_publications"] > 0, c
    assert (published == 0 and hot_rows == 0) if mode == "sync" else (published > 0 and hot_rows > 0)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA (the NCCL and GPU path)")
@pytest.mark.parametrize("mixed_precision", ["1", "0"])
@pytest.mark.slow
def test_adult_on_gpu(nats_server, job_name, tmp_path, mixed_precision):
    """Every rank on a GPU of its own (two ranks all-reducing with NCCL where there are two GPUs; NCCL refuses
    two ranks on one), float16 autocast or float32, to the CPU run's accuracy."""
    import torch

    nproc = min(2, torch.cuda.device_count())
    lines, _, _ = run_ranks(nats_server.url, job_name, tmp_path, nproc, EMBEDDING_STALENESS="4",
                            MIXED_PRECISION=mixed_precision)
    assert sorted(r["device"] for r in lines) == [f"cuda:{i}" for i in range(nproc)], lines
    assert all(r["mixed_precision"] == (mixed_precision == "1") for r in lines), lines
    assert sum(r["steps"] for r in lines) == 255 and len({r["dense_sha256"] for r in lines}) == 1, lines
    assert all(r["backend"] == ("nccl" if nproc > 1 else None) for r in lines), lines
    assert next(r["test_auc"] for r in lines if r["rank"] == 0) >= 0.885, lines


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA (ranks sharing a GPU)")
@pytest.mark.slow
def test_adult_with_more_ranks_than_gpus_sharing_them(nats_server, job_name, tmp_path):
    """One rank more than the host has GPUs, with PERSIA_SHARE_GPUS=1: the ranks share the GPUs round robin and
    all-reduce with gloo (NCCL refuses two ranks on one GPU), to the same weights on every rank and the CPU
    run's accuracy."""
    import torch

    gpus = torch.cuda.device_count()
    nproc = gpus + 1
    lines, _, _ = run_ranks(nats_server.url, job_name, tmp_path, nproc, EMBEDDING_STALENESS="4",
                            PERSIA_SHARE_GPUS="1")
    assert sorted(r["device"] for r in lines) == sorted(f"cuda:{r % gpus}" for r in range(nproc)), lines
    assert all(r["backend"] == "gloo" for r in lines), lines
    assert sum(r["steps"] for r in lines) == 255 and len({r["dense_sha256"] for r in lines}) == 1, lines
    assert next(r["test_auc"] for r in lines if r["rank"] == 0) >= 0.885, lines
