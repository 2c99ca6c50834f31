"""Embedding optimizer kernels: in-place row updates on the PS's float32 arrays.

Each optimizer keeps a fixed number of float32 state columns per row (:func:`state_width`), stored
beside the embedding rows by the store. Layouts:

- SGD: ``momentum > 0``: the momentum buffer (``dim`` columns); otherwise no state.
- Adagrad: the accumulator (``dim`` columns, or 1 with ``vectorwise_shared``).
- Adam: ``m`` (``dim``), ``v`` (``dim``), then the row's own step count ``t`` (1 column). Float32
  counts exactly up to 2**24 steps per row; beyond that ``t`` stops growing, when both bias
  corrections are 1 to float precision anyway.

All three add ``weight_decay * w`` to the gradient first (L2, as torch.optim does; PERSIA ignored
weight decay), and clip the touched rows to ``[-weight_bound, weight_bound]`` afterwards when
``weight_bound > 0``. Element arithmetic runs in float32, as PERSIA's kernels do.

Nothing an update sends can leave a row non-finite (a finite gradient of 8e34 squares to +inf in
Adagrad's float32 accumulator, which would freeze the row for good). The kernels keep every weight
within ``WEIGHT_LIMIT`` and every Adagrad accumulator within ``ACC_LIMIT``; an update whose gradients
are finite and at most ``SAFE_GRAD`` (with a sane lr, eps and weight decay) then provably stays
finite, which one sequential pass over the gradients tells (``_provably_finite``), at no cost to the
step. Any other update is judged row by row as it would land, before any row is stepped: refused whole
with :class:`NonFiniteUpdate` (a 400: the PS counts and answers it) where a weight or the state would
not be finite. A touched row that is non-finite already (from a checkpoint written before these bounds)
is repaired and logged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, cast

import numba
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from persia_nats.common.errors import BadRequest
from persia_nats.common.optim_config import AdagradConfig, AdamConfig, OptimizerConfig, SGDConfig

log = logging.getLogger(__name__)

__all__ = ["NonFiniteUpdate", "apply_update", "init_state", "prefetch", "prefetch_row", "state_fill_value",
           "state_width"]



class NonFiniteUpdate(BadRequest):
    """An update whose step would leave a weight or the optimizer state non-finite (refused whole, 400)."""


# How many rows ahead the kernels prefetch. Row updates are random DRAM reads; without prefetching
# the per-row arithmetic keeps the CPU from running ahead to the next rows' loads (about 3x slower).
# Farther (16, 32) measured slower: emb + state lines of that many rows exceed the miss buffers.
PREFETCH_ROWS = 8

#: the scalars of compiled kernels (an integer, a float): numba types them when it compiles, and to mypy
#: an element read out of an array is Any, so the kernels' scalar parameters are too
Int = Any
Float = Any


def state_width(cfg: OptimizerConfig | None, dim: int) -> int:
    """Return the number of float32 state columns per row for ``cfg`` at embedding width ``dim``.

    ``None`` (no optimizer registered yet) keeps no state.
    """
    if cfg is None:
        return 0
    if isinstance(cfg, SGDConfig):
        return dim if cfg.momentum > 0 else 0
    if isinstance(cfg, AdagradConfig):
        return 1 if cfg.vectorwise_shared else dim
    if isinstance(cfg, AdamConfig):
        return 2 * dim + 1
    raise TypeError(f"not an embedding optimizer config: {type(cfg).__name__}")


def state_fill_value(cfg: OptimizerConfig | None) -> float:
    """Return the value every state column of a fresh row starts at (the same for all columns)."""
    return cfg.initial_accumulator_value if isinstance(cfg, AdagradConfig) else 0.0


def init_state(cfg: OptimizerConfig | None, dim: int, out: np.ndarray) -> None:
    """Fill the state rows ``out`` (shape ``(n, state_width(cfg, dim))``) of freshly inserted rows.

    Adagrad starts at ``initial_accumulator_value``; SGD momentum and Adam's m, v and t start at 0.
    """
    width = state_width(cfg, dim)
    if out.ndim != 2 or out.shape[1] != width:
        raise ValueError(f"state rows must have shape (n, {width}), got {out.shape}")
    out.fill(state_fill_value(cfg))


def _prefetch(typingctx: Any, arr: Any, row: Any, offset: Any) -> Any:
    """Hint the CPU to fetch the cache line holding byte ``offset`` of ``arr[row]`` (never faults).

    Also used by :mod:`.store`'s kernels. numba's on-disk cache does not see edits made here from
    there: clear ``core/__pycache__`` after changing this or :func:`prefetch_row`.
    """
    if not (isinstance(arr, types.Array) and isinstance(row, types.Integer) and isinstance(offset, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        stride = cgutils.unpack_tuple(builder, ary.strides, aryty.ndim)[0]  # type: ignore[no-untyped-call]
        row_ = context.cast(builder, args[1], sig.args[1], types.intp)
        off = context.cast(builder, args[2], sig.args[2], types.intp)
        i8p = ir.IntType(8).as_pointer()
        ptr = builder.gep(builder.bitcast(ary.data, i8p), [builder.add(builder.mul(row_, stride), off)])
        i32 = ir.IntType(32)
        # the suffix is "p0" with opaque pointers (LLVM >= 17) and "p0i8" with typed ones
        name = "llvm.prefetch." + i8p.intrinsic_name
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), name)
        # read access, high temporal locality, data cache
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, row, offset), codegen


#: what compiled kernels call, ``prefetch(arr, row, offset)`` (numba's intrinsic hides the typing context)
prefetch = cast(Callable[[np.ndarray, Int, Int], None], intrinsic(_prefetch))


@numba.njit(cache=True, inline="always")
def prefetch_row(arr: np.ndarray, r: Int) -> None:
    """Prefetch every cache line of row ``r`` of a 2-D array."""
    for off in range(0, arr.shape[1] * arr.itemsize, 64):
        prefetch(arr, r, off)


@numba.njit(cache=True, inline="always")
def _prefetch_ahead(rows: np.ndarray, i: Int, emb: np.ndarray, state: np.ndarray) -> None:
    if i + PREFETCH_ROWS < rows.shape[0]:
        r = rows[i + PREFETCH_ROWS]
        prefetch_row(emb, r)
        prefetch_row(state, r)


@numba.njit(cache=True, inline="always")
def _clip(w: Float, bound: Float) -> Float:
    return min(max(w, -bound), bound)


#: every stored weight stays within +-WEIGHT_LIMIT, every Adagrad accumulator below ACC_LIMIT (float32's
#: largest is 3.4e38), and a gradient up to SAFE_GRAD then needs no row-by-row judging (_provably_finite)
WEIGHT_LIMIT = 1e15
ACC_LIMIT = 1e37
SAFE_GRAD = 1e15

# Element arithmetic is float32 (as PERSIA's kernels), which keeps rows in vector registers and runs
# about 1.3x faster than float64 here; per-row scalars (bias corrections) are computed in float64.
# ``bound`` arrives as +inf when there is no weight bound, so clipping needs no branch.


@numba.njit(cache=True)
def _sgd_kernel(rows: np.ndarray, grads: np.ndarray, emb: np.ndarray, state: np.ndarray, lr: Float, momentum: Float,
                weight_decay: Float, bound: Float) -> Int:
    lr, momentum = np.float32(lr), np.float32(momentum)
    weight_decay, bound = np.float32(weight_decay), np.float32(bound)
    bad = 0
    for i in range(rows.shape[0]):
        _prefetch_ahead(rows, i, emb, state)
        r = rows[i]
        out = np.float32(0.0)
        for j in range(emb.shape[1]):
            w = emb[r, j]
            g = grads[i, j] + weight_decay * w
            if momentum > 0:
                # An all-zero buffer gives buf = g on the first step, as torch's first-step clone does.
                g = momentum * state[r, j] + g
                state[r, j] = g
            w = _clip(w - lr * g, bound)
            emb[r, j] = w
            out += (g - g) + (w - w)
        bad += out != 0  # x - x is NaN for a non-finite x
    return bad


@numba.njit(cache=True)
def _adagrad_kernel(rows: np.ndarray, grads: np.ndarray, emb: np.ndarray, state: np.ndarray, lr: Float,
                    weight_decay: Float, g_square_momentum: Float, eps: Float, vectorwise: bool, persia_order: bool,
                    bound: Float) -> Int:
    dim = emb.shape[1]
    lr, weight_decay, bound = np.float32(lr), np.float32(weight_decay), np.float32(bound)
    gsm, eps, top = np.float32(g_square_momentum), np.float32(eps), np.float32(ACC_LIMIT)
    bad = 0
    for i in range(rows.shape[0]):
        _prefetch_ahead(rows, i, emb, state)
        r = rows[i]
        out = np.float32(0.0)
        if vectorwise:
            g2 = 0.0
            for j in range(dim):
                g = grads[i, j] + weight_decay * emb[r, j]
                g2 += np.float64(g) * g
            old = state[r, 0]
            new = min(old * gsm + np.float32(g2 / dim), top)
            state[r, 0] = new
            out += (old - old) + (new - new)  # an accumulator at +inf would be clipped, not noticed
            scale = lr / np.sqrt(old + eps) if persia_order else lr / (np.sqrt(new) + eps)
            for j in range(dim):
                w = emb[r, j]
                w = _clip(w - scale * (grads[i, j] + weight_decay * w), bound)
                emb[r, j] = w
                out += w - w
        else:
            for j in range(dim):
                w = emb[r, j]
                g = grads[i, j] + weight_decay * w
                old = state[r, j]
                new = min(old * gsm + g * g, top)
                state[r, j] = new
                step = g / np.sqrt(old + eps) if persia_order else g / (np.sqrt(new) + eps)
                w = _clip(w - lr * step, bound)
                emb[r, j] = w
                out += (old - old) + (new - new) + (w - w)
        bad += out != 0  # x - x is NaN for a non-finite x
    return bad


@numba.njit(cache=True)
def _adam_kernel(rows: np.ndarray, grads: np.ndarray, emb: np.ndarray, state: np.ndarray, lr: Float, beta1: Float,
                 beta2: Float, weight_decay: Float, eps: Float, bound: Float) -> Int:
    dim = emb.shape[1]
    b1, b2, weight_decay, eps, bound = (np.float32(beta1), np.float32(beta2), np.float32(weight_decay),
                                        np.float32(eps), np.float32(bound))
    c1, c2 = np.float32(1.0 - beta1), np.float32(1.0 - beta2)  # in float32, 1 - 0.999 loses 5 digits
    bad = 0
    for i in range(rows.shape[0]):
        _prefetch_ahead(rows, i, emb, state)
        r = rows[i]
        out = np.float32(0.0)
        t = state[r, 2 * dim] + np.float32(1.0)
        state[r, 2 * dim] = t
        step = np.float32(lr / (1.0 - beta1 ** np.float64(t)))
        root_bc2 = np.float32(math.sqrt(1.0 - beta2 ** np.float64(t)))
        for j in range(dim):
            w = emb[r, j]
            g = grads[i, j] + weight_decay * w
            m = b1 * state[r, j] + c1 * g
            v = b2 * state[r, dim + j] + c2 * g * g
            state[r, j] = m
            state[r, dim + j] = v
            # torch.optim.Adam's form: lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) = lr * m_hat / (sqrt(v_hat) + eps)
            w = _clip(w - step * m / (np.sqrt(v) / root_bc2 + eps), bound)
            emb[r, j] = w
            out += (v - v) + (w - w)
        bad += out != 0  # x - x is NaN for a non-finite x
    return bad


_SGD, _ADAGRAD, _ADAM = 0, 1, 2


@numba.njit(cache=True)
def _guard_kernel(kind: Int, rows: np.ndarray, grads: np.ndarray, emb: np.ndarray, state: np.ndarray, fill: Float,
                  lr: Float, p1: Float, p2: Float, weight_decay: Float, eps: Float, vectorwise: bool,
                  persia_order: bool) -> tuple[Int, Int]:
    """(first position whose step would leave a non-finite weight or state, or -1; rows repaired).

    Writes nothing but repairs: a touched row whose state or weights are already non-finite (left by
    an older version, or a checkpoint written by one) would never move again, so its state is reset to
    ``fill`` and its non-finite weights to 0 before the step is judged. The step is then computed as the
    kernels do, in float32, without storing it. ``p1, p2``: SGD's momentum; Adagrad's
    g_square_momentum; Adam's betas. ``x - x`` is 0 for a finite x and NaN otherwise, so each row
    sums those and branches once (branch-free loops vectorise: the guard costs less than the step).
    """
    dim = emb.shape[1]
    width = state.shape[1]
    lr32, wd, eps32 = np.float32(lr), np.float32(weight_decay), np.float32(eps)
    a, b, zero = np.float32(p1), np.float32(p2), np.float32(0.0)
    repaired = 0
    for i in range(rows.shape[0]):
        _prefetch_ahead(rows, i, emb, state)
        r = rows[i]
        held = zero
        for j in range(width):
            held += state[r, j] - state[r, j]
        for j in range(dim):
            held += emb[r, j] - emb[r, j]
        if held != zero:  # NaN compares unequal
            repaired += 1
            for j in range(width):
                state[r, j] = np.float32(fill)
            for j in range(dim):
                if not np.isfinite(emb[r, j]):
                    emb[r, j] = zero
        out = zero
        if kind == _ADAGRAD and vectorwise:
            g2 = 0.0
            for j in range(dim):
                g = grads[i, j] + wd * emb[r, j]
                g2 += np.float64(g) * g
            new = state[r, 0] * b + np.float32(g2 / dim)
            scale = lr32 / np.sqrt(state[r, 0] + eps32) if persia_order else lr32 / (np.sqrt(new) + eps32)
            out += new - new
            for j in range(dim):
                w = emb[r, j] - scale * (grads[i, j] + wd * emb[r, j])
                out += w - w
        elif kind == _SGD:
            for j in range(dim):
                w = emb[r, j]
                g = grads[i, j] + wd * w
                if a > 0:
                    g = a * state[r, j] + g
                w = w - lr32 * g
                out += (g - g) + (w - w)
        elif kind == _ADAGRAD:
            for j in range(dim):
                w = emb[r, j]
                g = grads[i, j] + wd * w
                new = state[r, j] * b + g * g
                step = g / np.sqrt(state[r, j] + eps32) if persia_order else g / (np.sqrt(new) + eps32)
                w = w - lr32 * step
                out += (new - new) + (w - w)
        else:
            for j in range(dim):
                w = emb[r, j]
                g = grads[i, j] + wd * w
                m = a * state[r, j] + (np.float32(1.0) - a) * g
                v = b * state[r, dim + j] + (np.float32(1.0) - b) * g * g
                # a bias-corrected step is at most lr/(1-beta1) * m/sqrt(v): finite when m, v and this are
                w = w - lr32 * m / (np.sqrt(v) + eps32)
                out += (m - m) + (v - v) + (w - w)
        if out != zero:
            return i, repaired
    return -1, repaired


def _guard(cfg: OptimizerConfig, rows: np.ndarray, grads: np.ndarray, emb: np.ndarray, state: np.ndarray) -> int:
    """Refuse (BadRequest, nothing stepped) an update whose effect on a weight or the optimizer state is not
    finite; repair touched rows already non-finite. Returns the rows repaired.

    A finite gradient can still overflow: ``scaled_grads`` 65504 with ``scale`` 2**-100 is 8e34, whose
    square is +inf in float32, and an Adagrad accumulator at +inf freezes its row for good (every
    later step divides by it). The gradient alone cannot tell, so the step is judged as it would land.
    """
    if isinstance(cfg, SGDConfig):
        kind, p1, p2, eps, vectorwise, persia_order = _SGD, cfg.momentum, 0.0, 0.0, False, False
    elif isinstance(cfg, AdagradConfig):
        kind, p1, p2, eps = _ADAGRAD, 0.0, cfg.g_square_momentum, cfg.eps
        vectorwise, persia_order = cfg.vectorwise_shared, cfg.persia_order
    elif isinstance(cfg, AdamConfig):
        kind, p1, p2, eps, vectorwise, persia_order = _ADAM, cfg.betas[0], cfg.betas[1], cfg.eps, False, False
    else:
        raise TypeError(f"not an embedding optimizer config: {type(cfg).__name__}")
    bad, repaired = _guard_kernel(kind, rows, grads, emb, state, state_fill_value(cfg), cfg.lr, p1, p2,
                                  cfg.weight_decay, eps, vectorwise, persia_order)
    if repaired:
        log.warning("repaired %d embedding rows whose weights or optimizer state were not finite (state reset "
                    "to %g, weights to 0)", repaired, state_fill_value(cfg))
    if bad >= 0:
        raise NonFiniteUpdate(f"the update of row {int(rows[bad])} (position {int(bad)}) would leave a weight or "
                              f"its {type(cfg).__name__} state non-finite (a gradient too large for float32); "
                              "no update applied")
    return int(repaired)


def apply_update(
    cfg: OptimizerConfig,
    rows: np.ndarray,
    grads: np.ndarray,
    emb: np.ndarray,
    state: np.ndarray,
    weight_bound: float,
) -> int:
    """Apply one optimizer step to ``emb[rows]`` (and their ``state``) in place.

    Adagrad follows torch.optim.Adagrad (and TorchRec): ``acc = acc * g_square_momentum + g**2``,
    then ``w -= lr * g / (sqrt(acc) + eps)``. With ``persia_order`` it steps with the accumulator from
    *before* this gradient, ``w -= lr * g / sqrt(acc_old + eps)``, as PERSIA did. With
    ``vectorwise_shared`` the row's single accumulator grows by the mean of ``g**2`` over the row
    (TorchRec's row-wise Adagrad). The formulas: ``docs/optimizers.md``.

    Args:
        cfg: The optimizer.
        rows: int64 row numbers, shape ``(n,)``. A row listed twice gets two successive steps; the
            store sums duplicate ids' gradients first, so it never passes one.
        grads: Gradients, shape ``(n, dim)``; converted to float32 if needed.
        emb: The float32 embedding rows, shape ``(N, dim)``, updated in place.
        state: The float32 optimizer state, shape ``(N, state_width(cfg, dim))``, updated in place.
        weight_bound: Clip the touched rows to ``[-weight_bound, weight_bound]`` when > 0.

    Returns:
        The touched rows whose weights or state were already non-finite, repaired first (logged).

    Raises:
        ValueError: Shapes or dtypes do not match.
        NonFiniteUpdate: The step would leave a weight or the state non-finite; nothing is stepped.
    """
    dim = emb.shape[1]
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    grads = np.ascontiguousarray(grads, dtype=np.float32)
    if emb.dtype != np.float32 or state.dtype != np.float32 or emb.ndim != 2 or state.ndim != 2:
        raise ValueError("emb and state must be 2-D float32 arrays")
    if grads.shape != (rows.shape[0], dim) or rows.ndim != 1:
        raise ValueError(f"grads must have shape ({rows.shape[0]}, {dim}), got {grads.shape}")
    if state.shape != (emb.shape[0], state_width(cfg, dim)):
        raise ValueError(f"state must have shape ({emb.shape[0]}, {state_width(cfg, dim)}), got {state.shape}")
    if rows.shape[0] and (rows.min() < 0 or rows.max() >= emb.shape[0]):
        raise ValueError("row number out of range")
    bound = min(float(weight_bound) if weight_bound > 0 else math.inf, WEIGHT_LIMIT)
    if not isinstance(cfg, (SGDConfig, AdagradConfig, AdamConfig)):
        raise TypeError(f"not an embedding optimizer config: {type(cfg).__name__}")
    if not _provably_finite(cfg, grads):
        # judged row by row before anything is stepped: refused whole, or stepped after repairs
        repaired = _guard(cfg, rows, grads, emb, state)
        _step(cfg, rows, grads, emb, state, bound)
        return repaired
    if not _step(cfg, rows, grads, emb, state, bound):
        return 0
    # a step with such inputs cannot leave a finite row non-finite: these rows were non-finite already (a
    # checkpoint written before the bounds). Their finite parts took this step too, so each restarts as a
    # new row (weights 0, state at its initial value) and takes the step again from there.
    touched = np.isfinite(emb[rows]).all(axis=1) & np.isfinite(state[rows]).all(axis=1)
    again = np.flatnonzero(~touched)
    emb[rows[again]] = 0
    state[rows[again]] = state_fill_value(cfg)
    _step(cfg, rows[again], grads[again], emb, state, bound)
    log.warning("repaired %d embedding rows whose weights or optimizer state were not finite (reset as new rows)",
                again.size)
    return int(again.size)


def _step(cfg: OptimizerConfig, rows: np.ndarray, grads: np.ndarray, emb: np.ndarray, state: np.ndarray,
          bound: float) -> int:
    """One step of the kernels; returns the rows left non-finite."""
    if isinstance(cfg, SGDConfig):
        return int(_sgd_kernel(rows, grads, emb, state, cfg.lr, cfg.momentum, cfg.weight_decay, bound))
    if isinstance(cfg, AdagradConfig):
        return int(_adagrad_kernel(rows, grads, emb, state, cfg.lr, cfg.weight_decay, cfg.g_square_momentum,
                                   cfg.eps, cfg.vectorwise_shared, cfg.persia_order, bound))
    assert isinstance(cfg, AdamConfig)
    return int(_adam_kernel(rows, grads, emb, state, cfg.lr, cfg.betas[0], cfg.betas[1], cfg.weight_decay, cfg.eps,
                            bound))


def _provably_finite(cfg: OptimizerConfig, grads: np.ndarray) -> bool:
    """Whether this step must leave every finite row finite, from the gradient and the config alone.

    The kernels keep weights within WEIGHT_LIMIT and Adagrad's accumulator within ACC_LIMIT, so with
    |g| <= SAFE_GRAD, weight decay <= 1 and lr <= 1e6: g + wd*w stays below 2e15, its square below 4e30,
    an accumulator below 1e37 + 4e30, and a step below lr * 2e15 / sqrt(eps) (eps >= 1e-20), all far
    inside float32. Checking that costs one sequential pass over the gradients, where judging each step
    as it would land re-reads every touched row (about as long as the step itself).
    """
    eps = getattr(cfg, "eps", 1.0)
    if cfg.weight_decay > 1 or cfg.lr > 1e6 or eps < 1e-20 or not grads.size:
        return not grads.size
    top = float(np.max(np.abs(grads)))  # NaN when any gradient is NaN: the comparison is then False
    return top <= SAFE_GRAD
