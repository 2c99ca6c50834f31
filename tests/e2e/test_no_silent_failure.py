"""No silent failure (issue 37): what a client publishes never decides the job's schema.

The poisoned-first-batch stream: a batch whose dense block is 4 wide (the model takes 5) is published
before the adult training split, on a job whose configuration leaves the schema open. The model fails
on it, so it fixes nothing; the first real batch that trains fixes the schema, and the poisoned batch is
dead-lettered. Every real batch trains, and the job reaches the clean stream's test AUC.
"""

from __future__ import annotations

import asyncio

import msgpack
import nats
import pytest
import yaml

from tests.e2e.test_bad_batches import _array, good_batches, run_job, wait_for_stream
from tests.e2e.test_stream_ingestion import _dead_letters, _stream_state
from tests.procs import ADULT, Job, job_env


def open_schema_config(tmp_path, max_deliveries: int = 2) -> str:
    """The adult example's configuration with its declared schema taken out: the NN ranks must fix it.
    Sync mode, so two runs of the same batches agree within 0.05% AUC (hybrid mode's spread is 0.3%)."""
    cfg = yaml.safe_load((ADULT / "config" / "global_config.yml").read_text())
    cfg.setdefault("nn_worker_config", {}).update(sync_mode="sync", embedding_staleness=1)
    loader = cfg.setdefault("data_loader_config", {})
    loader.pop("non_id_features", None)
    loader.pop("labels", None)
    loader["max_deliveries"] = max_deliveries
    (tmp_path / "global.yml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "global.yml")


async def publish_goods(url: str, job: str, poisoned_first: bool = False, limit: int | None = None) -> int:
    """The adult training split (its first ``limit`` batches), after a batch whose dense block is 4 wide
    where ``poisoned_first``; then the end marker."""
    goods = good_batches()[:limit]
    n = goods[0]["labels"][0]["data"]["shape"][0]
    poisoned = dict(goods[0], non_id=[{"name": "continuous", "data": _array("<f4", [n, 4], 4)}])
    nc = await nats.connect(url)
    js = nc.jetstream()
    await wait_for_stream(js, f"PERSIA_{job}")
    subject = f"persia.{job}.batches"
    if poisoned_first:
        await js.publish(subject, msgpack.packb(poisoned, use_bin_type=True))
    for good in goods:
        await js.publish(subject, msgpack.packb(good, use_bin_type=True))
    await js.publish(f"persia.{job}.stream_end", msgpack.packb({"v": 1, "end": True}))
    await nc.drain()
    return len(goods)


@pytest.mark.slow
def test_a_poisoned_first_batch_decides_nothing_and_every_real_batch_trains(nats_server, job_name, tmp_path):
    cfg = open_schema_config(tmp_path)
    (tmp_path / "clean").mkdir()
    (tmp_path / "poisoned").mkdir()
    clean_job = f"{job_name}-clean"
    clean = Job(job_env(nats_server.url, clean_job, PERSIA_GLOBAL_CONFIG=cfg), tmp_path / "clean")
    clean_result, _ = run_job(clean, lambda: asyncio.run(publish_goods(nats_server.url, clean_job)))
    job = Job(job_env(nats_server.url, job_name, PERSIA_GLOBAL_CONFIG=cfg), tmp_path / "poisoned")
    result, goods = run_job(job, lambda: asyncio.run(publish_goods(nats_server.url, job_name, poisoned_first=True)))
    state = asyncio.run(_stream_state(nats_server.url, job_name))
    dead = asyncio.run(_dead_letters(nats_server.url, job_name, 1))
    c = result["counters"]
    print(f"\npoisoned-first-batch stream: test AUC {result['test_auc']:.4f} (clean stream "
          f"{clean_result['test_auc']:.4f}), real batches trained {c['stream_acked']} of {goods}, "
          f"dead-lettered {state['dead']}: {dead[0][1]}")
    assert c["stream_acked"] == goods == 255 and not c.get("stream_redelivered_trained"), c
    assert c["batches_failed"] == 1, c  # the poisoned batch, once: then the confirmed schema refused it
    assert state["dead"] == 1 and state["stream_msgs"] == 0, state
    assert dead[0][0] == "1", dead
    assert "<f4 [4]" in dead[0][1] or "forward raised" in dead[0][1], dead
    assert "schema confirmed by batch" in job.log("nn"), job.log("nn")[-3000:]
    account = result["account"]
    assert account == dict(account, published=256, trained_once=255, trained_more_than_once=0, dead_lettered=1,
                           left=0, lost=0, failure=None), account
    assert clean_result["account"]["published"] == 255 and clean_result["failures"] == [], clean_result
    # the same batches in the same order as the clean stream: the poisoned one changed nothing
    assert abs(result["test_auc"] - clean_result["test_auc"]) <= 0.002 * clean_result["test_auc"], \
        (result["test_auc"], clean_result["test_auc"])


@pytest.mark.slow
def test_a_failed_final_checkpoint_fails_the_job_and_its_result_says_so(nats_server, job_name, tmp_path):
    """A disk without room for the final checkpoint (the newest one there claims an exabyte): refused before
    anything is written, the result names it, and rank 0 exits non-zero with one line saying why."""
    from tests.e2e.test_stream_ingestion import start_stream_job
    from tests.unit.test_checkpoint_space import fake_checkpoint

    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 1, 10**18)
    job = Job(job_env(nats_server.url, job_name, PERSIA_CHECKPOINT_DIR=str(root), FINAL_CHECKPOINT="1"), tmp_path)
    try:
        start_stream_job(job)
        asyncio.run(publish_goods(nats_server.url, job_name, limit=20))
        code = job.wait("nn", timeout=300)
        result = job.json_result("nn")
        log = job.log("nn")
    finally:
        job.stop_all()
    assert code != 0, log[-3000:]
    final = result["checkpoints"]["final"]
    assert "needs about" in final["error"] and "are free" in final["error"], result["checkpoints"]
    assert result["checkpoints"]["failed"] == 1 and result["failures"], result
    assert "job failed: the final checkpoint at step 20 in " in log and "are free" in log.splitlines()[-1], log[-3000:]
    assert result["account"]["trained_once"] == 20 and result["account"]["failure"] is None, result["account"]
    assert [p.name for p in root.iterdir()] == [ck_name(1)]  # nothing was written


def ck_name(number: int) -> str:
    from persia_nats.common.checkpoint import checkpoint_name

    return checkpoint_name(number)


async def publish_one_rank_only(url: str, job: str, goods_n: int) -> int:
    """``goods_n`` real batches, each after one the configured schema refuses: the stream's loaders route a
    batch to rank ``sequence % 2``, so every real batch lands on one rank and the other gets none."""
    goods = good_batches()[:goods_n]
    n = goods[0]["labels"][0]["data"]["shape"][0]
    refused = dict(goods[0], non_id=[{"name": "continuous", "data": _array("<f4", [n, 4], 4)}])
    nc = await nats.connect(url)
    js = nc.jetstream()
    await wait_for_stream(js, f"PERSIA_{job}")
    subject = f"persia.{job}.batches"
    for good in goods:
        await js.publish(subject, msgpack.packb(refused, use_bin_type=True))
        await js.publish(subject, msgpack.packb(good, use_bin_type=True))
    await js.publish(f"persia.{job}.stream_end", msgpack.packb({"v": 1, "end": True}))
    await nc.drain()
    return goods_n


@pytest.mark.slow
def test_two_ranks_end_when_every_batch_lands_on_one_of_them(nats_server, job_name, tmp_path):
    """The rank with no batch joins the other's steps instead of holding it in its all-reduce: before,
    rank 1 waited in the all-reduce for rank 0, which waited for a batch (600 s), and the end marker waited
    behind rank 1's unacknowledged batches."""
    from tests.e2e.test_stream_ingestion import start_stream_job

    goods = 30
    job = Job(job_env(nats_server.url, job_name), tmp_path)
    try:
        start_stream_job(job, nproc=2)
        asyncio.run(publish_one_rank_only(nats_server.url, job_name, goods))
        assert job.wait("nn", timeout=150) == 0, job.dump_logs()
        results = job.json_results("nn", '{"train_samples"')
    finally:
        job.stop_all()
    state = asyncio.run(_stream_state(nats_server.url, job_name))
    by_rank = sorted(r["counters"].get("stream_acked", 0) for r in results)
    print(f"\none rank fed: batches trained by rank {by_rank}, dead-lettered {state['dead']}")
    assert by_rank == [0, goods], results
    assert state["dead"] == goods and state["stream_msgs"] == 0, state
    account = next(r["account"] for r in results if r.get("account", {}).get("published") is not None)
    assert account["trained_once"] == goods and account["lost"] == account["overcounted"] == 0, account
    assert account["failure"] is None, account
