"""Two jobs on one nats-server, each role serving /metrics as its entry point does: every series a
scrape finds carries its own job's name, so one Prometheus tells the jobs apart."""

from __future__ import annotations

import asyncio
import urllib.request

import nats
import numpy as np
from persia_nats.common.config import DEFAULT_JOB_NAME, embedding_config_from_dict, global_config_from_dict
from persia_nats.common.discovery import cluster_status
from persia_nats.common.messages import EwLookup, GradRequest, SlotGradient
from persia_nats.common.rpc import request
from persia_nats.common.service import Service, run_service
from persia_nats.common.subjects import Subjects
from persia_nats.services.embedding_ps.service import EmbeddingParameterServer
from persia_nats.services.embedding_worker.service import EmbeddingWorkerService
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.helpers import EMBEDDING
from tests.integration.test_embedding_worker import configure, ingest

#: PERSIA's own default, which every series carried before metrics_config.job_name followed the job's
PERSIA_DEFAULT = "persia_default_jobname"


def _scrape(port: int) -> list[tuple[str, dict[str, str]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return [(s.name, s.labels) for family in text_string_to_metric_families(text) for s in family.samples]


async def _start_job(url: str, job: str) -> tuple[list[Service], list[asyncio.Task[int]]]:
    """Two PS replicas and an embedding worker, each through run_service with the metrics config the
    launcher passes: only ``common_config.job_name`` names the job, ``metrics_config`` does not."""
    gcfg = global_config_from_dict({"common_config": {"job_name": job,
                                                      "metrics_config": {"enable_metrics": True, "port": 0}},
                                    "embedding_worker_config": {"forward_buffer_size": 4}})
    ecfg = embedding_config_from_dict(EMBEDDING)
    made: list[Service] = []

    def maker(build):  # noqa: ANN001, ANN202
        async def make(nc):  # noqa: ANN001, ANN202
            made.append(build(nc))
            return made[-1]
        return make

    builds = [(f"ps-{i}", lambda nc, i=i: EmbeddingParameterServer(nc, gcfg, i, 2)) for i in range(2)]
    builds.append(("embedding-worker-0", lambda nc: EmbeddingWorkerService(nc, gcfg, ecfg, 0, ps_wait_s=10)))
    tasks = [asyncio.create_task(run_service(maker(build), [url], name, stats_interval=60,
                                             metrics=gcfg.common_config.metrics_config))
             for name, build in builds]
    return made, tasks


async def _metrics_ports(nc: nats.NATS, job: str) -> dict[tuple[str, int], int]:
    """Each instance's metrics port, as ``persia-launcher status`` lists it (a scrape config's source)."""
    for _ in range(200):
        listed = await cluster_status(nc, job, 0.2)
        ports = {(r["role"], r["replica"]): r.get("metrics_port") for r in listed}
        if len(ports) == 3 and all(ports.values()):
            return ports  # type: ignore[return-value]
        await asyncio.sleep(0.05)
    raise AssertionError(f"{job}: not every role listed with a metrics port: {ports}")


async def _train_one_batch(nc: nats.NATS, job: str, ew: EmbeddingWorkerService) -> None:
    """A lookup and its gradients, so the request-latency histograms have series too."""
    s = Subjects(job)
    await configure(nc, job)
    ref = await request(nc, s.ew_ingest(), ingest(), 5)
    await request(nc, s.ew_lookup(ew.worker_id), EwLookup(ref["ref"], train=True), 5)
    grads = GradRequest(ref["ref"], (SlotGradient("a", np.ones((3, 4), np.float16)),
                                     SlotGradient("r", np.ones((2, 2), np.float16)))).to_wire()
    await request(nc, s.ew_grad(ew.worker_id), grads, 5)


async def test_two_jobs_on_one_nats_are_told_apart_by_every_series(nats_server, job_name):
    jobs = (f"{job_name}a", f"{job_name}b")
    client = await nats.connect(nats_server.url)
    started = [await _start_job(nats_server.url, job) for job in jobs]
    try:
        ports = {job: await _metrics_ports(client, job) for job in jobs}
        assert len({p for by_role in ports.values() for p in by_role.values()}) == 6  # an endpoint each
        for job, (made, _) in zip(jobs, started, strict=True):
            (ew,) = [s for s in made if isinstance(s, EmbeddingWorkerService)]
            await _train_one_batch(client, job, ew)
        series: dict[str, set[tuple[str, tuple]]] = {}
        for job in jobs:
            series[job] = set()
            for (role, replica), port in ports[job].items():
                samples = await asyncio.to_thread(_scrape, port)
                assert len(samples) > 50, (job, role, samples)
                for name, labels in samples:
                    assert labels.get("persia_job") == job, (job, role, name, labels)
                    assert (labels["role"], labels["replica"]) == (role, str(replica)), (name, labels)
                    series[job].add((name, tuple(sorted(labels.items()))))
                names = {name for name, _ in samples}
                assert "persia_request_duration_seconds_count" in names and "process_cpu_seconds_total" in names
    finally:
        for made, tasks in started:
            for service in made:
                service.request_stop()
            assert await asyncio.wait_for(asyncio.gather(*tasks), 30) == [0] * len(tasks)
        await client.close()
    first, second = (series[job] for job in jobs)
    assert first and second and not first & second  # the jobs' series are distinct
    # ... told apart by persia_job (and the subject label, whose subjects hold the job): the same series otherwise
    unlabelled = [{(name, tuple(kv for kv in labels if kv[0] != "persia_job")) for name, labels in s}
                  for s in (first, second)]
    common = unlabelled[0] & unlabelled[1]
    expected = {"persia_ps_rows", "persia_ps_inserts_total", "persia_ps_index_misses_total",
                "persia_embedding_worker_staleness",
                "persia_request_duration_seconds_count"}
    assert {name for name, _ in common} >= expected
    every_job = {dict(labels)["persia_job"] for s in (first, second) for _, labels in s}
    assert every_job == set(jobs) and not every_job & {PERSIA_DEFAULT, DEFAULT_JOB_NAME}
