"""The PS's embedding storage: capacity-bounded (exact LRU) tables of float32 rows in flat arrays.

One :class:`EmbeddingTable` holds every row of one embedding width in a handful of numpy arrays, never
a Python object per row:

- ``recs``: per row a 16-byte record (24 beyond 2**31 rows) of its uint64 key and the ``prev``/``next``
  links of an intrusive doubly linked LRU list (head = least recently used). Key and links share a
  cache line, so the probe that checks a key also fetches the links a training lookup rewrites.
- ``emb`` (float32, ``dim`` wide) and ``state`` (the optimizer's float32 columns), by row number.
  Rows are always dense (``0..len-1``): an eviction hands its row straight to the new id.
- ``index``: open addressing with linear probing; slots hold row numbers only (a probe compares
  ``keys[row]``, so keys are not stored twice). It has twice as many slots as the row arrays have
  rows (load <= 0.5) and maps hashes onto slots by multiply-shift, so its size need not be a power
  of two. Deletion shifts entries back, so no tombstones build up.

The row arrays start at ``initial_rows`` and double up to ``capacity``; the index is rebuilt at each
growth. Large arrays ask for transparent huge pages (random rows over gigabytes otherwise miss the TLB
on nearly every access), and the kernels prefetch the rows of ids a few places ahead so the DRAM
misses of many ids overlap.

Each public call runs one numba kernel; an update runs two (gather-and-sum here, then the optimizer
kernel of :mod:`.optim`), kept apart because numba's on-disk cache does not notice edits to a kernel
in another module.
"""

from __future__ import annotations

import mmap
from typing import Any

import numba
import numpy as np

from common.errors import BadRequest, ConfigError, Conflict
from common.optim_config import AdagradConfig, AdamConfig, EmbeddingHyperparams, OptimizerConfig, SGDConfig
from services.embedding_ps import optim
from services.embedding_ps.optim import prefetch, prefetch_row

__all__ = ["EmbeddingStore", "EmbeddingTable"]

# meta[] slots: the table's mutable scalars, in one int64 array so kernels can update them.
_LIVE, _HEAD, _TAIL, _EVICTIONS, _INSERTS, _INDEX_MISS, _GRAD_MISS, _SALT = range(8)
_COUNTERS = {"evictions": _EVICTIONS, "inserts": _INSERTS, "index_miss_count": _INDEX_MISS,
             "gradient_id_miss_count": _GRAD_MISS, "admission_salt": _SALT}

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
_BLOCK = 16  # ids per prefetch stage while resolving ids to rows
_AHEAD = 16  # how many ids ahead row vectors are prefetched
_REC32 = np.dtype([("key", np.uint64), ("prev", np.int32), ("next", np.int32)])
_REC64 = np.dtype([("key", np.uint64), ("prev", np.int64), ("next", np.int64)])
_STATE_KINDS = ("none", "sgd_momentum", "adagrad", "adagrad_shared", "adam")


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
def _probe(keys, index, key, s):
    """Probe from slot ``s``: (row of ``key`` or -1, its slot or the free slot where it would go)."""
    nslots = index.shape[0]
    while True:
        r = np.int64(index[s])
        if r < 0 or keys[r] == key:
            return r, s
        s += 1
        if s == nslots:
            s = 0


@numba.njit(cache=True, inline="always")
def _find(keys, index, key):
    return _probe(keys, index, key, _home(key, index.shape[0]))


@numba.njit(cache=True)
def _resolve(ids, keys, index):
    """Row of each id, or -1. Prefetches index slots two blocks ahead and the rows they name one block
    ahead, so the DRAM misses of many ids overlap instead of queueing behind each other."""
    n = ids.shape[0]
    homes = _index_homes(ids, index.shape[0])
    rows = np.empty(n, np.int64)
    for b in range(-2 * _BLOCK, n, _BLOCK):
        for i in range(max(b + 2 * _BLOCK, 0), min(b + 3 * _BLOCK, n)):
            prefetch(index, homes[i], 0)
        for i in range(max(b + _BLOCK, 0), min(b + 2 * _BLOCK, n)):
            r = index[homes[i]]
            if r >= 0:
                prefetch(keys, r, 0)
        for i in range(max(b, 0), min(b + _BLOCK, n)):
            rows[i] = _probe(keys, index, ids[i], homes[i])[0]
    return rows


@numba.njit(cache=True, inline="always")
def _prefetch_rows(rows, i, emb, keys, prev, nxt, links):
    """Prefetch the vector of rows[i + _AHEAD] and, with ``links``, the LRU neighbours of rows[i + _AHEAD // 2]."""
    n = rows.shape[0]
    if i + _AHEAD < n and rows[i + _AHEAD] >= 0:
        prefetch_row(emb, rows[i + _AHEAD])
    if links and i + _AHEAD // 2 < n:
        r = rows[i + _AHEAD // 2]
        if r >= 0:
            prefetch(keys, prev[r], 0)
            prefetch(keys, nxt[r], 0)


@numba.njit(cache=True)
def _index_remove(keys, index, row):
    nslots = index.shape[0]
    i = _home(keys[row], nslots)
    while index[i] != row:
        i = i + 1 if i + 1 < nslots else 0
    j = i
    while True:
        j = j + 1 if j + 1 < nslots else 0
        q = index[j]
        if q < 0:
            break
        k = _home(keys[q], nslots)
        # The entry at j may fill the hole at i unless its home lies cyclically in (i, j].
        stays = (i < k <= j) if i <= j else (i < k or k <= j)
        if not stays:
            index[i] = q
            i = j
    index[i] = -1


@numba.njit(cache=True)
def _rebuild_index(keys, live, index):
    """Index rows 0..live-1; return the first row whose key repeats an earlier one, else -1."""
    index[:] = -1
    for r in range(live):
        found, s = _find(keys, index, keys[r])
        if found >= 0:
            return r
        index[s] = r
    return -1


@numba.njit(cache=True, inline="always")
def _unlink(prev, nxt, meta, r):
    p, n = prev[r], nxt[r]
    if p >= 0:
        nxt[p] = n
    else:
        meta[_HEAD] = n
    if n >= 0:
        prev[n] = p
    else:
        meta[_TAIL] = p


@numba.njit(cache=True, inline="always")
def _push_back(prev, nxt, meta, r):
    t = meta[_TAIL]
    prev[r] = t
    nxt[r] = -1
    if t >= 0:
        nxt[t] = r
    else:
        meta[_HEAD] = r
    meta[_TAIL] = r


@numba.njit(cache=True)
def _lookup_train(ids, start, keys, emb, state, prev, nxt, index, meta, capacity, lo, hi, admit_p, fill, out):
    """Look up ids[start:], inserting admitted unseen ids; return where it stopped for growth, or -1."""
    dim = emb.shape[1]
    hi32 = np.float32(hi)
    salt = np.uint64(meta[_SALT]) * _GOLDEN
    rows = _resolve(ids[start:], keys, index)
    for k in range(rows.shape[0]):
        _prefetch_rows(rows, k, emb, keys, prev, nxt, True)
        i = start + k
        key = ids[i]
        r, slot = rows[k], -1
        if r < 0 or keys[r] != key:  # an earlier id in this call inserted it, or evicted it
            r, slot = _find(keys, index, key)
        if r >= 0:
            if r != meta[_TAIL]:
                _unlink(prev, nxt, meta, r)
                _push_back(prev, nxt, meta, r)
        else:
            admitted = admit_p >= 1.0 or np.float64(_splitmix((key ^ _ADMIT_SEED) + salt) >> _S11) * _INV_2_53 < admit_p
            live = meta[_LIVE]
            if admitted and live < capacity and live == keys.shape[0]:
                return i
            meta[_INDEX_MISS] += 1
            if not admitted:
                out[i, :] = 0.0
                continue
            if live < capacity:
                r = live
                meta[_LIVE] = live + 1
            else:
                r = meta[_HEAD]
                _unlink(prev, nxt, meta, r)
                _index_remove(keys, index, r)
                meta[_EVICTIONS] += 1
                _, slot = _find(keys, index, key)  # the removal may have moved the free slot
            index[slot] = r
            keys[r] = key
            _push_back(prev, nxt, meta, r)
            meta[_INSERTS] += 1
            z = _splitmix(key ^ _INIT_SEED)
            for j in range(dim):
                z += _GOLDEN
                u = np.float64(_splitmix(z) >> _S11) * _INV_2_53
                emb[r, j] = min(np.float32(lo + (hi - lo) * u), hi32)
            for j in range(state.shape[1]):
                state[r, j] = fill
        for j in range(dim):
            out[i, j] = emb[r, j]
    return -1


@numba.njit(cache=True)
def _lookup_eval(ids, keys, emb, prev, nxt, index, meta, out):
    rows = _resolve(ids, keys, index)
    for i in range(ids.shape[0]):
        _prefetch_rows(rows, i, emb, keys, prev, nxt, False)
        r = rows[i]
        if r >= 0:
            for j in range(emb.shape[1]):
                out[i, j] = emb[r, j]
        else:
            meta[_INDEX_MISS] += 1
            out[i, :] = 0.0


@numba.njit(cache=True)
def _gather_grads(ids, grads, keys, index):
    """Sum the gradients of each stored id: (rows, sums, misses, first non-finite position or -1)."""
    n, dim = grads.shape
    for i in range(n):
        for j in range(dim):
            if not np.isfinite(grads[i, j]):
                return np.empty(0, np.int64), np.empty((0, dim), np.float32), 0, i
    found = _resolve(ids, keys, index)
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


@numba.njit(cache=True)
def _lru_order(nxt, meta):
    order = np.empty(meta[_LIVE], np.int64)
    r = meta[_HEAD]
    for i in range(order.shape[0]):
        order[i] = r
        r = nxt[r]
    return order


_HUGE = 2 << 20


def _empty(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """np.empty, but 4 MiB and up come from a private anonymous mapping advised to use huge pages
    (transparent huge pages in ``madvise`` mode, a common default, give them only when asked).
    Pages are committed when first written, as with np.empty."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < 2 * _HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    buf = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(buf, np.uint8)
    skip = -raw.ctypes.data % _HUGE
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)


def _state_kind(cfg: OptimizerConfig | None) -> str:
    if isinstance(cfg, SGDConfig) and cfg.momentum > 0:
        return "sgd_momentum"
    if isinstance(cfg, AdagradConfig):
        return "adagrad_shared" if cfg.vectorwise_shared else "adagrad"
    return "adam" if isinstance(cfg, AdamConfig) else "none"


def _kind_width(kind: str, dim: int) -> int:
    return {"none": 0, "sgd_momentum": dim, "adagrad": dim, "adagrad_shared": 1, "adam": 2 * dim + 1}[kind]


def _check_ids(ids: Any) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        what = f"{ids.dtype} array of shape {ids.shape}" if isinstance(ids, np.ndarray) else type(ids).__name__
        raise BadRequest(f"ids must be a 1-D uint64 array, got {what}")
    return np.ascontiguousarray(ids)


def _check_grads(grads: Any, n: int, dim: int | None) -> np.ndarray:
    if not isinstance(grads, np.ndarray) or grads.dtype.kind != "f" or grads.ndim != 2:
        what = f"{grads.dtype} array of shape {grads.shape}" if isinstance(grads, np.ndarray) else type(grads).__name__
        raise BadRequest(f"gradients must be a 2-D float array, got {what}")
    if grads.shape[0] != n or (dim is not None and grads.shape[1] != dim):
        raise BadRequest(f"gradients must have shape ({n}, {dim if dim is not None else 'dim'}), got {grads.shape}")
    if grads.dtype == np.float32:
        return np.ascontiguousarray(grads)
    with np.errstate(over="ignore"):  # float64 beyond float32 range becomes inf, refused as non-finite
        return grads.astype(np.float32, order="C")


def _check_optimizer(cfg: Any) -> OptimizerConfig:
    if not isinstance(cfg, (SGDConfig, AdagradConfig, AdamConfig)):
        raise ConfigError(f"not an embedding optimizer config: {type(cfg).__name__}")
    return cfg


def _check_hyper(hyper: Any) -> EmbeddingHyperparams:
    if not isinstance(hyper, EmbeddingHyperparams):
        raise ConfigError(f"hyper must be EmbeddingHyperparams, got {type(hyper).__name__}")
    return hyper


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


class EmbeddingTable:
    """All rows of one embedding width, with exact LRU eviction beyond ``capacity`` rows.

    Args:
        dim: Embedding width.
        capacity: Maximum number of rows; inserting beyond it evicts the least recently used row.
        optimizer: The embedding optimizer, or None until :meth:`set_optimizer` (updates refuse until then).
        hyper: Initialisation range, admission probability and weight bound.
        initial_rows: Rows allocated up front; the arrays double from here up to ``capacity``.

    Attributes:
        dim: Embedding width.
        capacity: Maximum number of rows.
    """

    def __init__(
        self,
        dim: int,
        capacity: int,
        optimizer: OptimizerConfig | None = None,
        hyper: EmbeddingHyperparams = EmbeddingHyperparams(),
        initial_rows: int = 1024,
    ) -> None:
        self.dim = _int("dim", dim, 1)
        self.capacity = _int("capacity", capacity, 1)
        self._initial_rows = min(_int("initial_rows", initial_rows, 1), self.capacity)
        self._rec_dtype = _REC32 if self.capacity < 2**31 - 1 else _REC64
        self._optimizer: OptimizerConfig | None = None
        self._kind = "none"
        self._fill = 0.0
        self._hyper = hyper
        self._meta = np.zeros(8, np.int64)
        self._meta[[_HEAD, _TAIL]] = -1
        self._allocate(self._initial_rows, 0)
        if optimizer is not None:
            self.set_optimizer(optimizer)
        self.set_hyper(hyper)

    def _allocate(self, rows: int, keep: int) -> None:
        """(Re)allocate the row arrays for ``rows`` rows, keeping rows ``0..keep-1``, and re-index."""
        recs = _empty(rows, self._rec_dtype)
        emb = _empty((rows, self.dim), np.float32)
        state = _empty((rows, _kind_width(self._kind, self.dim)), np.float32)
        if keep:
            for new, cur in ((recs, self._recs), (emb, self._emb), (state, self._state)):
                new[:keep] = cur[:keep]
        self._recs, self._emb, self._state = recs, emb, state
        # Field views share the records' memory; the kernels see them as strided arrays.
        self._keys, self._prev, self._nxt = recs["key"], recs["prev"], recs["next"]
        self._index = _empty(2 * rows, self._rec_dtype["prev"])
        _rebuild_index(self._keys, keep, self._index)

    def _grow(self) -> None:
        rows = self._keys.shape[0]
        self._allocate(min(2 * rows, self.capacity), rows)

    def set_optimizer(self, cfg: OptimizerConfig) -> None:
        """Register the optimizer for :meth:`update`.

        Re-registering an optimizer of the same kind (say, a new learning rate) keeps every row's
        state. A different kind of state (SGD momentum, Adagrad, Adagrad vectorwise, Adam, or none)
        reallocates the state of every stored row and initialises it as for a fresh row.
        """
        _check_optimizer(cfg)
        kind = _state_kind(cfg)
        if kind != self._kind:
            self._state = _empty((self._keys.shape[0], _kind_width(kind, self.dim)), np.float32)
            self._state.fill(optim.state_fill_value(cfg))
            self._kind = kind
        self._optimizer = cfg
        self._fill = float(optim.state_fill_value(cfg))

    def set_hyper(self, hyper: EmbeddingHyperparams) -> None:
        """Set the initialisation range, admission probability and weight bound for what comes next."""
        self._hyper = _check_hyper(hyper)

    def lookup(self, ids: np.ndarray, train: bool) -> np.ndarray:
        """Return the rows of ``ids`` as a fresh float32 array of shape ``(len(ids), dim)``.

        A training lookup inserts unseen ids (each admitted with ``admit_probability``; a rejected id
        reads as zeros and is not stored) and moves every id it touches to the most recently used end,
        in the order the ids appear; inserting beyond capacity evicts the least recently used row. A
        new row starts uniform in ``[init_lower, init_upper]``, drawn from a splitmix64 stream seeded
        by the id alone, so an id always starts with the same vector. Admission draws are seeded by
        the id and the table's count of training lookups: reproducible, and an id refused once may
        still be admitted when it comes back (as in PERSIA, where each sighting draws afresh).
        An eval lookup changes nothing and reads unknown ids as zeros.

        Raises:
            BadRequest: ``ids`` is not a 1-D uint64 array.
        """
        ids = _check_ids(ids)
        out = np.empty((ids.shape[0], self.dim), np.float32)
        if not train:
            _lookup_eval(ids, self._keys, self._emb, self._prev, self._nxt, self._index, self._meta, out)
            return out
        h = self._hyper
        start = 0
        while True:
            start = _lookup_train(ids, start, self._keys, self._emb, self._state, self._prev, self._nxt,
                                  self._index, self._meta, self.capacity, h.init_lower, h.init_upper,
                                  h.admit_probability, self._fill, out)
            if start < 0:
                break
            self._grow()
        self._meta[_SALT] += 1
        return out

    def update(self, ids: np.ndarray, grads: np.ndarray) -> int:
        """Apply one optimizer step to the stored rows of ``ids``; gradients of repeated ids are summed.

        Updates do not refresh recency. Ids not stored are skipped and counted.

        Args:
            ids: 1-D uint64 ids.
            grads: Gradients of shape ``(len(ids), dim)``, any float dtype (used as float32).

        Returns:
            The number of ids not found.

        Raises:
            Conflict: No optimizer is registered.
            BadRequest: Wrong types or shapes, or a non-finite gradient; nothing is changed.
        """
        if self._optimizer is None:
            raise Conflict("no embedding optimizer registered")
        ids = _check_ids(ids)
        grads = _check_grads(grads, ids.shape[0], self.dim)
        rows, sums, misses, bad = _gather_grads(ids, grads, self._keys, self._index)
        if bad >= 0:
            where = f"for id {ids[bad]} at position {bad}" if bad < ids.shape[0] else "after summing duplicates"
            raise BadRequest(f"non-finite gradient {where}; no update applied")
        optim.apply_update(self._optimizer, rows, sums, self._emb, self._state, self._hyper.weight_bound)
        self._meta[_GRAD_MISS] += misses
        return int(misses)

    def __len__(self) -> int:
        return int(self._meta[_LIVE])

    @property
    def evictions(self) -> int:
        """Rows evicted to make room (LRU), since creation or as restored by :meth:`load_state_dict`."""
        return int(self._meta[_EVICTIONS])

    @property
    def inserts(self) -> int:
        """Ids inserted by training lookups."""
        return int(self._meta[_INSERTS])

    @property
    def gradient_id_miss_count(self) -> int:
        """Gradient ids skipped by :meth:`update` because they were not stored."""
        return int(self._meta[_GRAD_MISS])

    @property
    def index_miss_count(self) -> int:
        """Looked-up ids that were not stored (inserted, refused admission, or read as zeros)."""
        return int(self._meta[_INDEX_MISS])

    def memory_bytes(self) -> int:
        """Bytes of every array this table has allocated (allocated capacity, not only live rows)."""
        arrays = (self._recs, self._emb, self._state, self._index, self._meta)
        return int(sum(a.nbytes for a in arrays))

    def raw_bytes_per_row(self) -> int:
        """Key + vector + optimizer state of one row: the floor :meth:`memory_bytes` is measured against."""
        return 8 + 4 * self.dim + 4 * _kind_width(self._kind, self.dim)

    def state_dict(self) -> dict[str, Any]:
        """Copy the table's contents, rows in LRU order (least recently used first).

        Returns:
            ``keys`` (uint64 ``(n,)``), ``emb`` (float32 ``(n, dim)``), ``state`` (float32 ``(n, w)``),
            ``state_kind`` (which optimizer the state belongs to), ``dim``, ``capacity`` and the counters.
        """
        order = _lru_order(self._nxt, self._meta)
        out: dict[str, Any] = {"keys": self._keys[order], "emb": self._emb[order], "state": self._state[order],
                               "state_kind": self._kind, "dim": self.dim, "capacity": self.capacity}
        out.update({name: int(self._meta[slot]) for name, slot in _COUNTERS.items()})
        return out

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Replace the table's contents with a :meth:`state_dict`, restoring values and LRU order.

        If more rows come than ``capacity`` allows, the least recently used ones are dropped (and counted
        as evictions). If the saved state belongs to a different optimizer than the registered one, it is
        initialised afresh, as :meth:`set_optimizer` would.

        Raises:
            BadRequest: The dict is malformed (missing keys, wrong dtypes or shapes, repeated keys);
                nothing is changed.
        """
        if not isinstance(d, dict):
            raise BadRequest(f"embedding table state must be a dict, got {type(d).__name__}")
        try:
            keys, emb, state, kind = d["keys"], d["emb"], d["state"], d["state_kind"]
            counters = {name: int(d.get(name, 0)) for name in _COUNTERS}
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"bad embedding table state: {exc!r}") from None
        keys = _check_ids(keys)
        n = keys.shape[0]
        if kind not in _STATE_KINDS:
            raise BadRequest(f"unknown state_kind {kind!r}")
        width = _kind_width(kind, self.dim)
        for name, arr, shape in (("emb", emb, (n, self.dim)), ("state", state, (n, width))):
            if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.shape != shape:
                raise BadRequest(f"{name} must be a float32 array of shape {shape}")
        drop = max(0, n - self.capacity)
        keys, emb, state, n = keys[drop:], emb[drop:], state[drop:], n - drop
        rows = self._initial_rows
        while rows < n:
            rows = min(2 * rows, self.capacity)
        new = EmbeddingTable.__new__(EmbeddingTable)
        new.__dict__.update(self.__dict__)
        new._kind = kind
        new._allocate(rows, 0)
        new._keys[:n], new._emb[:n], new._state[:n] = keys, emb, state
        if _rebuild_index(new._keys, n, new._index) >= 0:
            raise BadRequest("keys repeat in the embedding table state")
        new._prev[:n] = np.arange(-1, n - 1)
        new._nxt[:n] = np.arange(1, n + 1)
        if n:
            new._nxt[n - 1] = -1
        new._meta = np.zeros(8, np.int64)
        new._meta[[_LIVE, _HEAD, _TAIL]] = (n, 0 if n else -1, n - 1)
        for name, slot in _COUNTERS.items():
            new._meta[slot] = counters[name]
        new._meta[_EVICTIONS] += drop
        self.__dict__.update(new.__dict__)
        if self._optimizer is not None and _state_kind(self._optimizer) != kind:
            self.set_optimizer(self._optimizer)


class EmbeddingStore:
    """One :class:`EmbeddingTable` per embedding width, created by the first training lookup of that width.

    ``capacity`` bounds each table separately (PERSIA bounds the whole PS), so a replica holding
    tables of k widths may keep up to ``k * capacity`` rows.

    Args:
        capacity: Maximum rows per table.
        optimizer: The embedding optimizer, or None until :meth:`set_optimizer`.
        hyper: Initialisation range, admission probability and weight bound for every table.
        initial_rows: Rows each new table allocates up front.
        max_dim: Widest embedding accepted.
    """

    def __init__(
        self,
        capacity: int,
        optimizer: OptimizerConfig | None = None,
        hyper: EmbeddingHyperparams = EmbeddingHyperparams(),
        initial_rows: int = 1024,
        max_dim: int = 4096,
    ) -> None:
        self.capacity = _int("capacity", capacity, 1)
        self._initial_rows = _int("initial_rows", initial_rows, 1)
        self._max_dim = _int("max_dim", max_dim, 1)
        self._optimizer = None if optimizer is None else _check_optimizer(optimizer)
        self._hyper = _check_hyper(hyper)
        self._orphan_grad_misses = 0  # gradients for a width no table holds yet
        self.tables: dict[int, EmbeddingTable] = {}
        """The tables, by embedding width (read only: use the store's methods to change them)."""

    def _check_dim(self, dim: Any) -> int:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or not 1 <= dim <= self._max_dim:
            raise BadRequest(f"embedding dim must be an int in 1..{self._max_dim}, got {dim!r}")
        return int(dim)

    def lookup(self, ids: np.ndarray, dim: int, train: bool) -> np.ndarray:
        """Look up ``ids`` in the table of width ``dim``, as :meth:`EmbeddingTable.lookup`.

        Raises:
            BadRequest: ``dim`` is out of range or ``ids`` is not a 1-D uint64 array.
        """
        dim = self._check_dim(dim)
        table = self.tables.get(dim)
        if table is None:
            ids = _check_ids(ids)
            if not train:
                return np.zeros((ids.shape[0], dim), np.float32)
            table = self.tables[dim] = EmbeddingTable(dim, self.capacity, self._optimizer, self._hyper,
                                                      self._initial_rows)
        return table.lookup(ids, train)

    def update(self, ids: np.ndarray, grads: np.ndarray) -> int:
        """Apply gradients to the table of width ``grads.shape[1]``, as :meth:`EmbeddingTable.update`.

        Returns:
            The number of ids not found.

        Raises:
            Conflict: No optimizer is registered.
            BadRequest: Bad types, shapes or values; nothing is changed.
        """
        if self._optimizer is None:
            raise Conflict("no embedding optimizer registered")
        ids = _check_ids(ids)
        grads = _check_grads(grads, ids.shape[0], None)
        table = self.tables.get(self._check_dim(grads.shape[1]))
        if table is not None:
            return table.update(ids, grads)
        if not np.isfinite(grads).all():
            raise BadRequest("non-finite gradient; no update applied")
        self._orphan_grad_misses += ids.shape[0]
        return int(ids.shape[0])

    def set_optimizer(self, cfg: OptimizerConfig) -> None:
        """Register the optimizer with every table, present and future (see :meth:`EmbeddingTable.set_optimizer`)."""
        _check_optimizer(cfg)
        for table in self.tables.values():
            table.set_optimizer(cfg)
        self._optimizer = cfg

    def set_hyper(self, hyper: EmbeddingHyperparams) -> None:
        """Set the hyperparameters of every table, present and future."""
        _check_hyper(hyper)
        for table in self.tables.values():
            table.set_hyper(hyper)
        self._hyper = hyper

    def stats(self) -> dict[str, Any]:
        """Rows per width and totals: rows, memory bytes, evictions, inserts and misses."""
        tables = self.tables.values()
        return {
            "rows": len(self),
            "rows_per_dim": {dim: len(t) for dim, t in self.tables.items()},
            "memory_bytes": sum(t.memory_bytes() for t in tables),
            "evictions": sum(t.evictions for t in tables),
            "inserts": sum(t.inserts for t in tables),
            "index_miss_count": sum(t.index_miss_count for t in tables),
            "gradient_id_miss_count": self._orphan_grad_misses + sum(t.gradient_id_miss_count for t in tables),
        }

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables.values())
