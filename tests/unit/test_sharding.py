"""Which PS replica owns an id (persia_nats.core.sharding)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from persia_nats.core.sharding import shard_of, split_by_shard, splitmix64
from persia_nats.core.table_kernels import home_slots

FIXED = np.array([0, 1, 2, 42, 12345678901234567890, 2**64 - 1], np.uint64)


def test_splitmix64_matches_the_reference_stream():
    # The first two outputs of splitmix64 seeded with 0 (Vigna's reference implementation).
    assert [int(x) for x in splitmix64(FIXED[:2])] == [0xE220A8397B1DCDAF, 0x910A2DEC89025CC1]


def test_shard_of_is_fixed_forever():
    # Changing these moves every row to another replica: checkpoints would no longer load in place.
    assert shard_of(FIXED, 4).tolist() == [3, 1, 2, 1, 0, 0]
    assert shard_of(FIXED, 7).tolist() == [2, 2, 4, 5, 6, 0]
    assert shard_of(FIXED, 1).tolist() == [0] * 6


def test_shard_of_returns_int64_in_range_without_overflow_warnings():
    ids = np.random.default_rng(0).integers(0, 2**64, 10_000, dtype=np.uint64, endpoint=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shards = shard_of(ids, 5)
        single = shard_of(ids[:1], 5)
    assert shards.dtype == np.int64 and shards.shape == ids.shape
    assert shards.min() >= 0 and shards.max() < 5
    assert single[0] == shards[0]


@pytest.mark.parametrize("num_shards", [2, 8, 13])
def test_shards_are_balanced_within_2_percent(num_shards):
    rng = np.random.default_rng(num_shards)
    for ids in (rng.integers(0, 2**63, 1_000_000, dtype=np.uint64), np.arange(1_000_000, dtype=np.uint64)):
        counts = np.bincount(shard_of(ids, num_shards), minlength=num_shards)
        expected = ids.shape[0] / num_shards
        assert np.abs(counts - expected).max() < 0.02 * expected


@pytest.mark.parametrize("num_shards", [1, 6, 100_003])
def test_split_by_shard_groups_every_position_once_in_order(num_shards):
    ids = np.random.default_rng(1).integers(0, 2**64 - 1, 5000, dtype=np.uint64)
    ids[::7] = ids[0]  # repeats stay in their own places
    groups = split_by_shard(ids, num_shards)
    shards = shard_of(ids, num_shards)
    assert [s for s, _ in groups] == sorted({int(s) for s in shards})
    seen = np.concatenate([pos for _, pos in groups])
    assert np.array_equal(np.sort(seen), np.arange(ids.shape[0]))
    for shard, pos in groups:
        assert pos.dtype == np.int64
        assert np.all(np.diff(pos) > 0)
        assert np.all(shards[pos] == shard)


def test_split_by_shard_leaves_out_empty_shards_and_handles_empty_input():
    ids = np.array([42, 42, 1], np.uint64)  # shards 5 and 2 of 7
    assert [(s, p.tolist()) for s, p in split_by_shard(ids, 7)] == [(2, [2]), (5, [0, 1])]
    assert split_by_shard(np.empty(0, np.uint64), 3) == []


@pytest.mark.parametrize("ids", [np.array([1, 2], np.int64), np.array([[1]], np.uint64), [1, 2]])
def test_shard_of_refuses_anything_but_1d_uint64(ids):
    with pytest.raises(ValueError):
        shard_of(ids, 2)


@pytest.mark.parametrize("num_shards", [0, -1, 1.5, True])
def test_shard_of_refuses_bad_shard_counts(num_shards):
    with pytest.raises(ValueError):
        shard_of(np.array([1], np.uint64), num_shards)


def test_ps_index_hash_spreads_one_shards_ids():
    """The PS index must not reuse the shard mix: ids owned by one replica would crowd a few slots."""
    ids = np.random.default_rng(2).integers(0, 2**63, 400_000, dtype=np.uint64)
    mine = ids[shard_of(ids, 4) == 0]
    for nslots in (4096, 4000):
        counts = np.bincount(home_slots(mine, nslots), minlength=nslots)
        expected = mine.shape[0] / nslots
        assert counts.std() < 1.2 * np.sqrt(expected)  # as spread as a Poisson draw per slot
        # every residue class of the slots gets its share (a shared mix would fill one class only)
        per_class = np.bincount(np.arange(nslots) % 4, weights=counts)
        assert np.abs(per_class / mine.shape[0] - 0.25).max() < 0.01
