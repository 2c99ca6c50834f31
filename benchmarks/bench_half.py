"""The embedding worker's float16 conversions against numpy's, per batch.

    .venv/bin/python benchmarks/bench_half.py [--batch-sizes 512,4096] [--repeats 200]

For one batch of the synthetic example's shape (26 pooled slots of dim 16), it times:

- outputs: float32 pooled sums to float16 for the wire, refusing (float32 instead) any output with a
  magnitude float16 cannot hold. Reference: ``np.abs(x).max()`` then ``x.astype(np.float16)``, what the
  worker did before. Ours: ``persia_nats.core.half.to_half``, one pass.
- gradients: float16 from the wire to float32 divided by the loss scale, and whether all of it is
  finite. Reference: ``astype(np.float32)``, ``/=``, ``np.isfinite(...).all()``. Ours: ``to_float``.

Both sides run on the same arrays in the same process, alternating, and the table gives each one's
median microseconds per batch and the ratio (numpy / ours). Results are checked equal first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from persia_nats.core.half import HALF_MAX, to_float, to_half  # noqa: E402

SLOTS, DIM, LOSS_SCALE = 26, 16, 65536.0


def numpy_out(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16) if float(np.abs(x).max()) < HALF_MAX else x


def numpy_grad(g: np.ndarray) -> tuple[np.ndarray, bool]:
    out = g.astype(np.float32)
    out /= np.float32(LOSS_SCALE)
    return out, bool(np.isfinite(out).all())


def median_us(fn, arg, repeats: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="512,4096")
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'batch':>6} {'what':<10} {'numpy us':>10} {'ours us':>9} {'ratio':>6}")
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        pooled = (rng.standard_normal((SLOTS, bs, DIM)) * 0.05).astype(np.float32)
        grads = (rng.standard_normal((SLOTS, bs, DIM)) * LOSS_SCALE * 1e-4).astype(np.float16)
        assert np.array_equal(to_half(pooled), numpy_out(pooled))
        ours, finite = to_float(grads, LOSS_SCALE)
        ref, ref_finite = numpy_grad(grads)
        assert np.array_equal(ours, ref) and finite == ref_finite
        for what, ref_fn, our_fn, arr in (("outputs", numpy_out, to_half, pooled),
                                          ("gradients", numpy_grad, lambda g: to_float(g, LOSS_SCALE), grads)):
            ref_us, our_us = [], []
            for _ in range(5):  # alternate, so drift in the machine's load hits both sides alike
                ref_us.append(median_us(ref_fn, arr, args.repeats // 5))
                our_us.append(median_us(our_fn, arr, args.repeats // 5))
            r, o = statistics.median(ref_us), statistics.median(our_us)
            print(f"{bs:>6} {what:<10} {r:>10.0f} {o:>9.0f} {r / o:>6.2f}")


if __name__ == "__main__":
    main()
