"""PS checkpoints over a real nats-server: dump through ps.<i>.checkpoint, load at start and on request."""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import numpy as np
import pytest
from persia_nats.common import checkpoint as ck
from persia_nats.common.codec import WIRE_VERSION, array_from_wire, pack
from persia_nats.common.errors import BadRequest, Conflict
from persia_nats.common.messages import (
    Empty,
    PsCheckpoint,
    PsConfigure,
    PsLookup,
    PsLookupGroup,
    PsUpdate,
    PsUpdateGroup,
)
from persia_nats.common.optim_config import AdagradConfig, EmbeddingHyperparams
from persia_nats.common.rpc import request
from persia_nats.common.subjects import Subjects
from persia_nats.core.sharding import split_by_shard
from persia_nats.core.store import EmbeddingStore
from persia_nats.core.store_checkpoint import load_store
from persia_nats.services.embedding_ps.service import EmbeddingParameterServer

from tests.integration.helpers import global_config

DIMS = (4, 8)
IDS = np.random.default_rng(7).integers(1, 2**63, size=400, dtype=np.uint64)
OPTIMIZER = AdagradConfig(lr=0.05)
HYPER = EmbeddingHyperparams(init_lower=-0.1, init_upper=0.1)


@contextlib.asynccontextmanager
async def replicas(url: str, job: str, n: int, root: Path | str | None, gcfg=None) -> AsyncIterator[tuple]:
    """``n`` PS replicas of ``job`` in this event loop (``root``: their checkpoint root, None: none;
    ``gcfg``: their global config, the test default's when None)."""
    gcfg = global_config(job) if gcfg is None else gcfg
    nc = await nats.connect(url)
    services = []
    try:
        for i in range(n):
            ps = EmbeddingParameterServer(nc, gcfg, i, n, checkpoint_dir="" if root is None else str(root))
            await ps.start()
            services.append(ps)
        yield nc, services
    finally:
        for ps in services:
            await ps.stop(drain_timeout=5)
        await nc.close()


async def call(nc, job: str, replica: int, verb: str, msg, timeout: float = 10):
    return await request(nc, Subjects(job).ps(replica, verb), msg, timeout)


async def lookup(nc, job: str, n: int, ids: np.ndarray, dim: int, train: bool) -> np.ndarray:
    """Rows of ``ids``, routed to the replicas as the embedding workers route them."""
    out = np.zeros((ids.shape[0], dim), np.float32)
    for shard, pos in split_by_shard(ids, n):
        msg = PsLookup((PsLookupGroup(dim, ids[pos]),), train)
        reply = await call(nc, job, shard, "lookup", msg)
        out[pos] = array_from_wire(reply["groups"][0], "rows")
    return out


async def update(nc, job: str, n: int, ids: np.ndarray, grads: np.ndarray) -> int:
    missing = 0
    for shard, pos in split_by_shard(ids, n):
        msg = PsUpdate((PsUpdateGroup(ids[pos], grads[pos]),))
        missing += (await call(nc, job, shard, "update", msg))["missing"]
    return missing


async def train(nc, job: str, n: int) -> None:
    configure = PsConfigure(OPTIMIZER, HYPER)
    for i in range(n):
        await call(nc, job, i, "configure", configure)
    rng = np.random.default_rng(3)
    for _ in range(4):
        for dim in DIMS:
            batch = rng.choice(IDS, 150)
            await lookup(nc, job, n, batch, dim, train=True)
            assert await update(nc, job, n, batch, rng.standard_normal((150, dim)).astype(np.float32)) == 0


async def eval_rows(nc, job: str, n: int) -> dict[int, np.ndarray]:
    return {dim: await lookup(nc, job, n, IDS, dim, train=False) for dim in DIMS}


async def take_checkpoint(nc, job: str, n: int, root: Path, rel: bool = False) -> Path:
    """What the NN worker's coordinator does: a dump on every replica, then finalize."""
    partial = ck.partial_dir(root, ck.next_number(root))
    files, rows = {}, 0
    for i in range(n):
        reply = await call(nc, job, i, "checkpoint",
                           PsCheckpoint("dump", partial.name if rel else str(partial)))
        files.update(reply["files"])
        rows += reply["rows"]
    assert all(set(d) == {"size", "sha256"} for d in files.values())
    assert rows > 0
    return ck.finalize(partial, files, {"ps_rows": rows})


def new_job() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


async def test_a_restarted_ps_loads_the_checkpoint_and_trains_on(nats_server, job_name, tmp_path):
    root = tmp_path / "ckpt"
    restored_job = new_job()
    async with replicas(nats_server.url, job_name, 2, root) as (nc, original):
        assert all(ps.loaded_checkpoint == "" and not ps.configured for ps in original)  # nothing to load yet
        await train(nc, job_name, 2)
        ckpt = await take_checkpoint(nc, job_name, 2, root)
        assert ckpt.name == "ckpt-00000001" and ck.verify(ckpt) == []
        expected = await eval_rows(nc, job_name, 2)
        async with replicas(nats_server.url, restored_job, 2, root) as (_, restored):
            for old, new in zip(original, restored, strict=True):
                assert new.loaded_checkpoint == "ckpt-00000001" and new.configured
                assert len(new.store) == len(old.store) > 0
                info = await call(nc, restored_job, new.replica_index, "info", Empty())
                assert info["configured"] and info["loaded_checkpoint"] == "ckpt-00000001"
            got = await eval_rows(nc, restored_job, 2)
            for dim in DIMS:
                np.testing.assert_array_equal(got[dim], expected[dim])
            # no configure needed: the same update moves both jobs' rows alike
            grads = np.random.default_rng(11).standard_normal((IDS.shape[0], 8)).astype(np.float32)
            assert await update(nc, restored_job, 2, IDS, grads) == await update(nc, job_name, 2, IDS, grads)
            np.testing.assert_array_equal(await lookup(nc, restored_job, 2, IDS, 8, False),
                                          await lookup(nc, job_name, 2, IDS, 8, False))


@pytest.mark.parametrize("new_size", [3, 1])
async def test_a_checkpoint_loads_into_another_replica_count(nats_server, job_name, tmp_path, new_size):
    root = tmp_path / "ckpt"
    async with replicas(nats_server.url, job_name, 2, root) as (nc, original):
        await train(nc, job_name, 2)
        await take_checkpoint(nc, job_name, 2, root, rel=True)  # dir relative to the root
        expected = await eval_rows(nc, job_name, 2)
        total = sum(len(ps.store) for ps in original)
    job = new_job()
    async with replicas(nats_server.url, job, new_size, root) as (nc, restored):
        assert sum(len(ps.store) for ps in restored) == total
        got = await eval_rows(nc, job, new_size)
        for dim in DIMS:
            np.testing.assert_array_equal(got[dim], expected[dim])


async def test_load_on_request_replaces_the_rows(nats_server, job_name, tmp_path):
    root = tmp_path / "ckpt"
    async with replicas(nats_server.url, job_name, 2, root) as (nc, _):
        await train(nc, job_name, 2)
        ckpt = await take_checkpoint(nc, job_name, 2, root)
        expected = await eval_rows(nc, job_name, 2)
    job = new_job()
    # a root holding the checkpoint below it, so nothing is loaded at start
    async with replicas(nats_server.url, job, 3, tmp_path) as (nc, restored):
        await lookup(nc, job, 3, IDS[:10] + np.uint64(1), 4, train=True)  # rows the load must replace
        with pytest.raises(Conflict):
            await update(nc, job, 3, IDS[:1], np.ones((1, 4), np.float32))
        rows = 0
        for i in range(3):
            reply = await call(nc, job, i, "checkpoint", PsCheckpoint("load", str(ckpt)))
            assert reply["checkpoint"] == "ckpt-00000001"
            rows += reply["rows"]
        assert rows == sum(len(ps.store) for ps in restored)
        assert all(ps.configured and ps.loaded_checkpoint == "ckpt-00000001" for ps in restored)
        got = await eval_rows(nc, job, 3)
        for dim in DIMS:
            np.testing.assert_array_equal(got[dim], expected[dim])
        assert await update(nc, job, 3, IDS[:1], np.ones((1, 4), np.float32)) == 0


async def test_a_damaged_newest_checkpoint_falls_back_at_start_and_is_refused_on_request(nats_server, job_name,
                                                                                      tmp_path):
    root = tmp_path / "ckpt"
    async with replicas(nats_server.url, job_name, 1, root) as (nc, (ps,)):
        await train(nc, job_name, 1)
        await take_checkpoint(nc, job_name, 1, root)
        expected = await eval_rows(nc, job_name, 1)
        await train(nc, job_name, 1)
        newest = await take_checkpoint(nc, job_name, 1, root)
        emb = newest / "ps/replica-0-of-1/dim8.emb.npy"
        emb.write_bytes(emb.read_bytes()[:-4])  # truncated
        before = await eval_rows(nc, job_name, 1)
        with pytest.raises(BadRequest, match="ckpt-00000002 is invalid.*dim8.emb.npy"):
            await call(nc, job_name, 0, "checkpoint", PsCheckpoint("load", str(newest)))
        after = await eval_rows(nc, job_name, 1)
        for dim in DIMS:
            np.testing.assert_array_equal(after[dim], before[dim])
    job = new_job()
    async with replicas(nats_server.url, job, 1, root) as (nc, (ps,)):
        assert ps.loaded_checkpoint == "ckpt-00000001"
        got = await eval_rows(nc, job, 1)
        for dim in DIMS:
            np.testing.assert_array_equal(got[dim], expected[dim])


async def test_paths_outside_the_root_are_refused_and_change_nothing(nats_server, job_name, tmp_path):
    root = tmp_path / "ckpt"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    async with replicas(nats_server.url, job_name, 1, root) as (nc, (ps,)):
        await train(nc, job_name, 1)
        good = await take_checkpoint(nc, job_name, 1, root)
        (root / "link").symlink_to(outside)
        foreign = outside / good.name  # a valid checkpoint, but not where this PS may read
        foreign.mkdir()
        before = await eval_rows(nc, job_name, 1)
        for action, where in [
            ("dump", str(outside / "ckpt-00000009.partial")),
            ("dump", "../elsewhere/ckpt-00000009.partial"),
            ("dump", str(root / "link" / "ckpt-00000009.partial")),
            ("load", str(foreign)),
            ("load", str(root / ".." / "elsewhere" / good.name)),
        ]:
            with pytest.raises(BadRequest, match="outside the checkpoint root"):
                await call(nc, job_name, 0, "checkpoint", PsCheckpoint(action, where))
        assert list(outside.iterdir()) == [foreign] and list(foreign.iterdir()) == []
        after = await eval_rows(nc, job_name, 1)
        for dim in DIMS:
            np.testing.assert_array_equal(after[dim], before[dim])
        assert ps.loaded_checkpoint == ""


@pytest.mark.parametrize("msg, match", [
    ({"v": WIRE_VERSION, "dir": "ckpt-00000001"}, "action"),
    ({"v": WIRE_VERSION, "action": "delete", "dir": "ckpt-00000001"}, "action"),
    ({"v": WIRE_VERSION, "action": 1, "dir": "ckpt-00000001"}, "action"),
    ({"v": WIRE_VERSION, "action": "load"}, "dir"),
    ({"v": WIRE_VERSION, "action": "load", "dir": 5}, "dir"),
    ({"v": WIRE_VERSION, "action": "load", "dir": ""}, "dir"),
    ({"v": WIRE_VERSION, "action": "load", "dir": "x" * 5000}, "dir"),
    ({"v": WIRE_VERSION, "action": "load", "dir": "ckpt-00000001\x00"}, "dir"),
    ({"v": WIRE_VERSION, "action": "load", "dir": "ckpt-00000077"}, "no such checkpoint"),
    ({"v": WIRE_VERSION, "action": "load", "dir": "ckpt-00000001.partial"}, "named ckpt-<number>"),
    ({"v": WIRE_VERSION, "action": "dump", "dir": "ckpt-00000002"}, r"named ckpt-<number>\.partial"),
    ({"v": WIRE_VERSION, "action": "dump", "dir": "not-a-checkpoint"}, "named"),
    ({"v": 2, "action": "dump", "dir": "ckpt-00000002.partial"}, "version"),
    # names the job never writes: each would have become a directory, or moved the counter out of reach
    ({"v": WIRE_VERSION, "action": "dump", "dir": "ckpt-999999999999999999.partial"}, "8 ASCII digits"),
    ({"v": WIRE_VERSION, "action": "dump", "dir": "ckpt-99999999.partial"}, "must be the next number"),
    ({"v": WIRE_VERSION, "action": "dump", "dir": "~/x"}, "8 ASCII digits"),
    ({"v": WIRE_VERSION, "action": "dump", "dir": "a/b/ckpt-00000002.partial"}, "directly in the checkpoint root"),
    ({"v": WIRE_VERSION, "action": "dump", "dir": "ckpt-\u0663.partial"}, "8 ASCII digits"),
    ({"v": WIRE_VERSION, "action": "load", "dir": "ckpt-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661"},
     "8 ASCII digits"),
    (b"\xc1garbage", None),
])
async def test_bad_checkpoint_requests_are_refused(nats_server, job_name, tmp_path, msg, match):
    root = tmp_path / "ckpt"
    async with replicas(nats_server.url, job_name, 1, root) as (nc, (ps,)):
        await train(nc, job_name, 1)
        ck.partial_dir(root, 1).mkdir(parents=True)  # a partial checkpoint is no checkpoint to load
        rows = len(ps.store)
        with pytest.raises(BadRequest, match=match):
            await call(nc, job_name, 0, "checkpoint", msg if isinstance(msg, bytes) else pack(msg))
        assert len(ps.store) == rows and ps.loaded_checkpoint == ""
        assert sorted(p.name for p in root.iterdir()) == ["ckpt-00000001.partial"]
        assert list((root / "ckpt-00000001.partial").iterdir()) == []


async def test_a_dump_is_a_snapshot_while_lookups_keep_arriving(nats_server, job_name, tmp_path):
    root = tmp_path / "ckpt"
    async with replicas(nats_server.url, job_name, 1, root) as (nc, (ps,)):
        await train(nc, job_name, 1)
        rows_before = len(ps.store)
        partial = ck.partial_dir(root, 1)
        fresh = np.arange(1, 2001, dtype=np.uint64)
        dump = asyncio.create_task(call(nc, job_name, 0, "checkpoint",
                                        PsCheckpoint("dump", str(partial))))
        await asyncio.gather(*(lookup(nc, job_name, 1, fresh[k::20], 4, train=True) for k in range(20)))
        reply = await dump
        assert len(ps.store) == rows_before + fresh.shape[0]
        # the dump saw the store before or after each lookup, never in between
        ckpt = ck.finalize(partial, reply["files"])
        restored = EmbeddingStore(10**6)
        assert load_store(restored, ckpt, 0, 1, ck.read_manifest(ckpt)["files"]) == reply["rows"]
        assert (reply["rows"] - rows_before) % 100 == 0  # whole lookups of 100 ids each


async def test_without_a_root_every_checkpoint_request_is_refused(nats_server, job_name, tmp_path):
    async with replicas(nats_server.url, job_name, 1, None) as (nc, _):
        for action, name in (("dump", "ckpt-00000001.partial"), ("load", "ckpt-00000001")):
            for path in (name, str(tmp_path / name)):
                with pytest.raises(BadRequest, match="no checkpoint root"):
                    await call(nc, job_name, 0, "checkpoint", PsCheckpoint(action, path))
        assert not (tmp_path / "ckpt-00000001.partial").exists()


def test_the_root_comes_from_the_config_unless_given(tmp_path):
    from persia_nats.common.config import global_config_from_dict

    cfg = global_config_from_dict({"common_config": {"checkpointing_config": {"checkpoint_dir": str(tmp_path)}}})
    assert EmbeddingParameterServer(None, cfg).checkpoint_root == tmp_path.resolve()
    assert EmbeddingParameterServer(None, cfg, checkpoint_dir="").checkpoint_root is None
    assert EmbeddingParameterServer(None, cfg, checkpoint_dir=str(tmp_path / "x")).checkpoint_root == \
        (tmp_path / "x").resolve()


async def test_lookups_and_updates_are_answered_during_a_dump_which_is_the_store_when_it_began(
        nats_server, job_name, tmp_path):
    from persia_nats.core.store_checkpoint import DumpPace

    root = tmp_path / "ckpt"
    async with replicas(nats_server.url, job_name, 1, root) as (nc, (ps,)):
        await train(nc, job_name, 1)
        ps.dump_pace = DumpPace(scan_slots=8, step_bytes=64)  # thousands of steps, each yielding to requests
        partial = ck.partial_dir(root, 1)
        dump = asyncio.create_task(call(nc, job_name, 0, "checkpoint", PsCheckpoint("dump", str(partial)), timeout=60))
        for _ in range(2000):  # until the dump has begun: T0, with no request sent since
            if all(t.snapshot is not None for t in ps.store.tables.values()):
                break
            await asyncio.sleep(0.005)
        at_t0 = {dim: t.state_dict() for dim, t in ps.store.tables.items()}
        rng = np.random.default_rng(11)
        for dim in DIMS:
            batch = np.concatenate([rng.choice(IDS, 100), np.arange(1, 51, dtype=np.uint64)])
            await lookup(nc, job_name, 1, batch, dim, train=True)
            assert await update(nc, job_name, 1, batch, rng.standard_normal((150, dim)).astype(np.float32)) == 0
        assert not dump.done()  # answered while the dump went on
        reply = await dump
        ckpt = ck.finalize(partial, reply["files"])
        restored = EmbeddingStore(10**6)
        assert load_store(restored, ckpt, 0, 1, ck.read_manifest(ckpt)["files"]) == reply["rows"]
        for dim, before in at_t0.items():
            got = restored.tables[dim].state_dict()
            for key in ("keys", "emb", "state"):
                assert np.array_equal(got[key], before[key]), (dim, key)


async def test_a_replica_hashes_only_its_own_shard_and_only_the_damaged_shards_owner_falls_back(
        nats_server, job_name, tmp_path):
    root = tmp_path / "ckpt"
    async with replicas(nats_server.url, job_name, 2, root) as (nc, _):
        await train(nc, job_name, 2)
        await take_checkpoint(nc, job_name, 2, root)
        older = await eval_rows(nc, job_name, 2)
        await train(nc, job_name, 2)
        newest = await take_checkpoint(nc, job_name, 2, root)
        expected = await eval_rows(nc, job_name, 2)
    emb = newest / "ps/replica-1-of-2/dim8.emb.npy"
    data = bytearray(emb.read_bytes())
    data[-3] ^= 0x40  # the size stays: only a hash finds it
    emb.write_bytes(bytes(data))
    job = new_job()
    async with replicas(nats_server.url, job, 2, root) as (nc, (first, second)):
        # replica 0 never reads replica 1's files: it loads the newest checkpoint, its rows exact
        assert first.loaded_checkpoint == "ckpt-00000002" and second.loaded_checkpoint == "ckpt-00000001"
        got = await eval_rows(nc, job, 2)
        owner = np.zeros(IDS.shape[0], np.int64)
        for shard, pos in split_by_shard(IDS, 2):
            owner[pos] = shard
        for dim in DIMS:
            np.testing.assert_array_equal(got[dim][owner == 0], expected[dim][owner == 0])
            np.testing.assert_array_equal(got[dim][owner == 1], older[dim][owner == 1])
        with pytest.raises(BadRequest, match="ckpt-00000002 is invalid.*replica-1-of-2/dim8.emb.npy.*corrupt"):
            await call(nc, job, 1, "checkpoint", PsCheckpoint("load", str(newest)))
        # the NN worker, which hashes every file, resumes from the older one, and has replica 0 reload it: the
        # job does not train on two checkpoints at once
        from types import SimpleNamespace

        from persia_nats.common.checkpoint import latest_valid
        from persia_nats.services.nn_worker.ps_checkpoint import align_ps

        chosen = latest_valid(root)
        assert chosen is not None and chosen.name == "ckpt-00000001"
        assert await align_ps(SimpleNamespace(nc=nc, subjects=Subjects(job)), chosen, 5) == [0]
        assert first.loaded_checkpoint == second.loaded_checkpoint == "ckpt-00000001"
        got = await eval_rows(nc, job, 2)
        for dim in DIMS:
            np.testing.assert_array_equal(got[dim], older[dim])
        assert await align_ps(SimpleNamespace(nc=nc, subjects=Subjects(job)), chosen, 5) == []


def test_only_replicas_ahead_of_the_resumed_checkpoint_reload():
    from persia_nats.services.nn_worker.ps_checkpoint import ahead_of

    ckpt = Path("/c/ckpt-00000005")
    # behind (an NN worker restarted alone: the replicas are live since their own start) or equal: left alone
    assert ahead_of(["ckpt-00000005", "ckpt-00000003", ""], ckpt) == []
    assert ahead_of(["ckpt-00000006", "ckpt-00000005"], ckpt) == [0]
    assert ahead_of(["ckpt-00000002", ""], None) == [0]


async def test_a_loading_replica_says_how_far_it_has_read(nats_server, job_name, tmp_path, monkeypatch, caplog):
    import logging
    import time

    from persia_nats.services.embedding_ps import service

    root = tmp_path / "ckpt"
    async with replicas(nats_server.url, job_name, 1, root) as (nc, _):
        await train(nc, job_name, 1)
        await take_checkpoint(nc, job_name, 1, root)
    seen: list[str] = []
    reporter = EmbeddingParameterServer._load_reporter

    def slowed(self, name):
        report = reporter(self, name)

        def each_block(progress):
            report(progress)
            seen.append(self.waiting_for)
            time.sleep(0.02)  # (on the reading thread) long enough for info requests to see a load under way

        return each_block

    monkeypatch.setattr(EmbeddingParameterServer, "_load_reporter", slowed)
    monkeypatch.setattr(service, "LOAD_LOG_EVERY", 0.0)
    job = new_job()
    nc = await nats.connect(nats_server.url)
    ps = EmbeddingParameterServer(nc, global_config(job), 0, 1, checkpoint_dir=str(root))
    caplog.set_level(logging.INFO, logger=service.__name__)
    try:
        starting = asyncio.create_task(ps.start())
        answered = []
        while not starting.done():
            with contextlib.suppress(Exception):  # before info is served
                answered.append((await call(nc, job, 0, "info", Empty(), timeout=1))["waiting_for"])
            await asyncio.sleep(0.01)
        await starting
        pattern = r"the load of checkpoint ckpt-00000001: [0-9.]+ of [0-9.]+ kB read"
        assert any(re.fullmatch(pattern, w) for w in answered), answered
        assert re.fullmatch(pattern, seen[-1])
        done, total = re.findall(r"[0-9.]+", seen[-1].rpartition(":")[2])
        assert done == total and len(seen) > 6
        assert "loading checkpoint ckpt-00000001" in caplog.text
        assert ps.waiting_for == "" and ps.loaded_checkpoint == "ckpt-00000001"
    finally:
        await ps.stop(drain_timeout=5)
        await nc.close()
