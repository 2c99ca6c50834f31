"""Checkpoint directories shared by every role: atomic files, a checksummed manifest, discovery.

Layout of a checkpoint root ``ROOT`` (see ``docs/checkpoints.md``)::

    ROOT/ckpt-00000042/               a final checkpoint; 42 is its number, increasing
        ps/replica-<i>-of-<n>/...     written by PS replica i of n
        dense/...                     written by the NN worker
        state.json                    written by the NN worker
        MANIFEST.json                 written last: {"format", "number", "created", "files", ...}
    ROOT/ckpt-00000043.partial/       still being written; readers ignore it

A checkpoint becomes visible in one step: its writers fill ``ckpt-N.partial``, then :func:`finalize`
writes the manifest (size and SHA-256 of every file) and renames the directory to ``ckpt-N``. A
crash at any point leaves either a ``.partial`` directory, which readers skip, or a complete
checkpoint. Bytes can still rot or be truncated later (a full disk, a copy cut short), so readers
trust a checkpoint only after its bytes were hashed against the manifest: :func:`verify` re-hashes every
file, :func:`latest_valid` falls back to the previous checkpoint when the newest one fails. A reader that
uses only some of the files (a PS replica, its own shard) checks every listed file's size
(``verify(hash_files=False)``: a torn or truncated checkpoint is still refused as a whole) and hashes the
files it reads as it reads them (:func:`read_rows`), in one pass.

Nothing here unpickles: arrays are ``.npy`` files read with ``allow_pickle=False``, metadata is JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import IO, Any

import numpy as np
from persia_nats.common.errors import BadRequest

__all__ = [
    "FORMAT",
    "MANIFEST",
    "MAX_NUMBER",
    "AtomicWriter",
    "CheckpointError",
    "Digest",
    "check_file",
    "checkpoint_name",
    "checkpoint_number",
    "file_digest",
    "finalize",
    "fsync_dir",
    "latest_valid",
    "list_checkpoints",
    "load_array",
    "next_number",
    "npy_shape",
    "partial_dir",
    "prune",
    "read_manifest",
    "read_rows",
    "save_array",
    "verify",
    "write_bytes_atomic",
]

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "MANIFEST.json"
_BLOCK = 1 << 20
# read_rows' block: large enough that a read and a hash update cost far more than the call around them
_ROWS_BLOCK = 8 << 20
#: the highest checkpoint number: names carry exactly 8 ASCII digits, so they also sort by number
MAX_NUMBER = 99_999_999
_NAME = re.compile(r"ckpt-([0-9]{8})(\.partial)?", re.ASCII)
# a partial directory named like a checkpoint but not of the form this code writes (older builds let a
# request create ``ckpt-999999999999999999.partial``): never read, and removed by :func:`prune`
_STRAY_PARTIAL = re.compile(r"ckpt-[0-9]+\.partial", re.ASCII)
# manifest keys finalize owns; ``extra`` may not replace them
_RESERVED = ("format", "number", "created", "files")

Digest = tuple[int, str]


class CheckpointError(BadRequest):
    """A checkpoint is missing, torn, corrupt or malformed; the message names the file and the problem.

    A 400 on the wire: asking again for the same checkpoint cannot succeed.
    """


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def file_digest(path: str | os.PathLike[str]) -> Digest:
    """Size and SHA-256 (hex) of a file, read in 1 MiB blocks so a table of GBs never sits in memory."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


class _HashingWriter:
    """Forwards writes to a file and hashes them on the way, so a file is never read back to digest it.

    Not a real file object on purpose: numpy then writes an array in bounded chunks through
    :meth:`write` instead of ``tofile``, which would bypass the hash.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")
        self._f.write(view)
        self._hash.update(view)
        self.size += view.nbytes
        return view.nbytes

    def digest(self) -> Digest:
        return self.size, self._hash.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename itself is still atomic
        pass
    finally:
        os.close(fd)


def _write_atomic(path: str | os.PathLike[str], fill: Callable[[_HashingWriter], object]) -> Digest:
    """Write through ``fill`` into a temporary sibling, fsync it, then rename it over ``path``.

    Readers see the old file or the whole new one, never a prefix. The temporary file is created
    with mode 0666 filtered by the umask (unlike ``mkstemp``'s 0600), so other roles can read it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _HashingWriter(f)
            fill(writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return writer.digest()


class AtomicWriter:
    """A file written piece by piece, hashed on the way, and renamed over ``path`` only by :meth:`commit`.

    What :func:`_write_atomic` does for one callback, for a writer that produces its bytes over time (a
    live PS dump writes each table between the requests it serves). Readers see the old file or the
    whole new one; :meth:`abort` removes the temporary file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        self._file: IO[bytes] | None = os.fdopen(os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb")
        self._writer = _HashingWriter(self._file)

    def write(self, data: Any) -> int:
        return self._writer.write(data)

    def commit(self) -> Digest:
        """fsync, rename over the target, fsync the directory; return ``(size, sha256)``."""
        assert self._file is not None, "already closed"
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        fsync_dir(self.path.parent)
        return self._writer.digest()

    def abort(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


def npy_header(dtype: np.dtype[Any] | type, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header :func:`save_array` writes for a C-order array of ``dtype`` and ``shape``, so a file
    written as this header and then its rows in pieces is byte for byte the file ``save_array`` writes."""
    buf = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Digest:
    """Replace ``path`` with ``data`` atomically and durably.

    Returns:
        ``(size, sha256 hex)`` of what was written.
    """
    return _write_atomic(path, lambda w: w.write(data))


def save_array(path: str | os.PathLike[str], array: np.ndarray) -> Digest:
    """Write ``array`` as a ``.npy`` file atomically, hashing it while it is written.

    Raises:
        ValueError: ``array`` holds Python objects (they would need pickle, which is never used).
    """
    return _write_atomic(path, lambda w: np.save(w, array, allow_pickle=False))


def _expected(value: Any, name: str) -> Digest:
    """Normalise a digest given as ``(size, sha)`` or as a manifest entry ``{"size", "sha256"}``."""
    if isinstance(value, Mapping):
        value = (value.get("size"), value.get("sha256"))
    if (not isinstance(value, (tuple, list)) or len(value) != 2 or isinstance(value[0], bool)
            or not isinstance(value[0], int) or value[0] < 0 or not isinstance(value[1], str)
            or not re.fullmatch(r"[0-9a-f]{64}", value[1])):
        raise CheckpointError(f"{name}: malformed digest {value!r} (expected size and sha256 hex)")
    return int(value[0]), value[1]


def check_file(path: str | os.PathLike[str], expected: Digest | Mapping[str, Any]) -> None:
    """Hash a file and compare it with ``(size, sha256)`` or a manifest entry ``{"size", "sha256"}``.

    Raises:
        CheckpointError: Naming the file, when it is missing, unreadable, or differs.
    """
    path = Path(path)
    _check_digest(path, _expected(expected, str(path)))


def _check_digest(path: Path, expected: Digest) -> None:
    try:
        got = file_digest(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc}") from None
    if got[0] != expected[0]:
        raise CheckpointError(f"{path}: size {got[0]} bytes, the manifest says {expected[0]} (truncated?)")
    if got[1] != expected[1]:
        raise CheckpointError(f"{path}: sha256 {got[1]} does not match the manifest's {expected[1]} (corrupt)")


def load_array(
    path: str | os.PathLike[str],
    expected: Digest | Mapping[str, Any] | None = None,
    *,
    mmap: bool = False,
) -> np.ndarray:
    """Read a ``.npy`` file written by :func:`save_array`, never unpickling.

    Args:
        path: The file.
        expected: ``(size, sha256)`` (or a manifest entry); when given the file is hashed first and
            must match.
        mmap: Map the file read-only instead of reading it, so a caller can copy out only the rows
            it needs.

    Raises:
        CheckpointError: Naming the file, when it is missing, unreadable, not a plain ``.npy``
            array, or does not match ``expected``.
    """
    path = Path(path)
    if expected is not None:
        check_file(path, expected)
    try:
        array = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError, EOFError) as exc:
        raise CheckpointError(f"{path}: not a readable .npy array: {exc}") from None
    if not isinstance(array, np.ndarray):  # np.load gives an NpzFile for a zip archive
        raise CheckpointError(f"{path}: not a .npy array")
    return array


def _read_exact(f: io.FileIO, view: memoryview, path: Path) -> None:
    got = 0
    while got < view.nbytes:
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(f"{path}: ends {view.nbytes - got} bytes early (truncated)")
        got += n


def _npy_header(f: IO[bytes], path: Path) -> tuple[np.dtype[Any], tuple[int, ...], int]:
    """``(dtype, shape, data offset)`` of a C-order ``.npy`` file, read from its start; never unpickles."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except (OSError, ValueError, EOFError, SyntaxError) as exc:
        raise CheckpointError(f"{path}: not a readable .npy array: {exc}") from None
    if fortran or dtype.hasobject:
        raise CheckpointError(f"{path}: not a plain C-order .npy array of numbers")
    return dtype, tuple(int(x) for x in shape), f.tell()


def npy_shape(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """The shape a ``.npy`` file's header declares (its data unread and unchecked: :func:`read_rows` checks).

    Raises:
        CheckpointError: Naming the file, when it is missing or its header is not a plain ``.npy`` one.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return _npy_header(f, path)[1]
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc}") from None


def read_rows(
    path: str | os.PathLike[str],
    expected: Digest | Mapping[str, Any] | None,
    dtype: type | np.dtype[Any],
    shape: tuple[int | None, ...],
    *,
    keep: np.ndarray | None = None,
    out: np.ndarray | None = None,
    progress: Callable[[int], object] | None = None,
) -> np.ndarray:
    """Read a ``.npy`` array front to back once, hashing it on the way, and return its rows (or those ``keep`` marks).

    :func:`load_array` with a digest reads a file twice (hash, then load); this reads it once, block by block,
    straight into the result (or, with ``keep``, into a small buffer its kept rows are copied out of), and
    compares the whole file's size and SHA-256 with ``expected`` at the end. A row selection still reads and
    hashes every byte: the digest covers the whole file, and a shard's rows are in LRU order while a replica's
    share of them is chosen by a hash of the key, so its rows lie in every block of the file anyway.

    Args:
        path: The file.
        expected: ``(size, sha256)`` or a manifest entry; None reads without hashing.
        dtype: The dtype it must hold.
        shape: The shape it must have; None for a dimension takes whatever the file has.
        keep: Bool of the rows to return (one per row of the file); None returns them all.
        out: Where to put the rows (C-contiguous, ``dtype``, the rows returned by the shape's other
            dimensions); None allocates it.
        progress: Called with the bytes read after every block.

    Returns:
        ``out``, filled.

    Raises:
        CheckpointError: Naming the file, when it is missing, unreadable, not such an array, truncated, or
            does not match ``expected``. Whatever was written into ``out`` is then not to be used.
    """
    path = Path(path)
    want = None if expected is None else _expected(expected, str(path))
    try:
        f = open(path, "rb", buffering=0)  # unbuffered: readinto goes straight into the result
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc}") from None
    try:
        with f:
            return _read_rows(f, path, want, np.dtype(dtype), shape, keep, out, progress)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc}") from None


def _read_rows(f: io.FileIO, path: Path, want: Digest | None, dtype: np.dtype[Any], shape: tuple[int | None, ...],
               keep: np.ndarray | None, out: np.ndarray | None, progress: Callable[[int], object] | None) -> np.ndarray:
    size = os.fstat(f.fileno()).st_size
    if want is not None and size != want[0]:
        raise CheckpointError(f"{path}: size {size} bytes, the manifest says {want[0]} (truncated?)")
    got_dtype, got_shape, offset = _npy_header(f, path)
    ok = got_dtype == dtype and len(got_shape) == len(shape)
    if not ok or any(w is not None and g != w for g, w in zip(got_shape, shape, strict=False)):
        wanted = "x".join("w" if s is None else str(s) for s in shape)
        raise CheckpointError(f"{path}: expected {dtype.name} of shape ({wanted}), "
                              f"got {got_dtype} of shape {got_shape}")
    rows, rest = (got_shape[0], got_shape[1:]) if got_shape else (1, ())
    row_bytes = dtype.itemsize * int(np.prod(rest, dtype=np.int64))
    if offset + rows * row_bytes != size:
        raise CheckpointError(f"{path}: {size} bytes, its header says {offset + rows * row_bytes} (truncated?)")
    if keep is not None and (keep.dtype != np.bool_ or keep.shape != (rows,)):
        raise ValueError(f"keep must be a bool array of {rows} rows")
    kept = rows if keep is None else int(np.count_nonzero(keep))
    if out is None:
        out = np.empty((kept, *rest), dtype)
    elif out.dtype != dtype or out.shape != (kept, *rest) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {dtype.name} array of shape {(kept, *rest)}")
    digest = hashlib.sha256() if want is not None else None
    f.seek(0)
    head = memoryview(bytearray(offset))
    _read_exact(f, head, path)
    if digest is not None:
        digest.update(head)
    if progress is not None:
        progress(offset)
    per = max(1, _ROWS_BLOCK // max(1, row_bytes))
    if row_bytes and keep is None:  # straight into the result, block by block
        flat = out.reshape(-1).view(np.uint8).data
        for start in range(0, rows * row_bytes, per * row_bytes):
            view = flat[start:start + per * row_bytes]
            _read_exact(f, view, path)
            if digest is not None:
                digest.update(view)  # hashlib lets go of the GIL: replicas' threads hash side by side
            if progress is not None:
                progress(view.nbytes)
    elif row_bytes and keep is not None:
        block = np.empty((min(per, rows), *rest), dtype)
        raw = block.reshape(-1).view(np.uint8).data
        pos = 0
        for start in range(0, rows, per):
            n = min(per, rows - start)
            view = raw[:n * row_bytes]
            _read_exact(f, view, path)
            if digest is not None:
                digest.update(view)
            chosen = keep[start:start + n]
            k = int(np.count_nonzero(chosen))
            if k:
                np.compress(chosen, block[:n], axis=0, out=out[pos:pos + k])
                pos += k
            if progress is not None:
                progress(view.nbytes)
    if digest is not None and want is not None and digest.hexdigest() != want[1]:
        raise CheckpointError(f"{path}: sha256 {digest.hexdigest()} does not match the manifest's {want[1]} (corrupt)")
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoint directories
# ---------------------------------------------------------------------------------------------


def checkpoint_name(number: int) -> str:
    """The final directory name of checkpoint ``number`` (zero-padded so names also sort by number).

    Raises:
        CheckpointError: ``number`` is outside 1..MAX_NUMBER.
    """
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= MAX_NUMBER:
        raise CheckpointError(f"checkpoint number {number!r} is outside 1..{MAX_NUMBER}")
    return f"ckpt-{number:08d}"


def checkpoint_number(name: str) -> tuple[int, bool] | None:
    """``(number, is_partial)`` for a directory name of the form the job writes, None for any other name.

    Only ``ckpt-`` + 8 ASCII digits (+ ``.partial``): ``\\d`` would also take other scripts' digits.
    """
    m = _NAME.fullmatch(name)
    return (int(m.group(1)), m.group(2) is not None) if m else None


def partial_dir(root: str | os.PathLike[str], number: int) -> Path:
    """Where checkpoint ``number`` is written before :func:`finalize` (the caller creates it)."""
    return Path(root) / f"{checkpoint_name(number)}.partial"


def _entries(root: Path) -> list[tuple[int, bool, Path]]:
    try:
        children = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for child in children:
        parsed = checkpoint_number(child.name)
        if parsed is not None and child.is_dir():
            out.append((parsed[0], parsed[1], child))
    return out


def next_number(root: str | os.PathLike[str]) -> int:
    """1 + the highest number among final and partial checkpoints in ``root`` (1 when there are none).

    Partial directories count so a new checkpoint never reuses the number of one a crashed writer
    left half-written.

    Raises:
        CheckpointError: the counter is exhausted (``ckpt-99999999`` exists).
    """
    number = 1 + max((n for n, _, _ in _entries(Path(root))), default=0)
    if number > MAX_NUMBER:
        raise CheckpointError(f"{root}: checkpoint numbers are exhausted ({checkpoint_name(MAX_NUMBER)} exists)")
    return number


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Final checkpoint directories in ``root``, newest (highest number) first; partial ones are left out."""
    finals = [(n, p) for n, partial, p in _entries(Path(root)) if not partial]
    return [p for _, p in sorted(finals, key=lambda item: item[0], reverse=True)]


def _relpath(rel: Any) -> str:
    """A manifest path: relative, '/'-separated, staying inside the checkpoint directory."""
    if not isinstance(rel, str) or not rel:
        raise CheckpointError(f"file path {rel!r} in the manifest is not a non-empty string")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or "\\" in rel or "\x00" in rel or str(pure) != rel:
        raise CheckpointError(f"file path {rel!r} must be relative, normalised and inside the checkpoint")
    if rel == MANIFEST:
        raise CheckpointError(f"{MANIFEST} cannot list itself")
    return rel


def finalize(
    partial: str | os.PathLike[str],
    files: Mapping[str, Digest | Mapping[str, Any]],
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Seal a checkpoint: write its manifest, then rename ``ckpt-N.partial`` to ``ckpt-N``.

    Every listed file is fsynced first (writers other than :func:`save_array`, ``torch.save`` say,
    may not have), so the checkpoint is durable before it becomes visible. Sizes are compared with
    the files on disk; hashes are trusted (their writers computed them) and re-checked by
    :func:`verify` on every read.

    Args:
        partial: The ``ckpt-N.partial`` directory.
        files: ``{relative path: (size, sha256)}`` or manifest-style ``{"size", "sha256"}`` entries.
        extra: More manifest keys (JSON values); they may not replace format, number, created or files.

    Returns:
        The final directory.

    Raises:
        CheckpointError: The directory is not a partial checkpoint, a final one of that number
            exists, a listed file is missing or has another size, or ``extra`` is not JSON.
    """
    partial = Path(partial)
    parsed = checkpoint_number(partial.name)
    if parsed is None or not parsed[1] or not partial.is_dir():
        raise CheckpointError(f"{partial} is not a partial checkpoint directory (ckpt-N.partial)")
    number = parsed[0]
    final = partial.with_name(checkpoint_name(number))
    if final.exists():
        raise CheckpointError(f"{final} already exists")
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(_RESERVED))
    if clash:
        raise CheckpointError(f"extra manifest keys {clash} are reserved")
    entries: dict[str, dict[str, Any]] = {}
    for rel, digest in files.items():
        rel = _relpath(rel)
        size, sha = _expected(digest, rel)
        path = partial / rel
        try:
            with open(path, "rb") as f:
                actual = os.fstat(f.fileno()).st_size
                os.fsync(f.fileno())
        except (FileNotFoundError, IsADirectoryError):
            raise CheckpointError(f"{path}: listed but missing") from None
        if actual != size:
            raise CheckpointError(f"{path}: {actual} bytes on disk, listed as {size}")
        entries[rel] = {"size": size, "sha256": sha}
    for parent in sorted({(partial / rel).parent for rel in entries}):
        fsync_dir(parent)
    manifest = {"format": FORMAT, "number": number, "created": time.time(), "files": entries, **extra}
    try:
        data = json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the manifest is not JSON-serialisable: {exc}") from None
    write_bytes_atomic(partial / MANIFEST, data)
    os.rename(partial, final)
    fsync_dir(final.parent)
    return final


def read_manifest(ckpt_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed manifest of a checkpoint, its shape checked (file entries are not re-hashed).

    Raises:
        CheckpointError: It is missing (a torn checkpoint), not JSON, or malformed.
    """
    path = Path(ckpt_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (torn checkpoint)") from None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{path}: unreadable or not JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unsupported format {manifest.get('format')!r} (expected {FORMAT})")
    number = manifest.get("number")
    if isinstance(number, bool) or not isinstance(number, int):
        raise CheckpointError(f"{path}: number must be an int, got {number!r}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: files must be an object")
    for rel, digest in files.items():
        _expected(digest, _relpath(rel))
    return manifest


def verify(ckpt_dir: str | os.PathLike[str], *, hash_files: bool = True) -> list[str]:
    """Re-hash a checkpoint against its manifest.

    Args:
        ckpt_dir: The checkpoint.
        hash_files: False checks only that every listed file is there with its listed size (a stat each):
            for a reader that hashes the files it reads as it reads them (:func:`read_rows`) and reads
            only some of them, so a torn, truncated or half-deleted checkpoint is still refused whole.

    Returns:
        The problems found (no or invalid manifest, a number that disagrees with the directory
        name, a listed file missing, a size or SHA-256 mismatch); empty when the checkpoint is valid.
    """
    ckpt_dir = Path(ckpt_dir)
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError as exc:
        return [exc.description]
    problems = []
    parsed = checkpoint_number(ckpt_dir.name)
    if parsed is not None and parsed[0] != manifest["number"]:
        problems.append(f"manifest number {manifest['number']} does not match the directory {ckpt_dir.name}")
    for rel, digest in sorted(manifest["files"].items()):
        try:
            if hash_files:
                _check_digest(ckpt_dir / rel, _expected(digest, rel))
            else:
                _check_size(ckpt_dir / rel, _expected(digest, rel))
        except CheckpointError as exc:
            problems.append(exc.description)
    return problems


def _check_size(path: Path, expected: Digest) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc}") from None
    if size != expected[0]:
        raise CheckpointError(f"{path}: size {size} bytes, the manifest says {expected[0]} (truncated?)")


def latest_valid(root: str | os.PathLike[str]) -> Path | None:
    """The newest final checkpoint that passes :func:`verify`, or None.

    Each newer one that fails is logged at WARNING with its problems, so a torn or corrupt
    checkpoint costs the progress since the previous one, never the job.
    """
    for ckpt in list_checkpoints(root):
        problems = verify(ckpt)
        if not problems:
            return ckpt
        log.warning("checkpoint %s rejected: %s", ckpt, "; ".join(problems))
    return None


def _stray_partials(root: Path) -> list[Path]:
    try:
        children = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [c for c in children if _STRAY_PARTIAL.fullmatch(c.name) and checkpoint_number(c.name) is None
            and c.is_dir() and not c.is_symlink()]


def prune(root: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete final checkpoints beyond the newest ``keep``, partial ones older than the newest final, and
    partial ones whose name this code never writes (leftovers of hostile requests to older builds).

    A partial directory newer than every final one may still be being written, so it stays.

    Returns:
        The directories removed.

    Raises:
        ValueError: ``keep < 1``.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    entries = _entries(Path(root))
    finals = sorted(((n, p) for n, partial, p in entries if not partial), key=lambda item: item[0], reverse=True)
    newest = finals[0][0] if finals else None
    doomed = [p for _, p in finals[keep:]]
    doomed += [p for n, partial, p in entries if partial and newest is not None and n < newest]
    doomed += _stray_partials(Path(root))
    for path in doomed:
        # Renamed first, so a crash mid-delete never leaves a half-deleted final checkpoint that
        # readers would have to verify and reject; the name matches no checkpoint pattern.
        trash = path.with_name(f"{path.name}.deleting-{secrets.token_hex(4)}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    for leftover in Path(root).glob("ckpt-*.deleting-*"):  # left by a prune that crashed mid-delete
        shutil.rmtree(leftover, ignore_errors=True)
    if doomed:
        fsync_dir(Path(root))
    return doomed
