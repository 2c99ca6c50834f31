"""Checkpoint roots as URLs (persia_nats.common.storage): scheme checks, and publish / pull / prune against fsspec's
in-memory filesystem (a real fsspec filesystem, the one s3fs and gcsfs implement the API of)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from persia_nats.common import checkpoint as ck
from persia_nats.common.config import global_config_from_dict
from persia_nats.common.errors import ConfigError
from persia_nats.common.storage import (
    CheckpointRoot,
    _filesystem,
    check_root,
    open_root,
    prune_remote,
    publish,
    pull_newest,
)

from tests.unit.test_checkpoint import make_checkpoint


@pytest.mark.parametrize("raw, message", [
    ("http://host/ckpt", "unknown scheme 'http'"), ("ftp://host/ckpt", "unknown scheme 'ftp'"),
    ("s3:/bucket/ckpt", "missing a '/'"), ("s3://", "names no bucket"), ("file://host/ckpt", "local path")])
def test_roots_that_are_no_path_and_no_known_url_are_refused(raw, message):
    with pytest.raises(ConfigError, match=message):
        check_root(raw)
    with pytest.raises(ConfigError, match="checkpointing_config.checkpoint_dir"):
        global_config_from_dict({"common_config": {"checkpointing_config": {"checkpoint_dir": raw}}})


def test_paths_and_file_urls_are_local_directories(tmp_path):
    assert open_root(str(tmp_path)) == CheckpointRoot(tmp_path.resolve())
    assert open_root(f"file://{tmp_path}/c%20d") == CheckpointRoot((tmp_path / "c d").resolve())
    assert open_root("relative/ckpt").local == Path("relative/ckpt").resolve()


def test_a_url_root_caches_locally(tmp_path):
    root = open_root("memory://bucket/ckpt", cache=tmp_path / "cache")
    assert root.remote == "memory://bucket/ckpt" and root.local == (tmp_path / "cache").resolve()


@pytest.fixture
def remote(tmp_path):
    """A URL root on fsspec's in-memory filesystem, and a writer cache and a reader cache for it."""
    url = f"memory://bucket/{uuid.uuid4().hex}"
    yield open_root(url, cache=tmp_path / "writer"), open_root(url, cache=tmp_path / "reader")
    _filesystem(url).rm(url, recursive=True)


def test_a_published_checkpoint_is_pulled_whole_and_verified(remote):
    writer, reader = remote
    assert pull_newest(reader) is None  # nothing there yet
    first = make_checkpoint(writer.local, b"one")
    second = make_checkpoint(writer.local, b"two")
    for ckpt in (first, second):
        assert publish(writer, ckpt) == f"{writer.remote}/{ckpt.name}"
    pulled = pull_newest(reader)
    assert pulled == reader.local / second.name and ck.verify(pulled) == []
    assert (pulled / "dense" / "model.pt").read_bytes() == b"two"
    assert pull_newest(reader) == pulled  # already there: nothing downloaded twice


def test_a_torn_or_corrupt_remote_checkpoint_is_passed_by(remote):
    writer, reader = remote
    good = make_checkpoint(writer.local, b"good")
    publish(writer, good)
    torn = make_checkpoint(writer.local, b"torn")
    publish(writer, torn)
    fs = _filesystem(writer.remote)
    fs.rm(f"{writer.remote}/{torn.name}/MANIFEST.json")  # an upload cut short before its manifest
    assert pull_newest(reader) == reader.local / good.name
    corrupt = make_checkpoint(writer.local, b"corrupt")
    publish(writer, corrupt)
    fs.pipe_file(f"{writer.remote}/{corrupt.name}/dense/model.pt", b"CORRUPT")  # same size, other bytes
    assert pull_newest(reader) == reader.local / good.name
    assert not (reader.local / corrupt.name).exists() and not list(reader.local.glob(".fetch-*"))


def test_prune_remote_keeps_the_newest(remote):
    writer, reader = remote
    made = [make_checkpoint(writer.local, bytes([i])) for i in range(4)]
    for ckpt in made:
        publish(writer, ckpt)
    removed = prune_remote(writer, keep=2)
    assert removed == [f"{writer.remote}/{c.name}" for c in reversed(made[:2])]
    assert pull_newest(reader) == reader.local / made[-1].name
    fs = _filesystem(writer.remote)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(writer.remote, detail=False)) == [c.name for c in made[2:]]
