"""The stamp-based exact LRU of the PS store against an OrderedDict model: renumbering, wide slots, clock jumps."""

from collections import OrderedDict

import numpy as np
import persia_nats.core.store as store
import pytest
from persia_nats.common.optim_config import SGDConfig
from persia_nats.core import table_kernels as tk


def run(seed, cap, nbatches, pool, stamp_limit=None, slot64=False, clock_jump=0, batch=300, fresh=50):
    rng = np.random.default_rng(seed)
    saved = tk.SLOT32
    if slot64:
        tk.SLOT32 = tk.SLOT64
    try:
        t = store.EmbeddingTable(2, capacity=cap, optimizer=SGDConfig(lr=1.0), initial_rows=8)
    finally:
        tk.SLOT32 = saved
    if stamp_limit:
        t._stamp_limit = stamp_limit
    ref = store.EmbeddingTable(2, capacity=10**6)
    model = OrderedDict()
    pool_ids = rng.integers(0, 2**64 - 1, pool, dtype=np.uint64)
    renumbers = 0
    for k in range(nbatches):
        if clock_jump and k == nbatches // 2:
            t._meta[tk.CLOCK] += clock_jump
        ids = np.concatenate([rng.choice(pool_ids, batch), rng.integers(0, 2**64 - 1, fresh, dtype=np.uint64)])
        rng.shuffle(ids)
        before = t._meta[tk.CLOCK]
        out = t.lookup(ids, train=True)
        if t._meta[tk.CLOCK] < before:
            renumbers += 1
        for key in ids.tolist():
            if key in model:
                model.move_to_end(key)
            else:
                model[key] = None
                if len(model) > cap:
                    model.popitem(last=False)
        np.testing.assert_array_equal(out, ref.lookup(ids, train=True))  # every id reads its own initial vector
        if k % 7 == 0:
            assert t.state_dict()["keys"].tolist() == list(model), (seed, k)
            # eval lookups see exactly the model's rows
            probe = np.concatenate([pool_ids[:200], ids[:50]])
            got = t.lookup(probe, train=False)
            live = np.array([p in model for p in probe.tolist()])
            assert (got[~live] == 0).all() and (got[live] != 0).all()
    assert t.state_dict()["keys"].tolist() == list(model)
    assert len(t) == len(model) and t.inserts - t.evictions == len(t)
    sd = t.state_dict()
    c = store.EmbeddingTable(2, capacity=cap, optimizer=SGDConfig(lr=1.0))
    c.load_state_dict(sd)
    ids = rng.choice(pool_ids, 500)
    for tb in (t, c):
        tb.lookup(ids, train=True)
    assert t.state_dict()["keys"].tolist() == c.state_dict()["keys"].tolist()
    return renumbers, t.evictions


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("kwargs", [
    {"cap": 2000, "nbatches": 60, "pool": 3000},
    {"cap": 500, "nbatches": 60, "pool": 800, "stamp_limit": 3000},
    {"cap": 700, "nbatches": 40, "pool": 1200, "slot64": True},
    {"cap": 700, "nbatches": 40, "pool": 1200, "slot64": True, "clock_jump": 2**45},
    {"cap": 1, "nbatches": 10, "pool": 3, "batch": 5, "fresh": 2},
    {"cap": 3, "nbatches": 40, "pool": 6, "batch": 5, "fresh": 1, "stamp_limit": 40},
], ids=["plain", "renumber", "slot64", "slot64-clock-jump", "capacity-1", "capacity-3-renumber"])
def test_lru_order_matches_an_ordered_dict(seed, kwargs):
    renumbers, evictions = run(seed, **kwargs)
    assert evictions > 0
    if "stamp_limit" in kwargs:
        assert renumbers > 0  # the clock really wrapped and was renumbered
