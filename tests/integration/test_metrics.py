"""Prometheus endpoints of the PS and the embedding worker, scraped over HTTP against a real job."""

from __future__ import annotations

import asyncio
import urllib.request

import numpy as np
import pytest
from persia_nats.common import metrics as metrics_mod
from persia_nats.common.config import MetricsConfig, global_config_from_dict
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import EwLookup, GradRequest, SlotGradient
from persia_nats.common.rpc import request
from persia_nats.common.service import run_service
from persia_nats.common.subjects import Subjects
from persia_nats.services.embedding_ps.service import EmbeddingParameterServer
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.helpers import running_job
from tests.integration.test_embedding_worker import configure, ingest

ON = MetricsConfig(enable_metrics=True, job_name="metrics_test", port=0)


async def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Samples by (name, sorted labels); the scrape runs off the event loop, which serves the figures."""

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
            return resp.read().decode()

    text = await asyncio.to_thread(get)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    found = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


async def test_ps_and_worker_expose_live_figures(nats_server, job_name):
    async with running_job(nats_server.url, job_name) as (nc, pss, ew):
        servers = [metrics_mod.start_metrics_server(s, ON) for s in (*pss, ew)]
        try:
            ew_port = servers[-1].port
            assert ew_port > 0 and len({s.port for s in servers}) == 3
            before = await scrape(ew_port)
            # counters are there (at 0) before anything happened
            assert value(before, "persia_embedding_worker_grads_applied_total") == 0
            assert value(before, "persia_embedding_worker_staleness", persia_job="metrics_test", replica="0") == 0

            s = Subjects(job_name)
            await configure(nc, job_name)
            ref = await request(nc, s.ew_ingest(), ingest(), 5)
            await request(nc, s.ew_lookup(ew.worker_id), EwLookup(ref["ref"], train=True), 5)
            mid = await scrape(ew_port)
            assert value(mid, "persia_embedding_worker_staleness") == 1
            assert value(mid, "persia_embedding_worker_max_staleness") == 1
            assert value(mid, "persia_embedding_worker_looked_up_total") == 1
            grads = GradRequest(ref["ref"], (SlotGradient("a", np.ones((3, 4), np.float16)),
                                             SlotGradient("r", np.ones((2, 2), np.float16)))).to_wire()
            await request(nc, s.ew_grad(ew.worker_id), grads, 5)
            with pytest.raises(BadRequest):
                await request(nc, s.ew_ingest(), b"\xff\x00garbage", 5)

            after = await scrape(ew_port)
            assert value(after, "persia_embedding_worker_grads_applied_total") == 1
            assert value(after, "persia_embedding_worker_ingested_total") == 1
            assert value(after, "persia_embedding_worker_staleness") == 0
            assert value(after, "persia_embedding_worker_buffered") == 0
            assert value(after, "persia_embedding_worker_nan_skipped_total") == 0
            assert value(after, "persia_requests_total", subject=s.ew_ingest()) == 2
            assert value(after, "persia_requests_total", subject=s.ew_grad(ew.worker_id)) == 1
            assert value(after, "persia_refused_total", subject=s.ew_ingest(), code="400") == 1
            assert value(after, "persia_request_duration_seconds_count", kind="lookup") == 1
            assert value(after, "persia_request_duration_seconds_count", kind="grad") == 1
            assert value(after, "persia_request_duration_seconds_count", kind="ingest") == 2

            total_rows = 0
            for i, (ps, server) in enumerate(zip(pss, servers, strict=False)):
                got = await scrape(server.port)
                assert value(got, "persia_ps_rows", persia_job="metrics_test", replica=str(i)) == len(ps.store)
                assert value(got, "persia_ps_memory_bytes") == ps.store.stats()["memory_bytes"] > 0
                assert value(got, "persia_ps_inserts_total") == ps.store.stats()["inserts"]
                assert value(got, "persia_ps_evictions_total") == 0
                assert value(got, "persia_ps_duplicate_updates_total") == 0
                assert value(got, "persia_ps_gradient_id_misses_total") == 0
                assert value(got, "persia_ps_index_misses_total") == ps.store.stats()["index_miss_count"]
                assert value(got, "persia_ps_configured") == 1
                assert value(got, "persia_requests_total", subject=s.ps(i, "update")) == 1
                assert value(got, "persia_request_duration_seconds_count", kind="update") == 1
                total_rows += value(got, "persia_ps_rows")
            assert total_rows == 5
        finally:
            for server in servers:
                await asyncio.to_thread(server.close)


def test_metrics_off_by_default_start_no_endpoint(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("no endpoint may start when metrics are off")

    monkeypatch.setattr(metrics_mod, "start_http_server", fail)
    assert MetricsConfig().enable_metrics is False
    assert metrics_mod.maybe_start_metrics(object(), MetricsConfig()) is None  # type: ignore[arg-type]
    assert metrics_mod.maybe_start_metrics(object(), None) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("enabled", [True, False])
async def test_run_service_serves_metrics_only_when_enabled(nats_server, job_name, monkeypatch, enabled):
    gcfg = global_config_from_dict({"common_config": {"job_name": job_name}})
    made: list[EmbeddingParameterServer] = []
    started = asyncio.Event()

    async def make(nc):
        made.append(EmbeddingParameterServer(nc, gcfg, 0, 1))
        return made[0]

    real_start = EmbeddingParameterServer.start

    async def start(self):
        await real_start(self)
        started.set()

    monkeypatch.setattr(EmbeddingParameterServer, "start", start)
    config = MetricsConfig(enable_metrics=enabled, port=0)
    task = asyncio.create_task(run_service(make, [nats_server.url], "ps-0", stats_interval=60, metrics=config))
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.sleep(0.05)  # run_service starts the endpoint right after start()
    ps = made[0]
    if enabled:
        server = ps.metrics_server
        assert server is not None
        got = await scrape(server.port)
        # metrics_config.job_name unset: the job's own name, not PERSIA's persia_default_jobname for every job
        assert value(got, "persia_ps_rows", persia_job="persia", replica="0") == 0
    else:
        assert ps.metrics_server is None
    ps.request_stop()
    assert await asyncio.wait_for(task, 15) == 0
    if enabled:
        with pytest.raises(OSError):
            await scrape(server.port)


# -- the NN worker ---------------------------------------------------------------------------------


async def test_nn_worker_exposes_throughput_staleness_and_latency(nats_server, job_name):
    import nats
    from persia_nats.common.discovery import cluster_status
    from persia_nats.common.messages import BatchRef
    from persia_nats.services.data_loader.sender import BatchSender
    from persia_nats.services.nn_worker.metrics import CallTimes, start_nn_metrics
    from persia_nats.services.nn_worker.runtime import GradPush, NNRuntime, Pipeline, StalenessGate

    from tests.integration.test_nn_runtime import A_ONLY, persia_batch

    async with running_job(nats_server.url, job_name, embedding=A_ONLY) as (client, _, ew):
        await configure(client, job_name)
        s = Subjects(job_name)
        nc = await nats.connect(nats_server.url)
        calls = CallTimes()
        rt = NNRuntime.build(nc, s, rank=0, world_size=1, timeout=5, incoming_limit=4, observe_call=calls.observe)
        await rt.start()
        server = start_nn_metrics(rt, ON, calls=calls)
        assert server is not None and rt.registration is not None
        assert rt.registration.metadata["metrics_port"] == str(server.port)
        listed = [r for r in await cluster_status(nc, job_name, 0.3) if r["role"] == "nn-worker"]
        assert [r["metrics_port"] for r in listed] == [server.port], listed  # what `persia-launcher status` shows
        try:
            before = await scrape(server.port)
            for name in ("samples", "batches", "grads_applied", "grad_failures", "lookup_failures",
                         "batches_received"):
                assert value(before, f"persia_nn_worker_{name}_total", persia_job="metrics_test", replica="0") == 0
            assert value(before, "persia_nn_worker_queued") == 0
            assert value(before, "persia_nn_worker_incoming_limit") == 4
            assert value(before, "persia_nn_worker_lookup_duration_seconds_count") == 0

            gate = StalenessGate(2)
            rt.serve_loader(gate=gate, incoming_limit=4)
            pipe = Pipeline(rt, gate=gate, forward_buffer_size=2, train=True)
            sender = BatchSender(client, s, max_inflight=1)
            for i in range(3):
                await sender.send(persia_batch(i, bs=3))
            await sender.finish()
            items = [await asyncio.wait_for(pipe.next(), 10) for _ in range(2)]
            mid = await scrape(server.port)
            assert value(mid, "persia_nn_worker_staleness") == 2  # two batches hold permits
            assert value(mid, "persia_nn_worker_staleness_bound") == 2
            assert value(mid, "persia_nn_worker_batches_received_total") == 3
            for item in items:
                grads = tuple(SlotGradient(e.name, np.ones(e.emb.shape, np.float16)) for e in item.embeddings)
                rt.embeddings.send_grads(GradPush(ref=item.ref, grads=grads, permit=item.permit))
            items.append(await asyncio.wait_for(pipe.next(), 10))
            rt.embeddings.send_grads(GradPush(ref=BatchRef(ew.worker_id, 10**6)))  # an unknown ref: a failure
            await rt.embeddings.flush_grads()

            after = await scrape(server.port)
            assert value(after, "persia_nn_worker_samples_total") == 9
            assert value(after, "persia_nn_worker_batches_total") == 3
            assert value(after, "persia_nn_worker_grads_applied_total") == 2
            assert value(after, "persia_nn_worker_grad_failures_total") == 1
            assert value(after, "persia_nn_worker_lookup_failures_total") == 0
            assert value(after, "persia_nn_worker_staleness") == 1  # the third batch's permit
            assert value(after, "persia_nn_worker_max_staleness") == 2
            assert value(after, "persia_nn_worker_queued") == 0
            assert value(after, "persia_nn_worker_lookup_duration_seconds_count") == 3
            assert value(after, "persia_nn_worker_grad_push_duration_seconds_count") == 3
            assert value(after, "persia_nn_worker_grad_push_duration_seconds_sum") > 0
            assert value(after, "persia_requests_total", subject=s.nn_batch(0)) == 3
            assert value(after, "persia_request_duration_seconds_count", kind="batch") == 3
            # every NN series the Grafana dashboard plots exists
            import pathlib
            import re

            board = (pathlib.Path(__file__).parents[2] / "deploy" / "grafana-dashboard.json").read_text()
            plotted = set(re.findall(r"persia_nn_worker_\w+", board))
            # fed by a TrainCtx's backward() and its DataLoader, which this runtime alone has not run
            training_loop = {"persia_nn_worker_train_loss", "persia_nn_worker_samples_per_second"}
            assert training_loop <= plotted
            assert len(plotted) >= 9 and plotted - training_loop <= {name for name, _ in after}
            await pipe.cancel()
        finally:
            await asyncio.to_thread(server.close)
            await rt.close()


def test_nn_metrics_port_is_the_configured_port_plus_the_local_rank():
    from persia_nats.services.nn_worker.metrics import metrics_port

    assert metrics_port(MetricsConfig(enable_metrics=True, port=9400), 0) == 9400
    assert metrics_port(MetricsConfig(enable_metrics=True, port=9400), 3) == 9403
    assert metrics_port(MetricsConfig(enable_metrics=True, port=0), 3) == 0  # each rank a free port


@pytest.mark.parametrize(("enabled", "local_rank"), [(True, 1), (True, 0), (False, 1)])
async def test_an_nn_context_serves_metrics_on_port_plus_local_rank_while_entered(nats_server, job_name, enabled,
                                                                                  local_rank):
    """Rank 1 serves on base + its local rank: + 1 with two ranks on this host, + 0 alone on its
    host (its own pod or container), where it takes the port the deployments annotate."""
    import socket

    from persia_nats.common.env import Env
    from persia_nats.services.nn_worker.ctx import eval_ctx

    with socket.socket() as probe:  # the rank listens on base + local_rank: a port known to be free
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1] - local_rank
    gcfg = global_config_from_dict({"common_config": {"job_name": job_name, "metrics_config": {
        "enable_metrics": enabled, "job_name": "nn_metrics", "port": base}}})
    env = Env(nats_url=nats_server.url, rank=1, local_rank=local_rank, world_size=2)

    def run() -> None:
        import urllib.error

        with eval_ctx(env=env, global_config=gcfg) as ctx:
            if not enabled:
                assert ctx.metrics_server is None
                return
            assert ctx.metrics_server is not None and ctx.metrics_server.port == base + local_rank
            ctx.report(test_auc=0.75)
            for bad in ({"Test-AUC": 0.5}, {"test_auc": float("nan")}, {"test_auc": "0.9"}):
                with pytest.raises(ValueError, match="report"):
                    ctx.report(**bad)
            with urllib.request.urlopen(f"http://127.0.0.1:{base + local_rank}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            got = {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}
            labels = {"role": "nn-worker", "persia_job": "nn_metrics", "replica": "1"}
            assert got["persia_nn_worker_world_size"] == (labels, 2.0)
            assert got["persia_nn_worker_test_auc"] == (labels, 0.75)  # the bad reports changed nothing
            assert got["process_cpu_seconds_total"][0] == labels
        with pytest.raises((urllib.error.URLError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{base + local_rank}/metrics", timeout=2)

    await asyncio.to_thread(run)


def _nn_metrics_config(job_name: str, final_scrape_seconds: float) -> object:
    return global_config_from_dict({"common_config": {"job_name": job_name, "metrics_config": {
        "enable_metrics": True, "job_name": "nn_metrics", "port": 0, "final_scrape_seconds": final_scrape_seconds}}})


async def test_an_nn_context_ending_with_an_unscraped_report_waits_for_one_more_scrape(nats_server, job_name, caplog):
    """An AUC reported at the very end of ``eval_ctx`` reaches a Prometheus that scrapes this rank:
    the exit holds the endpoint open until the next scrape, which carries the figure."""
    import logging
    import threading

    from persia_nats.common.env import Env
    from persia_nats.services.nn_worker.ctx import eval_ctx

    caplog.set_level(logging.INFO, logger="persia_nats.common.metrics")
    env = Env(nats_url=nats_server.url, rank=0, local_rank=0, world_size=1)
    port: list[int] = []
    last: list[str] = []

    def get(p: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def scrape_once_the_exit_waits() -> None:
        # the exit logs that it waits; this "Prometheus" scrapes then, as its interval comes round
        for _ in range(600):
            if "waiting up to" in caplog.text:
                last.append(get(port[0]))
                return
            threading.Event().wait(0.05)

    def run() -> None:
        with eval_ctx(env=env, global_config=_nn_metrics_config(job_name, 30)) as ctx:
            port.append(ctx.metrics_server.port)
            assert "persia_nn_worker_test_auc" not in get(port[0])  # scraped: someone is watching
            ctx.report(test_auc=0.8125)
            scraper = threading.Thread(target=scrape_once_the_exit_waits)
            scraper.start()
        scraper.join(30)

    await asyncio.to_thread(run)
    assert last, "the context exited without waiting for a scrape"
    got = {s.name: s.value for f in text_string_to_metric_families(last[0]) for s in f.samples}
    assert got["persia_nn_worker_test_auc"] == 0.8125
    assert "no scrape of port" not in caplog.text


@pytest.mark.parametrize("case", ["never scraped", "report already scraped", "wait off"])
async def test_an_nn_context_exits_without_waiting_when_nothing_is_left_to_scrape(nats_server, job_name, caplog,
                                                                                   case):
    """No wait in a process nobody scrapes (no Prometheus: a test, compose without one), when a scrape
    has already read the report, or with final_scrape_seconds 0."""
    import logging

    from persia_nats.common.env import Env
    from persia_nats.common.metrics import ScrapeClock
    from persia_nats.services.nn_worker.ctx import eval_ctx

    caplog.set_level(logging.INFO, logger="persia_nats.common.metrics")
    env = Env(nats_url=nats_server.url, rank=0, local_rank=0, world_size=1)
    ScrapeClock.watched.clear()  # process-wide: earlier tests scraped other endpoints

    def run() -> None:
        with eval_ctx(env=env, global_config=_nn_metrics_config(job_name, 0 if case == "wait off" else 30)) as ctx:
            url = f"http://127.0.0.1:{ctx.metrics_server.port}/metrics"
            if case != "never scraped":
                urllib.request.urlopen(url, timeout=5).read()
            ctx.report(test_auc=0.5)
            if case == "report already scraped":
                urllib.request.urlopen(url, timeout=5).read()

    await asyncio.to_thread(run)
    assert "waiting up to" not in caplog.text
    assert ScrapeClock.watched.is_set() == (case != "never scraped")


# -- HELP ------------------------------------------------------------------------------------------


def undescribed(text: str, role: str) -> list[str]:
    """The ``persia_`` families of a scrape whose HELP is the old ``f"{role} {key}"`` or says it has none."""
    import re

    return [f"{f.name}: {f.documentation!r}" for f in text_string_to_metric_families(text)
            if f.name.startswith("persia_") and (not f.documentation or "undescribed" in f.documentation
                                                 or re.fullmatch(rf"{re.escape(role)} [a-z_0-9]+", f.documentation))]


async def test_every_figure_of_every_role_has_real_help(nats_server, job_name, tmp_path):
    """A PS, an embedding worker, an NN rank and a server, scraped: no placeholder HELP anywhere."""
    import nats
    import torch
    from persia_nats.common.config import embedding_config_from_dict
    from persia_nats.services.nn_worker.metrics import CallTimes, start_nn_metrics
    from persia_nats.services.nn_worker.runtime import NNRuntime, StalenessGate
    from persia_nats.services.serving.service import InferenceService

    from tests.integration.helpers import EMBEDDING, global_config

    def fetch(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    async with running_job(nats_server.url, job_name) as (client, pss, ew):
        await configure(client, job_name)
        ref = await request(client, Subjects(job_name).ew_ingest(), ingest(), 5)
        await request(client, Subjects(job_name).ew_lookup(ew.worker_id), EwLookup(ref["ref"], train=True), 5)
        nc = await nats.connect(nats_server.url)
        calls = CallTimes()
        rt = NNRuntime.build(nc, Subjects(job_name), rank=0, world_size=1, timeout=5, incoming_limit=4,
                             observe_call=calls.observe)
        await rt.start()
        rt.serve_loader(gate=StalenessGate(2), incoming_limit=4)
        serve_nc = await nats.connect(nats_server.url)
        server = InferenceService(serve_nc, global_config(job_name), embedding_config_from_dict(EMBEDDING),
                                  lambda: torch.nn.Linear(2, 1), tmp_path, reload_interval=0)
        await server.start()
        endpoints = [(s.role, metrics_mod.start_metrics_server(s, ON)) for s in (*pss, ew, server)]
        nn_server = start_nn_metrics(rt, ON, calls=calls)
        assert nn_server is not None
        endpoints.append((rt.role, nn_server))
        try:
            texts = [(role, await asyncio.to_thread(fetch, m.port)) for role, m in endpoints]
        finally:
            for _, m in endpoints:
                await asyncio.to_thread(m.close)
            await server.stop(drain_timeout=5)
            await serve_nc.close()
            await rt.close()
    scraped: dict[str, set[str]] = {}
    for role, text in texts:
        assert undescribed(text, role) == [], role
        scraped.setdefault(role, set()).update(f.name for f in text_string_to_metric_families(text))
    # every counter a role declares is exported (at 0 before it is bumped), described, under its Prometheus name
    for role, keys in metrics_mod.COUNTER_KEYS.items():
        if role == "data-loader":  # serves no endpoint
            continue
        for key in keys:
            assert metrics_mod.description(role, key), (role, key)
            name, _ = metrics_mod.exported(key, 0, role)
            assert f"persia_{metrics_mod.role_name(role)}_{name}" in scraped[role], (role, key)
    every = set().union(*scraped.values())
    assert "persia_ps_index_misses" in every and "persia_ps_gradient_id_misses" in every
    assert not {n for n in every if n.endswith("_count") or "miss_count" in n}
    assert "persia_nn_worker_train_wait_seconds" in every and "persia_serving_predictions" in every
