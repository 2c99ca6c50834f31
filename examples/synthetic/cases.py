"""The synthetic example's three cases (``SYNTHETIC_CASE``), each a stream that is a pure function of
``(seed, batch_index)``, as in synthetic_data.py:

- ``criteo`` (the default): synthetic_data.py's stream, 26 single-id Zipf slots and 13 dense features.
- ``ratings``: rating-like rows with popular items and a multi-hot slot, no dense features. Each row
  is one (user, item) rating, 8 slots: ``user`` (20,000 users, Zipf 0.9: some users rate a lot),
  ``item`` (3,000 items, Zipf 1.2: a few blockbusters take a large share of every batch),
  ``genres`` (multi-hot: the item's 1-3 of 18 genres, fixed per item), the user's ``age`` (7 buckets),
  ``gender``, ``occupation`` (21) and ``region`` (50), fixed per user, and the ``hour`` (24). The
  label (liked or not) is ``Bernoulli(sigmoid(logit))`` with ``logit = BIAS + w(user) + w(item) +
  sum over genres of (w(genre) + w(age, genre)) + w(occupation) + w(hour)``, each ``w`` a hashed
  uniform weight of ``task_seed`` (the ``age x genre`` taste an interaction the model has to learn).
- ``ids``: id-only, 10 single-id slots of synthetic_data.py's skewed law over 100,000 ids each and no
  dense features (the data of a click log reduced to its categorical columns).
- ``distinct``: id-only, 10 single-id slots, each id uniform over ``DISTINCT_IDS // 10`` values (the
  environment's ``DISTINCT_IDS``, default 10^6: the rows of the whole job, all slots together), no dense
  features; the label a hashed weight per (slot, id). For tables that grow: at 10^8 nearly every id of a
  batch is new, so the PS tables grow by about batch_size x 10 rows a batch
  (benchmarks/bench_big_tables.py).

The held-out set of every case is its ``TEST_SEED`` stream.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from synthetic_data import (
    N_DENSE,
    N_SLOTS,
    SLOT_NAMES,
    TEST_SEED,
    _unit,
    _zipf_ranks,
    make_batch_arrays,
    splitmix64,
)

__all__ = ["CASES", "Case", "RATING_SLOTS", "case_batch", "case_test_batches", "rating_batch"]

#: (slot, vocabulary) of the ratings case, in the order the model concatenates them
RATING_SLOTS = (("user", 20_000), ("item", 3_000), ("genres", 18), ("age", 7), ("gender", 2),
                ("occupation", 21), ("region", 50), ("hour", 24))
_USER_ZIPF, _ITEM_ZIPF = 0.9, 1.2
_RATING_BIAS = -0.3
_SCALE = {"user": 0.6, "item": 0.9, "genres": 0.4, "taste": 0.6, "occupation": 0.2, "hour": 0.2}
IDS_SLOTS, IDS_VOCAB = 10, 100_000
#: the distinct case's rows over all its slots (each slot draws uniformly from a tenth of them)
DISTINCT_IDS = int(os.environ.get("DISTINCT_IDS") or 1_000_000)
DISTINCT_SLOTS = 10


@dataclass(frozen=True)
class Case:
    name: str
    slots: tuple[str, ...]
    #: multi-hot slots (the rest hold one id per sample)
    multi_hot: tuple[str, ...]
    #: per slot, ids are below this (the single-process reference sizes its tables by it)
    vocab: tuple[int, ...]
    n_dense: int

    @property
    def embedding_config(self) -> Path:
        """The case's ``embedding_config.yml``: a job's batches carry every slot it configures."""
        name = "embedding_config.yml" if self.name == "criteo" else f"embedding_config_{self.name}.yml"
        return Path(__file__).resolve().parent / "config" / name


CASES = {
    "criteo": Case("criteo", SLOT_NAMES, (), (1_000_000,) * N_SLOTS, N_DENSE),
    "ratings": Case("ratings", tuple(s for s, _ in RATING_SLOTS), ("genres",), tuple(v for _, v in RATING_SLOTS), 0),
    "ids": Case("ids", SLOT_NAMES[:IDS_SLOTS], (), (IDS_VOCAB,) * IDS_SLOTS, 0),
    "distinct": Case("distinct", SLOT_NAMES[:DISTINCT_SLOTS], (),
                     (max(1, DISTINCT_IDS // DISTINCT_SLOTS),) * DISTINCT_SLOTS, 0),
}


def _weight(slot: int, ids: np.ndarray, task_seed: int, scale: float) -> np.ndarray:
    """A hashed weight in ``[-scale, scale]`` per id of one slot (``slot`` keeps slots apart)."""
    key = splitmix64(np.array([task_seed * (1 << 20) + slot + 0xA11CE], np.uint64))[0]  # an array: no overflow warning
    return scale * (2.0 * _unit(splitmix64(np.asarray(ids, np.uint64) ^ key)) - 1.0)


def _attribute(users: np.ndarray, which: int, vocab: int) -> np.ndarray:
    """A user's (or item's) fixed attribute ``which``: a hash of the id into ``0..vocab-1``."""
    return splitmix64(users * np.uint64(64) + np.uint64(which)) % np.uint64(vocab)


def _genres(items: np.ndarray) -> list[np.ndarray]:
    """Each item's 1-3 distinct genres, fixed per item."""
    count = 1 + (splitmix64(items ^ np.uint64(0x6E2E)) % np.uint64(3)).astype(np.int64)
    out = []
    for item, n in zip(items, count, strict=True):
        picks = _attribute(np.full(3, item, np.uint64) + np.arange(3, dtype=np.uint64) * np.uint64(1 << 40), 9, 18)
        out.append(np.unique(picks[:n]).astype(np.uint64))
    return out


def rating_batch(batch_index: int, batch_size: int, seed: int, task_seed: int = 0
                 ) -> tuple[dict[str, np.ndarray | list[np.ndarray]], np.ndarray]:
    """Batch ``batch_index`` of the ratings stream ``seed``: ``({slot: ids}, labels (batch_size, 1))``,
    single-id slots as uint64 arrays (batch_size,), ``genres`` as one uint64 array per sample."""
    rng = np.random.default_rng([int(seed), int(batch_index), 0x4A71])
    users = _zipf_ranks(rng, (batch_size,), RATING_SLOTS[0][1], _USER_ZIPF) - np.uint64(1)
    items = _zipf_ranks(rng, (batch_size,), RATING_SLOTS[1][1], _ITEM_ZIPF) - np.uint64(1)
    genres = _genres(items)
    age, gender = _attribute(users, 1, 7), _attribute(users, 2, 2)
    occupation, region = _attribute(users, 3, 21), _attribute(users, 4, 50)
    hour = rng.integers(0, 24, batch_size).astype(np.uint64)
    flat = np.concatenate(genres)
    owner = np.repeat(np.arange(batch_size), [g.shape[0] for g in genres])
    per_genre = _weight(2, flat, task_seed, _SCALE["genres"]) + _weight(
        9, age[owner] * np.uint64(32) + flat, task_seed, _SCALE["taste"])
    logit = (_RATING_BIAS + _weight(0, users, task_seed, _SCALE["user"]) + _weight(1, items, task_seed, _SCALE["item"])
             + np.bincount(owner, per_genre, batch_size) + _weight(5, occupation, task_seed, _SCALE["occupation"])
             + _weight(7, hour, task_seed, _SCALE["hour"]))
    labels = (rng.random(batch_size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32).reshape(-1, 1)
    ids = {"user": users, "item": items, "genres": genres, "age": age, "gender": gender, "occupation": occupation,
           "region": region, "hour": hour}
    return ids, labels


def _distinct_batch(c: Case, batch_index: int, batch_size: int, seed: int
                    ) -> tuple[dict[str, np.ndarray | list[np.ndarray]], None, np.ndarray]:
    """The distinct case's batch: every slot's ids uniform over its vocabulary, the label
    ``Bernoulli(sigmoid(sum of hashed per-(slot, id) weights))``."""
    rng = np.random.default_rng([int(seed), int(batch_index), 0xD157])
    ids = {s: rng.integers(0, v, batch_size, dtype=np.uint64) for s, v in zip(c.slots, c.vocab, strict=True)}
    logit = -0.5 + sum(_weight(k, v, 0, 0.5) for k, v in enumerate(ids.values()))
    labels = (rng.random(batch_size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32).reshape(-1, 1)
    return ids, None, labels


def case_batch(case: str, batch_index: int, batch_size: int, seed: int
               ) -> tuple[dict[str, np.ndarray | list[np.ndarray]], np.ndarray | None, np.ndarray]:
    """Batch ``batch_index`` of ``case``'s stream ``seed``: ``({slot: ids}, dense or None, labels)``."""
    if case == "ratings":
        ids, labels = rating_batch(batch_index, batch_size, seed)
        return ids, None, labels
    c = CASES[case]
    if case == "distinct":
        return _distinct_batch(c, batch_index, batch_size, seed)
    if case == "ids":
        arr, _, labels = make_batch_arrays(batch_index, batch_size, seed, n_slots=IDS_SLOTS, vocab=IDS_VOCAB, n_dense=0)
        return {s: np.ascontiguousarray(arr[:, i]) for i, s in enumerate(c.slots)}, None, labels
    arr, dense, labels = make_batch_arrays(batch_index, batch_size, seed)
    return {s: np.ascontiguousarray(arr[:, i]) for i, s in enumerate(c.slots)}, dense, labels


def case_test_batches(case: str, n_samples: int, batch_size: int
                      ) -> Iterator[tuple[dict[str, np.ndarray | list[np.ndarray]], np.ndarray | None, np.ndarray]]:
    """The held-out set of ``case``: the first ``n_samples`` rows of its ``TEST_SEED`` stream."""
    full, rest = divmod(n_samples, batch_size)
    for i in range(full + (1 if rest else 0)):
        ids, dense, labels = case_batch(case, i, batch_size, TEST_SEED)
        if i == full:
            ids = {s: v[:rest] for s, v in ids.items()}
            dense = None if dense is None else dense[:rest]
            labels = labels[:rest]
        yield ids, dense, labels
