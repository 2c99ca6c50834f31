"""PS replicas whose checkpoint root is a URL: a checkpoint published there (manifest last) is what a
fresh set of replicas, with an empty cache, loads at start. Against fsspec's in-memory filesystem,
and against S3 as moto's server speaks it on 127.0.0.1 (where moto and s3fs are installed)."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from persia_nats.common import checkpoint as ck
from persia_nats.common.storage import _filesystem, publish

from tests.integration.test_ps_checkpoint import eval_rows, replicas, take_checkpoint, train


@pytest.fixture
def s3_url(monkeypatch) -> Iterator[str]:
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")):
        monkeypatch.setenv(name, value)
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)  # a cached client would keep another endpoint
    fs.mkdir("persia-ckpt")
    try:
        yield "s3://persia-ckpt/jobs"
    finally:
        server.stop()
        fsspec.filesystem("s3").clear_instance_cache()


@pytest.fixture(params=["memory", "s3"])
def url(request) -> str:
    if request.param == "memory":
        return f"memory://bucket/{uuid.uuid4().hex}"
    return request.getfixturevalue("s3_url")


async def test_fresh_replicas_load_what_was_published(nats_server, job_name, url, tmp_path, monkeypatch):
    monkeypatch.setenv("PERSIA_CHECKPOINT_CACHE", str(tmp_path / "writer-cache"))
    async with replicas(nats_server.url, job_name, 2, url) as (nc, original):
        assert all(ps.storage.remote == url for ps in original)
        await train(nc, job_name, 2)
        cache = original[0].checkpoint_root
        ckpt = await take_checkpoint(nc, job_name, 2, cache)
        assert publish(original[0].storage, ckpt) == f"{url}/{ckpt.name}"
        expected = await eval_rows(nc, job_name, 2)
    # another host: an empty cache of its own
    monkeypatch.setenv("PERSIA_CHECKPOINT_CACHE", str(tmp_path / "reader-cache"))
    restored_job = f"t{uuid.uuid4().hex[:12]}"
    async with replicas(nats_server.url, restored_job, 2, url) as (nc, restored):
        for ps in restored:
            assert ps.loaded_checkpoint == ckpt.name
            assert ps.checkpoint_root != cache and ck.verify(ps.checkpoint_root / ckpt.name) == []
        got = await eval_rows(nc, restored_job, 2)
    for dim, rows in expected.items():
        np.testing.assert_array_equal(got[dim], rows)
    if url.startswith("memory://"):
        _filesystem(url).rm(url, recursive=True)


async def test_a_checkpoint_whose_upload_stopped_before_its_manifest_is_not_loaded(nats_server, job_name, tmp_path,
                                                                                 monkeypatch):
    url = f"memory://bucket/{uuid.uuid4().hex}"
    monkeypatch.setenv("PERSIA_CHECKPOINT_CACHE", str(tmp_path / "writer-cache"))
    async with replicas(nats_server.url, job_name, 1, url) as (nc, (ps,)):
        await train(nc, job_name, 1)
        ckpt = await take_checkpoint(nc, job_name, 1, ps.checkpoint_root)
        publish(ps.storage, ckpt)
        _filesystem(url).rm(f"{url}/{ckpt.name}/MANIFEST.json")
    monkeypatch.setenv("PERSIA_CHECKPOINT_CACHE", str(tmp_path / "reader-cache"))
    async with replicas(nats_server.url, f"t{uuid.uuid4().hex[:12]}", 1, url) as (_, (fresh,)):
        assert fresh.loaded_checkpoint == "" and len(fresh.store) == 0
    _filesystem(url).rm(url, recursive=True)
