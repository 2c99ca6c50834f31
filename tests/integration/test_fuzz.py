"""Every subject survives hostile payloads: answered, never a 500, refusals change nothing."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import nats
import numpy as np
import pytest
from persia_nats.common.codec import WIRE_VERSION
from persia_nats.common.optim_config import SGDConfig, to_wire
from persia_nats.common.rpc import request
from persia_nats.common.subjects import Subjects
from persia_nats.services.nn_worker.runtime import NNRuntime

from tests.fuzzing import FuzzReport, fuzz_hostile, fuzz_subject, payloads, subjects_for, valid_messages
from tests.integration.helpers import running_job

PER_SUBJECT = int(os.environ.get("FUZZ_PER_SUBJECT", "600"))


def state(pss, ew, rt):
    return (
        tuple((len(p.store), p.configured, p.store.stats()["inserts"], p.duplicate_updates) for p in pss),
        len(ew.ids), len(ew.pending), rt.inbox.incoming.qsize(), rt.inbox._received,
        tuple(sorted(rt.inbox._loader_ends.items())),
    )


@contextlib.asynccontextmanager
async def fuzzed_job(url: str, job: str) -> AsyncIterator[tuple]:
    """One PS (SGD configured), an embedding worker and an NN-worker runtime: what the fuzzing aims at."""
    async with running_job(url, job, replicas=1) as (client, pss, ew):
        s = Subjects(job)
        await request(client, s.ps(0, "configure"), {"v": WIRE_VERSION, "optimizer": to_wire(SGDConfig(lr=0.1))}, 5)
        rt = NNRuntime.build(await nats.connect(url), s, rank=0, world_size=1, timeout=5, incoming_limit=10_000)
        await rt.start()
        try:
            yield client, s, pss, ew, rt
        finally:
            await rt.close()


@pytest.mark.timeout(600)
async def test_every_subject_survives_hostile_payloads(nats_server, job_name):
    async with fuzzed_job(nats_server.url, job_name) as (client, s, pss, ew, rt):
        ref = (await request(client, s.ew_ingest(), valid_messages(ew.worker_id, 0)["ingest"], 5))["ref"]
        seeds = valid_messages(ew.worker_id, ref)
        report = FuzzReport()
        for i, (kind, subject) in enumerate(subjects_for(s, ew.worker_id).items()):
            blobs = payloads(seeds[kind], PER_SUBJECT, seed=i)
            await fuzz_subject(client, subject, kind, blobs, lambda: state(pss, ew, rt), report)
        assert not report.failures, report.failures[:10]
        assert all(report.refused[k] > PER_SUBJECT // 2 for k in report.sent), report.refused
        # still serving: a valid round trip through every role after the storm
        ew.ids.clear()
        ref = (await request(client, s.ew_ingest(), seeds["ingest"], 5))["ref"]
        reply = await request(client, s.ew_lookup(ew.worker_id), {"v": WIRE_VERSION, "ref": ref}, 5)
        assert len(reply["embeddings"]) == 2
        assert np.isfinite(pss[0].store.lookup(np.array([1], np.uint64), 4, False)).all()


@pytest.mark.timeout(300)
async def test_the_hostile_campaigns_findings_are_refused_within_byte_bounds(nats_server, job_name):
    async with fuzzed_job(nats_server.url, job_name) as (client, s, pss, ew, rt):
        report = FuzzReport()
        figures = await fuzz_hostile(client, s, pss, ew, rt, lambda: state(pss, ew, rt), report)
        assert not report.failures, report.failures[:10]
        assert report.refused["hostile_ps_lookup"] == report.sent["hostile_ps_lookup"] > 200
        assert 0 < report.accepted["hostile_ingest"] < report.sent["hostile_ingest"]  # until the byte bound
        assert report.refused["chunks"] == 8 and figures["ps_chunk_bytes_held"] == 0
        assert figures["rss_growth"] < figures["ew_buffer_bound"] + (128 << 20), figures
