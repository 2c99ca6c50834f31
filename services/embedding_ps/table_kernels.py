"""Numba kernels of the PS embedding store (:mod:`.store`): the hash index, exact LRU by stamps, lookups.

The index is open addressing with linear probing over ``slots`` records of ``(key, row, stamp)``: 16 bytes
(uint64 key, int32 row, uint32 stamp) while the capacity fits int32 rows, else 24 (all 64-bit). An empty
slot has ``row < 0``. The key sits in the slot, so a lookup that hits reads one index line and one vector
row, and writes the row's recency into the line it has just read. There are 3 slots for every 2 allocated
rows (load <= 2/3), mapped by multiply-shift (any slot count works); deletion shifts entries back, so no
tombstones build up. Rows (``emb``, ``state``) are dense, ``0..live-1``: an eviction hands its row
straight to the new id.

Exact LRU without a linked list: every id a training lookup touches gets the next value of a per-table
clock as its slot's ``stamp`` (in id order), so the LRU order is the stamp order, and a touch writes no
neighbour. Eviction takes the live row of smallest stamp from a candidate list: a scan collects the
keys whose stamps are <= a threshold T, sorted by stamp (about ``live / 16`` of them). Every stamp given
after the scan exceeds T, so among rows outside the list no stamp is <= T, and the first listed key whose
slot still holds the listed stamp (not touched since, nor evicted) is exactly the least recently used
row; a touched key is skipped. When the list runs out the kernel stops and :mod:`.store` rescans.
32-bit stamps are renumbered by rank (order kept) before the clock would wrap, after about 4e9 touches.

The kernels pipeline ids: hash and prefetch the index slot ``_DA`` ids ahead, probe (and insert or
evict) and prefetch the vector ``_DB`` ids ahead, copy the vector out last, so the DRAM misses of many ids
overlap. State changes all happen at the probe stage, in id order. A vector still waiting to be copied
is never evicted: it was stamped after the candidate scan, and the kernel returns (copying out what it
resolved) before any rescan. numba's on-disk cache keys each kernel on its own file only, so kernels
that call each other live together here.
"""

from __future__ import annotations

import mmap
from typing import Any

import numba
import numpy as np

from services.embedding_ps.optim import prefetch, prefetch_row

# meta[] slots: the table's mutable scalars, in one int64 array so kernels can update them.
_LIVE, _CLOCK, _EVICTIONS, _INSERTS, _INDEX_MISS, _GRAD_MISS, _SALT, _CAND_POS = range(8)
_COUNTERS = {"evictions": _EVICTIONS, "inserts": _INSERTS, "index_miss_count": _INDEX_MISS,
             "gradient_id_miss_count": _GRAD_MISS, "admission_salt": _SALT}
_GROW, _REFILL = 1, 2  # why a training lookup stopped early

_SLOT32 = np.dtype([("key", np.uint64), ("row", np.int32), ("stamp", np.uint32)])
_SLOT64 = np.dtype([("key", np.uint64), ("row", np.int64), ("stamp", np.uint64)])
_STAMP_LIMIT = {_SLOT32: 2**32 - 1, _SLOT64: 2**63 - 1}  # the clock must stay below this
_CAND_SHARE = 16  # a candidate scan lists about live / _CAND_SHARE keys
_BUCKETS = 1 << 16  # histogram buckets of the candidate threshold search

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SM1, _SM2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64 finaliser
_FM1, _FM2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)  # murmur3 fmix64
# Seeds keep the index hash, the initial values and admission independent of each other and of
# common.sharding (plain splitmix64): a replica's ids all share one shard residue and must not cluster.
_INDEX_SEED = np.uint64(0x5851F42D4C957F2D)
_INIT_SEED = np.uint64(0x2545F4914F6CDD1D)
_ADMIT_SEED = np.uint64(0xD1B54A32D192ED03)
_S11, _S27, _S30, _S31, _S32, _S33 = (np.uint64(s) for s in (11, 27, 30, 31, 32, 33))
_U32_MAX = 0xFFFFFFFF
_INV_2_53 = 1.0 / 9007199254740992.0
_DA = 20  # ids ahead: hash the id and prefetch its index slot
_DB = 10  # ids ahead: probe the slot (insert, evict, stamp) and prefetch the vector
_RING = 32  # ring buffers of per-id homes and rows (power of two > _DA)
_HUGE = 2 << 20


def _empty(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """np.empty, but 4 MiB and up come from a private anonymous mapping advised to use huge pages
    (transparent huge pages in ``madvise`` mode, a common default, give them only when asked): random
    rows over gigabytes otherwise miss the TLB on nearly every access. Pages are committed when first
    written, as with np.empty."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < 2 * _HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    buf = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(buf, np.uint8)
    skip = -raw.ctypes.data % _HUGE
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)


def slot_count(rows: int) -> int:
    """Index slots for ``rows`` allocated rows (load <= 2/3; always at least one free slot)."""
    return rows + rows // 2 + 1


@numba.njit(cache=True, inline="always")
def _splitmix(z):
    z = (z ^ (z >> _S30)) * _SM1
    z = (z ^ (z >> _S27)) * _SM2
    return z ^ (z >> _S31)


@numba.njit(cache=True, inline="always")
def _home(key, nslots):
    h = key ^ _INDEX_SEED
    h = (h ^ (h >> _S33)) * _FM1
    h = (h ^ (h >> _S33)) * _FM2
    h ^= h >> _S33
    if nslots <= _U32_MAX:
        return np.int64(((h >> _S32) * np.uint64(nslots)) >> _S32)
    return np.int64(h % np.uint64(nslots))


@numba.njit(cache=True)
def _index_homes(ids, nslots):
    out = np.empty(ids.shape[0], np.int64)
    for i in range(ids.shape[0]):
        out[i] = _home(ids[i], nslots)
    return out


@numba.njit(cache=True, inline="always")
def _probe(skey, srow, key, s):
    """Probe from slot ``s``: (row of ``key`` or -1, its slot or the free slot where it would go)."""
    nslots = skey.shape[0]
    while True:
        r = np.int64(srow[s])
        if r < 0 or skey[s] == key:
            return r, s
        s += 1
        if s == nslots:
            s = 0


@numba.njit(cache=True)
def _index_delete(skey, srow, sstamp, i):
    """Empty slot ``i``, shifting back the entries of its probe run that may move."""
    nslots = skey.shape[0]
    j = i
    while True:
        j = j + 1 if j + 1 < nslots else 0
        if srow[j] < 0:
            break
        k = _home(skey[j], nslots)
        # The entry at j may fill the hole at i unless its home lies cyclically in (i, j].
        stays = (i < k <= j) if i <= j else (i < k or k <= j)
        if not stays:
            skey[i], srow[i], sstamp[i] = skey[j], srow[j], sstamp[j]
            i = j
    srow[i] = -1


@numba.njit(cache=True)
def _rehash(okey, orow, ostamp, skey, srow, sstamp):
    """Insert every entry of the old index (okey, orow, ostamp) into the new, empty one."""
    nslots = skey.shape[0]
    srow[:] = -1
    ahead = np.zeros(_RING, np.int64)
    for s in range(-_DA, okey.shape[0]):
        a = s + _DA
        if a < okey.shape[0] and orow[a] >= 0:
            ahead[a & (_RING - 1)] = _home(okey[a], nslots)
            prefetch(skey, ahead[a & (_RING - 1)], 0)
        if s >= 0 and orow[s] >= 0:
            t = _probe(skey, srow, okey[s], ahead[s & (_RING - 1)])[1]
            skey[t], srow[t], sstamp[t] = okey[s], orow[s], ostamp[s]


@numba.njit(cache=True)
def _build_index(keys, skey, srow, sstamp):
    """Index keys[r] -> row r with stamp r; return the first position whose key repeats an earlier one, else -1."""
    srow[:] = -1
    for r in range(keys.shape[0]):
        found, s = _probe(skey, srow, keys[r], _home(keys[r], skey.shape[0]))
        if found >= 0:
            return r
        skey[s], srow[s], sstamp[s] = keys[r], r, r
    return -1


@numba.njit(cache=True, inline="always")
def _copy_out(emb, r, out, i):
    if r >= 0:
        for j in range(emb.shape[1]):
            out[i, j] = emb[r, j]
    else:
        for j in range(out.shape[1]):
            out[i, j] = 0.0


@numba.njit(cache=True)
def _lookup_eval(ids, skey, srow, emb, meta, out):
    n, nslots, mask = ids.shape[0], skey.shape[0], _RING - 1
    homes = np.empty(_RING, np.int64)
    found = np.empty(_RING, np.int64)
    misses = 0
    for i in range(-_DA, n):
        a = i + _DA
        if a < n:
            homes[a & mask] = _home(ids[a], nslots)
            prefetch(skey, homes[a & mask], 0)
        b = i + _DB
        if 0 <= b < n:
            r = _probe(skey, srow, ids[b], homes[b & mask])[0]
            found[b & mask] = r
            if r >= 0:
                prefetch_row(emb, r)
            else:
                misses += 1
        if i >= 0:
            _copy_out(emb, found[i & mask], out, i)
    meta[_INDEX_MISS] += misses


@numba.njit(cache=True)
def _lookup_train(ids, start, skey, srow, sstamp, emb, state, meta, cand_keys, cand_stamps,
                  capacity, lo, hi, admit_p, fill, out):
    """Look up ids[start:], inserting admitted unseen ids and stamping every touched row in id order.

    Returns (-1, 0) when done, or (position, _GROW / _REFILL) where it stopped because the row arrays
    are full below capacity or the eviction candidates ran out; everything before it is done.
    """
    n, nslots, mask = ids.shape[0], skey.shape[0], _RING - 1
    dim = emb.shape[1]
    hi32 = np.float32(hi)
    salt = np.uint64(meta[_SALT]) * _GOLDEN
    clock, live, cpos = meta[_CLOCK], meta[_LIVE], meta[_CAND_POS]
    ncand = cand_keys.shape[0]
    inserts = evictions = misses = 0
    homes = np.empty(_RING, np.int64)
    found = np.empty(_RING, np.int64)
    stop, reason = -1, 0
    for i in range(start - _DA, n):
        a = i + _DA
        if a < n:
            homes[a & mask] = _home(ids[a], nslots)
            prefetch(skey, homes[a & mask], 0)
        b = i + _DB
        if start <= b < n:
            key = ids[b]
            r, s = _probe(skey, srow, key, homes[b & mask])
            if r >= 0:
                sstamp[s] = clock
                clock += 1
                prefetch_row(emb, r)
            elif admit_p >= 1.0 or np.float64(_splitmix((key ^ _ADMIT_SEED) + salt) >> _S11) * _INV_2_53 < admit_p:
                if live < capacity:
                    if live == emb.shape[0]:
                        stop, reason = b, _GROW
                    else:
                        r = live
                        live += 1
                else:
                    while cpos < ncand:  # the first candidate still holding its listed stamp is the LRU row
                        if cpos + 4 < ncand:
                            prefetch(skey, _home(cand_keys[cpos + 4], nslots), 0)
                        ck, cs = cand_keys[cpos], cand_stamps[cpos]
                        cpos += 1
                        q, qs = _probe(skey, srow, ck, _home(ck, nslots))
                        if q >= 0 and np.uint64(sstamp[qs]) == cs:
                            _index_delete(skey, srow, sstamp, qs)
                            evictions += 1
                            r = q
                            s = _probe(skey, srow, key, homes[b & mask])[1]  # the free slot may have moved
                            break
                    if r < 0:
                        stop, reason = b, _REFILL
                if stop >= 0:
                    for c in range(max(i, start), b):
                        _copy_out(emb, found[c & mask], out, c)
                    break
                misses += 1
                inserts += 1
                skey[s], srow[s], sstamp[s] = key, r, clock
                clock += 1
                z = _splitmix(key ^ _INIT_SEED)
                for j in range(dim):
                    z += _GOLDEN
                    u = np.float64(_splitmix(z) >> _S11) * _INV_2_53
                    emb[r, j] = min(np.float32(lo + (hi - lo) * u), hi32)
                for j in range(state.shape[1]):
                    state[r, j] = fill
            else:
                misses += 1  # refused admission: reads as zeros
            found[b & mask] = r
        if i >= start:
            _copy_out(emb, found[i & mask], out, i)
    meta[_CLOCK], meta[_LIVE], meta[_CAND_POS] = clock, live, cpos
    meta[_INSERTS] += inserts
    meta[_EVICTIONS] += evictions
    meta[_INDEX_MISS] += misses
    return stop, reason


@numba.njit(cache=True)
def _select_candidates(skey, srow, sstamp, clock, want):
    """Keys (and stamps) of the live rows whose stamps are <= T, by stamp, with T chosen so that about
    ``want`` (at least 1, at most want + 2**16 or 2 * want) are listed: histograms of the stamps,
    narrowing the range until a bucket boundary falls close enough."""
    lo, hi, below = np.int64(0), np.int64(clock), np.int64(0)
    while True:
        width = max(np.int64(1), (hi - lo + _BUCKETS - 1) // _BUCKETS)
        hist = np.zeros(_BUCKETS, np.int64)
        for s in range(srow.shape[0]):
            t = np.int64(sstamp[s])
            if srow[s] >= 0 and lo <= t < hi:
                hist[(t - lo) // width] += 1
        total, b = below, 0
        while b < _BUCKETS - 1 and total + hist[b] < want:
            total += hist[b]
            b += 1
        if width == 1 or total + hist[b] <= max(2 * want, want + _BUCKETS):
            limit = lo + (b + 1) * width - 1
            break
        below, lo, hi = total, lo + b * width, lo + (b + 1) * width
    count = total + hist[b]
    ck = np.empty(count, np.uint64)
    cs = np.empty(count, np.uint64)
    k = 0
    for s in range(srow.shape[0]):
        if srow[s] >= 0 and np.int64(sstamp[s]) <= limit:
            ck[k], cs[k] = skey[s], sstamp[s]
            k += 1
    order = np.argsort(cs)
    return ck[order], cs[order]


@numba.njit(cache=True)
def _lru_slots(srow, sstamp):
    """Occupied slots, least recently used first."""
    occupied = np.empty(srow.shape[0], np.int64)
    n = 0
    for s in range(srow.shape[0]):
        if srow[s] >= 0:
            occupied[n] = s
            n += 1
    occupied = occupied[:n]
    return occupied[np.argsort(sstamp[occupied])]


@numba.njit(cache=True)
def _renumber_stamps(srow, sstamp):
    """Replace stamps by their ranks 0..live-1 (same order); return the new clock."""
    slots = _lru_slots(srow, sstamp)
    for k in range(slots.shape[0]):
        sstamp[slots[k]] = k
    return slots.shape[0]


@numba.njit(cache=True)
def _resolve(ids, skey, srow):
    """Row of each id, or -1; index slots prefetched ``_DA`` ids ahead."""
    n, nslots, mask = ids.shape[0], skey.shape[0], _RING - 1
    homes = np.empty(_RING, np.int64)
    rows = np.empty(n, np.int64)
    for i in range(-_DA, n):
        a = i + _DA
        if a < n:
            homes[a & mask] = _home(ids[a], nslots)
            prefetch(skey, homes[a & mask], 0)
        if i >= 0:
            rows[i] = _probe(skey, srow, ids[i], homes[i & mask])[0]
    return rows


@numba.njit(cache=True)
def _gather_grads(ids, grads, skey, srow):
    """Sum the gradients of each stored id: (rows, sums, misses, first non-finite position or -1)."""
    n, dim = grads.shape
    for i in range(n):
        for j in range(dim):
            if not np.isfinite(grads[i, j]):
                return np.empty(0, np.int64), np.empty((0, dim), np.float32), 0, i
    found = _resolve(ids, skey, srow)
    bits = 1
    while (1 << bits) < 2 * n:
        bits += 1
    mask = (1 << bits) - 1
    local = np.full(1 << bits, -1, np.int32)  # row -> position in rows/sums, for summing duplicates
    rows = np.empty(n, np.int64)
    sums = np.empty((n, dim), np.float32)
    u = 0
    misses = 0
    for i in range(n):
        r = found[i]
        if r < 0:
            misses += 1
            continue
        h = np.int64((np.uint64(r) * _GOLDEN) >> np.uint64(64 - bits))
        while local[h] >= 0 and rows[local[h]] != r:
            h = (h + 1) & mask
        q = local[h]
        if q < 0:
            local[h] = u
            rows[u] = r
            for j in range(dim):
                sums[u, j] = grads[i, j]
            u += 1
        else:
            for j in range(dim):
                sums[q, j] += grads[i, j]
    if u < n:  # summing duplicates can overflow float32
        for q in range(u):
            for j in range(dim):
                if not np.isfinite(sums[q, j]):
                    return rows[:0], sums[:0], 0, n
    return rows[:u], sums[:u], misses, -1
