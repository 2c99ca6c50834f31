"""The synthetic example's ratings and ids cases (examples/synthetic/cases.py): deterministic streams
with the shapes, skew and multi-hot slot the convergence study relies on."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.procs import ROOT

sys.path.insert(0, str(ROOT / "examples" / "synthetic"))
import cases  # noqa: E402


@pytest.mark.parametrize("case", ["ratings", "ids", "criteo"])
def test_every_case_is_a_pure_function_of_seed_and_batch(case):
    a, b, c = (cases.case_batch(case, i, 64, seed=s) for i, s in ((3, 1), (3, 1), (4, 1)))
    for name in cases.CASES[case].slots:
        x, y, z = a[0][name], b[0][name], c[0][name]
        if isinstance(x, list):
            x, y, z = np.concatenate(x), np.concatenate(y), np.concatenate(z)
        np.testing.assert_array_equal(x, y)
        assert x.dtype == np.uint64
    np.testing.assert_array_equal(a[2], b[2])
    assert not np.array_equal(a[2], c[2]) or not np.array_equal(a[0]["s0" if case != "ratings" else "item"],
                                                               c[0]["s0" if case != "ratings" else "item"])
    assert list(a[0]) == list(cases.CASES[case].slots)
    assert (a[1] is None) == (cases.CASES[case].n_dense == 0)


def test_ratings_have_popular_items_a_multi_hot_slot_and_a_learnable_label():
    ids, labels = zip(*(cases.rating_batch(i, 256, seed=0) for i in range(40)), strict=True)
    items = np.concatenate([x["item"] for x in ids]).astype(np.int64)
    share = np.bincount(items).max() / items.shape[0]
    assert share > 0.1  # the top item is in more than a tenth of the rows: a hot row in every batch
    genres = [g for x in ids for g in x["genres"]]
    assert {len(g) for g in genres} == {1, 2, 3} and all(np.unique(g).shape == g.shape for g in genres)
    assert max(int(g.max()) for g in genres) < 18
    # an item's genres are fixed: equal items carry equal genre lists
    first = {}
    for x in ids:
        for item, g in zip(x["item"], x["genres"], strict=True):
            np.testing.assert_array_equal(first.setdefault(int(item), g), g)
    y = np.concatenate(labels).ravel()
    assert 0.3 < y.mean() < 0.7
    for slot, vocab in cases.RATING_SLOTS:
        top = max(int(np.max(np.concatenate(x[slot]) if slot == "genres" else x[slot])) for x in ids)
        assert top < vocab, slot


def test_the_held_out_set_has_exactly_the_rows_asked_for():
    rows = sum(labels.shape[0] for _, _, labels in cases.case_test_batches("ratings", 1000, 256))
    assert rows == 1000


@pytest.mark.parametrize("case", ["ratings", "ids", "criteo"])
def test_every_case_has_an_embedding_config_of_exactly_its_slots(case):
    """A job refuses batches that leave out a configured slot, so a case's config holds its slots only."""
    from persia_nats.common.config import load_embedding_config

    config = load_embedding_config(cases.CASES[case].embedding_config)
    assert list(config.slots_config) == list(cases.CASES[case].slots)
