"""Tests for examples/adult-income/metrics.py (numpy AUC / log loss)."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

import numpy as np
import pytest

_EXAMPLE_DIR = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adult-income"


@pytest.fixture(scope="module")
def metrics():
    """The example's metrics module, loaded by path (the folder name has a hyphen)."""
    spec = importlib.util.spec_from_file_location("adult_income_metrics", _EXAMPLE_DIR / "metrics.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def test_auc_perfect_reversed_and_all_tied(metrics):
    """Test that perfect ranking gives 1, reversed gives 0, and one shared score gives 0.5."""
    y = [0, 0, 1, 1]
    assert metrics.auc(y, [0.1, 0.2, 0.8, 0.9]) == 1.0
    assert metrics.auc(y, [0.9, 0.8, 0.2, 0.1]) == 0.0
    assert metrics.auc(y, [0.3, 0.3, 0.3, 0.3]) == 0.5


def test_auc_hand_example_without_ties(metrics):
    """Test a hand-counted example: 3 of the 4 positive/negative pairs are ordered right."""
    assert metrics.auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == pytest.approx(0.75)


def test_auc_counts_tied_pairs_as_half(metrics):
    """Test that a positive tied with a negative counts 1/2: pairs are 0.5 + 1 + 1 + 1 of 4."""
    assert metrics.auc([0, 1, 0, 1], [0.5, 0.5, 0.2, 0.9]) == pytest.approx(0.875)
    # Ties inside one class do not matter.
    assert metrics.auc([1, 1, 0, 0], [0.7, 0.7, 0.1, 0.1]) == 1.0
    # A three-way tie across classes: pos {0.5, 0.5, 0.9}, neg {0.5, 0.1}.
    # pairs: 0.5 vs 0.5 (x2) -> 0.5 each, 0.5 vs 0.1 (x2) -> 1, 0.9 vs both -> 2 => 5 / 6.
    assert metrics.auc([1, 1, 0, 1, 0], [0.5, 0.5, 0.5, 0.9, 0.1]) == pytest.approx(5 / 6)


def test_auc_accepts_column_vectors_bools_and_is_rank_invariant(metrics):
    """Test (n, 1) inputs, bool labels, and invariance under a monotone transform of the scores."""
    rng = np.random.default_rng(1)
    y = rng.random(200) < 0.3
    s = rng.normal(size=200)
    base = metrics.auc(y, s)
    assert metrics.auc(y.reshape(-1, 1).astype(np.float32), s.reshape(-1, 1)) == pytest.approx(base)
    assert metrics.auc(y, np.exp(3 * s) + 7) == pytest.approx(base)
    assert metrics.auc(~y, s) == pytest.approx(1 - base)


@pytest.mark.parametrize(
    "labels, scores",
    [([1, 1, 1], [0.1, 0.2, 0.3]), ([0, 0], [0.1, 0.2]), ([0, 1], [0.1, float("nan")]), ([0, 1, 1], [0.1, 0.2])],
)
def test_auc_rejects_undefined_inputs(metrics, labels, scores):
    """Test that one class only, a NaN score, or mismatched sizes raise ValueError."""
    with pytest.raises(ValueError):
        metrics.auc(labels, scores)


def test_auc_matches_sklearn_on_random_data_with_ties(metrics):
    """Test agreement with sklearn.metrics.roc_auc_score, heavy ties included."""
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(2, 5000))
        y = (rng.random(n) < rng.uniform(0.05, 0.95)).astype(np.float32)
        y[0], y[-1] = 0.0, 1.0
        s = rng.normal(size=n) + y * rng.uniform(0, 2)
        if trial % 2:
            s = np.round(s, 1)  # many ties
        assert metrics.auc(y, s) == pytest.approx(sk.roc_auc_score(y, s), abs=1e-12)


def test_log_loss_hand_values_and_clipping(metrics):
    """Test log loss against the formula, and that 0/1 probabilities are clipped, not infinite."""
    assert metrics.log_loss([1, 0], [0.8, 0.3]) == pytest.approx(-(math.log(0.8) + math.log(0.7)) / 2)
    assert math.isfinite(metrics.log_loss([1, 0], [0.0, 1.0]))
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(2)
    y = (rng.random(1000) < 0.25).astype(np.float32)
    p = rng.uniform(0.01, 0.99, size=1000)
    assert metrics.log_loss(y, p) == pytest.approx(sk.log_loss(y, p), rel=1e-9)


def test_accuracy_thresholds_at_one_half(metrics):
    """Test accuracy: probabilities >= 0.5 predict the positive class."""
    assert metrics.accuracy([1, 0, 1, 0], [0.5, 0.49, 0.2, 0.9]) == 0.5
