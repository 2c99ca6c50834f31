"""The embedding worker's float32 <-> float16 conversions: bit for bit what numpy's astype gives (round to
nearest, ties to even, subnormals, signed zeros), with the checks numpy needs extra passes for."""

from __future__ import annotations

import numpy as np
import pytest
from persia_nats.core.half import HALF_MAX, to_float, to_half


def _bits(values: np.ndarray) -> np.ndarray:
    return values.view(np.uint16 if values.dtype == np.float16 else np.uint32)


def _fitting(bits: np.ndarray) -> np.ndarray:
    values = bits.astype(np.uint32).view(np.float32)
    return values[np.abs(values) < HALF_MAX]  # NaNs compare False: left out too


@pytest.mark.parametrize("lo, hi", [
    (0, 1 << 16),                        # the smallest subnormal float32s: signed zeros in float16
    (0x33000000 - 4096, 0x33000000 + 4096),  # around half of float16's smallest subnormal: ties to zero or up
    (0x38000000, 0x38800000 + 8192),    # float16's subnormals up to its smallest normal
    (0x3F7F0000, 0x3F810000),            # around 1.0: ties to even in the normal range
    (0x477FE000 - (1 << 16), 0x477FE000),  # up to float16's largest, which values round up to but never past
])
def test_every_float32_of_a_range_converts_as_numpy_does(lo, hi):
    for sign in (0, 0x80000000):
        values = (np.arange(lo, hi, dtype=np.uint32) | np.uint32(sign)).view(np.float32)
        assert values.size >= 8192
        half = to_half(values)
        assert half is not None and half.dtype == np.float16
        np.testing.assert_array_equal(_bits(half), _bits(values.astype(np.float16)))


def test_random_float32s_convert_as_numpy_does():
    values = _fitting(np.random.default_rng(0).integers(0, 1 << 32, size=400_000, dtype=np.uint64))
    np.testing.assert_array_equal(_bits(to_half(values)), _bits(values.astype(np.float16)))


@pytest.mark.parametrize("bad", [HALF_MAX, -HALF_MAX, 1e6, np.inf, -np.inf, np.nan])
def test_a_value_float16_cannot_hold_refuses_the_whole_output(bad):
    values = np.zeros((4, 3), np.float32)
    values[2, 1] = bad
    assert to_half(values) is None


def test_the_shape_is_kept_and_the_input_left_alone():
    values = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    before = values.copy()
    half = to_half(values)
    assert half.shape == (3, 4)
    np.testing.assert_array_equal(values, before)
    np.testing.assert_array_equal(half, values.astype(np.float16))
    assert to_half(np.zeros((0, 16), np.float32)).shape == (0, 16)


def test_every_float16_converts_back_as_numpy_does():
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    values, finite = to_float(halves)
    expected = halves.astype(np.float32)
    assert values.dtype == np.float32 and values.flags.writeable and not finite  # the infinities and NaNs
    same = (_bits(values) == _bits(expected)) | (np.isnan(values) & np.isnan(expected))
    assert same.all()


@pytest.mark.parametrize("divisor", [1.0, 3.0, 65536.0, 2.0 ** -20])
def test_a_divisor_is_applied_as_numpy_divides(divisor):
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    halves = halves[np.isfinite(halves)].reshape(-1, 16)
    values, finite = to_float(halves, divisor)
    expected = halves.astype(np.float32) / np.float32(divisor)
    np.testing.assert_array_equal(values, expected)
    assert values.shape == halves.shape and finite == bool(np.isfinite(expected).all())


def test_finiteness_is_reported():
    halves = np.ones((2, 4), np.float16)
    assert to_float(halves)[1]
    halves[1, 3] = np.inf
    assert not to_float(halves)[1]
    halves[1, 3] = np.nan
    assert not to_float(halves)[1]
    # finite float16s that overflow float32 once divided
    assert not to_float(np.full((1, 2), 60000, np.float16), 2.0 ** -120)[1]
