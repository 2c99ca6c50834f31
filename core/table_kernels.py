"""Numba kernels of the PS embedding store (:mod:`.store`): hash index, exact LRU by stamps, lookups.

Index: open addressing, linear probing, slots of ``(key, row, stamp)``, 16 bytes (uint64, int32, uint32)
while rows fit int32, else 24; ``row < 0`` marks an empty slot. 3 slots per 2 allocated rows (load <= 2/3),
homes by multiply-shift; deletion shifts entries back (no tombstones). A hit reads one index line and one
vector row, and writes the recency stamp into the line it has just read. Rows (``emb``, ``state``) are
dense, ``0..live-1``: an eviction hands its row straight to the new id.

Exact LRU without a linked list: each id a training lookup touches gets the next tick of a per-table
clock as its slot's stamp (in id order), so LRU order is stamp order and a touch writes no neighbour.
Eviction reads a candidate list: the keys whose stamps are <= a threshold T, by stamp (about ``live /
8``, from one pass over the index). Every stamp given after that pass exceeds T, so the first listed key
whose slot still holds its listed stamp (neither touched nor evicted since) is exactly the least recently
used row; touched keys are skipped. The next list is built ahead, in steps, while the current one serves
(from half consumed): a threshold T from sampled stamps, then a scan of a bounded number of slots after
each training lookup (:func:`next_scan`; an eviction first collects the entries its deletion may shift
back across the scan's cursor, :func:`next_record_run`), then an LSD radix sort in bounded steps
(:func:`next_sort_step`). When the list runs out the kernel stops and :mod:`.store` swaps in the next
one (finishing what is left of it, if the lookups did not); only a small table, a sample that misses,
or a renumbering falls back to one rescan of the whole index (:func:`select_candidates`).
32-bit stamps are renumbered by rank (order kept) before the clock wraps, after ~4e9 touches.

While a checkpoint dump reads a snapshot of the table (:mod:`.store_snapshot`), ``lookup_train`` keeps
what the snapshot has yet to read, through ``cow_meta`` and the arrays beside it (all off when
``cow_meta`` is zero): a hit on an entry stamped before the snapshot's clock records its key and old
stamp by row (one compare on the line the probe read); an eviction records the victim's probe run
(the deletion may shift those entries back) and copies the victim's row aside before the new id takes it.

Lookups hash every id first, in a pass of their own, then probe the ids in order, each id's index lines
prefetched ``_DA`` ids ahead (insert, evict, stamp: every change, in id order), noting each id's row;
then a last pass copies the rows out, each prefetched ``_DB`` ids ahead (:func:`copy_rows`). A row
waiting to be copied is never evicted: it was stamped after the candidate pass, and the kernel copies
out what it resolved before returning for a rescan. numba's on-disk cache keys a kernel on its own file
only, so kernels that call each other live together here. The same holds for the kernels elsewhere that
inline this file's index functions (:func:`find_slot`, :func:`delete_slot`: the hot-row mirror, the
embedding worker's in-flight counts): clear their ``__pycache__`` too after changing those.
"""

from __future__ import annotations

import numba
import numpy as np
from persia_nats.core.optim import Float, Int, prefetch, prefetch_row

# meta[] slots: the table's mutable scalars, in one int64 array so kernels can update them.
LIVE, CLOCK, EVICTIONS, INSERTS, INDEX_MISS, GRAD_MISS, SALT, CAND_POS = range(8)
COUNTERS = {"evictions": EVICTIONS, "inserts": INSERTS, "index_miss_count": INDEX_MISS,
            "gradient_id_miss_count": GRAD_MISS, "admission_salt": SALT}
GROW, REFILL, COW = 1, 2, 3  # why a training lookup stopped early (COW: a live dump's pre-image block is full)
# cow_meta[] slots of a live dump (:mod:`.store_snapshot`); an all-zero cow_meta turns every hook off.
COW_SAVED, COW_BASE, SNAP_CLOCK, COW_LIVE = range(4)
# nxt_meta[] slots of the next candidate list, built ahead in steps (see EmbeddingTable._advance_next):
# entries collected, stamp limit + 1 (0: no build, hooks off), overflowed, radix pass (-1: still collecting),
# position in the pass, and the current list's last stamp (it holds every row stamped up to it: the next
# list collects only stamps above, or it would start with the current list's rows, gone by then)
NXT_N, NXT_LIMIT, NXT_OVER, NXT_PASS, NXT_POS, NXT_LOW = range(6)
# grow_meta[] slot: old index slots already copied into the doubled index being built ahead (0: none)
GROW_CURSOR = 0

SLOT32 = np.dtype([("key", np.uint64), ("row", np.int32), ("stamp", np.uint32)])
SLOT64 = np.dtype([("key", np.uint64), ("row", np.int64), ("stamp", np.uint64)])
STAMP_LIMIT = {SLOT32: 2**32 - 1, SLOT64: 2**63 - 1}  # the clock must stay below this
CAND_SHARE = 8  # a candidate scan lists about live / CAND_SHARE keys
_SAMPLE = 4096  # slots sampled to pick the candidate threshold

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SM1, _SM2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64 finaliser
_FM1, _FM2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)  # murmur3 fmix64
# Seeds keep the index hash, the initial values and admission independent of each other and of
# persia_nats.core.sharding (plain splitmix64): a replica's ids all share one shard residue and must not cluster.
_INDEX_SEED = np.uint64(0x5851F42D4C957F2D)
_INIT_SEED = np.uint64(0x2545F4914F6CDD1D)
_ADMIT_SEED = np.uint64(0xD1B54A32D192ED03)
_S11, _S27, _S30, _S31, _S32, _S33 = (np.uint64(s) for s in (11, 27, 30, 31, 32, 33))
_U32_MAX = 0xFFFFFFFF
_INV_2_53 = 1.0 / 9007199254740992.0
# Each id costs two dependent DRAM misses (index line, then vector), so the lookups are bound by how
# many misses are in flight. Twice the former distances (24, 12) measured 1.2-1.3x faster lookups on a
# 2M-row table (index and vectors well past L3); 64 / 32 measured no better than 48 / 24 (both when one
# pipeline probed an id _DA - _DB ids after prefetching its index lines and copied its vector _DB later).
_DA = 48  # ids ahead: prefetch the index lines of an id's probe
_DB = 24  # ids ahead: prefetch a row to copy (the lookups' copy pass), or an entry's target (scans, migrate)
_RING = 64  # ring buffers of per-id homes and rows (power of two > _DA)


def slot_count(rows: int) -> int:
    """Index slots for ``rows`` allocated rows (load <= 2/3; always at least one free slot)."""
    return rows + rows // 2 + 1


@numba.njit(cache=True, inline="always")
def _splitmix(z: Int) -> Int:
    z = (z ^ (z >> _S30)) * _SM1
    z = (z ^ (z >> _S27)) * _SM2
    return z ^ (z >> _S31)


@numba.njit(cache=True, inline="always")
def home_slot(key: Int, nslots: Int) -> Int:
    """The slot where ``key``'s probe run starts in an index of ``nslots`` slots."""
    h = key ^ _INDEX_SEED
    h = (h ^ (h >> _S33)) * _FM1
    h = (h ^ (h >> _S33)) * _FM2
    h ^= h >> _S33
    if nslots <= _U32_MAX:
        return np.int64(((h >> _S32) * np.uint64(nslots)) >> _S32)
    return np.int64(h % np.uint64(nslots))


@numba.njit(cache=True)
def find_rows(ids: np.ndarray, skey: np.ndarray, srow: np.ndarray) -> np.ndarray:
    """The row of each id, -1 where it is not stored (no recency change: a plain read)."""
    out = np.empty(ids.shape[0], np.int64)
    nslots = skey.shape[0]
    for i in range(ids.shape[0]):
        out[i] = probe(skey, srow, ids[i], home_slot(ids[i], nslots))[0]
    return out


@numba.njit(cache=True)
def home_slots(ids: np.ndarray, nslots: Int) -> np.ndarray:
    """:func:`home_slot` of each id. Lookups hash every id this way before any probe (8 bytes an id, for
    the call): a loop of the hash alone vectorizes, and the probe loop then carries fewer instructions per
    id while its misses are in flight: eval lookups measured 6-9% faster on a 10M-row table (Zipf and
    uniform ids)."""
    out = np.empty(ids.shape[0], np.int64)
    for i in range(ids.shape[0]):
        out[i] = home_slot(ids[i], nslots)
    return out


@numba.njit(cache=True, inline="always")
def probe(skey: np.ndarray, srow: np.ndarray, key: Int, s: Int) -> tuple[Int, Int]:
    """Probe from slot ``s``: (row of ``key`` or -1, its slot or the free slot where it would go).

    Hot loops index with unsigned ints where they can (here, and the row copies): numba adds a negative
    index wraparound to every signed index, and dropping those measured about 5% faster lookups."""
    nslots, u = np.uint64(skey.shape[0]), np.uint64(s)
    while True:
        r = np.int64(srow[u])
        if r < 0 or skey[u] == key:
            return r, np.int64(u)
        u += np.uint64(1)
        if u == nslots:
            u = np.uint64(0)


@numba.njit(cache=True, inline="always")
def prefetch_probe(skey: np.ndarray, s: Int) -> None:
    """Prefetch the index lines a probe from slot ``s`` reads: the line holding ``s`` and the two after it.

    A probe that reads past its prefetched lines waits for memory, and the ids behind it in the pipeline
    wait with it. At the index's top load (2/3) a key's run spans one line for 82% of keys, two for 14%
    and three or more for 4%; prefetching one line past the home line (as before) left those 4% to such
    waits. With two lines past it, training lookups on a full 10M-row table ran 1.05x (Zipf ids) and
    1.28x (uniform) as fast, eval lookups 1.08x and 1.29x (the two kernels in one process, turns
    shuffled). A third line more measured no better on Zipf ids."""
    prefetch(skey, s, 0)
    prefetch(skey, s, 64)
    prefetch(skey, s, 128)


@numba.njit(cache=True, inline="always")
def find_slot(skey: np.ndarray, srow: np.ndarray, key: Int) -> tuple[Int, Int]:
    """(row of ``key`` or -1, its slot or the free slot where it would go): :func:`probe` from its home.

    The index API the hot-row mirror and the embedding worker's in-flight counts share with the
    table: arrays ``skey`` (uint64) and ``srow`` (int64, or int32 here; < 0 empty) of
    :func:`slot_count` slots, an entry written as ``skey[s], srow[s] = key, row`` into the slot this
    returns, removed with :func:`delete_slot`."""
    return probe(skey, srow, key, home_slot(key, skey.shape[0]))


@numba.njit(cache=True)
def delete_slot(skey: np.ndarray, srow: np.ndarray, sstamp: np.ndarray, i: Int) -> None:
    """Empty slot ``i``, shifting back the entries of its probe run that may move."""
    nslots = skey.shape[0]
    j = i
    while True:
        j = j + 1 if j + 1 < nslots else 0
        if srow[j] < 0:
            break
        k = home_slot(skey[j], nslots)
        # The entry at j may fill the hole at i unless its home lies cyclically in (i, j].
        stays = (i < k <= j) if i <= j else (i < k or k <= j)
        if not stays:
            skey[i], srow[i], sstamp[i] = skey[j], srow[j], sstamp[j]
            i = j
    srow[i] = -1


@numba.njit(cache=True)
def snap_record_run(skey: np.ndarray, srow: np.ndarray, sstamp: np.ndarray, i: Int, snap_clock: Int,
                    mkey: np.ndarray, mstamp: np.ndarray) -> None:
    """Record, by row, the key and stamp of every entry of slot ``i``'s probe run stamped before ``snap_clock``.

    Called before :func:`delete_slot` while a live dump scans the index: the deletion may shift any of these
    entries back across the scan's cursor, where the scan would miss them."""
    nslots = skey.shape[0]
    j = i
    while srow[j] >= 0:
        if np.int64(sstamp[j]) < snap_clock and srow[j] < mkey.shape[0]:
            mkey[srow[j]], mstamp[srow[j]] = skey[j], sstamp[j]
        j = j + 1 if j + 1 < nslots else 0


@numba.njit(cache=True)
def snap_scan(skey: np.ndarray, srow: np.ndarray, sstamp: np.ndarray, start: Int, stop: Int, snap_clock: Int,
              mkey: np.ndarray, mstamp: np.ndarray) -> None:
    """Record, by row, key and stamp of the entries in slots ``start..stop-1`` stamped before ``snap_clock``.

    Rows lie at random: their lines are prefetched ``_DB`` slots ahead."""
    for s in range(start, stop):
        if s + _DB < stop and srow[s + _DB] >= 0:
            prefetch(mkey, srow[s + _DB], 0)
            prefetch(mstamp, srow[s + _DB], 0)
        r = srow[s]
        if r >= 0 and np.int64(sstamp[s]) < snap_clock and r < mkey.shape[0]:
            mkey[r], mstamp[r] = skey[s], sstamp[s]


@numba.njit(cache=True, inline="always")
def _next_add(key: Int, stamp: Int, nxt_meta: np.ndarray, nxt_keys: np.ndarray, nxt_stamps: np.ndarray) -> None:
    n = nxt_meta[NXT_N]
    if n == nxt_keys.shape[0]:
        nxt_meta[NXT_OVER] = 1
        return
    nxt_keys[n], nxt_stamps[n] = key, stamp
    nxt_meta[NXT_N] = n + 1


@numba.njit(cache=True)
def next_record_run(skey: np.ndarray, srow: np.ndarray, sstamp: np.ndarray, i: Int, nxt_meta: np.ndarray,
                    nxt_keys: np.ndarray, nxt_stamps: np.ndarray) -> None:
    """Collect the entries after slot ``i`` in its probe run stamped below the next list's limit: deleting
    slot ``i`` may shift them back across the build's cursor. A key collected twice is harmless: the
    eviction that meets it again finds it gone or restamped, and skips it."""
    nslots = skey.shape[0]
    low, limit = nxt_meta[NXT_LOW], nxt_meta[NXT_LIMIT]
    j = i + 1 if i + 1 < nslots else 0
    while srow[j] >= 0:
        if low < np.int64(sstamp[j]) < limit:
            _next_add(skey[j], sstamp[j], nxt_meta, nxt_keys, nxt_stamps)
        j = j + 1 if j + 1 < nslots else 0


@numba.njit(cache=True)
def next_scan(skey: np.ndarray, srow: np.ndarray, sstamp: np.ndarray, start: Int, stop: Int, nxt_meta: np.ndarray,
              nxt_keys: np.ndarray, nxt_stamps: np.ndarray) -> None:
    """Collect the entries of slots ``start..stop-1`` stamped below the next list's limit."""
    low, limit = nxt_meta[NXT_LOW], nxt_meta[NXT_LIMIT]
    for s in range(start, stop):
        if srow[s] >= 0 and low < np.int64(sstamp[s]) < limit:
            _next_add(skey[s], sstamp[s], nxt_meta, nxt_keys, nxt_stamps)


@numba.njit(cache=True)
def sample_threshold(srow: np.ndarray, sstamp: np.ndarray, clock: Int, live: Int, want: Int) -> Int:
    """The stamp below which about ``want`` of the ``live`` rows lie, from ~_SAMPLE sampled slots (as
    :func:`select_candidates` picks it), or -1 when too few sampled slots were occupied."""
    sample = np.empty(_SAMPLE, np.uint64)
    m = 0
    z = np.uint64(clock)
    for _ in range(_SAMPLE):
        z += _GOLDEN
        s = home_slot(_splitmix(z), srow.shape[0])
        if srow[s] >= 0:
            sample[m] = sstamp[s]
            m += 1
    if m < _SAMPLE // 4:
        return -1
    sample = np.sort(sample[:m])
    return np.int64(sample[min(m - 1, want * m // live)])


@numba.njit(cache=True)
def next_sort_step(keys: np.ndarray, stamps: np.ndarray, keys2: np.ndarray, stamps2: np.ndarray, counts: np.ndarray,
                   nxt_meta: np.ndarray, budget: Int) -> bool:
    """Advance an LSD radix sort of ``stamps`` (with ``keys``) by about ``budget`` elements; True once sorted.
    16 bits a digit, as many digits as the limit needs; each digit counts, then scatters from one pair of
    arrays into the other (``keys``/``stamps`` first): after an odd number of digits the result lies in
    ``keys2``/``stamps2`` (:func:`sort_digits`). Resumable: the phase and the position live in ``nxt_meta``."""
    n, mask = nxt_meta[NXT_N], np.uint64(0xFFFF)
    phases = 2 * sort_digits(nxt_meta[NXT_LIMIT])
    done = 0
    while done < budget:
        p, pos = nxt_meta[NXT_PASS], nxt_meta[NXT_POS]
        if p >= phases:
            return True
        shift = np.uint64(16 * (p // 2))
        src_k, src_s, dst_k, dst_s = (keys, stamps, keys2, stamps2) if (p // 2) % 2 == 0 else \
            (keys2, stamps2, keys, stamps)
        stop = min(n, pos + budget - done)
        if p % 2 == 0:  # counting
            if pos == 0:
                counts[:] = 0
            for k in range(pos, stop):
                counts[(np.uint64(src_s[k]) >> shift) & mask] += 1
            if stop == n:
                total = 0
                for d in range(counts.shape[0]):
                    total, counts[d] = total + counts[d], total
        else:  # scattering
            for k in range(pos, stop):
                digit = (np.uint64(src_s[k]) >> shift) & mask
                dst_k[counts[digit]], dst_s[counts[digit]] = src_k[k], src_s[k]
                counts[digit] += 1
        done += stop - pos + 1
        if stop == n:
            nxt_meta[NXT_PASS], nxt_meta[NXT_POS] = p + 1, 0
        else:
            nxt_meta[NXT_POS] = stop
    return bool(nxt_meta[NXT_PASS] >= phases)


@numba.njit(cache=True)
def sort_digits(limit: Int) -> Int:
    """16-bit digits :func:`next_sort_step` sorts stamps below ``limit`` by."""
    digits = 0
    while digits < 4 and (np.uint64(limit) >> np.uint64(16 * digits)) > 0:
        digits += 1
    return digits


@numba.njit(cache=True)
def migrate(okey: np.ndarray, orow: np.ndarray, ostamp: np.ndarray, start: Int, stop: Int, skey: np.ndarray,
            srow: np.ndarray, sstamp: np.ndarray) -> None:
    """Insert the entries of old slots ``start..stop-1`` into the new index (cleared beforehand)."""
    nslots = skey.shape[0]
    for s in range(start, stop):
        if orow[s] >= 0:
            if s + _DB < stop and orow[s + _DB] >= 0:
                prefetch(skey, home_slot(okey[s + _DB], nslots), 0)
            t = probe(skey, srow, okey[s], home_slot(okey[s], nslots))[1]
            skey[t], srow[t], sstamp[t] = okey[s], orow[s], ostamp[s]


@numba.njit(cache=True)
def rehash(okey: np.ndarray, orow: np.ndarray, ostamp: np.ndarray, skey: np.ndarray, srow: np.ndarray,
           sstamp: np.ndarray) -> None:
    """Insert every entry of the old index (okey, orow, ostamp) into the new, empty one."""
    nslots = skey.shape[0]
    srow[:] = -1
    ahead = np.zeros(_RING, np.int64)
    for s in range(-_DA, okey.shape[0]):
        a = s + _DA
        if a < okey.shape[0] and orow[a] >= 0:
            ahead[a & (_RING - 1)] = home_slot(okey[a], nslots)
            prefetch(skey, ahead[a & (_RING - 1)], 0)
        if s >= 0 and orow[s] >= 0:
            t = probe(skey, srow, okey[s], ahead[s & (_RING - 1)])[1]
            skey[t], srow[t], sstamp[t] = okey[s], orow[s], ostamp[s]


@numba.njit(cache=True)
def build_index(keys: np.ndarray, skey: np.ndarray, srow: np.ndarray, sstamp: np.ndarray) -> Int:
    """Index keys[r] -> row r with stamp r; return the first position whose key repeats an earlier one, else -1."""
    srow[:] = -1
    for r in range(keys.shape[0]):
        found, s = probe(skey, srow, keys[r], home_slot(keys[r], skey.shape[0]))
        if found >= 0:
            return r
        skey[s], srow[s], sstamp[s] = keys[r], r, r
    return -1


@numba.njit(cache=True)
def lookup_eval(ids: np.ndarray, skey: np.ndarray, srow: np.ndarray, emb: np.ndarray, meta: np.ndarray,
                out: np.ndarray) -> None:
    n = ids.shape[0]
    homes = home_slots(ids, skey.shape[0])
    found = np.empty(n, np.int64)
    misses = 0
    for i in range(-_DA, n):
        a = i + _DA
        if a < n:
            prefetch_probe(skey, homes[a])
        if i >= 0:
            r = probe(skey, srow, ids[i], homes[i])[0]
            found[i] = r
            misses += r < 0
    copy_rows(found, n, emb, out)
    meta[INDEX_MISS] += misses


@numba.njit(cache=True)
def copy_rows(found: np.ndarray, n: Int, emb: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = emb[found[i]]`` for ``i < n`` (zeros where ``found[i] < 0``), each row prefetched ``_DB``
    ahead: the lookups' second pass, once every id is resolved.

    Two passes, not one pipeline: probing (index lines only), then copying (vector rows only), each pass's
    random reads on one array. On a full table of 5e7 rows of dim 16 (1.2 GB of index, 3.2 GB of vectors:
    more 2 MiB pages than a Zen 3 core's second-level TLB holds, one candidate cause) the one pipeline that
    interleaved them ran slower than the two passes' times added up, and the two passes measured faster at
    every size: the store's lookups before and after, same process, turns shuffled, training 1.09x /
    1.19x / 1.14x as fast at 1e6 / 1e7 / 5e7 rows, eval 1.02x / 1.10x / 1.17x."""
    dim = emb.shape[1]
    for i in range(n):
        if i + _DB < n and found[i + _DB] >= 0:
            prefetch_row(emb, found[i + _DB])
        r, ui = found[i], np.uint64(i)
        if r >= 0:
            ur = np.uint64(r)
            for j in range(dim):
                out[ui, j] = emb[ur, j]
        else:
            for j in range(dim):
                out[ui, j] = 0.0


@numba.njit(cache=True, inline="always")
def _admitted(key: Int, salt: Int, admit_p: Float) -> bool:
    """Whether a training lookup's miss of ``key`` inserts it (``admit_p`` 1: always; else a draw seeded by the
    key and the salt: the table's count of training lookups)."""
    return bool(admit_p >= 1.0 or np.float64(_splitmix((key ^ _ADMIT_SEED) + salt) >> _S11) * _INV_2_53 < admit_p)


@numba.njit(cache=True, inline="always")
def _new_row(key: Int, r: Int, s: Int, clock: Int, skey: np.ndarray, srow: np.ndarray, sstamp: np.ndarray,
             emb: np.ndarray, state: np.ndarray, lo: Float, hi: Float, fill: Float, gkey: np.ndarray,
             grow_: np.ndarray, gstamp: np.ndarray, copied: Int) -> None:
    """Enter ``key`` in free slot ``s`` with row ``r`` and stamp ``clock`` (and in the doubled index built
    ahead, if ``s`` lies behind its copy cursor ``copied``), and initialise the row: its vector uniform in
    ``[lo, hi]`` from a splitmix64 stream seeded by the key alone, its optimizer state ``fill``."""
    skey[s], srow[s], sstamp[s] = key, r, clock
    if s < copied:  # behind the doubled index's copy: insert it there too
        t = probe(gkey, grow_, key, home_slot(key, gkey.shape[0]))[1]
        gkey[t], grow_[t], gstamp[t] = key, r, clock
    hi32 = np.float32(hi)
    z = _splitmix(key ^ _INIT_SEED)
    for j in range(emb.shape[1]):
        z += _GOLDEN
        u = np.float64(_splitmix(z) >> _S11) * _INV_2_53
        emb[r, j] = min(np.float32(lo + (hi - lo) * u), hi32)
    for j in range(state.shape[1]):
        state[r, j] = fill


@numba.njit(cache=True)
def _insert(key: Int, home: Int, skey: np.ndarray, srow: np.ndarray, sstamp: np.ndarray, emb: np.ndarray,
            state: np.ndarray, cand_keys: np.ndarray, cand_stamps: np.ndarray, clock: Int, live: Int, cpos: Int,
            capacity: Int, salt: Int, admit_p: Float, lo: Float, hi: Float, fill: Float, mkey: np.ndarray,
            mstamp: np.ndarray, cow_pos: np.ndarray, cow_emb: np.ndarray, cow_state: np.ndarray,
            cow_meta: np.ndarray, nxt_keys: np.ndarray, nxt_stamps: np.ndarray, nxt_meta: np.ndarray,
            gkey: np.ndarray, grow_: np.ndarray, gstamp: np.ndarray, grow_meta: np.ndarray
            ) -> tuple[Int, Int, Int, Int, Int]:
    """A training lookup's miss: admit ``key`` or not; insert it (evicting the LRU row when full) with stamp
    ``clock``. Returns (its row or -1, 0 or why the kernel must stop, live, cpos, rows evicted). Kept out
    of the lookup loop, whose hits run about 5% faster without it; the loop inserts inline only the common
    miss, a free row below capacity (see :func:`_lookup_train`)."""
    if not _admitted(key, salt, admit_p):
        return -1, 0, live, cpos, 0  # refused: reads as zeros
    nslots, evicted = skey.shape[0], 0
    if live < capacity:
        if live == emb.shape[0]:
            return -1, GROW, live, cpos, 0
        r, s = live, probe(skey, srow, key, home)[1]
        live += 1
    else:
        r = -1
        while cpos < cand_keys.shape[0]:  # the first candidate still holding its listed stamp is the LRU row
            if cpos + 4 < cand_keys.shape[0]:
                prefetch(skey, home_slot(cand_keys[cpos + 4], nslots), 0)
            ck, cs = cand_keys[cpos], cand_stamps[cpos]
            cpos += 1
            q, qs = probe(skey, srow, ck, home_slot(ck, nslots))
            if q >= 0 and np.uint64(sstamp[qs]) == cs:
                if q < cow_meta[COW_LIVE] and cow_pos[q] == 0:  # a live dump still needs this row's values
                    at = cow_meta[COW_SAVED] - cow_meta[COW_BASE]
                    if at >= cow_emb.shape[0]:
                        return -1, COW, live, cpos - 1, 0  # the candidate is examined again on resume
                    cow_emb[at], cow_state[at] = emb[q], state[q]
                    cow_meta[COW_SAVED] += 1
                    cow_pos[q] = cow_meta[COW_SAVED]
                if cow_meta[SNAP_CLOCK] > 0:
                    snap_record_run(skey, srow, sstamp, qs, cow_meta[SNAP_CLOCK], mkey, mstamp)
                if nxt_meta[NXT_LIMIT] > 0 and nxt_meta[NXT_PASS] < 0:  # the next list is being collected
                    next_record_run(skey, srow, sstamp, qs, nxt_meta, nxt_keys, nxt_stamps)
                delete_slot(skey, srow, sstamp, qs)
                r, evicted = q, 1
                break
        if r < 0:
            return -1, REFILL, live, cpos, 0
        s = probe(skey, srow, key, home)[1]
    _new_row(key, r, s, clock, skey, srow, sstamp, emb, state, lo, hi, fill, gkey, grow_, gstamp,
             grow_meta[GROW_CURSOR])
    return r, 0, live, cpos, evicted


@numba.njit(cache=True)
def lookup_train(ids: np.ndarray, start: Int, skey: np.ndarray, srow: np.ndarray, sstamp: np.ndarray, emb: np.ndarray,
                 state: np.ndarray, meta: np.ndarray, cand_keys: np.ndarray, cand_stamps: np.ndarray, capacity: Int,
                 lo: Float, hi: Float, admit_p: Float, fill: Float, out: np.ndarray, mkey: np.ndarray,
                 mstamp: np.ndarray, cow_pos: np.ndarray, cow_emb: np.ndarray, cow_state: np.ndarray,
                 cow_meta: np.ndarray, nxt_keys: np.ndarray, nxt_stamps: np.ndarray, nxt_meta: np.ndarray,
                 gkey: np.ndarray, grow_: np.ndarray, gstamp: np.ndarray, grow_meta: np.ndarray) -> tuple[Int, Int]:
    """Look up ids[start:], inserting admitted unseen ids and stamping every touched row in id order.

    Returns (-1, 0) when done, or (position, GROW / REFILL / COW) where it stopped because the row arrays
    are full below capacity, the eviction candidates ran out, or a live dump's pre-image block is full;
    everything before it is done. ``mkey`` .. ``cow_meta`` are a live dump's hooks (:mod:`.store_snapshot`):
    before a touch or an eviction changes what the dump has yet to read, the old key, stamp or row is kept.
    """
    stop, reason = _lookup_train(ids[start:], skey, srow, sstamp, emb, state, meta, cand_keys, cand_stamps, capacity,
                                 lo, hi, admit_p, fill, out[start:], mkey, mstamp, cow_pos, cow_emb, cow_state,
                                 cow_meta, nxt_keys, nxt_stamps, nxt_meta, gkey, grow_, gstamp, grow_meta)
    return (stop + start if stop >= 0 else stop), reason


@numba.njit(cache=True)
def _lookup_train(ids: np.ndarray, skey: np.ndarray, srow: np.ndarray, sstamp: np.ndarray, emb: np.ndarray,
                  state: np.ndarray, meta: np.ndarray, cand_keys: np.ndarray, cand_stamps: np.ndarray, capacity: Int,
                  lo: Float, hi: Float, admit_p: Float, fill: Float, out: np.ndarray, mkey: np.ndarray,
                  mstamp: np.ndarray, cow_pos: np.ndarray, cow_emb: np.ndarray, cow_state: np.ndarray,
                  cow_meta: np.ndarray, nxt_keys: np.ndarray, nxt_stamps: np.ndarray, nxt_meta: np.ndarray,
                  gkey: np.ndarray, grow_: np.ndarray, gstamp: np.ndarray, grow_meta: np.ndarray
                  ) -> tuple[Int, Int]:
    """:func:`lookup_train` from the first id. Its loop bounds are constants: with the resume position in
    them (``range(start - _DA, n)``, ``start <= b``) training lookups measured 6-13% slower."""
    n = ids.shape[0]
    salt = np.uint64(meta[SALT]) * _GOLDEN
    clock, live, cpos = meta[CLOCK], meta[LIVE], meta[CAND_POS]
    snap_clock = cow_meta[SNAP_CLOCK]
    copied = grow_meta[GROW_CURSOR]
    inserts = evictions = misses = 0
    row_limit = emb.shape[0]
    homes = home_slots(ids, skey.shape[0])
    found = np.empty(n, np.int64)
    stop, reason = -1, 0
    for i in range(-_DA, n):
        a = i + _DA
        if a < n:
            prefetch_probe(skey, homes[a])
        if i >= 0:
            r, s = probe(skey, srow, ids[i], homes[i])
            if r >= 0:
                if np.int64(sstamp[np.uint64(s)]) < snap_clock and r < mkey.shape[0]:  # first touch since T0
                    mkey[r], mstamp[r] = ids[i], sstamp[np.uint64(s)]
                if s < copied:  # the doubled index built ahead holds a copy of this entry
                    gstamp[probe(gkey, grow_, ids[i], home_slot(ids[i], gkey.shape[0]))[1]] = clock
                sstamp[np.uint64(s)] = clock
                clock += 1
            elif live < capacity and live < row_limit:
                # the common miss, a free row below capacity, inline: through the call to _insert (30
                # arguments) a training lookup took 352 ns of CPU a new id, inline 139, where ids held took
                # 142-166 (benchmarks/bench_inserts.py, 2M rows committed ahead). Evictions and the stop
                # to grow the rows still go through _insert
                misses += 1
                if _admitted(ids[i], salt, admit_p):
                    r = live
                    live += 1
                    _new_row(ids[i], r, s, clock, skey, srow, sstamp, emb, state, lo, hi, fill, gkey, grow_,
                             gstamp, copied)
                    clock += 1
                    inserts += 1
                else:
                    r = -1  # refused: reads as zeros
            else:
                r, why, live, cpos, ev = _insert(ids[i], homes[i], skey, srow, sstamp, emb, state, cand_keys,
                                                 cand_stamps, clock, live, cpos, capacity, salt, admit_p, lo, hi,
                                                 fill, mkey, mstamp, cow_pos, cow_emb, cow_state, cow_meta,
                                                 nxt_keys, nxt_stamps, nxt_meta, gkey, grow_, gstamp, grow_meta)
                if why:
                    stop, reason = i, why  # resolved and to be copied: 0..stop-1
                    break
                misses += 1
                if r >= 0:
                    clock += 1
                    inserts += 1
                    evictions += ev
            found[i] = r
    copy_rows(found, stop if stop >= 0 else n, emb, out)
    meta[CLOCK], meta[LIVE], meta[CAND_POS] = clock, live, cpos
    meta[INSERTS] += inserts
    meta[EVICTIONS] += evictions
    meta[INDEX_MISS] += misses
    return stop, reason


@numba.njit(cache=True)
def _radix_order(vals: np.ndarray) -> np.ndarray:
    """The permutation sorting ``vals`` (unsigned) ascending: LSD radix, 16 bits a pass, as many passes as
    ``max - min`` needs (two for 32-bit stamps); several times faster than a comparison argsort here."""
    n = vals.shape[0]
    idx = np.arange(n)
    if n < 2:
        return idx
    lo = np.uint64(vals.min())
    span = np.uint64(vals.max()) - lo
    key = np.empty(n, np.uint64)
    for k in range(n):
        key[k] = np.uint64(vals[k]) - lo
    key2, idx2 = np.empty_like(key), np.empty_like(idx)
    counts = np.empty(1 << 16, np.int64)
    digit = np.uint64(0xFFFF)
    shift = np.uint64(0)
    while shift < 64 and (span >> shift) > 0:
        counts[:] = 0
        for k in range(n):
            counts[(key[k] >> shift) & digit] += 1
        total = 0
        for d in range(1 << 16):
            total, counts[d] = total + counts[d], total
        for k in range(n):
            d = (key[k] >> shift) & digit
            key2[counts[d]], idx2[counts[d]] = key[k], idx[k]
            counts[d] += 1
        key, key2, idx, idx2 = key2, key, idx2, idx
        shift += np.uint64(16)
    return idx


@numba.njit(cache=True)
def _collect(skey: np.ndarray, srow: np.ndarray, sstamp: np.ndarray, limit: Int,
             room: Int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Keys and stamps of the live rows whose stamps are <= limit, by stamp, and False; or, past ``room`` of
    them, nothing and True."""
    ck = np.empty(room, np.uint64)
    cs = np.empty(room, np.uint64)
    k = 0
    for s in range(srow.shape[0]):
        if srow[s] >= 0 and np.uint64(sstamp[s]) <= limit:
            if k == room:
                return ck[:0], cs[:0], True
            ck[k], cs[k] = skey[s], sstamp[s]
            k += 1
    order = _radix_order(cs[:k])
    return ck[:k][order], cs[:k][order], False


@numba.njit(cache=True)
def select_candidates(skey: np.ndarray, srow: np.ndarray, sstamp: np.ndarray, clock: Int, live: Int,
                      want: Int) -> tuple[np.ndarray, np.ndarray]:
    """Keys (and stamps) of the live rows whose stamps are <= T, by stamp, with T chosen so that about
    ``want`` are listed (at least 1). T is the matching quantile of the stamps of ~_SAMPLE sampled slots, so
    one pass over the index collects them. Small tables, or a sample that misses by 2x (practically never:
    a full table fills 2/3 of its slots, so ~2700 stamps are sampled), sort every live row instead."""
    if live >= 1 << 16:
        limit = sample_threshold(srow, sstamp, clock, live, want)
        if limit >= 0:
            ck, cs, full = _collect(skey, srow, sstamp, np.uint64(limit), 2 * want)
            if not full and ck.shape[0] > 0:
                return ck, cs
    ck, cs, _ = _collect(skey, srow, sstamp, np.uint64(clock), live)
    return ck[:want].copy(), cs[:want].copy()


@numba.njit(cache=True)
def lru_slots(srow: np.ndarray, sstamp: np.ndarray) -> np.ndarray:
    """Occupied slots, least recently used first."""
    occupied = np.empty(srow.shape[0], np.int64)
    n = 0
    for s in range(srow.shape[0]):
        if srow[s] >= 0:
            occupied[n] = s
            n += 1
    occupied = occupied[:n]
    out: np.ndarray = occupied[_radix_order(sstamp[occupied])]
    return out


@numba.njit(cache=True)
def renumber_stamps(srow: np.ndarray, sstamp: np.ndarray) -> Int:
    """Replace stamps by their ranks 0..live-1 (same order); return the new clock."""
    slots = lru_slots(srow, sstamp)
    for k in range(slots.shape[0]):
        sstamp[slots[k]] = k
    return slots.shape[0]


@numba.njit(cache=True)
def gather_grads(ids: np.ndarray, grads: np.ndarray, skey: np.ndarray,
                 srow: np.ndarray) -> tuple[np.ndarray, np.ndarray, Int, Int]:
    """Sum the gradients of each stored id: (rows, sums, misses, first non-finite position or -1). Index
    slots are prefetched ``_DA`` ids ahead; a small local hash of rows finds duplicates."""
    n, dim = grads.shape
    for i in range(n):
        for j in range(dim):
            if not np.isfinite(grads[i, j]):
                return np.empty(0, np.int64), np.empty((0, dim), np.float32), 0, i
    bits = 1
    while (1 << bits) < 2 * n:
        bits += 1
    mask, nslots, ring = (1 << bits) - 1, skey.shape[0], _RING - 1
    local = np.full(1 << bits, -1, np.int32)  # row -> position in rows/sums
    rows = np.empty(n, np.int64)
    sums = np.empty((n, dim), np.float32)
    homes = np.empty(_RING, np.int64)
    u = misses = 0
    for i in range(-_DA, n):
        a = i + _DA
        if a < n:
            homes[a & ring] = home_slot(ids[a], nslots)
            prefetch_probe(skey, homes[a & ring])
        if i < 0:
            continue
        r = probe(skey, srow, ids[i], homes[i & ring])[0]
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
