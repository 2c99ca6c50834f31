"""Checkpoint files and directories (common.checkpoint) and PS shard dumps and loads, resharding included."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
from persia_nats.common import checkpoint as ck
from persia_nats.common.checkpoint import CheckpointError
from persia_nats.common.errors import BadRequest
from persia_nats.common.optim_config import AdagradConfig, AdamConfig, EmbeddingHyperparams, SGDConfig
from persia_nats.core.sharding import shard_of
from persia_nats.core.store import EmbeddingStore
from persia_nats.core.store_checkpoint import dump_store, load_store, read_store

# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------


def test_write_bytes_atomic_returns_the_digest_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    assert ck.write_bytes_atomic(target, b"first") == (5, hashlib.sha256(b"first").hexdigest())
    data = os.urandom(3 << 20)  # several hashing blocks
    assert ck.write_bytes_atomic(target, data) == (len(data), hashlib.sha256(data).hexdigest())
    assert target.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    assert ck.file_digest(target) == (len(data), hashlib.sha256(data).hexdigest())


def test_a_failed_write_leaves_neither_a_temporary_nor_a_target(tmp_path: Path) -> None:
    with pytest.raises(ValueError):  # object arrays would need pickle
        ck.save_array(tmp_path / "x.npy", np.array([{"a": 1}], dtype=object))
    assert list(tmp_path.iterdir()) == []


def test_save_and_load_array_round_trip_with_digest(tmp_path: Path) -> None:
    arr = np.random.default_rng(0).standard_normal((1000, 7)).astype(np.float32)
    path = tmp_path / "a.npy"
    digest = ck.save_array(path, arr)
    assert digest == ck.file_digest(path)
    assert [p.name for p in tmp_path.iterdir()] == ["a.npy"]
    np.testing.assert_array_equal(ck.load_array(path, digest), arr)
    np.testing.assert_array_equal(ck.load_array(path, {"size": digest[0], "sha256": digest[1]}, mmap=True), arr)
    with pytest.raises(CheckpointError, match="a.npy.*sha256"):
        ck.load_array(path, (digest[0], "0" * 64))
    with pytest.raises(CheckpointError, match="a.npy.*size"):
        ck.load_array(path, (digest[0] + 1, digest[1]))
    with pytest.raises(CheckpointError, match="missing"):
        ck.load_array(tmp_path / "nope.npy")


def test_load_array_never_unpickles(tmp_path: Path) -> None:
    path = tmp_path / "obj.npy"
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(CheckpointError, match="obj.npy"):
        ck.load_array(path)


def test_checkpoint_error_is_a_400() -> None:
    err = CheckpointError("torn")
    assert isinstance(err, BadRequest) and err.code == 400 and str(err) == "400: torn"


# ---------------------------------------------------------------------------------------------
# directories
# ---------------------------------------------------------------------------------------------


def make_checkpoint(root: Path, payload: bytes = b"payload", extra: dict | None = None) -> Path:
    number = ck.next_number(root)
    partial = ck.partial_dir(root, number)
    (partial / "dense").mkdir(parents=True)
    files = {"dense/model.pt": ck.write_bytes_atomic(partial / "dense" / "model.pt", payload),
             "arr.npy": ck.save_array(partial / "arr.npy", np.arange(100, dtype=np.float32))}
    return ck.finalize(partial, files, extra)


def test_finalize_writes_the_manifest_and_renames(tmp_path: Path) -> None:
    final = make_checkpoint(tmp_path, extra={"step": 7})
    assert final.name == "ckpt-00000001" and final.is_dir()
    assert not ck.partial_dir(tmp_path, 1).exists()
    manifest = ck.read_manifest(final)
    assert manifest["format"] == 1 and manifest["number"] == 1 and manifest["step"] == 7
    assert set(manifest["files"]) == {"dense/model.pt", "arr.npy"}
    assert manifest["files"]["dense/model.pt"] == {"size": 7, "sha256": hashlib.sha256(b"payload").hexdigest()}
    assert ck.verify(final) == []
    assert not [p for p in final.rglob("*") if p.name.endswith(".tmp")]


def test_finalize_refuses_missing_or_misreported_files_and_bad_names(tmp_path: Path) -> None:
    partial = ck.partial_dir(tmp_path, 1)
    partial.mkdir()
    digest = ck.write_bytes_atomic(partial / "a", b"abc")
    with pytest.raises(CheckpointError, match="missing"):
        ck.finalize(partial, {"a": digest, "b": digest})
    with pytest.raises(CheckpointError, match="3 bytes on disk"):
        ck.finalize(partial, {"a": (4, digest[1])})
    with pytest.raises(CheckpointError, match="inside the checkpoint"):
        ck.finalize(partial, {"../a": digest})
    with pytest.raises(CheckpointError, match="reserved"):
        ck.finalize(partial, {"a": digest}, extra={"files": {}})
    with pytest.raises(CheckpointError, match="not a partial"):
        ck.finalize(tmp_path, {"a": digest})
    assert partial.is_dir() and not (partial / ck.MANIFEST).exists()  # nothing sealed
    final = ck.finalize(partial, {"a": {"size": 3, "sha256": digest[1]}})
    assert ck.verify(final) == []


def truncate(ckpt: Path) -> None:
    path = ckpt / "arr.npy"
    path.write_bytes(path.read_bytes()[:-10])


def flip_byte(ckpt: Path) -> None:
    path = ckpt / "arr.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def tear(ckpt: Path) -> None:
    (ckpt / ck.MANIFEST).unlink()


def drop_file(ckpt: Path) -> None:
    (ckpt / "dense" / "model.pt").unlink()


def garble_manifest(ckpt: Path) -> None:
    (ckpt / ck.MANIFEST).write_text("{not json")


@pytest.mark.parametrize("damage, problem", [
    (truncate, "size"), (flip_byte, "sha256"), (tear, "missing .*torn"), (drop_file, "model.pt: missing"),
    (garble_manifest, "not JSON"),
])
def test_damage_is_detected_and_latest_valid_falls_back(tmp_path: Path, damage, problem, caplog) -> None:
    older = make_checkpoint(tmp_path, b"one")
    newer = make_checkpoint(tmp_path, b"two")
    assert ck.latest_valid(tmp_path) == newer
    damage(newer)
    problems = ck.verify(newer)
    assert len(problems) == 1 and re.search(problem, problems[0]), problems
    with caplog.at_level(logging.WARNING, logger="persia_nats.common.checkpoint"):
        assert ck.latest_valid(tmp_path) == older
    assert "ckpt-00000002 rejected" in caplog.text
    damage(older)
    assert ck.latest_valid(tmp_path) is None


def test_verify_notices_a_manifest_moved_to_another_number(tmp_path: Path) -> None:
    first = make_checkpoint(tmp_path)
    moved = first.rename(tmp_path / "ckpt-00000005")
    assert any("does not match" in p for p in ck.verify(moved))


def test_numbers_listing_and_partials(tmp_path: Path) -> None:
    assert ck.next_number(tmp_path / "missing") == 1 and ck.list_checkpoints(tmp_path / "missing") == []
    assert ck.latest_valid(tmp_path / "missing") is None
    assert ck.next_number(tmp_path) == 1
    ck.partial_dir(tmp_path, 3).mkdir()  # a crashed writer's leftover: its number is never reused
    assert ck.next_number(tmp_path) == 4
    assert ck.list_checkpoints(tmp_path) == []  # readers ignore partial ones
    made = [make_checkpoint(tmp_path) for _ in range(3)]
    assert [p.name for p in made] == ["ckpt-00000004", "ckpt-00000005", "ckpt-00000006"]
    (tmp_path / "ckpt-junk").mkdir()
    (tmp_path / "ckpt-00000099").write_text("a file, not a checkpoint")
    assert ck.list_checkpoints(tmp_path) == made[::-1]
    assert ck.checkpoint_number("ckpt-00000042.partial") == (42, True)
    assert ck.checkpoint_number("ckpt-00000042") == (42, False) and ck.checkpoint_number("x") is None


@pytest.mark.parametrize("name", ["ckpt-999999999999999999.partial", "ckpt-1", "ckpt-\u0663", "ckpt-0000000\u0663",
                                  "ckpt-00000001.partial/x", "~/ckpt-00000001", "ckpt-00000001\n"])
def test_only_names_of_the_form_the_job_writes_are_checkpoints(name: str) -> None:
    assert ck.checkpoint_number(name) is None


def test_the_counter_is_bounded_and_leftovers_never_block_it(tmp_path: Path) -> None:
    (tmp_path / "ckpt-999999999999999999.partial").mkdir()  # what a hostile dump left with an older build
    assert ck.next_number(tmp_path) == 1
    made = make_checkpoint(tmp_path)
    assert made.name == "ckpt-00000001"
    ck.prune(tmp_path, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000001"]
    for number in (0, ck.MAX_NUMBER + 1, 10**18, True):
        with pytest.raises(ck.CheckpointError, match="outside"):
            ck.checkpoint_name(number)
    ck.partial_dir(tmp_path, ck.MAX_NUMBER).mkdir()
    with pytest.raises(ck.CheckpointError, match="exhausted"):
        ck.next_number(tmp_path)


def test_prune_keeps_the_newest_and_removes_stale_partials(tmp_path: Path) -> None:
    ck.partial_dir(tmp_path, 1).mkdir()  # stale: older than the newest final one
    made = [make_checkpoint(tmp_path) for _ in range(4)]  # 2..5
    ck.partial_dir(tmp_path, 6).mkdir()  # perhaps being written right now
    removed = ck.prune(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["ckpt-00000001.partial", "ckpt-00000002", "ckpt-00000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000004", "ckpt-00000005", "ckpt-00000006.partial"]
    assert ck.list_checkpoints(tmp_path) == [made[3], made[2]]
    assert ck.prune(tmp_path, 2) == []
    with pytest.raises(ValueError):
        ck.prune(tmp_path, 0)


# ---------------------------------------------------------------------------------------------
# PS shards
# ---------------------------------------------------------------------------------------------

OPTIMIZERS = [SGDConfig(lr=0.1), SGDConfig(lr=0.1, momentum=0.9), AdagradConfig(lr=0.05),
              AdagradConfig(vectorwise_shared=True), AdamConfig(lr=0.01)]
HYPER = EmbeddingHyperparams(init_lower=-0.05, init_upper=0.05, weight_bound=3.0)
DIMS = (4, 8, 16)


def train(store: EmbeddingStore, ids: np.ndarray, rng: np.random.Generator, steps: int = 5) -> None:
    for _ in range(steps):
        for dim in DIMS:
            batch = rng.choice(ids, size=min(200, ids.shape[0]), replace=True)
            store.lookup(batch, dim, True)
            store.update(batch, rng.standard_normal((batch.shape[0], dim)).astype(np.float32))
    store.lookup(ids[:3], DIMS[0], False)  # an eval miss or two for the counters


def trained_replicas(n: int, optimizer, seed: int = 0, count: int = 3000, capacity: int = 100_000):
    """``n`` stores, each holding the ids the embedding workers would route to it."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 2**63, size=count, dtype=np.uint64)
    owner = shard_of(ids, n)
    stores = []
    for r in range(n):
        store = EmbeddingStore(capacity, optimizer, HYPER, initial_rows=64)
        train(store, ids[owner == r], rng)
        stores.append(store)
    return stores


def dump_all(root: Path, stores: list[EmbeddingStore], extra_files: dict | None = None) -> Path:
    partial = ck.partial_dir(root, ck.next_number(root))
    files = dict(extra_files or {})
    for r, store in enumerate(stores):
        files.update(dump_store(store, partial, r, len(stores)))
    return ck.finalize(partial, files)


def rows_by_key(stores: list[EmbeddingStore]) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray, int]]:
    out = {}
    for r, store in enumerate(stores):
        for dim, table in store.tables.items():
            sd = table.state_dict()
            for k, key in enumerate(sd["keys"].tolist()):
                assert (dim, key) not in out, "a key is held twice"
                out[(dim, key)] = (sd["emb"][k], sd["state"][k], r)
    return out


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: f"{type(o).__name__}-{o}")
def test_dump_and_load_round_trip(tmp_path: Path, optimizer) -> None:
    (store,) = trained_replicas(1, optimizer)
    ckpt = dump_all(tmp_path, [store])
    manifest = ck.read_manifest(ckpt)
    assert set(manifest["files"]) == {f"ps/replica-0-of-1/dim{d}.{p}.npy" for d in DIMS for p in
                                      ("keys", "emb", "state")} | {"ps/replica-0-of-1/shard.json"}
    fresh = EmbeddingStore(100_000, initial_rows=64)
    assert load_store(fresh, ckpt, 0, 1, manifest["files"]) == len(store)
    assert fresh._optimizer == optimizer and fresh._hyper == HYPER
    for dim in DIMS:
        a, b = store.tables[dim].state_dict(), fresh.tables[dim].state_dict()
        assert set(a) == set(b)
        for key, value in a.items():  # keys in LRU order, rows, state, kind and every counter
            if isinstance(value, np.ndarray):
                np.testing.assert_array_equal(value, b[key], err_msg=key)
            else:
                assert value == b[key], key
    kept = ("rows", "rows_per_dim", "evictions", "inserts", "index_miss_count")
    assert {k: store.stats()[k] for k in kept} == {k: fresh.stats()[k] for k in kept}
    # the restored store trains on exactly as the original
    ids = store.tables[8].state_dict()["keys"][:50]
    grads = np.random.default_rng(1).standard_normal((50, 8)).astype(np.float32)
    store.update(ids, grads)
    fresh.update(ids, grads)
    np.testing.assert_array_equal(store.lookup(ids, 8, False), fresh.lookup(ids, 8, False))
    new_ids = np.arange(1, 20, dtype=np.uint64)  # inserts see the same admission and LRU state
    np.testing.assert_array_equal(store.lookup(new_ids, 4, True), fresh.lookup(new_ids, 4, True))
    assert store.tables[4].state_dict()["keys"].tolist() == fresh.tables[4].state_dict()["keys"].tolist()


def test_a_store_with_no_tables_and_no_optimizer_round_trips(tmp_path: Path) -> None:
    ckpt = dump_all(tmp_path, [EmbeddingStore(10)])
    fresh = EmbeddingStore(10, SGDConfig(lr=1.0))
    assert load_store(fresh, ckpt, 0, 1) == 0
    assert fresh.tables == {} and fresh._optimizer == SGDConfig(lr=1.0)  # no optimizer saved: kept


# (3, 2), (2, 4), (4, 6): the counts where a replica reads some old shards whole, one shard in part, or all
@pytest.mark.parametrize("old, new", [(2, 3), (3, 1), (2, 2), (4, 2), (1, 4), (3, 2), (2, 4), (4, 6)])
def test_resharding_puts_every_key_once_where_shard_of_routes_it(tmp_path: Path, old: int, new: int) -> None:
    before = trained_replicas(old, AdamConfig(lr=0.01), seed=old * 10 + new)
    ckpt = dump_all(tmp_path, before)
    files = ck.read_manifest(ckpt)["files"]
    after = [EmbeddingStore(100_000) for _ in range(new)]
    for r, store in enumerate(after):
        load_store(store, ckpt, r, new, files)
        assert store._optimizer == AdamConfig(lr=0.01) and store._hyper == HYPER
        assert sorted(store.tables) == list(DIMS)
    want, got = rows_by_key(before), rows_by_key(after)
    assert set(want) == set(got)
    for (dim, key), (emb, state, r) in got.items():
        assert shard_of(np.array([key], np.uint64), new)[0] == r
        np.testing.assert_array_equal(emb, want[(dim, key)][0])
        np.testing.assert_array_equal(state, want[(dim, key)][1])
    for r, store in enumerate(after):  # each old shard's LRU order, shard after shard
        for dim in DIMS:
            expected = []
            for old_store in before:
                keys = old_store.tables[dim].state_dict()["keys"]
                expected += keys[shard_of(keys, new) == r].tolist()
            assert store.tables[dim].state_dict()["keys"].tolist() == expected
    for name in ("inserts", "evictions", "index_miss_count"):
        total_before = sum(s.stats()[name] for s in before)
        total_after = sum(s.stats()[name] for s in after)
        if old % new == 0:  # whole shards move: exact
            assert total_after == total_before, name
        else:  # split in proportion to the rows taken, rounded down
            assert total_before - old * new * len(DIMS) <= total_after <= total_before, name


def test_loading_beyond_capacity_keeps_the_most_recent_rows(tmp_path: Path) -> None:
    before = trained_replicas(2, SGDConfig(lr=0.1), count=500)
    ckpt = dump_all(tmp_path, before)
    small = EmbeddingStore(100)
    load_store(small, ckpt, 0, 1)
    for dim in DIMS:
        tail = np.concatenate([s.tables[dim].state_dict()["keys"] for s in before])[-100:]
        assert small.tables[dim].state_dict()["keys"].tolist() == tail.tolist()


def snapshot(store: EmbeddingStore) -> dict:
    return {dim: {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in t.state_dict().items()}
            for dim, t in store.tables.items()}


def assert_same(store: EmbeddingStore, snap: dict) -> None:
    assert sorted(store.tables) == sorted(snap)
    for dim, sd in snap.items():
        now = store.tables[dim].state_dict()
        for key, value in sd.items():
            if isinstance(value, np.ndarray):
                np.testing.assert_array_equal(now[key], value)
            else:
                assert now[key] == value


def corrupt_emb(ckpt: Path) -> None:
    path = ckpt / "ps/replica-1-of-2/dim16.emb.npy"  # the last file read: everything else built already
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate_state(ckpt: Path) -> None:
    path = ckpt / "ps/replica-1-of-2/dim16.state.npy"
    path.write_bytes(path.read_bytes()[:-64])


def drop_replica(ckpt: Path) -> None:
    for p in (ckpt / "ps/replica-1-of-2").iterdir():
        p.unlink()
    (ckpt / "ps/replica-1-of-2").rmdir()


def garble_shard_json(ckpt: Path) -> None:
    (ckpt / "ps/replica-1-of-2/shard.json").write_text(json.dumps({"format": 1, "replica_index": 1}))


@pytest.mark.parametrize("damage, message", [
    (corrupt_emb, "dim16.emb.npy"), (truncate_state, "dim16.state.npy"), (drop_replica, "missing"),
    (garble_shard_json, "shard.json"),
])
@pytest.mark.parametrize("with_manifest", [True, False])
def test_a_damaged_checkpoint_leaves_the_store_unchanged(tmp_path: Path, damage, message, with_manifest) -> None:
    ckpt = dump_all(tmp_path, trained_replicas(2, AdagradConfig()))
    files = ck.read_manifest(ckpt)["files"]
    (live,) = trained_replicas(1, SGDConfig(lr=0.5), seed=99, count=300)
    snap, optimizer = snapshot(live), live._optimizer
    if not with_manifest and damage is corrupt_emb:
        pytest.skip("without a manifest a flipped float is just a different value")
    damage(ckpt)
    with pytest.raises(CheckpointError, match=message):
        load_store(live, ckpt, 0, 1, files if with_manifest else None)
    assert_same(live, snap)
    assert live._optimizer == optimizer


def test_shards_the_manifest_does_not_list_are_ignored(tmp_path: Path) -> None:
    stores = trained_replicas(2, SGDConfig(lr=0.1))
    partial = ck.partial_dir(tmp_path, 1)
    dump_store(trained_replicas(3, SGDConfig(lr=0.1), seed=5)[0], partial, 0, 3)  # a failed attempt's leftover
    files = {}
    for r, store in enumerate(stores):
        files.update(dump_store(store, partial, r, 2))
    ckpt = ck.finalize(partial, files)
    fresh = EmbeddingStore(100_000)
    assert load_store(fresh, ckpt, 0, 1, ck.read_manifest(ckpt)["files"]) == sum(len(s) for s in stores)
    with pytest.raises(CheckpointError, match="different replica counts"):
        load_store(EmbeddingStore(10), ckpt, 0, 1)  # without a manifest nothing tells the two sets apart


def test_a_retried_dump_replaces_the_earlier_attempt(tmp_path: Path) -> None:
    (store,) = trained_replicas(1, SGDConfig(lr=0.1))
    partial = ck.partial_dir(tmp_path, 1)
    dump_store(store, partial, 0, 1)
    store.tables.pop(16)  # (not a public operation; stands in for a store that changed)
    files = dump_store(store, partial, 0, 1)
    assert not (partial / "ps/replica-0-of-1/dim16.keys.npy").exists()
    ckpt = ck.finalize(partial, files)
    with pytest.raises(CheckpointError, match="finalized"):
        dump_store(store, ckpt, 0, 1)
    fresh = EmbeddingStore(100_000)
    load_store(fresh, ckpt, 0, 1, ck.read_manifest(ckpt)["files"])
    assert sorted(fresh.tables) == [4, 8]


def test_read_store_builds_aside_until_installed(tmp_path: Path) -> None:
    ckpt = dump_all(tmp_path, trained_replicas(1, AdamConfig()))
    live = EmbeddingStore(100_000)
    restored = read_store(live, ckpt, 0, 1)
    assert live.tables == {} and restored.rows > 0
    assert restored.install(live) == len(live) == restored.rows


# ---------------------------------------------------------------------------------------------
# configuration of the checkpoint root
# ---------------------------------------------------------------------------------------------


def test_the_checkpoint_root_comes_from_yaml_env_or_flag(tmp_path: Path) -> None:
    from persia_nats.common.config import global_config_from_dict, load_global_config
    from persia_nats.common.env import read_env
    from persia_nats.common.errors import ConfigError
    from persia_nats.common.settings import global_config_from_env

    from persia.launcher import _parser

    cfg = global_config_from_dict({"common_config": {"checkpointing_config": {"checkpoint_dir": "/ckpt", "keep": 5}}})
    assert (cfg.common_config.checkpointing_config.checkpoint_dir, cfg.common_config.checkpointing_config.keep) == \
        ("/ckpt", 5)
    with pytest.raises(ConfigError, match="keep"):
        global_config_from_dict({"common_config": {"checkpointing_config": {"keep": 0}}})
    assert load_global_config(None).common_config.checkpointing_config.checkpoint_dir == ""
    yml = tmp_path / "g.yml"
    yml.write_text("common_config: {job_name: j, checkpointing_config: {checkpoint_dir: /from-yaml}}\n")
    assert global_config_from_env(read_env({}), str(yml)).common_config.checkpointing_config.checkpoint_dir == \
        "/from-yaml"
    env = read_env({"PERSIA_CHECKPOINT_DIR": "/from-env"})
    assert env.checkpoint_dir == "/from-env"
    overridden = global_config_from_env(env, str(yml)).common_config
    assert overridden.checkpointing_config.checkpoint_dir == "/from-env" and overridden.job_name == "j"
    assert read_env({"PERSIA_CHECKPOINT_DIR": ""}).checkpoint_dir is None
    args = _parser().parse_args(["embedding-parameter-server", "--checkpoint-dir", "/from-flag"])
    assert args.checkpoint_dir == "/from-flag"
    assert _parser().parse_args(["embedding-parameter-server"]).checkpoint_dir is None
