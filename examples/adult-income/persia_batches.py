"""Adult rows -> PersiaBatch: 8 single-id slots, the continuous block, the label."""

from __future__ import annotations

import numpy as np
from adult_data import CATEGORICAL

from persia.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch


def make_batch(ids: np.ndarray, dense: np.ndarray, labels: np.ndarray, requires_grad: bool = True) -> PersiaBatch:
    return PersiaBatch(
        [IDTypeFeatureWithSingleID(name, np.ascontiguousarray(ids[:, i])) for i, name in enumerate(CATEGORICAL)],
        non_id_type_features=[NonIDTypeFeature(np.ascontiguousarray(dense), name="continuous")],
        labels=[Label(np.ascontiguousarray(labels), name="income")],
        requires_grad=requires_grad,
    )
