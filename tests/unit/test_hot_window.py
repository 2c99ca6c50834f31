"""The embedding worker's automatic hot-row choice (persia_nats.services.embedding_worker.hot_window)."""

from __future__ import annotations

import numpy as np
from persia_nats.common.config import embedding_config_from_dict
from persia_nats.common.messages import IdFeature
from persia_nats.core.plan import make_plan
from persia_nats.services.embedding_worker import hot_window
from persia_nats.services.embedding_worker.hot_window import AUTO_READS_PER_BATCH, InFlightReads, batch_reads

ECFG = embedding_config_from_dict({"feature_index_prefix_bit": 8, "slots_config": {
    "a": {"dim": 4}, "b": {"dim": 2}, "r": {"dim": 2, "embedding_summation": False, "sample_fixed_size": 2}}})


def plan(a, b=None, r=None):
    """A batch whose slot a holds the id lists ``a`` (and b, r when given)."""
    def feat(name, rows):
        return IdFeature(name, np.array([x for row in rows for x in row], np.uint64),
                         np.array([len(row) for row in rows], np.int32))
    feats = [feat("a", a)] + ([feat("b", b)] if b else []) + ([feat("r", r)] if r else [])
    return make_plan(feats, ECFG)


def key(slot, i):
    return np.uint64(i) | np.uint64(ECFG.prefix_of(slot))


def hot_keys(window, p, dim):
    masks = window.hot(p) or {}
    return set() if dim not in masks else {int(k) for k in p.distinct[dim][masks[dim]]}


def test_nothing_is_hot_while_nothing_is_in_flight():
    window = InFlightReads(capacity=8, expire_s=60)
    assert window.hot(plan([[1], [1], [1], [1]])) is None


def test_rows_the_batches_in_flight_read_once_per_batch_on_average_are_hot():
    assert AUTO_READS_PER_BATCH == 1
    window = InFlightReads(capacity=8, expire_s=60)
    window.add(10, plan([[1], [1], [2], [3]]))  # id 1 read twice, 2 and 3 once
    window.add(11, plan([[1, 2], [1], [4], [1]]))  # id 1 three times, 2 and 4 once
    # two batches in flight: 2 reads needed; id 1 has 5, id 2 has 2, ids 3 and 4 one each
    assert hot_keys(window, plan([[1], [2], [3], [4], [5]]), 4) == {int(key("a", 1)), int(key("a", 2))}
    window.remove(10)  # one batch left: every row it reads is hot, and only those
    assert hot_keys(window, plan([[1], [2], [3], [4]]), 4) == {int(key("a", 1)), int(key("a", 2)),
                                                                 int(key("a", 4))}
    window.remove(11)
    assert window.hot(plan([[1], [2]])) is None and window.rows == 0 and len(window) == 0


def test_dims_are_counted_apart_and_raw_slots_are_not_counted():
    p = plan([[1], [1]], b=[[7], [7]], r=[[9, 9], [9]])
    reads = batch_reads(p)
    assert set(reads) == {4, 2}  # r (raw) is pooled by no one: its dim-2 rows are b's only
    np.testing.assert_array_equal(reads[2][0], [key("b", 7)])
    np.testing.assert_array_equal(reads[2][1], [2])
    window = InFlightReads(capacity=8, expire_s=60)
    window.add(1, p)
    masks = window.hot(p)
    assert {int(k) for k in p.distinct[2][masks[2]]} == {int(key("b", 7))}


def test_a_batch_in_flight_longer_than_the_buffer_keeps_it_is_forgotten():
    now = [0.0]
    window = InFlightReads(capacity=8, expire_s=5, clock=lambda: now[0])
    window.add(1, plan([[1], [1]]))
    assert hot_keys(window, plan([[1]]), 4) == {int(key("a", 1))}
    now[0] = 6.0
    assert window.hot(plan([[1]])) is None and len(window) == 0 and window.rows == 0
    window.remove(1)  # its gradients come after all: nothing left to take off, nothing goes negative
    assert window.rows == 0


def test_the_window_holds_at_most_capacity_batches_and_grows_its_table():
    window = InFlightReads(capacity=3, expire_s=60)
    for ref in range(5):
        window.add(ref, plan([[ref * 1000 + i] for i in range(600)]))  # 3 x 600 rows > the first table
    assert len(window) == 3 and window.rows == 1800
    for ref in range(5):
        window.remove(ref)
    assert window.rows == 0


def test_adding_a_ref_again_replaces_its_reads():
    window = InFlightReads(capacity=8, expire_s=60)
    window.add(1, plan([[1], [1]]))
    window.add(1, plan([[2], [2]]))
    assert len(window) == 1 and hot_keys(window, plan([[1], [2]]), 4) == {int(key("a", 2))}


def test_past_the_cap_only_the_most_read_rows_are_hot(monkeypatch):
    monkeypatch.setattr(hot_window, "AUTO_MAX_ROWS", 2)
    window = InFlightReads(capacity=8, expire_s=60)
    window.add(1, plan([[1], [1], [1], [2], [2], [3], [4]], b=[[7], [7]]))  # reads: 1: 3, 2: 2, 7: 2, 3 and 4: 1
    masks = window.hot(plan([[1], [2], [3], [4]], b=[[7]]))
    # 5 rows reach one read per batch; the 2 kept are the most read: id 1 (3 reads), then one of the
    # two read twice (2 of a, 7 of b)
    kept = {int(k) for d, m in masks.items() for k in plan([[1], [2], [3], [4]], b=[[7]]).distinct[d][m]}
    assert len(kept) == 2 and int(key("a", 1)) in kept and kept - {int(key("a", 1))} <= {int(key("a", 2)),
                                                                                         int(key("b", 7))}


def test_the_most_read_rows_are_those_a_stable_sort_by_count_keeps():
    rng = np.random.default_rng(3)
    for n, k in ((1, 1), (10, 3), (5000, 512), (5000, 37)):
        # mostly -1 (not hot), the rest few distinct counts: ties at the cut are the rule, not the exception
        counts = np.where(rng.random(n) < 0.4, rng.integers(0, 6, n), -1).astype(np.int64)
        if int((counts >= 0).sum()) <= k:
            np.testing.assert_array_equal(hot_window._most_read(counts, k), counts >= 0)
            continue
        expected = np.zeros(n, np.bool_)
        expected[np.argsort(-counts, kind="stable")[:k]] = True
        kept = hot_window._most_read(counts, k)
        np.testing.assert_array_equal(kept, expected)
        assert int(kept.sum()) == k


def straightforward_hot(in_flight, p, k):
    """The hot rows of ``p`` as the rule states them: every row's reads by the batches ``in_flight``
    counted one by one, those read once per batch on average kept, at most the ``k`` most read (a
    stable sort by count, ties to the earlier dim and row)."""
    if not in_flight:
        return None
    counts: dict[tuple[int, int], int] = {}
    for b in in_flight:
        for dim, (keys, reads) in batch_reads(b).items():
            for key_, n in zip(keys.tolist(), reads.tolist(), strict=True):
                counts[dim, key_] = counts.get((dim, key_), 0) + n
    least = AUTO_READS_PER_BATCH * len(in_flight)
    flat = np.array([c if (c := counts.get((dim, key_), 0)) >= least else -1
                     for dim in p.pooled for key_ in p.distinct[dim].tolist()], np.int64)
    keep = np.zeros(flat.shape[0], np.bool_)
    hot = np.flatnonzero(flat >= 0)
    keep[hot[np.argsort(-flat[hot], kind="stable")[:k]]] = True
    bounds = np.cumsum([0] + [p.distinct[dim].shape[0] for dim in p.pooled])
    masks = {dim: keep[bounds[i]:bounds[i + 1]] for i, dim in enumerate(p.pooled)}
    return {dim: m for dim, m in masks.items() if m.any()} or None


def zipf_plan(rng, batch=300):
    """Two pooled dims of Zipf ids, some samples with several ids: many rows read once, a few read often."""
    def rows(n_ids):
        return [list(rng.zipf(1.3, size=int(rng.integers(1, 3))) % n_ids) for _ in range(batch)]
    return plan(rows(5000), b=rows(800))


def test_the_hot_rows_are_those_counting_every_read_gives(monkeypatch):
    """Counting only the rows some batch reads often (while the cap decides), or those and the rows every
    batch reads (while it may not), chooses what counting every row would: windows of 1 to 6 batches,
    caps that decide and a cap that does not."""
    full = []  # one entry per dim of a lookup that counted every row that may be hot
    real = hot_window._in_all
    monkeypatch.setattr(hot_window, "_in_all", lambda *a: full.append(1) or real(*a))
    rng = np.random.default_rng(11)
    plans = [zipf_plan(rng) for _ in range(30)]
    for k in (5, 40, 100_000):
        monkeypatch.setattr(hot_window, "AUTO_MAX_ROWS", k)
        for size in (1, 2, 3, 6, hot_window.WIDE_WINDOW + 4):  # the last counts in one shared table
            full.clear()
            window = InFlightReads(capacity=size, expire_s=60)
            for i, p in enumerate(plans):
                expected = straightforward_hot(plans[max(0, i - size):i], p, k)
                got = window.hot(p)
                assert (got is None) == (expected is None), (k, size, i)
                if got is not None:
                    assert got.keys() == expected.keys()
                    for dim in got:
                        np.testing.assert_array_equal(got[dim], expected[dim], err_msg=f"{k} {size} {i} {dim}")
                window.add(i, p)
            counted = 2 * (len(plans) - 1)  # two dims; the first lookup finds nothing in flight
            if k == 5 and size <= hot_window.WIDE_WINDOW:
                assert len(full) < counted / 2  # most lookups counted the often-read rows only
            if k == 100_000 and size <= hot_window.WIDE_WINDOW:
                assert len(full) == counted


def test_membership_of_sorted_keys():
    rng = np.random.default_rng(5)
    for n, m in ((0, 5), (5, 0), (1, 1), (300, 200), (2000, 3000)):
        keys = np.unique(rng.integers(0, 4000, n).astype(np.uint64))
        b_keys = np.unique(rng.integers(0, 4000, m).astype(np.uint64))
        found = np.zeros(keys.shape[0], np.bool_)
        hot_window._member(keys, b_keys, found)
        np.testing.assert_array_equal(found, np.isin(keys, b_keys))


def test_rows_every_batch_in_flight_reads_once_are_hot_though_none_reads_them_twice():
    window = InFlightReads(capacity=8, expire_s=60)
    for ref in range(3):
        window.add(ref, plan([[1], [2 + ref], [9]], b=[[7]] if ref != 1 else None))
    # ids 1 and 9 of a: once in each of the 3 batches, so 3 reads; 7 of b: 2 batches of 3 read it once
    assert hot_keys(window, plan([[1], [2], [9]], b=[[7]]), 4) == {int(key("a", 1)), int(key("a", 9))}
    assert hot_keys(window, plan([[1], [2], [9]], b=[[7]]), 2) == set()


def test_a_window_that_widens_and_narrows_again_counts_the_same():
    """Past WIDE_WINDOW batches the reads are counted in one table too, until half as many are left:
    the hot rows stay what counting every read gives, on the way up and down."""
    rng = np.random.default_rng(2)
    plans = [zipf_plan(rng, batch=200) for _ in range(hot_window.WIDE_WINDOW + 4)]
    window = InFlightReads(capacity=64, expire_s=60)
    refs: list[int] = []
    probe_plan = zipf_plan(rng, batch=200)
    for ref, p in enumerate(plans):
        window.add(ref, p)
        refs.append(ref)
        assert window.rows == len({(d, int(k)) for r in refs for d, (ks, _) in batch_reads(plans[r]).items()
                                   for k in ks})
        assert _same(window.hot(probe_plan), straightforward_hot([plans[r] for r in refs], probe_plan, 512)), ref
    assert window._shared is not None
    while refs:
        window.remove(refs.pop(0))
        got, want = window.hot(probe_plan), straightforward_hot([plans[r] for r in refs], probe_plan, 512)
        assert _same(got, want), len(refs)
    assert window._shared is None and window.rows == 0


def _same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and a.keys() == b.keys()
                                         and all(np.array_equal(a[d], b[d]) for d in a))
