"""Restarts that read only what they keep: read_rows, verify(hash_files=False), and which files a PS replica's
load opens and hashes, resharded or not (issue 39 item 5)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from persia_nats.common import checkpoint as ck
from persia_nats.common.checkpoint import CheckpointError
from persia_nats.common.optim_config import AdagradConfig, AdamConfig, SGDConfig
from persia_nats.core.sharding import shard_of
from persia_nats.core.store import EmbeddingStore
from persia_nats.core.store_checkpoint import LoadProgress, load_store, read_store, shards_to_read

from tests.unit.test_checkpoint import DIMS, dump_all, trained_replicas

# ---------------------------------------------------------------------------------------------
# read_rows: one pass, hashed on the way
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def big(tmp_path: Path) -> tuple[Path, np.ndarray, ck.Digest]:
    """Several of read_rows' 8 MiB blocks, and a last one cut short."""
    arr = np.random.default_rng(0).standard_normal((70_001, 40)).astype(np.float32)
    path = tmp_path / "a.npy"
    return path, arr, ck.save_array(path, arr)


def test_read_rows_reads_the_whole_array_or_the_kept_rows_and_checks_the_hash(big) -> None:
    path, arr, digest = big
    seen: list[int] = []
    np.testing.assert_array_equal(ck.read_rows(path, digest, np.float32, (70_001, 40), progress=seen.append), arr)
    assert sum(seen) == digest[0] and len(seen) > 2  # every byte, header included, block by block
    keep = shard_of(np.arange(70_001, dtype=np.uint64), 3) == 1
    out = np.full((int(keep.sum()) + 2, 40), -1, np.float32)
    got = ck.read_rows(path, {"size": digest[0], "sha256": digest[1]}, np.float32, (None, 40), keep=keep, out=out[1:-1])
    np.testing.assert_array_equal(got, arr[keep])
    np.testing.assert_array_equal(out[1:-1], arr[keep])
    assert (out[0] == -1).all() and (out[-1] == -1).all()  # nothing written beyond its place
    np.testing.assert_array_equal(ck.read_rows(path, None, np.float32, (70_001, None)), arr)  # no manifest: no hash
    assert ck.npy_shape(path) == (70_001, 40)


def damage(path: Path, kind: str) -> None:
    data = bytearray(path.read_bytes())
    if kind == "flip":
        data[len(data) // 2] ^= 0x10
    elif kind == "truncate":
        del data[-40:]
    elif kind == "append":
        data += b"\0" * 160
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind, match", [("flip", "sha256.*corrupt"), ("truncate", "size"), ("append", "size")])
def test_read_rows_refuses_a_damaged_file(big, kind: str, match: str) -> None:
    path, _, digest = big
    damage(path, kind)
    with pytest.raises(CheckpointError, match=f"a.npy.*{match}"):
        ck.read_rows(path, digest, np.float32, (None, 40))
    keep = np.zeros(70_001, bool)
    keep[::7] = True
    with pytest.raises(CheckpointError, match=f"a.npy.*{match}"):  # a selection reads and hashes every byte too
        ck.read_rows(path, digest, np.float32, (None, 40), keep=keep)
    if kind != "flip":  # without a digest the header still gives the size away
        with pytest.raises(CheckpointError, match="truncated"):
            ck.read_rows(path, None, np.float32, (None, 40))


def test_read_rows_refuses_another_dtype_or_shape_or_a_pickle(tmp_path: Path, big) -> None:
    path, _, digest = big
    with pytest.raises(CheckpointError, match="expected float32 of shape \\(5xw\\)"):
        ck.read_rows(path, digest, np.float32, (5, None))
    with pytest.raises(CheckpointError, match="expected uint64"):
        ck.read_rows(path, digest, np.uint64, (None, 40))
    pickled = tmp_path / "obj.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(CheckpointError, match="obj.npy"):
        ck.read_rows(pickled, None, np.float32, (None,))
    with pytest.raises(CheckpointError, match="missing"):
        ck.read_rows(tmp_path / "nope.npy", None, np.float32, (None,))


def test_verify_without_hashing_checks_every_file_is_there_at_its_size(tmp_path: Path) -> None:
    ckpt = dump_all(tmp_path, trained_replicas(2, SGDConfig(lr=0.1), count=500))
    emb = ckpt / "ps/replica-1-of-2/dim8.emb.npy"
    damage(emb, "flip")
    assert ck.verify(ckpt, hash_files=False) == []  # a flipped byte is for the reader's hash to find
    assert any("dim8.emb.npy" in p and "sha256" in p for p in ck.verify(ckpt))
    damage(emb, "truncate")
    assert any("dim8.emb.npy" in p and "size" in p for p in ck.verify(ckpt, hash_files=False))
    emb.unlink()
    assert any("dim8.emb.npy: missing" in p for p in ck.verify(ckpt, hash_files=False))
    (ckpt / ck.MANIFEST).unlink()
    assert any("torn" in p for p in ck.verify(ckpt, hash_files=False))


# ---------------------------------------------------------------------------------------------
# which shards a replica reads
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("old, new, expected", [
    (2, 2, [[0], [1]]),
    (4, 2, [[0, 2], [1, 3]]),
    (2, 4, [[0], [1], [0], [1]]),
    (4, 6, [[0, 2], [1, 3], [0, 2], [1, 3], [0, 2], [1, 3]]),
    (2, 3, [[0, 1]] * 3),
    (3, 2, [[0, 1, 2]] * 2),
])
def test_a_replica_reads_only_the_shards_that_can_hold_its_keys(old: int, new: int, expected: list) -> None:
    assert [shards_to_read(old, r, new) for r in range(new)] == expected
    h = np.arange(10_000, dtype=np.uint64)  # any hash: shard j of old and replica r of new share keys iff listed
    for r in range(new):
        holding = sorted({int(j) for j in np.unique(h[h % np.uint64(new) == r] % np.uint64(old))})
        assert holding == shards_to_read(old, r, new)


def shard_files(n: int, j: int) -> set[str]:
    return {f"ps/replica-{j}-of-{n}/dim{d}.{p}.npy" for d in DIMS for p in ("keys", "emb", "state")}


def shard_jsons(n: int) -> set[str]:
    return {f"ps/replica-{j}-of-{n}/shard.json" for j in range(n)}


@pytest.mark.parametrize("old, new", [(2, 2), (2, 3), (3, 2), (2, 4), (4, 2)])
def test_a_replica_opens_and_hashes_only_the_files_of_the_shards_it_reads(tmp_path: Path, old: int, new: int) -> None:
    ckpt = dump_all(tmp_path, trained_replicas(old, AdagradConfig(), count=2000))
    files = ck.read_manifest(ckpt)["files"]
    for r in range(new):
        progress = LoadProgress()
        load_store(EmbeddingStore(100_000), ckpt, r, new, files, progress=progress)
        wanted = set().union(*(shard_files(old, j) for j in shards_to_read(old, r, new)))
        assert set(progress.files) == wanted | shard_jsons(old)  # every shard.json: a few hundred bytes each
        assert all(progress.files.values())  # each one hashed as it was read
        assert progress.done == progress.total == sum(files[f]["size"] for f in progress.files)
        assert progress.hashed_bytes == progress.done


def test_a_corrupt_file_in_another_shard_is_not_this_replicas_concern(tmp_path: Path) -> None:
    before = trained_replicas(2, AdamConfig(lr=0.01), count=2000)
    ckpt = dump_all(tmp_path, before)
    files = ck.read_manifest(ckpt)["files"]
    damage(ckpt / "ps/replica-1-of-2/dim8.emb.npy", "flip")
    own = EmbeddingStore(100_000)
    assert load_store(own, ckpt, 0, 2, files) == len(before[0])
    for dim in DIMS:
        want, got = before[0].tables[dim].state_dict(), own.tables[dim].state_dict()
        for key in ("keys", "emb", "state"):
            np.testing.assert_array_equal(got[key], want[key])
    with pytest.raises(CheckpointError, match="replica-1-of-2/dim8.emb.npy.*corrupt"):
        load_store(EmbeddingStore(100_000), ckpt, 1, 2, files)
    with pytest.raises(CheckpointError, match="replica-1-of-2/dim8.emb.npy.*corrupt"):
        load_store(EmbeddingStore(100_000), ckpt, 0, 3, files)  # resharded, every replica reads that file


def test_progress_is_reported_block_by_block(tmp_path: Path) -> None:
    ckpt = dump_all(tmp_path, trained_replicas(1, SGDConfig(lr=0.1), count=500))
    said: list[str] = []
    progress = LoadProgress(lambda p: said.append(p.describe()))
    restored = read_store(EmbeddingStore(1000), ckpt, 0, 1, ck.read_manifest(ckpt)["files"], progress=progress)
    assert restored.rows > 0 and len(said) >= 3 * len(DIMS)
    assert said[-1].endswith("kB read") and said[-1].split(" of ")[0] == said[-1].split(" of ")[1].split()[0]
    progress.total, progress.done = 2_430_000_000, 1_210_000_000
    assert progress.describe() == "1.2 of 2.4 GB read"


def test_a_manifest_digest_is_the_files_sha256(tmp_path: Path) -> None:
    ckpt = dump_all(tmp_path, trained_replicas(1, SGDConfig(lr=0.1), count=50))
    for rel, entry in ck.read_manifest(ckpt)["files"].items():
        assert hashlib.sha256((ckpt / rel).read_bytes()).hexdigest() == entry["sha256"]  # what read_rows compares
