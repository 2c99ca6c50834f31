"""Discovery through the NATS services API ($SRV.PING / INFO / STATS) against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest
from persia_nats.common import discovery
from persia_nats.common.codec import unpack
from persia_nats.common.discovery import discover_replica_size
from persia_nats.common.errors import PeersMissing
from persia_nats.common.messages import Empty
from persia_nats.common.rpc import gather, request
from persia_nats.common.subjects import Subjects
from persia_nats.services.embedding_ps.service import EmbeddingParameterServer
from persia_nats.services.nn_worker.runtime import NNRuntime

from tests.integration.helpers import global_config, running_job


async def srv(nc, subject: str, wait: float = 0.3) -> list[dict]:
    """A raw scatter-gather, as any NATS client (or ``nats micro``) does it: every JSON reply in ``wait`` s."""
    inbox = nc.new_inbox()
    replies: list[dict] = []

    async def on_reply(msg):
        if msg.data:
            replies.append(json.loads(msg.data))

    sub = await nc.subscribe(inbox, cb=on_reply)
    await nc.publish(subject, b"", reply=inbox)
    await asyncio.sleep(wait)
    await sub.unsubscribe()
    return replies


def of_job(replies: list[dict], job: str) -> list[dict]:
    return [r for r in replies if r.get("metadata", {}).get("job") == job]


@pytest.fixture
async def nn_runtime(nats_server, job_name):
    nc = await nats.connect(nats_server.url)
    rt = NNRuntime.build(nc, Subjects(job_name), rank=0, world_size=1, timeout=5)
    await rt.start()
    yield rt
    await rt.close()


async def test_every_role_registers_and_srv_lists_it(nats_server, job_name, nn_runtime):
    async with running_job(nats_server.url, job_name) as (nc, pss, ew):
        pings = of_job(await srv(nc, "$SRV.PING"), job_name)
        assert sorted((p["name"], p["metadata"]["replica_index"]) for p in pings) == [
            ("persia-embedding-worker", "0"), ("persia-nn-worker", "0"), ("persia-ps", "0"), ("persia-ps", "1")]
        assert all(p["type"] == "io.nats.micro.v1.ping_response" and p["version"] == discovery.project_version()
                   for p in pings)

        infos = of_job(await srv(nc, "$SRV.INFO.persia-ps"), job_name)
        assert len(infos) == 2
        for info in infos:
            meta = info["metadata"]
            i = int(meta["replica_index"])
            assert meta["role"] == "embedding-parameter-server" and meta["replica_size"] == "2"
            assert meta["instance"] == f"ps-{i}" and meta["job"] == job_name
            assert all(isinstance(v, str) for v in meta.values())  # the protocol's map of strings
            served = {e["subject"]: e["queue_group"] for e in info["endpoints"]}
            s = Subjects(job_name)
            for verb in ("lookup", "update", "configure", "info"):
                assert served[s.ps(i, verb)] == ""
            assert served[s.srv_status(f"ps-{i}")] == "q"  # the one micro endpoint
            assert served[s.status()] == ""

        (ew_info,) = of_job(await srv(nc, "$SRV.INFO.persia-embedding-worker"), job_name)
        assert ew_info["metadata"]["instance"] == ew.worker_id and "replica_size" not in ew_info["metadata"]
        served = {e["subject"]: e["queue_group"] for e in ew_info["endpoints"]}
        assert served[Subjects(job_name).ew_ingest()] == "ew"
        (nn_info,) = of_job(await srv(nc, "$SRV.INFO.persia-nn-worker"), job_name)
        assert nn_info["metadata"]["replica_size"] == "1" and nn_info["metadata"]["instance"] == "nn-0"

        # discover() parses the same into typed fields
        found = await discovery.discover(nc, job_name, "embedding-parameter-server")
        assert [(f["replica_index"], f["replica_size"], f["instance"]) for f in found] == [(0, 2, "ps-0"),
                                                                                          (1, 2, "ps-1")]
        everyone = await discovery.discover(nc, job_name)
        assert {f["role"] for f in everyone} == {"embedding-parameter-server", "embedding-worker", "nn-worker"}


async def test_stats_carry_the_rpc_counters_and_the_status_map(nats_server, job_name):
    async with running_job(nats_server.url, job_name) as (nc, pss, ew):
        s = Subjects(job_name)
        for _ in range(3):
            await request(nc, s.ps(1, "info"), Empty(), 5)
        stats = {st["metadata"]["instance"]: st for st in of_job(await srv(nc, "$SRV.STATS.persia-ps"), job_name)}
        st = stats["ps-1"]
        assert st["type"] == "io.nats.micro.v1.stats_response" and st["started"].endswith("Z")
        endpoints = {e["subject"]: e for e in st["endpoints"]}
        info = endpoints[s.ps(1, "info")]
        # discover_replica_size may have asked too, so at least our three
        assert info["num_requests"] >= 3 and info["num_errors"] == 0 and info["processing_time"] > 0
        status = endpoints[s.srv_status("ps-1")]["data"]
        assert status["role"] == "embedding-parameter-server" and status["replica"] == 1
        assert status["stats"]["rows"] == 0 and status["stats"]["requests"] >= 3

        # an error reply is counted per subject and code
        with pytest.raises(Exception):  # noqa: B017
            await request(nc, s.ps(0, "lookup"), b"\xff\x00garbage", 5)
        (st0,) = [x for x in await discovery.stats(nc, job_name, "ps") if x["instance"] == "ps-0"]
        lookup = {e["subject"]: e for e in st0["endpoints"]}[s.ps(0, "lookup")]
        assert lookup["num_errors"] == 1 and lookup["data"] == {"errors_by_code": {"400": 1}}

        # the micro status endpoint answers the broadcast's map, per instance
        reply = unpack((await nc.request(s.srv_status(ew.worker_id), b"", timeout=5)).data)
        assert reply["instance"] == ew.worker_id and reply["role"] == "embedding-worker"


async def test_two_jobs_on_one_server_are_kept_apart(nats_server, job_name):
    other = job_name + "b"
    async with running_job(nats_server.url, job_name, replicas=1) as (nc, _, _), \
            running_job(nats_server.url, other, replicas=2):
        ours = await discovery.discover(nc, job_name, "ps")
        theirs = await discovery.discover(nc, other, "ps")
        assert [f["replica_size"] for f in ours] == [1]
        assert [f["replica_size"] for f in theirs] == [2, 2]
        assert len(of_job(await srv(nc, "$SRV.PING.persia-ps"), job_name)) == 1
        s = Subjects(job_name)
        assert await discover_replica_size(nc, s, timeout=2, deadline=5) == 1
        assert await discover_replica_size(nc, Subjects(other), timeout=2, deadline=5) == 2


async def test_wait_for_returns_once_a_late_ps_starts(nats_server, job_name):
    gcfg = global_config(job_name)
    nc = await nats.connect(nats_server.url)
    conns = [nc]
    started: list[EmbeddingParameterServer] = []

    async def start_late(index: int, delay: float) -> None:
        await asyncio.sleep(delay)
        c = await nats.connect(nats_server.url)
        conns.append(c)
        ps = EmbeddingParameterServer(c, gcfg, index, 2)
        await ps.start()
        started.append(ps)

    try:
        t0 = time.monotonic()
        late = [asyncio.create_task(start_late(0, 0.2)), asyncio.create_task(start_late(1, 0.6))]
        found = await discovery.wait_for(nc, job_name, "embedding-parameter-server", 2, deadline=10)
        assert discovery.replica_indexes(found) == {0, 1} and 0.5 < time.monotonic() - t0 < 5
        await asyncio.gather(*late)
        # the embedding worker's start-up waits through the same API
        assert await discover_replica_size(nc, Subjects(job_name), timeout=2, deadline=5) == 2
    finally:
        for ps in started:
            await ps.stop(drain_timeout=2)
        for c in conns:
            await c.close()


async def test_wait_for_times_out_with_a_clear_error(nats_server, job_name):
    nc = await nats.connect(nats_server.url)
    try:
        t0 = time.monotonic()
        with pytest.raises(discovery.DiscoveryTimeout, match=rf"2 persia-ps instance\(s\) of job '{job_name}'"):
            await discovery.wait_for(nc, job_name, "embedding-parameter-server", 2, deadline=0.8)
        assert time.monotonic() - t0 < 3
        with pytest.raises(PeersMissing, match=r"not every PS replica \(embedding-parameter-server\)"):
            await discover_replica_size(nc, Subjects(job_name), timeout=1, deadline=0.5)
    finally:
        await nc.close()


async def test_an_instance_that_stops_disappears(nats_server, job_name):
    async with running_job(nats_server.url, job_name) as (nc, pss, ew):
        assert len(await discovery.discover(nc, job_name, "ps")) == 2
        await pss[1].stop(drain_timeout=1)
        assert [f["instance"] for f in await discovery.discover(nc, job_name, "ps")] == ["ps-0"]
        assert not of_job(await srv(nc, "$SRV.PING.persia-ps"), job_name + "-none")
        with pytest.raises(discovery.DiscoveryTimeout, match=r"found replica indexes \[0\]"):
            await discovery.wait_for(nc, job_name, "ps", 2, deadline=0.5)
        await ew.stop(drain_timeout=1)
        assert await discovery.discover(nc, job_name, "embedding-worker") == []


async def test_nn_runtime_unregisters_on_close(nats_server, job_name):
    nc = await nats.connect(nats_server.url)
    client = await nats.connect(nats_server.url)
    try:
        rt = NNRuntime.build(nc, Subjects(job_name), rank=1, world_size=2, timeout=5)
        await rt.start()
        (found,) = await discovery.wait_for(client, job_name, "nn-worker", 1, deadline=5)
        assert (found["replica_index"], found["replica_size"], found["instance"]) == (1, 2, "nn-1")
        (st,) = await discovery.stats(client, job_name, "nn-worker")
        data = {e["name"]: e for e in st["endpoints"]}["status"]["data"]
        assert data["stats"]["world_size"] == 2 and data["stats"]["queued"] == 0
        await rt.close()
        assert await discovery.discover(client, job_name, "nn-worker") == []
    finally:
        await client.close()


async def test_legacy_ps_without_registration_is_still_found(nats_server, job_name, monkeypatch):
    """A PS that only answers ``ps.<i>.info`` (an older build) is found by the fallback."""

    async def no_register(*args, **kwargs):
        return None

    monkeypatch.setattr(EmbeddingParameterServer, "serve_status", no_register)
    async with running_job(nats_server.url, job_name) as (nc, pss, ew):
        assert await discovery.discover(nc, job_name, "ps") == []
        assert ew.ps is not None and ew.ps.replica_size == 2
        assert await discover_replica_size(nc, Subjects(job_name), timeout=2, deadline=5) == 2


async def test_status_command_builds_its_table_from_srv(nats_server, job_name, nn_runtime, monkeypatch, capsys):
    from persia.launcher import main

    monkeypatch.setenv("PERSIA_NATS_URL", nats_server.url)
    monkeypatch.setenv("PERSIA_JOB_NAME", job_name)
    async with running_job(nats_server.url, job_name) as (nc, pss, ew):
        assert await asyncio.to_thread(main, ["status", "--wait", "0.3"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].split()[:6] == ["role", "replica", "instance", "version", "uptime", "metrics"]
        assert "rows" in out[0].split() and "requests" in out[0].split()
        lines = [line.split() for line in out[1:]]
        assert [(x[0], x[1], x[2]) for x in lines] == [
            ("embedding-parameter-server", "0", "ps-0"), ("embedding-parameter-server", "1", "ps-1"),
            ("embedding-worker", "0", ew.worker_id), ("nn-worker", "0", "nn-0")]
        assert all(x[3] == discovery.project_version() and x[4].endswith("s") for x in lines)
        assert all(x[5] == "-" for x in lines)  # metrics are off in this job

        assert await asyncio.to_thread(main, ["status", "--wait", "0.3", "--json"]) == 0
        entries = json.loads(capsys.readouterr().out)
        assert [e["source"] for e in entries] == ["srv"] * 4
        ps0 = entries[0]
        assert ps0["stats"]["rows"] == 0 and ps0["replica_size"] == 2 and ps0["uptime_s"] >= 0
        assert ps0["metrics_port"] is None
        assert Subjects(job_name).ps(0, "lookup") in ps0["subjects"]

        # $SRV is the one registry: an instance that unregistered is gone from the table, though it
        # still answers the status broadcast
        await pss[1].registration.stop()
        assert await asyncio.to_thread(main, ["status", "--wait", "0.3", "--json"]) == 0
        entries = json.loads(capsys.readouterr().out)
        assert [e["instance"] for e in entries] == ["ps-0", ew.worker_id, "nn-0"]
        assert {r["instance"] for r in await gather(nc, Subjects(job_name).status(), Empty(), 0.3)} >= {"ps-1"}
