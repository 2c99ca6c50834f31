"""A bad batch never stops a job: the adult training split on the ingestion stream with 200 batches that do
not fit the job's schema and 20 that make the model raise mixed in, against the clean stream.

The bad ones are every kind a client can get wrong (a slot missing, a slot unknown, the dense feature 4 wide
or float64, labels 2 wide, ``requires_grad: false``); some good batches list their slots in reverse order,
and some are published twice with the same ``Nats-Msg-Id``. The job must end normally with every bad batch
dead-lettered with its reason, every good one trained once, and the clean stream's test AUC (within 0.2%).

Both jobs train in sync mode: in hybrid mode two runs of the same clean stream differ by up to 0.3% in test
AUC (staleness decides which updates a lookup sees), which would hide what the bad batches did; in sync mode
three pairs of runs differed by 0.003-0.032%.
"""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys
from collections import Counter

import msgpack
import nats
import pytest
import yaml
from nats.js.errors import NotFoundError

from tests.e2e.test_stream_ingestion import PUBLISHER, _dead_letters, _stream_state, start_stream_job
from tests.procs import ADULT, Job, job_env

NN = ADULT.parents[1] / "tests" / "e2e" / "raising_nn.py"
MARK = 12345.0  # raising_nn.MARK
N_BAD, N_RAISING, MAX_DELIVERIES = 200, 20, 2


def _array(dtype: str, shape: list[int], itemsize: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data": bytes(itemsize * shape[0] * shape[1])}


def bad_kinds(good: dict) -> list[tuple[dict, str]]:
    """(batch, what its dead-letter reason says) for each kind of schema violation."""
    n = good["labels"][0]["data"]["shape"][0]
    features = good["features"]
    return [
        (dict(good, features=features[1:]), "features: slot 'workclass' is missing"),
        (dict(good, features=[*features, dict(features[0], name="no_such_slot")]), "unknown slot 'no_such_slot'"),
        (dict(good, non_id=[{"name": "continuous", "data": _array("<f4", [n, 4], 4)}]), "non_id(continuous): <f4 [4]"),
        (dict(good, non_id=[{"name": "continuous", "data": _array("<f8", [n, 5], 8)}]), "non_id(continuous): <f8 [5]"),
        (dict(good, labels=[{"name": "income", "data": _array("<f4", [n, 2], 4)}]), "labels(income): <f4 [2]"),
        (dict(good, requires_grad=False), "requires_grad: false"),
    ]


def marked(good: dict) -> dict:
    """A copy of ``good`` whose first dense value is MARK: the model raises on it."""
    dense = good["non_id"][0]
    data = struct.pack("<f", MARK) + bytes(dense["data"]["data"])[4:]
    return dict(good, non_id=[dict(dense, data=dict(dense["data"], data=data))])


def good_batches() -> list[dict]:
    """The batches publish_stream.py publishes with its defaults, in its order."""
    sys.path.insert(0, str(PUBLISHER.parent))
    import publish_stream as ps

    rows = ps.read_rows(ADULT / "data" / "adult.data")
    samples = ps.encode(rows, *ps.train_encoding(rows))
    import random

    random.Random(0).shuffle(samples)
    return [ps.batch_message(samples[i:i + 128]) for i in range(0, len(samples), 128)]


async def wait_for_stream(js, name: str, patience: float = 60.0) -> None:
    """The job's stream loader creates the stream on start-up (1.5-3 s, more on a loaded host); a publish
    before that has no stream to land in, and the bare publishes below do not retry as a client should."""
    loop = asyncio.get_running_loop()
    end = loop.time() + patience
    while True:
        try:
            await js.stream_info(name)
            return
        except NotFoundError:
            if loop.time() > end:
                raise
            await asyncio.sleep(0.1)


async def publish_mixed(url: str, job: str, n_good: int | None = None, n_bad: int = N_BAD,
                        n_raising: int = N_RAISING) -> dict[str, object]:
    """The good batches (the first ``n_good``) with the bad ones spread between them; returns what was published."""
    goods = good_batches()[:n_good]
    after: dict[int, list[tuple[dict, str]]] = {}
    for k in range(n_bad):
        batch, reason = bad_kinds(goods[k % len(goods)])[k % 6]
        after.setdefault(1 + k * (len(goods) - 2) // n_bad, []).append((batch, reason))
    for k in range(n_raising):
        after.setdefault(2 + k * (len(goods) - 3) // n_raising, []).append((marked(goods[k]), "a marked batch"))
    nc = await nats.connect(url)
    js = nc.jetstream()
    await wait_for_stream(js, f"PERSIA_{job}")
    subject, expected, duplicates = f"persia.{job}.batches", Counter(), 0
    for i, good in enumerate(goods):
        if i % 3 == 1:  # names, not positions: the slots in reverse order train the same
            good = dict(good, features=list(reversed(good["features"])))
        payload = msgpack.packb(good, use_bin_type=True)
        await js.publish(subject, payload, headers={"Nats-Msg-Id": f"good-{i}"})
        if i % 10 == 0:  # a resend after a lost ack: the stream keeps one copy
            duplicates += (await js.publish(subject, payload, headers={"Nats-Msg-Id": f"good-{i}"})).duplicate
        for batch, reason in after.get(i, []):
            await js.publish(subject, msgpack.packb(batch, use_bin_type=True))
            expected[reason] += 1
    await js.publish(f"persia.{job}.stream_end", msgpack.packb({"v": 1, "end": True}))
    await nc.drain()
    return {"goods": len(goods), "expected": expected, "duplicates": duplicates}


def run_job(job: Job, publish, nn_script=ADULT / "train.py", nproc: int = 1) -> tuple[dict, dict]:
    try:
        start_stream_job(job, nn_script, nproc)
        published = publish()
        assert job.wait("nn", timeout=600) == 0, job.dump_logs()
        assert job.wait("loader", timeout=60) == 0, job.dump_logs()
        result = job.json_result("nn") if nproc == 1 else job.json_results("nn", '{"train_samples"')
    finally:
        codes = job.stop_all()
    assert all(code == 0 for code in codes.values()), (codes, job.dump_logs())  # no role crashed
    return result, published


def global_config(tmp_path, max_deliveries: int, **nn_worker_config: object) -> str:
    cfg = yaml.safe_load((ADULT / "config" / "global_config.yml").read_text())
    cfg.setdefault("data_loader_config", {})["max_deliveries"] = max_deliveries
    cfg.setdefault("nn_worker_config", {}).update(nn_worker_config)
    (tmp_path / "global.yml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "global.yml")


@pytest.mark.slow
def test_bad_batches_are_dead_lettered_and_the_job_trains_as_on_the_clean_stream(nats_server, job_name, tmp_path):
    cfg = global_config(tmp_path, MAX_DELIVERIES, sync_mode="sync", embedding_staleness=1)
    (tmp_path / "bad").mkdir()
    (tmp_path / "clean").mkdir()
    clean_job = f"{job_name}-clean"
    bad = Job(job_env(nats_server.url, job_name, PERSIA_GLOBAL_CONFIG=cfg), tmp_path / "bad")
    clean = Job(job_env(nats_server.url, clean_job, PERSIA_GLOBAL_CONFIG=cfg), tmp_path / "clean")

    def publish_clean() -> None:
        pub = subprocess.run([sys.executable, str(PUBLISHER), "--nats-url", nats_server.url, "--job", clean_job],
                             capture_output=True, text=True, timeout=300)
        assert pub.returncode == 0, pub.stderr

    clean_result, _ = run_job(clean, publish_clean)
    result, published = run_job(bad, lambda: asyncio.run(publish_mixed(nats_server.url, job_name)), NN)
    state = asyncio.run(_stream_state(nats_server.url, job_name))
    dead = asyncio.run(_dead_letters(nats_server.url, job_name, N_BAD + N_RAISING))
    c = result["counters"]
    # every good batch trained once: the duplicates never entered the stream, the bad ones never trained
    assert published["duplicates"] == 26, published
    assert c["stream_acked"] == published["goods"] == 255 and not c.get("stream_redelivered_trained"), c
    assert c["batches_failed"] == N_RAISING * MAX_DELIVERIES and c["stream_dead_lettered"] == N_RAISING, c
    assert state["stream_msgs"] == 0 and state["ack_pending"] == 0, state
    assert state["dead"] == N_BAD + N_RAISING, state
    reasons = [reason for _, reason in dead]
    for needle, count in published["expected"].items():
        assert sum(needle in r for r in reasons) == count, (needle, count, reasons[:10])
    raised = [r for r in reasons if "a marked batch" in r]
    summary = f"training step failed {MAX_DELIVERIES} time(s): forward raised ValueError"
    assert all(r.startswith(summary) for r in raised), raised
    assert "schema_refused=200" in bad.log("loader"), bad.log("loader")[-2000:]
    gap = abs(result["test_auc"] - clean_result["test_auc"]) / clean_result["test_auc"]
    print(f"\nbad-batch stream: test AUC {result['test_auc']:.4f} vs clean {clean_result['test_auc']:.4f} "
          f"(gap {gap:.3%}); dead-lettered {state['dead']}; good batches trained {c['stream_acked']}")
    assert gap <= 0.002, (result["test_auc"], clean_result["test_auc"])


@pytest.mark.slow
def test_a_rank_whose_batch_raised_still_steps_with_the_others(nats_server, job_name, tmp_path):
    """Two NN ranks: each skips the batches its model raised on and joins the step's all-reduce empty-handed,
    so both end on the same dense weights; a batch that fails once (max_deliveries 1) is dead-lettered."""
    job = Job(job_env(nats_server.url, job_name, PERSIA_GLOBAL_CONFIG=global_config(tmp_path, 1)), tmp_path)
    ranks, published = run_job(job, lambda: asyncio.run(publish_mixed(nats_server.url, job_name, 40, 0, 6)), NN, 2)
    state = asyncio.run(_stream_state(nats_server.url, job_name))
    assert sorted(r["rank"] for r in ranks) == [0, 1], ranks
    assert len({r["dense_sha256"] for r in ranks}) == 1, ranks
    counters = [r["counters"] for r in ranks]
    assert sum(c["stream_acked"] for c in counters) == published["goods"] == 40, counters
    assert sum(c.get("batches_failed", 0) for c in counters) == 6, counters
    assert sum(c.get("stream_dead_lettered", 0) for c in counters) == 6, counters
    assert state["dead"] == 6 and state["stream_msgs"] == 0, state
