"""Synthetic rows -> PersiaBatch (26 single-id slots, the dense block, the click label), and the
run's size, read from the environment by both the data loader and the NN workers.

Environment (all optional): ``SEED`` (the training stream and the model init, default 0),
``BATCH_SIZE`` (default 512), ``TRAIN_BATCHES`` (batches in the training pass, default 400),
``TEST_SAMPLES`` (held-out rows scored at the end, default 20480), ``CURVE_SAMPLES`` (held-out rows
scored during training for the AUC curve, default 4096; they are the first rows of the test set),
``CURVE_POINTS`` (evaluations during training on rank 0, default 6; 0 turns the curve off).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from synthetic_data import SLOT_NAMES

from persia.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch


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


def make_batch(ids: np.ndarray, dense: np.ndarray, labels: np.ndarray, requires_grad: bool = True) -> PersiaBatch:
    return PersiaBatch(
        [IDTypeFeatureWithSingleID(name, np.ascontiguousarray(ids[:, i])) for i, name in enumerate(SLOT_NAMES)],
        non_id_type_features=[NonIDTypeFeature(np.ascontiguousarray(dense), name="dense")],
        labels=[Label(np.ascontiguousarray(labels), name="click")],
        requires_grad=requires_grad,
    )
