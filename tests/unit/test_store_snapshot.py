"""Live dumps: a checkpoint read in steps while the table trains equals the table stopped at T0.

The reference is :func:`dump_store_stopped` (the stop-the-world dump) run on a copy of the store taken at
T0: the live dump's files must be the same bytes, whatever lookups, inserts, evictions, growths, stamp
renumberings and updates run between its steps. And the table must answer exactly as a twin without a
dump: the hooks keep what the dump needs and change nothing anyone sees.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from persia_nats.common.errors import Conflict
from persia_nats.common.optim_config import AdagradConfig, AdamConfig, OptimizerConfig, SGDConfig
from persia_nats.core import store_snapshot
from persia_nats.core.store import EmbeddingStore
from persia_nats.core.store_checkpoint import DumpPace, LiveDump, dump_store_stopped

OPTIMIZERS = [SGDConfig(lr=0.1), AdagradConfig(lr=0.1), AdamConfig(lr=0.01)]


def _store(optimizer: OptimizerConfig, capacity: int, initial_rows: int, seed: int = 0) -> EmbeddingStore:
    store = EmbeddingStore(capacity, optimizer, initial_rows=initial_rows)
    rng = np.random.default_rng(seed)
    for _ in range(4):
        for dim in (4, 8):
            _train(store, rng, dim, min(3 * capacity // 2, 4500), 400)
    return store


def _train(store: EmbeddingStore, rng: np.random.Generator, dim: int, id_range: int, n: int) -> np.ndarray:
    ids = rng.integers(1, id_range, n, dtype=np.uint64)
    out = store.lookup(ids, dim, True)
    store.update(ids, rng.standard_normal((n, dim)).astype(np.float32))
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _live_dump(store: EmbeddingStore, root: Path, pace: DumpPace, between: Callable[[], None]) -> LiveDump:
    dump = LiveDump(store, root, 0, 1, pace)
    dump.prepare()
    dump.begin()
    for work in dump.steps():
        between()
        if work is not None:
            work()
        between()
    return dump


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("capacity, initial_rows, id_range", [(10**5, 64, 10**6), (3000, 4096, 20000)],
                         ids=["growing", "evicting"])
def test_a_dump_taken_while_the_table_trains_is_the_table_at_t0(tmp_path: Path, optimizer: OptimizerConfig,
                                                                 capacity: int, initial_rows: int,
                                                                 id_range: int) -> None:
    store = _store(optimizer, capacity, initial_rows)
    allocated = {dim: t._emb.shape[0] for dim, t in store.tables.items()}
    stopped = copy.deepcopy(store)
    dump_store_stopped(stopped, tmp_path / "ref", 0, 1)
    rng = np.random.default_rng(1)
    sizes = {dim: len(t) for dim, t in store.tables.items()}
    dump = _live_dump(store, tmp_path / "live", DumpPace(scan_slots=97, step_bytes=2000),
                      lambda: [_train(store, rng, dim, id_range, 150) for dim in (4, 8)])
    assert dump.rows == sum(sizes.values())
    assert _files(tmp_path / "live") == _files(tmp_path / "ref")
    assert all(t.snapshot is None for t in store.tables.values())
    if capacity > 3000:
        assert all(t._emb.shape[0] >= 4 * allocated[dim] for dim, t in store.tables.items())
    else:
        assert sum(t.evictions for t in store.tables.values()) > sum(t.evictions for t in stopped.tables.values())


def test_lookups_and_updates_during_a_dump_answer_as_without_one(tmp_path: Path) -> None:
    store = _store(AdagradConfig(lr=0.1), 3000, 64)
    twin = _store(AdagradConfig(lr=0.1), 3000, 64)  # not a deepcopy: that would part the rows from their reservation
    rng, twin_rng = np.random.default_rng(5), np.random.default_rng(5)
    seen: list[np.ndarray] = []

    def both() -> None:
        seen.append(_train(store, rng, 4, 6000, 200))
        assert np.array_equal(seen[-1], _train(twin, twin_rng, 4, 6000, 200))
        ids = rng.integers(1, 6000, 300, dtype=np.uint64)
        twin_rng.integers(1, 6000, 300, dtype=np.uint64)
        assert np.array_equal(store.lookup(ids, 4, False), twin.lookup(ids, 4, False))

    _live_dump(store, tmp_path, DumpPace(scan_slots=50, step_bytes=1000), both)
    assert len(seen) > 20
    for dim, table in store.tables.items():
        a, b = table.state_dict(), twin.tables[dim].state_dict()
        for key in a:
            assert np.array_equal(a[key], b[key]) if isinstance(a[key], np.ndarray) else a[key] == b[key], key


def test_a_stamp_renumbering_and_full_preimage_blocks_mid_dump_keep_it_exact(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_snapshot, "BLOCK_ROWS", 7)  # evictions and updates fill many blocks
    store = _store(AdagradConfig(lr=0.1), 2000, 4096)
    stopped = copy.deepcopy(store)
    dump_store_stopped(stopped, tmp_path / "ref", 0, 1)
    rng = np.random.default_rng(2)
    table = store.tables[4]
    table._stamp_limit = int(table._meta[1]) + 4000  # the clock passes it during the scan: renumbered
    renumbered = []

    def churn() -> None:
        clock = int(table._meta[1])
        _train(store, rng, 4, 9000, 120)
        renumbered.append(int(table._meta[1]) < clock)

    _live_dump(store, tmp_path / "live", DumpPace(scan_slots=40, step_bytes=500), churn)
    assert any(renumbered)
    assert _files(tmp_path / "live") == _files(tmp_path / "ref")


def test_an_abandoned_dump_leaves_no_files_open_and_the_table_unhooked(tmp_path: Path) -> None:
    store = _store(SGDConfig(lr=0.1), 1000, 64)
    dump = LiveDump(store, tmp_path, 0, 1, DumpPace(scan_slots=10, step_bytes=100))
    dump.prepare()
    dump.begin()
    steps = dump.steps()
    for _ in range(30):
        next(steps)
    with pytest.raises(Conflict):
        LiveDump(store, tmp_path, 0, 1).begin()  # one dump at a time
    with pytest.raises(Conflict):
        store.tables[4].load_state_dict(store.tables[4].state_dict())
    with pytest.raises(Conflict):
        store.tables[4].set_optimizer(AdamConfig())  # another kind of state
    steps.close()
    assert all(t.snapshot is None for t in store.tables.values())
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []
    store.tables[4].set_optimizer(AdamConfig())
    LiveDump(store, tmp_path, 0, 1).run_sync()


@pytest.mark.parametrize("during_dump", [False, True])
def test_candidate_lists_built_ahead_evict_exactly_as_a_rescan(tmp_path: Path, during_dump: bool) -> None:
    """Eviction candidates collected and sorted in steps between lookups (the table never rescans its
    index at once) evict the very rows the rescan would: every answer and the final LRU order agree."""
    capacity = 1 << 17
    ahead, rescan = (EmbeddingStore(capacity, AdagradConfig(lr=0.1), initial_rows=capacity) for _ in range(2))
    rng = np.random.default_rng(4)
    fill = np.arange(1, capacity + 1, dtype=np.uint64)
    for store in (ahead, rescan):
        store.lookup(fill[:10], 2, True)
        store.tables[2]._incremental = store is ahead
        store.lookup(fill, 2, True)
    pace = DumpPace(scan_slots=5000, step_bytes=20000)
    dump = LiveDump(ahead, tmp_path / "live", 0, 1, pace) if during_dump else None
    steps = None
    if dump is not None:
        dump_store_stopped(rescan, tmp_path / "ref", 0, 1)  # the twin, stopped at T0
        dump.prepare()
        dump.begin()
        steps = dump.steps()
    for _ in range(150):
        hot = rng.integers(1, capacity, 1500, dtype=np.uint64)
        new = rng.integers(1, 6 * capacity, 2500, dtype=np.uint64)
        ids = rng.permutation(np.concatenate([hot, new]))
        assert np.array_equal(ahead.lookup(ids, 2, True), rescan.lookup(ids, 2, True))
        grads = rng.standard_normal((ids.shape[0], 2)).astype(np.float32)
        assert ahead.update(ids, grads) == rescan.update(ids, grads)
        if steps is not None:
            work = next(steps, None)
            if callable(work):
                work()
    if steps is not None:
        for work in steps:
            if work is not None:
                work()
    if dump is not None:
        assert _files(tmp_path / "live") == _files(tmp_path / "ref")
    a, b = ahead.tables[2], rescan.tables[2]
    assert a.lists_built_ahead > 3 and b.lists_built_ahead == 0
    assert a.evictions == b.evictions > capacity
    sa, sb = a.state_dict(), b.state_dict()
    for key in ("keys", "emb", "state"):
        assert np.array_equal(sa[key], sb[key]), key


@pytest.mark.parametrize("during_dump", [False, True])
def test_indexes_doubled_ahead_answer_as_a_rebuild_at_once(tmp_path: Path, during_dump: bool) -> None:
    """A doubled index copied in steps after each lookup (entries inserted or touched behind the copy's
    cursor mirrored into it) and swapped in when the rows run out: every answer, the final LRU order and
    a dump taken meanwhile are those of the table that rebuilt its index at once."""
    ahead, rebuilt = (EmbeddingStore(1 << 20, AdagradConfig(lr=0.1), initial_rows=1 << 16) for _ in range(2))
    rng = np.random.default_rng(9)
    for store in (ahead, rebuilt):
        store.lookup(np.arange(1, 11, dtype=np.uint64), 2, True)
        store.tables[2]._incremental = store is ahead
    steps = None
    if during_dump:
        dump_store_stopped(rebuilt, tmp_path / "ref", 0, 1)
        dump = LiveDump(ahead, tmp_path / "live", 0, 1, DumpPace(scan_slots=3000, step_bytes=3000))
        dump.prepare()
        dump.begin()
        steps = dump.steps()
    for _ in range(120):
        ids = rng.permutation(np.concatenate([rng.integers(1, 20000, 1000, dtype=np.uint64),
                                              rng.integers(1, 2**40, 2500, dtype=np.uint64)]))
        assert np.array_equal(ahead.lookup(ids, 2, True), rebuilt.lookup(ids, 2, True))
        grads = rng.standard_normal((ids.shape[0], 2)).astype(np.float32)
        assert ahead.update(ids, grads) == rebuilt.update(ids, grads)
        probe = rng.integers(1, 2**40, 500, dtype=np.uint64)
        assert np.array_equal(ahead.lookup(probe, 2, False), rebuilt.lookup(probe, 2, False))
        if steps is not None:
            work = next(steps, None)
            if callable(work):
                work()
    if steps is not None:
        for work in steps:
            if work is not None:
                work()
        assert _files(tmp_path / "live") == _files(tmp_path / "ref")
    a, b = ahead.tables[2], rebuilt.tables[2]
    assert a.growths_built_ahead >= 2 and b.growths_built_ahead == 0
    assert a._emb.shape == b._emb.shape and len(a) == len(b) > 1 << 18
    sa, sb = a.state_dict(), b.state_dict()
    for key in ("keys", "emb", "state"):
        assert np.array_equal(sa[key], sb[key]), key
