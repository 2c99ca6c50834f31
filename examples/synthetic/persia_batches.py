"""Synthetic rows -> PersiaBatch (the case's slots, its dense block if any, the label), and the
run's case and size, read from the environment by both the data loader and the NN workers.

Environment (all optional): ``SEED`` (the training stream and the model init, default 0),
``BATCH_SIZE`` (default 512), ``TRAIN_BATCHES`` (batches in the training pass, default 400),
``TEST_SAMPLES`` (held-out rows scored at the end, default 20480), ``CURVE_SAMPLES`` (held-out rows
scored during training for the AUC curve, default 4096; they are the first rows of the test set),
``CURVE_POINTS`` (evaluations during training on rank 0, default 6; 0 turns the curve off),
``SYNTHETIC_CASE`` (``criteo``, the default, ``ratings`` or ``ids``: see cases.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from cases import CASES, Case

from persia.embedding.data import IDTypeFeature, IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch


@dataclass(frozen=True)
class RunSettings:
    seed: int = 0
    batch_size: int = 512
    train_batches: int = 400
    test_samples: int = 20480
    curve_samples: int = 4096
    curve_points: int = 6

    @classmethod
    def from_env(cls) -> RunSettings:
        def get(name: str, default: int) -> int:
            value = int(os.environ.get(name, default))
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
            return value

        d = cls()
        s = cls(seed=get("SEED", d.seed), batch_size=get("BATCH_SIZE", d.batch_size),
                train_batches=get("TRAIN_BATCHES", d.train_batches), test_samples=get("TEST_SAMPLES", d.test_samples),
                curve_samples=get("CURVE_SAMPLES", d.curve_samples), curve_points=get("CURVE_POINTS", d.curve_points))
        if s.batch_size < 1 or s.test_samples < 1:
            raise ValueError("BATCH_SIZE and TEST_SAMPLES must be >= 1")
        return s


def case_from_env() -> Case:
    name = os.environ.get("SYNTHETIC_CASE") or "criteo"
    if name not in CASES:
        raise ValueError(f"SYNTHETIC_CASE must be one of {sorted(CASES)}, got {name!r}")
    return CASES[name]


def make_batch(ids: dict[str, np.ndarray | list[np.ndarray]], dense: np.ndarray | None, labels: np.ndarray,
               requires_grad: bool = True) -> PersiaBatch:
    """A batch of ``{slot: ids}`` (an array: one id per sample; a list: one array per sample)."""
    features = [IDTypeFeature(name, v) if isinstance(v, list) else
                IDTypeFeatureWithSingleID(name, np.ascontiguousarray(v)) for name, v in ids.items()]
    return PersiaBatch(
        features,
        non_id_type_features=[] if dense is None else [NonIDTypeFeature(np.ascontiguousarray(dense), name="dense")],
        labels=[Label(np.ascontiguousarray(labels), name="click")],
        requires_grad=requires_grad,
    )
