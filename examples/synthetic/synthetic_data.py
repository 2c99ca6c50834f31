"""A Criteo-like synthetic click stream with a learnable label: numpy only.

Every batch is a pure function of ``(seed, batch_index)``, so a data loader and a test set can be
regenerated anywhere without files:

- **ids**: ``n_slots`` categorical slots (Criteo has 26), one id per sample and slot, drawn from a
  bounded Zipf law (``P(rank = k) ~ k ** -zipf_a`` for ``k`` in ``1..vocab``), so a few ids are very
  frequent and most are rare, as in click logs. The law is sampled by inverting the continuous
  power-law CDF on ``[1, vocab + 1)`` and flooring, which keeps the support bounded without the
  spike at ``vocab`` that clipping an unbounded ``numpy`` Zipf draw would make. The id is
  ``rank - 1`` (``0..vocab-1``); the system's per-slot prefix keeps the slots apart.
- **dense**: ``n_dense`` (13 in Criteo) standard-normal features.
- **label**: ``Bernoulli(sigmoid(logit))`` with a hidden ground truth that does not depend on the
  stream's ``seed`` (only on ``task_seed``), so every seed samples the same task::

      logit = BIAS + sum over slots of w(slot, id) + dense @ v

  ``w(slot, id) = SLOT_SCALE * u`` with ``u`` uniform in ``[-1, 1]`` from a splitmix64 hash of
  ``(task_seed, slot, id)``; a hashed ``HEAVY_FRACTION`` of the ids count ``HEAVY_FACTOR`` times
  more. ``v`` is fixed (normal * ``DENSE_SCALE`` from ``task_seed``). With the defaults the logit has
  a standard deviation of about 1.6 and the click rate is about 0.3, so the Bayes-optimal AUC
  (:func:`bayes_probs`) is about 0.85 while a model only learns the ids it has seen often: the head
  of each slot is learnable in a short run, the tail stays noise, and staleness of the embedding
  updates can show.

The held-out test set is the stream of ``TEST_SEED`` (a seed no training run uses), so its ids
come from the same distribution as training's and every training seed is scored on the same rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = [
    "BIAS", "DENSE_SCALE", "HEAVY_FACTOR", "HEAVY_FRACTION", "N_DENSE", "N_SLOTS", "SLOT_NAMES", "SLOT_SCALE",
    "TEST_SEED", "VOCAB", "ZIPF_A", "bayes_probs", "batches", "hidden_logit", "make_batch_arrays",
    "splitmix64", "test_batches",
]

N_SLOTS = 26
N_DENSE = 13
VOCAB = 1_000_000
ZIPF_A = 1.1
#: Per-slot weight scale: w = SLOT_SCALE * uniform[-1, 1] (HEAVY_FACTOR times that for heavy ids).
SLOT_SCALE = 0.45
HEAVY_FRACTION = 0.02
HEAVY_FACTOR = 3.0
DENSE_SCALE = 0.2
BIAS = -1.1
#: The stream seed of the held-out test set.
TEST_SEED = 1_000_003
SLOT_NAMES = tuple(f"s{i}" for i in range(N_SLOTS))

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, element-wise on uint64 (wrapping arithmetic)."""
    z = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _unit(h: np.ndarray) -> np.ndarray:
    """uint64 hash -> float64 uniform in [0, 1) from its top 53 bits."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _zipf_ranks(rng: np.random.Generator, shape: tuple[int, ...], vocab: int, a: float) -> np.ndarray:
    """Bounded Zipf ranks in 1..vocab: floor of the inverse continuous power-law CDF on [1, vocab+1)."""
    u = rng.random(shape)
    if abs(a - 1.0) < 1e-9:
        x = np.exp(u * np.log(vocab + 1.0))
    else:
        top = (vocab + 1.0) ** (1.0 - a)
        x = (1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - a))
    return np.clip(np.floor(x), 1, vocab).astype(np.uint64)


def _slot_weights(ids: np.ndarray, task_seed: int) -> np.ndarray:
    """Hidden per-(slot, id) weights, shape of ``ids`` (n, n_slots)."""
    slot_keys = splitmix64(np.arange(ids.shape[1], dtype=np.uint64) + np.uint64(task_seed) * np.uint64(1 << 20))
    h = splitmix64(ids ^ slot_keys[None, :])
    w = SLOT_SCALE * (2.0 * _unit(h) - 1.0)
    heavy = _unit(splitmix64(h)) < HEAVY_FRACTION
    return np.where(heavy, w * HEAVY_FACTOR, w)


def _dense_weights(n_dense: int, task_seed: int) -> np.ndarray:
    return np.random.default_rng([task_seed, 0xD15E]).standard_normal(n_dense) * DENSE_SCALE


def hidden_logit(ids: np.ndarray, dense: np.ndarray, task_seed: int = 0) -> np.ndarray:
    """The ground-truth logit of each row, shape (n,)."""
    with np.errstate(over="ignore"):
        w = _slot_weights(np.asarray(ids, dtype=np.uint64), task_seed)
    return BIAS + w.sum(axis=1) + np.asarray(dense, dtype=np.float64) @ _dense_weights(dense.shape[1], task_seed)


def bayes_probs(ids: np.ndarray, dense: np.ndarray, task_seed: int = 0) -> np.ndarray:
    """The Bayes-optimal click probability of each row (what a perfect model would predict)."""
    return 1.0 / (1.0 + np.exp(-hidden_logit(ids, dense, task_seed)))


def make_batch_arrays(batch_index: int, batch_size: int, seed: int, n_slots: int = N_SLOTS, vocab: int = VOCAB,
                      zipf_a: float = ZIPF_A, n_dense: int = N_DENSE, task_seed: int = 0
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch ``batch_index`` of the stream ``seed``: ``(ids, dense, labels)``.

    ``ids`` uint64 (batch_size, n_slots) in ``0..vocab-1``; ``dense`` float32 (batch_size, n_dense);
    ``labels`` float32 (batch_size, 1) of 0.0 / 1.0. Deterministic in all arguments.
    """
    if batch_size < 1 or batch_index < 0 or vocab < 1 or n_slots < 1 or n_dense < 0:
        raise ValueError("batch_size, vocab and n_slots must be >= 1, batch_index and n_dense >= 0")
    rng = np.random.default_rng([int(seed), int(batch_index), 0x5EED])
    ids = _zipf_ranks(rng, (batch_size, n_slots), vocab, zipf_a) - np.uint64(1)
    dense = rng.standard_normal((batch_size, n_dense)).astype(np.float32)
    p = bayes_probs(ids, dense, task_seed)
    labels = (rng.random(batch_size) < p).astype(np.float32).reshape(-1, 1)
    return ids, dense, labels


def batches(seed: int, n_batches: int, batch_size: int, start: int = 0, **kwargs: object
            ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Batches ``start .. start + n_batches - 1`` of the stream ``seed``."""
    for i in range(start, start + n_batches):
        yield make_batch_arrays(i, batch_size, seed, **kwargs)  # type: ignore[arg-type]


def test_batches(n_samples: int, batch_size: int = 1024, **kwargs: object
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The held-out set: the first ``n_samples`` rows of the ``TEST_SEED`` stream, in ``batch_size`` batches."""
    full, rest = divmod(n_samples, batch_size)
    yield from batches(TEST_SEED, full, batch_size, **kwargs)
    if rest:
        ids, dense, labels = make_batch_arrays(full, batch_size, TEST_SEED, **kwargs)  # type: ignore[arg-type]
        yield ids[:rest], dense[:rest], labels[:rest]


test_batches.__test__ = False  # not a pytest test
