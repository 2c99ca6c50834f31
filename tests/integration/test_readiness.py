"""Readiness that means ready, over a real nats-server: each role is "not ready" until it can do its job,
"ready" after, and a PS loading its shard is live all along (``persia-launcher health``, common/health.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest
import torch
from persia_nats.common import checkpoint as ck
from persia_nats.common.config import embedding_config_from_dict
from persia_nats.common.discovery import discover_replica_size
from persia_nats.common.errors import PeersMissing
from persia_nats.common.health import Health
from persia_nats.common.health import check as check_subject
from persia_nats.common.subjects import Subjects
from persia_nats.dense.checkpoint import MODEL_FILE, STATE_FILE, torch_bytes
from persia_nats.services.embedding_ps.service import EmbeddingParameterServer
from persia_nats.services.embedding_worker.service import EmbeddingWorkerService
from persia_nats.services.nn_worker.runtime import NNRuntime
from persia_nats.services.serving.service import InferenceService

from persia.launcher import health_subject
from tests.integration.helpers import EMBEDDING, global_config
from tests.integration.test_ps_checkpoint import replicas, take_checkpoint, train
from tests.procs import ROOT, job_env, launcher_cmd

PS = "embedding-parameter-server"


class GatedLoadPS(EmbeddingParameterServer):
    """A PS whose checkpoint load waits for the test: a load as long as the test needs to look at it."""

    gate: asyncio.Event

    async def _load(self, ckpt: Path) -> int:
        await self.gate.wait()
        return await super()._load(ckpt)


async def check(nc: nats.NATS, subjects: Subjects, target: str, index: int, timeout: float) -> Health:
    return await check_subject(nc, health_subject(subjects.job, target, index), target, timeout)


async def health_cli(url: str, job: str, *args: str) -> tuple[int, str]:
    """``persia-launcher health ...`` as a probe runs it: exit status and stderr."""
    proc = await asyncio.create_subprocess_exec(
        *launcher_cmd("health", *args, "--timeout", "3"), cwd=ROOT, env=job_env(url, job),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_a_ps_loading_its_shard_is_live_not_ready_and_not_found_by_peers(nats_server, job_name, tmp_path):
    root = tmp_path / "ckpt"
    async with replicas(nats_server.url, job_name, 1, root) as (nc, _):
        await train(nc, job_name, 1)
        ckpt = await take_checkpoint(nc, job_name, 1, root)
    restored = f"{job_name}r"
    subjects = Subjects(restored)
    nc = await nats.connect(nats_server.url)
    ps = GatedLoadPS(nc, global_config(restored), 0, 1, checkpoint_dir=str(root))
    ps.gate = asyncio.Event()
    try:
        before = await check(nc, subjects, PS, 0, 1)
        assert not before.live and not before.ready
        starting = asyncio.get_running_loop().create_task(ps.start())
        for _ in range(200):
            loading = await check(nc, subjects, PS, 0, 1)
            if loading.live and ckpt.name in loading.why:
                break
            await asyncio.sleep(0.05)
        assert loading.live and not loading.ready, loading
        assert loading.why == f"waiting for the load of checkpoint {ckpt.name}"
        code, err = await health_cli(nats_server.url, restored, PS, "--replica-index", "0")
        assert code == 1 and f"not ready: {PS} 0" in err and ckpt.name in err, err
        assert (await health_cli(nats_server.url, restored, PS, "--replica-index", "0", "--live"))[0] == 0
        # an embedding worker counting replicas does not take a loading one for a serving one
        with pytest.raises(PeersMissing):
            await discover_replica_size(nc, subjects, 1, 0.5)
        ps.gate.set()
        await asyncio.wait_for(starting, 30)
        after = await check(nc, subjects, PS, 0, 1)
        assert after.ready and after.info["loaded_checkpoint"] == ckpt.name
        assert await discover_replica_size(nc, subjects, 1, 5) == 1
        assert (await health_cli(nats_server.url, restored, PS, "--replica-index", "0"))[0] == 0
    finally:
        ps.gate.set()
        await ps.stop(drain_timeout=5)
        await nc.close()


async def test_an_embedding_worker_is_ready_once_it_found_every_ps_replica(nats_server, job_name):
    gcfg = global_config(job_name)
    subjects = Subjects(job_name)
    nc = await nats.connect(nats_server.url)
    ew = EmbeddingWorkerService(nc, gcfg, embedding_config_from_dict(EMBEDDING), 0, ps_wait_s=30)
    pss = [EmbeddingParameterServer(nc, gcfg, i, 2) for i in range(2)]
    try:
        starting = asyncio.get_running_loop().create_task(ew.start())
        await pss[0].start()
        await asyncio.sleep(0.5)
        waiting = await check(nc, subjects, "embedding-worker", 0, 1)
        assert not waiting.ready and not starting.done()
        await pss[1].start()
        await asyncio.wait_for(starting, 30)
        assert (await check(nc, subjects, "embedding-worker", 0, 2)).ready
    finally:
        for service in (ew, *pss):
            await service.stop(drain_timeout=5)
        await nc.close()


async def test_an_nn_rank_is_ready_once_its_rendezvous_is_done(nats_server, job_name):
    subjects = Subjects(job_name)
    nc = await nats.connect(nats_server.url)
    rt = NNRuntime.build(nc, subjects, rank=1, world_size=2, timeout=5)
    try:
        await rt.start()
        before = await check(nc, subjects, "nn-worker", 0, 2)
        assert before.live and not before.ready and "rendezvous" in before.why
        rt.joined_dense_group()  # what TrainCtx calls once init_process_group returned
        assert (await check(nc, subjects, "nn-worker", 0, 2)).ready
    finally:
        await rt.close()
        await nc.close()


def _model() -> torch.nn.Module:
    return torch.nn.Linear(2, 1)


async def _serving_checkpoint(url: str, job: str, root: Path) -> Path:
    """A final checkpoint with rows (a PS dump) and dense weights, as a training job leaves one."""
    async with replicas(url, job, 1, root) as (nc, _):
        await train(nc, job, 1)
        partial = ck.partial_dir(root, ck.next_number(root))
        reply = await take_checkpoint_files(nc, job, partial)
    (partial / "dense").mkdir(exist_ok=True)
    files = {**reply, MODEL_FILE: ck.write_bytes_atomic(partial / MODEL_FILE, torch_bytes(_model().state_dict())),
             STATE_FILE: ck.write_bytes_atomic(partial / STATE_FILE, b'{"step": 7}')}
    return ck.finalize(partial, files)


async def take_checkpoint_files(nc: nats.NATS, job: str, partial: Path) -> dict:
    from persia_nats.common.messages import PsCheckpoint
    from persia_nats.common.rpc import request

    reply = await request(nc, Subjects(job).ps(0, "checkpoint"), PsCheckpoint("dump", str(partial)), 30)
    return dict(reply["files"])


async def test_a_server_is_ready_only_once_a_checkpoint_is_loaded(nats_server, job_name, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    subjects = Subjects(job_name)
    nc = await nats.connect(nats_server.url)
    server = InferenceService(nc, global_config(job_name), embedding_config_from_dict(EMBEDDING), _model, root,
                              reload_interval=0)
    try:
        await server.start()
        empty = await check(nc, subjects, "serve", 0, 2)
        assert empty.live and not empty.ready and "no checkpoint loaded" in empty.why
        code, err = await health_cli(nats_server.url, job_name, "serve")
        assert code == 1 and "not ready: serve" in err, err
        assert (await health_cli(nats_server.url, job_name, "serve", "--live"))[0] == 0
        ckpt = await _serving_checkpoint(nats_server.url, f"{job_name}t", root)
        assert await server.reload()
        loaded = await check(nc, subjects, "serve", 0, 2)
        assert loaded.ready and loaded.info["checkpoint"] == ckpt.name
        assert (await health_cli(nats_server.url, job_name, "serve"))[0] == 0
    finally:
        await server.stop(drain_timeout=5)
        await nc.close()

