"""float32 <-> float16 for the wire, in one pass each.

The embedding worker sends every pooled output as float16 and receives every gradient as float16.
numpy converts between the two with a scalar routine per element (about 3 ns an element on this
machine's cores: 0.7 ms for one batch of the synthetic example's 26 slots), and the checks around it
(the largest magnitude before, ``isfinite`` after) each take another pass and a temporary. These
loops do the conversion and its check together, bit for bit as numpy converts (round to nearest,
ties to even; subnormals; signed zeros).
"""

from __future__ import annotations

import math

import numba
import numpy as np

#: float16's largest finite value; an output with a larger magnitude travels as float32
HALF_MAX = 65504.0
_HALF_MAX_BITS = 0x477FE000  # HALF_MAX as float32 bits: a magnitude's bits at or above it (NaN too) do not fit


@numba.njit(cache=True, nogil=True)
def _to_half(values: np.ndarray, out: np.ndarray) -> bool:
    """``out[i]`` = the float16 bits of ``values[i]`` (float32); False when a magnitude is HALF_MAX or more, or
    a NaN (``out`` then holds garbage). Branch-free, so the loop vectorizes: a float16 subnormal comes from
    the float adder (adding 0.5 lines its bits up, and rounds them to nearest even), a normal from integer
    arithmetic on the bits (the bias 0xfff, plus one when the kept significand is odd, rounds ties to even)."""
    bits = values.view(np.uint32)
    bad = np.uint32(0)
    for i in range(values.shape[0]):
        f = bits[i]
        sign = f & np.uint32(0x80000000)
        m = f ^ sign
        bad |= np.uint32(m >= np.uint32(_HALF_MAX_BITS))
        sub = np.float32(np.abs(values[i]) + np.float32(0.5)).view(np.uint32) - np.uint32(126 << 23)
        odd = (m >> np.uint32(13)) & np.uint32(1)
        normal = (m + np.uint32(0xC8000FFF) + odd) >> np.uint32(13)  # 0xC8000FFF: (15 - 127) << 23, + 0xfff
        h = sub if m < np.uint32(113 << 23) else normal
        out[i] = np.uint16((h | (sign >> np.uint32(16))) & np.uint32(0xFFFF))
    return bool(bad == 0)


@numba.njit(cache=True, nogil=True)
def _to_float(bits: np.ndarray, divisor: np.float32, out: np.ndarray) -> bool:
    """``out[i]`` = the float16 whose bits are ``bits[i]``, as float32, divided by ``divisor``; False when
    any result is not finite. Branch-free like :func:`_to_half`: the exponent is rebiased on the bits, a
    subnormal is renormalized by the float subtracter, infinities and NaNs get float32's top exponent."""
    out_bits = out.view(np.uint32)
    for i in range(bits.shape[0]):
        h = np.uint32(bits[i])
        o = (h & np.uint32(0x7FFF)) << np.uint32(13)
        exp = o & np.uint32(0x0F800000)
        o += np.uint32(112 << 23)
        top = o + np.uint32(112 << 23)
        low = np.float32(np.uint32(o + np.uint32(1 << 23)).view(np.float32) - np.float32(6.103515625e-05))
        o = top if exp == np.uint32(0x0F800000) else o
        o = low.view(np.uint32) if exp == np.uint32(0) else o
        out_bits[i] = o | ((h & np.uint32(0x8000)) << np.uint32(16))
    finite = True
    if divisor != np.float32(1.0):
        for i in range(out.shape[0]):
            out[i] = out[i] / divisor
    for i in range(out.shape[0]):
        finite &= np.isfinite(out[i])
    return finite


def to_half(values: np.ndarray) -> np.ndarray | None:
    """``values`` (float32) as float16, the same shape; None when a magnitude is HALF_MAX or more, or a NaN."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    out = np.empty(flat.shape[0], np.uint16)
    if not _to_half(flat, out):
        return None
    return out.view(np.float16).reshape(values.shape)


def to_float(values: np.ndarray, divisor: float = 1.0) -> tuple[np.ndarray, bool]:
    """``values`` (float16) as float32 divided by ``divisor``, a new writable array, and whether all of it is
    finite."""
    flat = np.ascontiguousarray(values, dtype=np.float16).reshape(-1)
    out = np.empty(values.shape, np.float32)  # an array of that shape owns the memory, not a view of a flat one
    finite = _to_float(flat.view(np.uint16), np.float32(divisor), out.reshape(-1))
    return out, finite


#: a scaled gradient's largest magnitude lies in [2**13, 2**14): float16's top is 65504, and the margin leaves
#: room for the rounding of the peak itself
SCALED_PEAK_LOG2 = 14
#: the powers of two a scale may take (what a PS accepts, ``PsUpdateGroup.scale``)
_SCALE_LOG2_LIMIT = 100


def pow2_scale(peak: float) -> float:
    """The power of two that lifts a largest magnitude ``peak`` into [2**13, 2**14), so float16 keeps the
    small values' digits where unscaled it would flush them to zero; 1 for 0 or a non-finite peak. The
    embedding worker and the NN worker scale their float16 gradients by it, and the PS divides it out
    exactly."""
    if not peak > 0.0 or not math.isfinite(peak):
        return 1.0
    return math.ldexp(1.0, max(-_SCALE_LOG2_LIMIT, min(_SCALE_LOG2_LIMIT, SCALED_PEAK_LOG2 - math.frexp(peak)[1])))
