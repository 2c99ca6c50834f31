"""The PS embedding store (persia_nats.core.store): LRU, hash index, init, admission, updates."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from persia_nats.common.errors import BadRequest, ConfigError, Conflict
from persia_nats.common.optim_config import AdagradConfig, AdamConfig, EmbeddingHyperparams, SGDConfig
from persia_nats.core.store import EmbeddingStore, EmbeddingTable
from persia_nats.core.table_kernels import home_slots


def u64(*ids):
    return np.array(ids, np.uint64)


def lru_keys(table):
    return table.state_dict()["keys"].tolist()


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            assert a[k] == b[k], k


# ---------------------------------------------------------------- LRU


def test_lru_evicts_least_recently_used():
    t = EmbeddingTable(2, capacity=3)
    t.lookup(u64(1, 2, 3), train=True)
    t.lookup(u64(1), train=True)  # touch 1: order 2, 3, 1
    assert lru_keys(t) == [2, 3, 1]
    t.lookup(u64(4), train=True)  # evicts 2
    assert lru_keys(t) == [3, 1, 4] and t.evictions == 1 and len(t) == 3
    t.lookup(u64(5), train=True)  # evicts 3
    assert lru_keys(t) == [1, 4, 5] and t.evictions == 2
    np.testing.assert_array_equal(t.lookup(u64(2, 3), train=False), 0.0)
    assert t.inserts == 5


def test_lru_refresh_follows_id_order_within_a_call():
    t = EmbeddingTable(2, capacity=10)
    t.lookup(u64(1, 2, 3), train=True)
    t.lookup(u64(3, 1), train=True)
    assert lru_keys(t) == [2, 3, 1]
    t.lookup(u64(2, 5, 3), train=True)
    assert lru_keys(t) == [1, 2, 5, 3]


def test_capacity_one_and_eviction_inside_one_call():
    t = EmbeddingTable(3, capacity=1)
    out = t.lookup(u64(1, 2, 1), train=True)
    assert lru_keys(t) == [1] and t.evictions == 2
    np.testing.assert_array_equal(out[0], out[2])  # re-inserted 1 starts from the same vector


def test_eval_lookup_neither_inserts_nor_refreshes():
    t = EmbeddingTable(2, capacity=3)
    first = t.lookup(u64(1, 2, 3), train=True)
    before = t.state_dict()
    out = t.lookup(u64(9, 1, 9), train=False)
    np.testing.assert_array_equal(out[[0, 2]], 0.0)
    np.testing.assert_array_equal(out[1], first[0])
    after = t.state_dict()
    assert after["keys"].tolist() == [1, 2, 3] and len(t) == 3 and t.inserts == 3
    assert after["index_miss_count"] == before["index_miss_count"] + 2
    t.lookup(u64(4), train=True)
    assert lru_keys(t) == [2, 3, 4]  # 1 was not refreshed by the eval lookup


def test_updates_do_not_refresh_recency():
    t = EmbeddingTable(2, capacity=2, optimizer=SGDConfig(lr=1.0))
    t.lookup(u64(1, 2), train=True)
    t.update(u64(1), np.ones((1, 2), np.float32))
    t.lookup(u64(3), train=True)
    assert lru_keys(t) == [2, 3]


# ---------------------------------------------------------------- initialisation and admission


def test_init_is_deterministic_by_id_and_within_bounds():
    ids = np.random.default_rng(0).integers(0, 2**64 - 1, 500, dtype=np.uint64)
    a = EmbeddingTable(8, capacity=1000).lookup(ids, train=True)
    b_table = EmbeddingTable(8, capacity=600, initial_rows=1)
    b_table.lookup(ids[::-1][:100], train=True)  # another order, other batches, other growth history
    b = b_table.lookup(ids, train=True)
    np.testing.assert_array_equal(a, b)
    assert a.min() >= -0.01 and a.max() <= 0.01
    assert len({row.tobytes() for row in a}) == 500  # distinct ids, distinct vectors
    assert abs(float(a.mean())) < 1e-3 and a.std() > 0.005  # spread over the whole range


def test_init_uses_the_configured_range():
    hyper = EmbeddingHyperparams(init_lower=2.0, init_upper=3.0)
    out = EmbeddingTable(16, capacity=100, hyper=hyper).lookup(np.arange(50, dtype=np.uint64), train=True)
    assert out.min() >= 2.0 and out.max() <= 3.0 and out.max() - out.min() > 0.9


def test_evicted_id_comes_back_with_its_initial_vector():
    t = EmbeddingTable(4, capacity=1, optimizer=SGDConfig(lr=1.0))
    first = t.lookup(u64(7), train=True)
    t.update(u64(7), np.ones((1, 4), np.float32))
    t.lookup(u64(8), train=True)
    np.testing.assert_array_equal(t.lookup(u64(7), train=True), first)


def test_admission_zero_stores_nothing():
    t = EmbeddingTable(4, capacity=100, hyper=EmbeddingHyperparams(admit_probability=0.0))
    out = t.lookup(np.arange(20, dtype=np.uint64), train=True)
    np.testing.assert_array_equal(out, 0.0)
    assert len(t) == 0 and t.inserts == 0 and t.index_miss_count == 20


def test_admission_probability_is_honoured_and_reproducible():
    hyper = EmbeddingHyperparams(admit_probability=0.3)
    ids = np.arange(10_000, dtype=np.uint64)
    a, b = EmbeddingTable(2, 20_000, hyper=hyper), EmbeddingTable(2, 20_000, hyper=hyper)
    out = a.lookup(np.concatenate([ids, ids]), train=True)
    b.lookup(np.concatenate([ids, ids]), train=True)
    assert 2700 < len(a) < 3300
    assert sorted(lru_keys(a)) == sorted(lru_keys(b))
    admitted = np.zeros(10_000, bool)
    admitted[lru_keys(a)] = True
    np.testing.assert_array_equal(out[:10_000].any(axis=1), admitted)  # refused ids read as zeros
    np.testing.assert_array_equal(out[:10_000], out[10_000:])  # one decision per id within a call


def test_refused_ids_get_fresh_draws_on_later_lookups():
    t = EmbeddingTable(2, 1000, hyper=EmbeddingHyperparams(admit_probability=0.5))
    ids = np.arange(200, dtype=np.uint64)
    for _ in range(12):
        t.lookup(ids, train=True)
    assert len(t) == 200  # 0.5**12 * 200 < 0.05 expected stragglers; each draw depends on the call


# ---------------------------------------------------------------- lookup input and output


def test_duplicates_in_one_lookup_share_one_row():
    t = EmbeddingTable(4, capacity=10)
    out = t.lookup(u64(7, 7, 3, 7), train=True)
    assert len(t) == 2 and t.inserts == 2
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0], out[3])


def test_lookup_returns_a_fresh_array():
    t = EmbeddingTable(2, capacity=10)
    out = t.lookup(u64(1), train=True)
    out[:] = 5.0
    assert t.lookup(u64(1), train=False).max() <= 0.01
    assert t.lookup(u64(), train=True).shape == (0, 2)


def test_read_only_and_strided_ids_are_accepted():
    t = EmbeddingTable(2, capacity=10)
    ro = np.frombuffer(u64(1, 2, 3).tobytes(), np.uint64)
    assert not ro.flags.writeable
    np.testing.assert_array_equal(t.lookup(ro, train=True), t.lookup(u64(1, 2, 3, 4)[:3], train=False))
    np.testing.assert_array_equal(t.lookup(u64(1, 9, 2, 9)[::2], train=False), t.lookup(u64(1, 2), train=False))


@pytest.mark.parametrize("ids", [np.array([1], np.int64), np.array([[1]], np.uint64), [1], np.array([1], ">u8")])
def test_lookup_refuses_bad_ids(ids):
    t = EmbeddingTable(2, capacity=10)
    with pytest.raises(BadRequest):
        t.lookup(ids, train=True)
    assert len(t) == 0


# ---------------------------------------------------------------- updates


def test_update_sums_duplicate_gradients_then_steps_once():
    cfg = AdagradConfig(lr=0.1, initial_accumulator_value=0.01, eps=1e-10)
    t = EmbeddingTable(2, capacity=10, optimizer=cfg, hyper=EmbeddingHyperparams(weight_bound=0.0))
    w = t.lookup(u64(5), train=True)[0].astype(np.float64)
    misses = t.update(u64(5, 5), np.array([[0.25, 1.0], [0.25, -3.0]], np.float32))
    assert misses == 0
    g = np.array([0.5, -2.0])  # summed; one step: acc += g^2, then w -= 0.1 g / sqrt(acc)
    np.testing.assert_allclose(t.lookup(u64(5), train=False)[0], w - 0.1 * g / np.sqrt(0.01 + g**2), rtol=1e-6)
    np.testing.assert_allclose(t.state_dict()["state"][0], 0.01 + g**2, rtol=1e-6)


def test_update_skips_and_counts_unknown_ids():
    t = EmbeddingTable(2, capacity=10, optimizer=SGDConfig(lr=1.0))
    before = t.lookup(u64(1, 2), train=True)
    assert t.update(u64(1, 99, 98, 99), np.ones((4, 2), np.float32)) == 3
    assert t.gradient_id_miss_count == 3 and len(t) == 2
    np.testing.assert_allclose(t.lookup(u64(1, 2), train=False), before - [[1, 1], [0, 0]], rtol=1e-6)


def test_update_without_optimizer_is_a_conflict():
    t = EmbeddingTable(2, capacity=10)
    t.lookup(u64(1), train=True)
    with pytest.raises(Conflict):
        t.update(u64(1), np.ones((1, 2), np.float32))


def test_update_accepts_float16_and_float64_gradients():
    t = EmbeddingTable(2, capacity=10, optimizer=SGDConfig(lr=1.0))
    w = t.lookup(u64(1), train=True)
    t.update(u64(1), np.ones((1, 2), np.float16))
    t.update(u64(1), np.ones((1, 2), np.float64))
    np.testing.assert_allclose(t.lookup(u64(1), train=False), w - 2.0, rtol=1e-6)


def test_weight_bound_applies_to_updates():
    t = EmbeddingTable(2, 10, optimizer=SGDConfig(lr=1.0), hyper=EmbeddingHyperparams(weight_bound=0.5))
    t.lookup(u64(1), train=True)
    t.update(u64(1), np.array([[-100.0, 100.0]], np.float32))
    np.testing.assert_array_equal(t.lookup(u64(1), train=False), [[0.5, -0.5]])


BAD_UPDATES = [
    (np.array([1, 2], np.int64), np.ones((2, 2), np.float32)),
    (u64(1, 2).reshape(2, 1), np.ones((2, 2), np.float32)),
    ([1, 2], np.ones((2, 2), np.float32)),
    (u64(1, 2), np.ones((2, 3), np.float32)),
    (u64(1, 2), np.ones((3, 2), np.float32)),
    (u64(1, 2), np.ones(4, np.float32)),
    (u64(1, 2), np.ones((2, 2), np.int32)),
    (u64(1, 2), [[1.0, 1.0], [1.0, 1.0]]),
    (u64(1, 2), np.array([[1.0, np.nan], [1.0, 1.0]], np.float32)),
    (u64(1, 99), np.array([[1.0, 1.0], [np.inf, 1.0]], np.float32)),  # even for an unknown id
    (u64(1, 2), np.array([[1e300, 1.0], [1.0, 1.0]], np.float64)),  # overflows float32
    (u64(1, 1), np.array([[3e38, 1.0], [3e38, 1.0]], np.float32)),  # the sum overflows
]


@pytest.mark.parametrize(("ids", "grads"), BAD_UPDATES)
def test_bad_updates_are_refused_and_change_nothing(ids, grads):
    t = EmbeddingTable(2, capacity=10, optimizer=AdamConfig())
    t.lookup(u64(1, 2, 3), train=True)
    t.update(u64(2), np.ones((1, 2), np.float32))
    before = t.state_dict()
    with pytest.raises(BadRequest):
        t.update(ids, grads)
    assert_same_state(before, t.state_dict())


# ---------------------------------------------------------------- optimizer registration


def test_set_optimizer_keeps_state_of_the_same_kind_and_resets_another():
    t = EmbeddingTable(2, capacity=10, optimizer=AdagradConfig(lr=0.1, initial_accumulator_value=0.5))
    t.lookup(u64(1, 2), train=True)
    t.update(u64(1), np.ones((1, 2), np.float32))
    acc = t.state_dict()["state"]
    t.set_optimizer(AdagradConfig(lr=0.01, initial_accumulator_value=0.5))  # a new learning rate
    np.testing.assert_array_equal(t.state_dict()["state"], acc)
    t.set_optimizer(AdamConfig())
    assert t.state_dict()["state"].shape == (2, 5) and not t.state_dict()["state"].any()
    assert t.raw_bytes_per_row() == 8 + 8 + 20
    t.set_optimizer(AdagradConfig(initial_accumulator_value=0.25, vectorwise_shared=True))
    np.testing.assert_array_equal(t.state_dict()["state"], [[0.25], [0.25]])
    t.set_optimizer(SGDConfig(lr=0.1))
    assert t.state_dict()["state"].shape == (2, 0)
    with pytest.raises(ConfigError):
        t.set_optimizer({"type": "sgd"})


def test_rows_inserted_before_the_optimizer_get_state_when_it_arrives():
    t = EmbeddingTable(2, capacity=10)
    t.lookup(u64(1), train=True)
    t.set_optimizer(AdagradConfig(initial_accumulator_value=0.125))
    t.lookup(u64(2), train=True)
    np.testing.assert_array_equal(t.state_dict()["state"], 0.125)


# ---------------------------------------------------------------- growth, index, memory


def test_growth_past_initial_rows_keeps_every_row():
    t = EmbeddingTable(3, capacity=10_000, initial_rows=2)
    ids = np.random.default_rng(3).integers(0, 2**64 - 1, 3000, dtype=np.uint64)
    first = t.lookup(ids, train=True)
    assert len(t) == 3000
    np.testing.assert_array_equal(t.lookup(ids, train=False), first)
    np.testing.assert_array_equal(EmbeddingTable(3, capacity=10_000).lookup(ids, train=True), first)


def test_calls_stopped_to_grow_or_refill_return_every_row():
    """A training lookup stops to grow the rows or to list eviction candidates and resumes where it
    stopped; the rows it had resolved but not yet copied out, and every row after, are each id's own."""
    ids = np.random.default_rng(5).integers(0, 2**64 - 1, 6000, dtype=np.uint64)
    expected = EmbeddingTable(3, capacity=10_000).lookup(ids, train=True)
    t = EmbeddingTable(3, capacity=700, initial_rows=1)
    np.testing.assert_array_equal(t.lookup(ids, train=True), expected)
    assert t.evictions == 6000 - 700
    np.testing.assert_array_equal(t.lookup(ids[-700:], train=False), expected[-700:])


def test_allocation_stops_at_capacity():
    t = EmbeddingTable(4, capacity=100, initial_rows=8)
    small = t.memory_bytes()
    t.lookup(np.arange(1000, dtype=np.uint64), train=True)
    full = t.memory_bytes()
    t.lookup(np.arange(1000, 5000, dtype=np.uint64), train=True)
    assert small < full == t.memory_bytes() and len(t) == 100


def test_memory_per_row_close_to_raw_bytes():
    t = EmbeddingTable(16, capacity=8192, optimizer=AdagradConfig())
    t.lookup(np.arange(8192, dtype=np.uint64), train=True)
    assert t.raw_bytes_per_row() == 8 + 64 + 64
    assert t.memory_bytes() / len(t) <= 1.3 * t.raw_bytes_per_row()


def test_many_evictions_against_a_dict_model():
    """200k random ids (with repeats) through a 150k-row table; every id keeps its own row."""
    rng = np.random.default_rng(4)
    cap = 150_000
    t = EmbeddingTable(2, capacity=cap, optimizer=SGDConfig(lr=1.0), initial_rows=1024)
    model: OrderedDict[int, None] = OrderedDict()
    pool = rng.integers(0, 2**64 - 1, 200_000, dtype=np.uint64)
    for _ in range(60):
        batch = np.concatenate([rng.choice(pool, 4000), rng.integers(0, 2**64 - 1, 1000, dtype=np.uint64)])
        t.lookup(batch, train=True)
        for key in batch.tolist():
            if key in model:
                model.move_to_end(key)
            else:
                model[key] = None
                if len(model) > cap:
                    model.popitem(last=False)
    assert lru_keys(t) == list(model)
    assert t.inserts - t.evictions == len(t) == len(model)
    live = np.array(list(model), np.uint64)
    # the row each id reads is its own: an id-specific update lands where the same id reads it back
    reference = EmbeddingTable(2, capacity=len(live)).lookup(live, train=True)
    shift = (live % np.uint64(1000)).astype(np.float32)[:, None] * np.float32([1e-3, -1e-3])
    assert t.update(live, shift) == 0
    np.testing.assert_allclose(t.lookup(live, train=False), reference - shift, rtol=1e-6)
    gone = np.setdiff1d(pool, live)[:1000]
    np.testing.assert_array_equal(t.lookup(gone, train=False), 0.0)


def test_huge_capacity_uses_int64_links_and_costs_nothing_up_front():
    t = EmbeddingTable(2, capacity=2**40, optimizer=SGDConfig(lr=1.0), initial_rows=4)
    assert t.memory_bytes() < 4096
    w = t.lookup(np.arange(100, dtype=np.uint64), train=True)
    t.lookup(u64(5), train=True)
    t.update(u64(5), np.ones((1, 2), np.float32))
    np.testing.assert_allclose(t.lookup(u64(5, 6), train=False), [w[5] - 1, w[6]], rtol=1e-6)
    assert lru_keys(t)[-2:] == [99, 5]
    assert t.raw_bytes_per_row() == 16


def test_index_home_slots_cover_tables_beyond_32_bit_slot_counts():
    ids = np.random.default_rng(5).integers(0, 2**64 - 1, 10_000, dtype=np.uint64)
    for nslots in (3, 2**32 + 7):
        homes = home_slots(ids, nslots)
        assert homes.min() >= 0 and homes.max() < nslots and homes.max() > nslots // 2


# ---------------------------------------------------------------- state dict


def _busy_table(capacity=5, optimizer=None):
    t = EmbeddingTable(3, capacity=capacity, optimizer=optimizer or AdamConfig(lr=0.1))
    t.lookup(u64(1, 2, 3, 4, 5, 6), train=True)
    t.lookup(u64(3, 2), train=True)
    t.update(u64(2, 4, 42), np.arange(9, dtype=np.float32).reshape(3, 3))
    return t


def test_state_dict_round_trip_keeps_values_order_and_counters():
    t = _busy_table()
    sd = t.state_dict()
    assert sd["keys"].tolist() == [4, 5, 6, 3, 2] and sd["state_kind"] == "adam"
    copy = EmbeddingTable(3, capacity=5, optimizer=AdamConfig(lr=0.1), initial_rows=1)
    copy.load_state_dict(sd)
    assert_same_state(sd, copy.state_dict())
    for table in (t, copy):  # both go on the same way: 7 evicts 4, whose return evicts 5
        table.lookup(u64(7, 4), train=True)
        table.update(u64(4, 6), np.ones((2, 3), np.float32))
    assert_same_state(t.state_dict(), copy.state_dict())
    assert lru_keys(copy) == [6, 3, 2, 7, 4] and copy.evictions == 3


def test_load_into_a_smaller_table_drops_the_oldest_rows():
    sd = _busy_table().state_dict()
    small = EmbeddingTable(3, capacity=2, optimizer=AdamConfig(lr=0.1))
    small.load_state_dict(sd)
    assert lru_keys(small) == [3, 2] and small.evictions == sd["evictions"] + 3


def test_load_with_another_optimizer_reinitialises_state():
    sd = _busy_table().state_dict()
    t = EmbeddingTable(3, capacity=5, optimizer=AdagradConfig(initial_accumulator_value=0.5))
    t.load_state_dict(sd)
    np.testing.assert_array_equal(t.state_dict()["emb"], sd["emb"])
    np.testing.assert_array_equal(t.state_dict()["state"], 0.5)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda sd: sd.update(keys=np.array([4, 5, 6, 3, 4], np.uint64)),  # a repeated key
        lambda sd: sd.update(emb=sd["emb"].astype(np.float64)),
        lambda sd: sd.update(state=sd["state"][:, :2]),
        lambda sd: sd.update(state_kind="rmsprop"),
        lambda sd: sd.pop("keys"),
        lambda sd: sd.update(evictions="many"),
    ],
)
def test_bad_state_dicts_are_refused_and_change_nothing(corrupt):
    t = _busy_table()
    before = t.state_dict()
    sd = t.state_dict()
    corrupt(sd)
    with pytest.raises(BadRequest):
        t.load_state_dict(sd)
    assert_same_state(before, t.state_dict())


# ---------------------------------------------------------------- store of tables


def test_store_keeps_one_table_per_dim():
    s = EmbeddingStore(capacity=4, optimizer=SGDConfig(lr=1.0))
    a = s.lookup(u64(1, 2), 2, train=True)
    b = s.lookup(u64(1), 8, train=True)
    assert a.shape == (2, 2) and b.shape == (1, 8) and len(s) == 3
    np.testing.assert_array_equal(s.lookup(u64(1), 4, train=False), np.zeros((1, 4)))
    assert sorted(s.tables) == [2, 8]  # an eval lookup creates no table
    assert s.update(u64(1, 3), np.ones((2, 8), np.float32)) == 1
    assert s.update(u64(1), np.ones((1, 5), np.float32)) == 1  # no table of width 5
    np.testing.assert_allclose(s.lookup(u64(1), 8, train=False), b - 1.0, rtol=1e-6)
    stats = s.stats()
    assert stats["rows_per_dim"] == {2: 2, 8: 1} and stats["rows"] == 3
    assert stats["gradient_id_miss_count"] == 2 and stats["evictions"] == 0
    assert stats["memory_bytes"] == sum(t.memory_bytes() for t in s.tables.values())


def test_store_capacity_applies_per_table():
    s = EmbeddingStore(capacity=2)
    s.lookup(u64(1, 2, 3), 2, train=True)
    s.lookup(u64(1, 2, 3), 4, train=True)
    assert s.stats()["rows_per_dim"] == {2: 2, 4: 2} and s.stats()["evictions"] == 2


def test_store_registration_reaches_present_and_future_tables():
    s = EmbeddingStore(capacity=10)
    s.lookup(u64(1), 2, train=True)
    with pytest.raises(Conflict):
        s.update(u64(1), np.ones((1, 2), np.float32))
    s.set_optimizer(SGDConfig(lr=1.0))
    s.set_hyper(EmbeddingHyperparams(init_lower=1.0, init_upper=2.0, weight_bound=0.0))
    assert s.update(u64(1), np.ones((1, 2), np.float32)) == 0
    assert s.lookup(u64(1), 3, train=True).min() >= 1.0
    assert s.update(u64(1), np.ones((1, 3), np.float32)) == 0


def test_store_refuses_bad_configs_before_any_table_exists():
    s = EmbeddingStore(capacity=10)
    with pytest.raises(ConfigError):
        s.set_optimizer({"type": "sgd", "lr": 0.1})
    with pytest.raises(ConfigError):
        s.set_hyper({"init_lower": 0.0})
    with pytest.raises(ConfigError):
        EmbeddingStore(capacity=10, optimizer="adam")
    assert s.lookup(u64(1), 2, train=True).shape == (1, 2)


@pytest.mark.parametrize("dim", [0, -1, 5000, 2.0, True, "4"])
def test_store_refuses_bad_dims(dim):
    s = EmbeddingStore(capacity=10, optimizer=SGDConfig(lr=1.0))
    with pytest.raises(BadRequest):
        s.lookup(u64(1), dim, train=True)
    assert len(s) == 0


def test_store_refuses_bad_gradients_for_unknown_dims_too():
    s = EmbeddingStore(capacity=10, optimizer=SGDConfig(lr=1.0))
    with pytest.raises(BadRequest):
        s.update(u64(1), np.array([[np.nan, 1.0]], np.float32))
    with pytest.raises(BadRequest):
        s.update(u64(1), np.ones((1, 0), np.float32))
    assert s.stats()["gradient_id_miss_count"] == 0


@pytest.mark.parametrize("kwargs", [{"capacity": 0}, {"capacity": 1.5}, {"capacity": 10, "dim": 0},
                                    {"capacity": 10, "initial_rows": 0}])
def test_table_constructor_validates(kwargs):
    with pytest.raises(ConfigError):
        EmbeddingTable(**{"dim": 2, **kwargs})


# ---------------------------------------------------------------- the table against a dict model

_REFERENCE = EmbeddingTable(4, capacity=64)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("train"), st.lists(st.integers(0, 9), max_size=6)),
        st.tuples(st.just("eval"), st.lists(st.integers(0, 9), max_size=6)),
        st.tuples(st.just("update"), st.lists(st.tuples(st.integers(0, 9), st.integers(-3, 3)), max_size=6)),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 6), ops=_ops)
def test_table_matches_a_dict_model(capacity, ops):
    hyper = EmbeddingHyperparams(weight_bound=0.05)
    t = EmbeddingTable(4, capacity=capacity, optimizer=SGDConfig(lr=0.01), hyper=hyper, initial_rows=1)
    model: OrderedDict[int, np.ndarray] = OrderedDict()
    evictions = 0
    for op, arg in ops:
        if op == "update":
            ids = u64(*[i for i, _ in arg])
            grads = np.array([[g, -g, 2 * g, 0] for _, g in arg], np.float32).reshape(-1, 4)
            missing = t.update(ids, grads)
            assert missing == sum(1 for i, _ in arg if i not in model)
            sums: dict[int, np.ndarray] = {}
            for (i, _), g in zip(arg, grads, strict=True):
                if i in model:
                    sums[i] = sums.get(i, np.zeros(4, np.float32)) + g
            for i, g in sums.items():
                model[i] = np.clip(model[i] - np.float32(0.01) * g, -0.05, 0.05).astype(np.float32)
            continue
        ids = u64(*arg)
        out = t.lookup(ids, train=(op == "train"))
        for k, i in enumerate(arg):
            if op == "train":
                if i in model:
                    model.move_to_end(i)
                else:
                    model[i] = _REFERENCE.lookup(u64(i), train=True)[0]
                    if len(model) > capacity:
                        model.popitem(last=False)
                        evictions += 1
            expected = model.get(i, np.zeros(4, np.float32))
            if op == "train" or i in model:
                np.testing.assert_allclose(out[k], expected, rtol=1e-6, atol=1e-7)
            else:
                np.testing.assert_array_equal(out[k], 0.0)
    sd = t.state_dict()
    assert sd["keys"].tolist() == list(model)
    if model:
        np.testing.assert_allclose(sd["emb"], np.stack(list(model.values())), rtol=1e-6, atol=1e-7)
    assert t.evictions == evictions and len(t) == len(model)


def test_the_warm_up_compiles_what_a_replica_runs_on_wire_arrays():
    from persia_nats.common.codec import array_from_wire, array_to_wire, pack, unpack

    def wire(arr):  # through msgpack, as a message brings it: a read-only view of the bytes
        return unpack(pack({"a": array_to_wire(arr)}))["a"]
    from persia_nats.core import optim
    from persia_nats.core import table_kernels as tk
    from persia_nats.core.store import warm_up

    warm_up()
    kernels = [tk.lookup_train, tk.lookup_eval, tk.find_rows, tk.gather_grads, optim._sgd_kernel,
               optim._adagrad_kernel, optim._adam_kernel]
    compiled = [len(k.signatures) for k in kernels]
    assert all(compiled)
    for cfg in (SGDConfig(lr=0.1), AdagradConfig(), AdamConfig()):
        store = EmbeddingStore(3, cfg)
        # as the PS handlers get them: ids and float16 gradients from msgpack, the gradients made float32
        ids = array_from_wire(wire(np.arange(1, 6, dtype=np.uint64)), "ids", dtype="<u8", ndim=1)
        grads = array_from_wire(wire(np.ones((5, 8), np.float16)), "grads", dtype="<f2", ndim=2)
        store.lookup(ids, 8, True)
        store.lookup(ids, 8, False)
        store.read(ids, 8)
        store.update(ids, grads.astype(np.float32))
    assert [len(k.signatures) for k in kernels] == compiled  # nothing left to compile inside a job


def test_the_warm_up_compiles_what_a_training_lookup_runs_while_the_index_doubles():
    """A doubled index under construction hands the kernels strided views of its fields, another kind of
    argument than the empty ones; warm_up compiles it too, so no lookup of a growing table compiles a kernel
    while holding the store (5.3 s on the first lookup after 3/4 of 2^16 rows, with a cold cache)."""
    from persia_nats.common.optim_config import AdagradConfig
    from persia_nats.core import table_kernels as tk
    from persia_nats.core.store import EmbeddingStore, warm_up

    warm_up()
    kernels = (tk.lookup_train, tk._lookup_train, tk.lookup_eval)
    compiled = [len(k.signatures) for k in kernels]
    store = EmbeddingStore(1 << 30, AdagradConfig())
    rng = np.random.default_rng(0)
    grew = False
    for _ in range(6):
        ids = rng.integers(1, 1 << 60, 20480).astype(np.uint64)
        ids.flags.writeable = False  # as the wire delivers them
        store.lookup(ids, 16, True)
        store.lookup(ids, 16, False)
        grew |= store.tables[16]._grow_index is not None
    assert grew  # the doubled index was built while these lookups ran
    assert [len(k.signatures) for k in kernels] == compiled
