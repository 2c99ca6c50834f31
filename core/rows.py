"""Embedding rows as one array: what the hot-row merge builds and the NN worker's leaves and the
merge itself take, without a copy where the rows already are one array's."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def stacked_rows(arrs: Sequence[np.ndarray]) -> np.ndarray:
    """``arrs`` (equal shapes and dtypes) as one (k, ...) array that nothing else writes: a writable
    array whose consecutive rows ``arrs`` already are (what the hot-row merge builds) is taken as it
    is, anything else is copied once."""
    base = arrs[0].base
    if isinstance(base, np.ndarray) and base.flags.writeable and base.flags.c_contiguous \
            and base.shape == (len(arrs), *arrs[0].shape) and base.dtype == arrs[0].dtype:
        start, step = base.__array_interface__["data"][0], base.strides[0]
        if all(a.base is base and a.__array_interface__["data"][0] == start + i * step for i, a in enumerate(arrs)):
            return base
    return np.stack(arrs)
