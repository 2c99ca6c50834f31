"""Which PS replica owns an id.

An id's shard is ``splitmix64(id) % num_shards``: a fixed 64-bit mix, so the answer never depends on
the process, the Python hash seed or the machine. The PS's own hash index (``persia_nats.core.store``)
mixes with different constants and a seed, so the ids one replica owns (all congruent under this mix)
still spread over its index slots.
"""

from __future__ import annotations

import numpy as np

__all__ = ["shard_of", "split_by_shard", "splitmix64"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def splitmix64(ids: np.ndarray) -> np.ndarray:
    """Mix each uint64 with the splitmix64 step (add the golden gamma, then the finaliser).

    Args:
        ids: uint64 array of any shape.

    Returns:
        A new uint64 array of the same shape.
    """
    # Wrapping uint64 arithmetic is the point of the mix; errstate keeps numpy from warning on it.
    with np.errstate(over="ignore"):
        z = ids + _GOLDEN
        z ^= z >> _S30
        z *= _MIX1
        z ^= z >> _S27
        z *= _MIX2
        z ^= z >> _S31
    return z


def _check(ids: np.ndarray, num_shards: int) -> None:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        raise ValueError(f"ids must be a 1-D uint64 array, got {getattr(ids, 'dtype', type(ids))!s}")
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Return the shard (PS replica index) of every id.

    Args:
        ids: 1-D uint64 array of ids.
        num_shards: Number of PS replicas, >= 1.

    Returns:
        int64 array of the same length with values in ``[0, num_shards)``.

    Raises:
        ValueError: ``ids`` is not a 1-D uint64 array, or ``num_shards < 1``.
    """
    _check(ids, num_shards)
    return (splitmix64(ids) % np.uint64(num_shards)).astype(np.int64)


def split_by_shard(ids: np.ndarray, num_shards: int) -> list[tuple[int, np.ndarray]]:
    """Group the positions of ``ids`` by shard.

    Args:
        ids: 1-D uint64 array of ids.
        num_shards: Number of PS replicas, >= 1.

    Returns:
        ``[(shard, positions), ...]`` for every shard that owns at least one id, in increasing shard
        order; ``positions`` is an int64 array of indices into ``ids``, increasing, so
        ``ids[positions]`` keeps the caller's order within a shard.

    Raises:
        ValueError: as :func:`shard_of`.
    """
    shards = shard_of(ids, num_shards)
    if shards.shape[0] == 0:
        return []
    if num_shards <= 1 << 16:
        shards = shards.astype(np.uint16)  # numpy's stable sort is a radix sort for 16-bit keys
    order = np.argsort(shards, kind="stable")  # stable: positions stay increasing within a shard
    grouped = shards[order]
    starts = np.flatnonzero(np.diff(grouped, prepend=grouped[0] ^ 1))  # first position of each run
    ends = [*starts[1:].tolist(), len(order)]
    return [(int(grouped[a]), order[a:b]) for a, b in zip(starts.tolist(), ends, strict=True)]
