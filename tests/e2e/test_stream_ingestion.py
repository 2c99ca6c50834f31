"""Durable ingestion: a plain nats-py client publishes onto the JetStream stream; every role runs as a process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from tests.procs import ADULT, ROOT, Job, job_env

PUBLISHER = ROOT / "examples" / "clients" / "publish_stream.py"


async def _stream_state(url: str, job: str) -> dict:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.consumer_info(f"PERSIA_{job}", "loaders")
        stream = await js.stream_info(f"PERSIA_{job}")
        dead = await js.stream_info(f"PERSIA_{job}_DEAD")
        return {"ack_pending": info.num_ack_pending, "pending": info.num_pending,
                "ack_floor": info.ack_floor.stream_seq, "stream_msgs": stream.state.messages,
                "last_seq": stream.state.last_seq, "dead": dead.state.messages}
    finally:
        await nc.close()


def start_stream_job(job: Job, nn_script: Path = ADULT / "train.py", nproc: int = 1) -> None:
    """One PS, one embedding worker, the adult NN worker (or ``nn_script``, ``nproc`` ranks) and a loader
    reading the stream."""
    job.start("ps0", "embedding-parameter-server", "--replica-index", "0", "--replica-size", "1")
    job.start("ew0", "embedding-worker", "--replica-index", "0", "--replica-size", "1")
    job.start("nn", "nn-worker", str(nn_script), "--nproc-per-node", str(nproc))
    job.start("loader", "data-loader", "--from-stream")


@pytest.mark.slow
def test_plain_client_batches_train_through_the_stream(nats_server, job_name, tmp_path):
    job = Job(job_env(nats_server.url, job_name), tmp_path)
    try:
        start_stream_job(job)
        pub = subprocess.run([sys.executable, str(PUBLISHER), "--nats-url", nats_server.url, "--job", job_name],
                             capture_output=True, text=True, timeout=300)
        assert pub.returncode == 0, pub.stderr
        assert "published 255 batches" in pub.stdout
        assert job.wait("nn", timeout=300) == 0, job.dump_logs()
        assert job.wait("loader", timeout=60) == 0, job.dump_logs()
        result = job.json_result("nn")
        state = asyncio.run(_stream_state(nats_server.url, job_name))
        loader_log = job.log("loader")
    finally:
        job.stop_all()
    # a pull subscription left subscribed held the exit's connection drain for its whole bound, then
    # logged an asyncio error about a cancelled future
    assert "never retrieved" not in loader_log and "Traceback" not in loader_log, loader_log[-3000:]
    assert result["train_samples"] == 32561, result
    assert result["test_auc"] >= 0.89, result
    # every batch was acknowledged by the NN worker once trained: the work queue is empty
    assert state["stream_msgs"] == 0 and state["ack_pending"] == 0 and state["pending"] == 0, state
    assert state["ack_floor"] == state["last_seq"] == 256, state
    assert state["dead"] == 0, state
    assert result["counters"]["stream_acked"] == 255, result


async def _publish_bad_then_end(url: str, job: str) -> list[int]:
    import msgpack

    subject = f"persia.{job}.batches"
    nc = await nats.connect(url)
    js = nc.jetstream()
    good = await _one_good_batch()
    nan = dict(good, non_id=[{"name": "continuous", "data": {"dtype": "<f4", "shape": [2, 5],
                                                             "data": b"\x00\x00\xc0\x7f" * 10}}])
    unknown_slot = dict(good, features=[dict(good["features"][0], name="no_such_slot")])
    # a zero-size array whose shape overflows numpy's index type once killed every loader it reached
    overflow = dict(good, non_id=[{"name": "continuous", "data": {"dtype": "<f4", "shape": [0, 2**62], "data": b""}}])
    bad = [b"\xc1 not msgpack", msgpack.packb([1, 2, 3]), msgpack.packb({"v": 1, "features": "x"}),
           msgpack.packb(nan, use_bin_type=True), msgpack.packb(unknown_slot, use_bin_type=True),
           msgpack.packb(overflow, use_bin_type=True), msgpack.packb({"v": 1, "end": 1})]
    seqs = [(await js.publish(subject, payload)).seq for payload in bad]
    await js.publish(subject, msgpack.packb(good, use_bin_type=True))
    await js.publish(f"persia.{job}.stream_end", msgpack.packb({"v": 1, "end": True}))
    await nc.drain()
    return seqs


async def _one_good_batch() -> dict:
    sys.path.insert(0, str(PUBLISHER.parent))
    import publish_stream as ps

    rows = ps.read_rows(ADULT / "data" / "adult.data")
    return ps.batch_message(ps.encode(rows[:2], *ps.train_encoding(rows)))


async def _loader_status(url: str, job: str) -> dict:
    from persia_nats.common.discovery import cluster_status

    nc = await nats.connect(url)
    try:
        for _ in range(50):
            found = [r for r in await cluster_status(nc, job, 0.5) if r.get("role") == "data-loader"]
            if found and found[0]["stats"].get("received"):
                return found[0]
        raise AssertionError("the stream loader never showed up in the job's status with batches received")
    finally:
        await nc.close()


async def _dead_letters(url: str, job: str, n: int) -> list[tuple[str, str]]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    sub = await js.pull_subscribe(f"persia.{job}.dead", durable="audit", stream=f"PERSIA_{job}_DEAD")
    msgs = await sub.fetch(n, timeout=5)
    out = [(m.headers["Persia-Stream-Seq"], m.headers["Persia-Dead-Reason"]) for m in msgs]
    await nc.close()
    return out


@pytest.mark.slow
def test_malformed_batches_are_dead_lettered_with_a_reason_and_never_retried(nats_server, job_name, tmp_path):
    job = Job(job_env(nats_server.url, job_name), tmp_path)
    try:
        start_stream_job(job)
        pub = subprocess.run([sys.executable, str(PUBLISHER), "--nats-url", nats_server.url, "--job", job_name,
                              "--limit", "10", "--no-end"], capture_output=True, text=True, timeout=300)
        assert pub.returncode == 0, pub.stderr
        loader = asyncio.run(_loader_status(nats_server.url, job_name))
        bad_seqs = asyncio.run(_publish_bad_then_end(nats_server.url, job_name))
        assert job.wait("nn", timeout=300) == 0, job.dump_logs()
        assert job.wait("loader", timeout=60) == 0, job.dump_logs()
        result = job.json_result("nn")
        state = asyncio.run(_stream_state(nats_server.url, job_name))
        dead = asyncio.run(_dead_letters(nats_server.url, job_name, 7))
    finally:
        job.stop_all()
    assert result["counters"]["stream_acked"] == 11, result
    # the running loader was listed with its counters (persia-launcher status reads the same)
    assert loader["instance"] == "loader-0" and loader["stats"]["end_marker"] is None, loader
    assert loader["stats"]["received"] >= 1 and "inflight" in loader["stats"], loader
    assert state["stream_msgs"] == 0 and state["dead"] == 7, state
    by_seq = dict(dead)
    assert sorted(int(s) for s in by_seq) == bad_seqs
    reasons = [by_seq[str(s)] for s in bad_seqs]
    assert "malformed msgpack" in reasons[0]
    assert "must be a map" in reasons[1]
    assert "features" in reasons[2]
    assert "non-finite" in reasons[3]
    assert "not the job's schema: features: unknown slot 'no_such_slot'" in reasons[4]
    assert "more than a message can hold" in reasons[5]
    assert "end: expected true" in reasons[6], reasons[6]
    assert "dead_lettered': 7" in job.log("loader") or "dead_lettered=7" in job.log("loader"), job.log("loader")


def test_a_stream_loader_stops_on_sigterm_within_its_drain_bound(nats_server, job_name, tmp_path):
    """Started by hand with no NN worker up, it waits for one; SIGTERM ends that wait and the process."""
    import signal
    import time

    from persia_nats.services.data_loader.stream import DRAIN_TIMEOUT_S

    job = Job(job_env(nats_server.url, job_name), tmp_path)
    proc = job.start("loader", "data-loader", "--from-stream")
    try:
        for _ in range(2400):  # the loader has created the job's stream: it now waits for an NN rank
            if proc.poll() is not None or "created consumer" in job.log("loader"):
                break
            time.sleep(0.05)
        assert proc.poll() is None, job.log("loader")
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=DRAIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # the loader's asyncio tasks, where each waits, into its log
            time.sleep(1.0)
            proc.kill()
            raise AssertionError(f"still running {DRAIN_TIMEOUT_S:g}s after SIGTERM:\n{job.log('loader')}") from None
        assert code == 0, job.log("loader")
    finally:
        job.stop_all()
    assert "nats error" not in job.log("loader"), job.log("loader")
