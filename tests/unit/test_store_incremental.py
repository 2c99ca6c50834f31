"""Incremental updates from real PS stores: tracked keys, deltas written and restored on top of a checkpoint.

The stores train as PS replicas do (training lookups, then gradient updates); a full checkpoint is dumped
between deltas, as the PS does it (the tracked rows cut as a last delta at T0). Restoring the checkpoint and
then its deltas, under any replica count, must give exactly the trained rows and optimizer state.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from persia_nats.common import checkpoint as ck
from persia_nats.common.optim_config import AdagradConfig, EmbeddingHyperparams
from persia_nats.core.sharding import shard_of
from persia_nats.core.store import EmbeddingStore
from persia_nats.core.store_checkpoint import dump_store, read_store
from persia_nats.core.store_incremental import (
    DONE,
    KeyTracker,
    apply_deltas,
    delta_name,
    delta_time,
    deltas_to_apply,
    list_deltas,
    prune_deltas,
    restore_deltas,
    take_delta,
    write_delta,
)

JOB = "incjob"
DIMS = (4, 8)
OPT = AdagradConfig(lr=0.05)
HYPER = EmbeddingHyperparams(init_lower=-0.1, init_upper=0.1)


def test_the_tracker_counts_distinct_keys_exactly_and_gives_each_back_once():
    t = KeyTracker()
    assert not t and t.since is None
    t.add(4, np.array([5, 3, 5], np.uint64))
    assert t.distinct == 2 and t.since is not None
    t.add(4, np.array([3, 9, 0, 0, 2, 7], np.uint64))  # 0 is a key like any other
    t.add(8, np.array([3], np.uint64))
    assert t.distinct == 7
    many = np.random.default_rng(0).integers(1, 2**64 - 1, size=5000, dtype=np.uint64)
    t.add(8, many)  # the set grows past its first 1024 slots
    t.add(8, many[::-1])
    assert t.distinct == 7 + len(set(many.tolist()) - {3})
    got = t.take()
    assert sorted(got[4].tolist()) == [0, 2, 3, 5, 7, 9]
    assert sorted(got[8].tolist()) == sorted({3, *many.tolist()})
    assert not t and t.since is None and t.take() == {}
    t.put_back({4: np.array([2, 2], np.uint64)})
    assert t.take()[4].tolist() == [2]


def test_delta_names_order_as_times_to_the_microsecond():
    a, b = 1_765_000_000_123_456, 1_765_000_000_123_457
    assert delta_name(a) < delta_name(b) and len(delta_name(a)) == len("inc_") + 20
    assert delta_time(delta_name(a)) == a and delta_time("inc_x") is None and delta_time("ckpt-00000001") is None


class Replica:
    """One PS replica's store and tracker, trained as the PS trains it."""

    def __init__(self, index: int, size: int) -> None:
        self.index, self.size = index, size
        self.store = EmbeddingStore(10_000, OPT, HYPER, initial_rows=64)
        self.tracker = KeyTracker()
        self.follows = ""
        self.clock = 1_765_000_000_000_000 + index

    def train(self, ids: np.ndarray, dim: int, rng: np.random.Generator) -> None:
        mine = ids[shard_of(ids, self.size) == self.index]
        self.store.lookup(mine, dim, True)
        self.store.update(mine, rng.standard_normal((mine.shape[0], dim)).astype(np.float32))
        self.tracker.add(dim, mine)

    def delta(self, root) -> int:
        """Cut and write a delta (the PS's DeltaWriter, synchronously); the rows written."""
        self.clock += 1000
        delta = take_delta(self.store, self.tracker.take(), delta_name(self.clock), self.follows)
        write_delta(root, delta, job=JOB, replica_index=self.index, replica_size=self.size)
        return delta.rows


def by_key(store: EmbeddingStore) -> dict[int, dict[str, np.ndarray]]:
    out = {}
    for dim, table in store.tables.items():
        sd = table.state_dict()
        order = np.argsort(sd["keys"])
        out[dim] = {"keys": sd["keys"][order], "emb": sd["emb"][order], "state": sd["state"][order]}
    return out


def merged(stores: list[EmbeddingStore]) -> dict[int, dict[str, np.ndarray]]:
    """Every row of the stores (one table split across replicas), by key."""
    out = {}
    for dim in DIMS:
        parts = [by_key(s)[dim] for s in stores if dim in s.tables]
        keys = np.concatenate([p["keys"] for p in parts])
        order = np.argsort(keys)
        out[dim] = {name: np.concatenate([p[name] for p in parts])[order] for name in ("keys", "emb", "state")}
    return out


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for dim in want:
        for name in ("keys", "emb", "state"):
            np.testing.assert_array_equal(got[dim][name], want[dim][name], err_msg=f"dim {dim} {name}")


def checkpoint(replicas: list[Replica], root) -> str:
    """A full checkpoint as the PS dumps one: each replica cuts its tracked rows as a delta first (T0)."""
    partial = ck.partial_dir(root, ck.next_number(root))
    name = ck.checkpoint_name(ck.next_number(root))
    files = {}
    for r in replicas:
        if r.tracker:
            r.delta(root / "inc")
        r.follows = name
        files.update(dump_store(r.store, partial, r.index, r.size))
    return ck.finalize(partial, files).name


@pytest.fixture
def trained(tmp_path):
    """Two replicas: trained, a delta, a checkpoint, more training with deltas, and some rows not in any delta
    yet (the restore then lacks exactly those)."""
    rng = np.random.default_rng(11)
    universe = rng.integers(1, 2**63, size=3000, dtype=np.uint64)
    reps = [Replica(i, 2) for i in range(2)]
    root = tmp_path / "ckpt"
    root.mkdir()
    inc = root / "inc"

    def steps(n: int) -> None:
        for _ in range(n):
            for dim in DIMS:
                ids = rng.choice(universe, 200, replace=False)
                for r in reps:
                    r.train(ids, dim, rng)

    steps(3)
    for r in reps:
        r.delta(inc)  # before any checkpoint: follows nothing
    steps(2)
    base = checkpoint(reps, root)
    rows = 0
    for _ in range(3):
        steps(2)
        rows += sum(r.delta(inc) for r in reps)
    return reps, root, inc, base, rows


def restore(root, inc, base: str, index: int, size: int) -> EmbeddingStore:
    ckpt = root / base
    store = EmbeddingStore(10_000, initial_rows=64)
    restored = read_store(store, ckpt, index, size, ck.read_manifest(ckpt)["files"])
    restore_deltas(restored, store, inc, job=JOB, base=base, replica_index=index, replica_size=size)
    restored.install(store)
    return store


@pytest.mark.parametrize("size", [2, 3, 1])
def test_a_checkpoint_plus_its_deltas_restores_exactly_the_trained_rows(trained, size):
    reps, root, inc, base, rows = trained
    assert rows > 0
    want = merged([r.store for r in reps])
    assert_same(merged([restore(root, inc, base, i, size) for i in range(size)]), want)
    # without the deltas, the checkpoint alone is older
    plain = EmbeddingStore(10_000, initial_rows=64)
    read_store(plain, root / base, 0, 1, ck.read_manifest(root / base)["files"]).install(plain)
    assert not all(np.array_equal(by_key(plain)[d]["emb"], want[d]["emb"]) for d in DIMS)


def test_only_complete_deltas_of_the_job_following_the_checkpoint_apply_in_time_order(trained, caplog):
    reps, root, inc, base, _ = trained
    found = list_deltas(inc)
    assert all(d.complete for d in found) and len({d.replica_dir for d in found}) == 2
    listed = deltas_to_apply(inc, job=JOB, base=base)
    # per replica: 3 after the checkpoint, none of the 2 before it (the first, and the cut at T0)
    assert len(listed) == 6 and all(meta["follows"] == base for _, meta in listed)
    assert [s.time_us for s, _ in listed] == sorted(s.time_us for s, _ in listed)
    assert len(deltas_to_apply(inc, job="another", base=base)) == 0
    assert len(deltas_to_apply(inc, job=JOB, base="")) == len(found)
    # an older checkpoint (none: number 0) takes every delta: the cut at T0 makes the chain whole
    newest = found[-1]
    marker = json.loads((newest.path / DONE).read_text())
    assert marker["replica_size"] == 2 and set(marker["files"]) == {f"dim{d}.{p}.npy" for d in DIMS
                                                                    for p in ("keys", "emb", "state")}
    # the newest delta without its marker: ignored with a log line, so its rows are the previous delta's
    (newest.path / DONE).unlink()
    with caplog.at_level(logging.INFO, logger="persia_nats.core.store_incremental"):
        assert len(deltas_to_apply(inc, job=JOB, base=base)) == 5
    assert f"incremental update {newest.path} is incomplete" in caplog.text


def test_a_corrupt_delta_is_skipped_and_logged(trained, caplog):
    reps, root, inc, base, _ = trained
    victim = deltas_to_apply(inc, job=JOB, base=base)[0][0]
    path = victim.path / "dim8.emb.npy"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    store = EmbeddingStore(10_000, OPT, HYPER, initial_rows=64)
    with caplog.at_level(logging.WARNING):
        applied, _ = apply_deltas(store, inc, job=JOB, base=base)
    assert len(applied) == 5 and victim.rel not in {s.rel for s, _ in applied}
    assert "skipped" in caplog.text and "sha256" in caplog.text


def test_upsert_writes_rows_and_state_only_of_the_same_optimizer():
    store = EmbeddingStore(100, OPT, HYPER, initial_rows=4)
    keys = np.array([7, 3, 5], np.uint64)
    emb = np.arange(12, dtype=np.float32).reshape(3, 4)
    state = np.full((3, 4), 2.5, np.float32)
    assert store.upsert(keys, 4, emb, state, "adagrad") == 3
    held, rows, st = store.read(keys, 4)
    assert held.all()
    np.testing.assert_array_equal(rows, emb)
    np.testing.assert_array_equal(st, state)
    store.upsert(keys[:1], 4, emb[:1] + 1, state[:1], "adam")  # another optimizer's state: fresh state
    _, rows, st = store.read(keys[:1], 4)
    np.testing.assert_array_equal(rows, emb[:1] + 1)
    assert not np.array_equal(st, state[:1])


def test_pruning_deletes_only_what_no_kept_checkpoint_needs(trained):
    reps, root, inc, base, _ = trained
    before = {d.rel for d in list_deltas(inc)}
    dead = inc / "s0" / delta_name(1_765_000_000_000_500)  # an old write cut short
    dead.mkdir()
    for index in range(2):
        gone = prune_deltas(inc, index, ck.checkpoint_number(base)[0])
        assert len(gone) == 2 + (index == 0), gone  # the first delta and the cut at T0 (and the dead write)
    after = {d.rel for d in list_deltas(inc)}
    assert after < before and len(after) == 6 and not dead.exists()
    want = merged([r.store for r in reps])
    assert_same(merged([restore(root, inc, base, i, 2) for i in range(2)]), want)


def test_a_server_waits_for_a_delta_being_written_and_passes_one_that_never_will(trained, caplog):
    from persia_nats.services.serving.incremental import AppliedDeltas, DeltaFollower

    reps, root, inc, base, _ = trained
    follower, done = DeltaFollower(inc, JOB), AppliedDeltas()
    ready = follower.ready(base, done)
    assert len(ready) == 6 and {s.replica_dir for s, _ in ready} == {0, 1}
    s0 = [s for s, _ in ready if s.replica_dir == 0]
    # the newest of replica 0 still being written: replica 1's are ready, replica 0's up to it
    (s0[-1].path / DONE).rename(s0[-1].path / "held")
    assert [s.rel for s, _ in follower.ready(base, done)] == [s.rel for s, _ in ready if s.rel != s0[-1].rel]
    # one in the middle without its marker while a later one is complete: a write cut short, passed by
    (s0[-1].path / "held").rename(s0[-1].path / DONE)
    (s0[1].path / DONE).unlink()
    with caplog.at_level(logging.WARNING):
        got = follower.ready(base, done)
    assert [s.rel for s, _ in got] == [s.rel for s, _ in ready if s.rel != s0[1].rel]
    assert "is incomplete and a later one is complete: passed by" in caplog.text
    # applied ones are not offered again
    store = EmbeddingStore(10_000, OPT, HYPER, initial_rows=64)
    assert follower.apply_now(store, base, done) == 5 and follower.ready(base, done) == []
    assert done.deltas == 5 and done.newest == got[-1][0].name and done.rows > 0


def test_the_incremental_keys_are_read_without_a_warning_and_checked(caplog):
    from persia_nats.common.config import global_config_from_dict
    from persia_nats.common.errors import ConfigError

    keys = {"enable_incremental_update": True, "incremental_buffer_size": 5000, "incremental_dir": "/data/inc",
            "incremental_interval_sec": 1.5, "incremental_poll_interval_sec": 0.5}
    with caplog.at_level(logging.INFO):
        ps = global_config_from_dict({"embedding_parameter_server_config": keys}).embedding_parameter_server_config
    assert (ps.enable_incremental_update, ps.incremental_buffer_size, ps.incremental_dir, ps.incremental_interval_sec,
            ps.incremental_poll_interval_sec) == (True, 5000, "/data/inc", 1.5, 0.5)
    assert "incremental" not in caplog.text
    for bad, says in (({"incremental_interval_sec": 0}, "incremental_interval_sec"),
                      ({"incremental_poll_interval_sec": -1}, "incremental_poll_interval_sec"),
                      ({"incremental_dir": "s3://bucket/inc"}, "incremental_dir"),
                      ({"incremental_buffer_size": 0}, "incremental_buffer_size")):
        with pytest.raises(ConfigError, match=says):
            global_config_from_dict({"embedding_parameter_server_config": bad})
