"""Binary-classification metrics in numpy only, so the example needs no scikit-learn.

``auc`` is the Mann-Whitney form of ROC AUC with tied scores given their average rank, which equals
``sklearn.metrics.roc_auc_score`` (trapezoidal ROC area) including ties.
"""

from __future__ import annotations

import numpy as np

__all__ = ["auc", "log_loss", "accuracy"]


def _flat(labels, scores):
    y = np.asarray(labels).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"labels and scores differ in size: {y.shape[0]} vs {s.shape[0]}")
    return y, s


def auc(labels, scores) -> float:
    """Area under the ROC curve; ``labels`` are 0/1 (or bool), ``scores`` any real numbers.

    Raises:
        ValueError: sizes differ, a score is NaN, or only one class is present (AUC undefined).
    """
    y, s = _flat(labels, scores)
    if np.isnan(s).any():
        raise ValueError("scores contain NaN")
    pos = y.astype(bool)
    n_pos = int(pos.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC is undefined when only one class is present")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    # Average rank (1-based) of each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], s.size]
    avg_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(s.size, dtype=np.float64)
    ranks[order] = np.repeat(avg_rank, ends - starts)
    u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def log_loss(labels, probs, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy, probabilities clipped to ``[eps, 1 - eps]``."""
    y, p = _flat(labels, probs)
    p = np.clip(p, eps, 1.0 - eps)
    y = y.astype(np.float64)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def accuracy(labels, probs, threshold: float = 0.5) -> float:
    """Share of rows where ``probs >= threshold`` matches the 0/1 label."""
    y, p = _flat(labels, probs)
    return float(np.mean((p >= threshold) == y.astype(bool)))
