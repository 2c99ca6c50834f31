"""The synthetic Criteo-like example, end to end: every role a real process over a real nats-server."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from tests.procs import ROOT, Job, job_env

SYNTHETIC = ROOT / "examples" / "synthetic"
TRAIN_BATCHES, BATCH_SIZE, TEST_SAMPLES = 100, 512, 8192


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"synthetic_{name}", SYNTHETIC / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sd():
    return _load("synthetic_data")


@pytest.fixture(scope="module")
def metrics():
    spec = importlib.util.spec_from_file_location("adult_metrics_for_synthetic", ROOT / "examples" / "adult-income"
                                                  / "metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stream_is_deterministic_and_learnable_but_not_trivial(sd, metrics):
    a = sd.make_batch_arrays(7, 256, seed=3)
    b = sd.make_batch_arrays(7, 256, seed=3)
    c = sd.make_batch_arrays(8, 256, seed=3)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])
    ids, dense, labels = (np.concatenate(p) for p in zip(*sd.test_batches(TEST_SAMPLES), strict=True))
    assert ids.dtype == np.uint64 and ids.shape == (TEST_SAMPLES, sd.N_SLOTS) and int(ids.max()) < sd.VOCAB
    assert dense.dtype == np.float32 and dense.shape == (TEST_SAMPLES, sd.N_DENSE)
    assert 0.2 < labels.mean() < 0.45
    bayes = metrics.auc(labels, sd.bayes_probs(ids, dense))
    assert 0.75 < bayes < 0.9, bayes
    # Zipf: the most frequent id of a slot covers several % of the rows, and most ids are rare
    counts = np.bincount(ids[:, 0].astype(np.int64))
    assert counts.max() > 0.04 * TEST_SAMPLES and (counts[counts > 0] == 1).mean() > 0.5


@pytest.mark.slow
def test_synthetic_example_trains_through_every_role(nats_server, job_name, tmp_path, sd, metrics):
    env = job_env(nats_server.url, job_name,
                  PERSIA_GLOBAL_CONFIG=str(SYNTHETIC / "config" / "global_config.yml"),
                  PERSIA_EMBEDDING_CONFIG=str(SYNTHETIC / "config" / "embedding_config.yml"),
                  SEED="1", TRAIN_BATCHES=str(TRAIN_BATCHES), BATCH_SIZE=str(BATCH_SIZE),
                  TEST_SAMPLES=str(TEST_SAMPLES), CURVE_SAMPLES="2048", CURVE_POINTS="2")
    env.pop("EMBEDDING_STALENESS", None)
    env.pop("EMBEDDING_LR", None)
    job = Job(env, tmp_path)
    try:
        job.start("ps0", "embedding-parameter-server")
        job.start("ew0", "embedding-worker")
        job.start("nn", "nn-worker", str(SYNTHETIC / "train.py"))
        job.start("loader", "data-loader", str(SYNTHETIC / "data_loader.py"))
        assert job.wait("nn", timeout=120) == 0, job.dump_logs()
        assert job.wait("loader", timeout=30) == 0, job.dump_logs()
        result = job.json_result("nn")
    finally:
        codes = job.stop_all()
    assert all(code == 0 for code in codes.values()), (codes, job.dump_logs())
    assert result["train_samples"] == TRAIN_BATCHES * BATCH_SIZE and result["steps"] == TRAIN_BATCHES
    assert result["test_samples"] == TEST_SAMPLES
    assert result["counters"].get("grads_applied") == result["steps"], result
    assert not result["counters"].get("grad_failures") and not result["counters"].get("lookup_failures"), result
    # it learns: the training loss falls and the held-out AUC is clearly above chance ...
    assert result["loss_last"] < result["loss_first"] - 0.01, result
    assert result["test_auc"] > 0.6, result
    # ... but a short run stays below what the hidden ground truth allows (no label leak)
    ids, dense, labels = (np.concatenate(p) for p in zip(*sd.test_batches(TEST_SAMPLES), strict=True))
    assert result["test_auc"] < metrics.auc(labels, sd.bayes_probs(ids, dense)), result
    # the AUC curve: before training, during it, and at the end, on growing sample counts
    curve = result["auc_curve"]
    assert [p[0] for p in curve] == sorted(p[0] for p in curve) and curve[0][0] == 0, curve
    assert curve[-1][0] == TRAIN_BATCHES * BATCH_SIZE and len(curve) >= 3, curve
    assert curve[-1][1] > curve[0][1] + 0.05, curve
