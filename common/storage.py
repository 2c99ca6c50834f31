"""Where checkpoints live: a local directory, or an object store (``s3://``, ``gs://``, ...) through fsspec.

Every role reads and writes checkpoints as local files (:mod:`persia_nats.common.checkpoint`: atomic files,
renames, a manifest). With a URL root, a local directory stands in for it, the *cache*
(``PERSIA_CHECKPOINT_CACHE``, else ``~/.cache/persia-nats/checkpoints/<scheme>/<bucket>/<path>``;
roles on one host share it, as they share a local root), and this module moves whole
checkpoints between the two:

- :func:`publish` uploads a finalized checkpoint's files, then its ``MANIFEST.json`` last. An
  object store has no atomic rename of a directory, so the manifest is what makes a remote
  checkpoint exist: one without it (an upload cut short) is torn, and readers pass it by.
- :func:`pull_newest` downloads the newest remote checkpoint that has a manifest and whose files
  then verify (size and SHA-256) into the cache, unless the cache holds it already; a download
  lands in a hidden directory and is renamed into place only once it verified.
- :func:`prune_remote` deletes remote checkpoints beyond the newest ``keep``, manifest first.

``file://`` URLs are local directories. A scheme fsspec does not know, or one whose package is
missing (``s3://`` needs ``s3fs``, ``gs://`` ``gcsfs``), is refused with the reason.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from persia_nats.common.errors import ConfigError

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"  # the same name as persia_nats.common.checkpoint.MANIFEST (which imports nothing from here)
_FINAL = re.compile(r"^ckpt-(\d{1,18})$")
#: the object stores a checkpoint root may name, with the package fsspec needs for each
REMOTE_SCHEMES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                  "memory": None}


@dataclass(frozen=True, slots=True)
class CheckpointRoot:
    """A checkpoint root: ``local`` is where the roles read and write; ``remote`` the URL it mirrors, if any."""

    local: Path
    remote: str | None = None

    def __str__(self) -> str:
        return self.remote or str(self.local)


def check_root(raw: str, name: str = "checkpoint_dir") -> None:
    """Refuse a root that is neither a path nor a URL of a known scheme (without importing fsspec).

    Raises:
        ConfigError: naming ``name``, the value and the schemes accepted.
    """
    _split(raw, name)


def _split(raw: str, name: str) -> tuple[str, str]:
    """``(scheme, rest)``: scheme "" for a local path (``file://`` URLs included, rest then the path)."""
    scheme, sep, rest = raw.partition("://")
    if not sep:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:/", raw) and not re.match(r"^[A-Za-z]:[\\/]", raw):
            # "s3:/bucket": a URL that lost a slash, which a path would silently become
            raise ConfigError(f"{name}={raw!r} looks like a URL missing a '/': write SCHEME://...")
        return "", raw
    scheme = scheme.lower()
    if scheme == "file":
        parts = urlsplit(raw)
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ConfigError(f"{name}={raw!r}: a file:// URL names a local path, file:///abs/path")
        return "", unquote(parts.path)
    if scheme not in REMOTE_SCHEMES:
        known = ", ".join(["file", *REMOTE_SCHEMES])
        raise ConfigError(f"{name}={raw!r}: unknown scheme {scheme!r}; a checkpoint root is a path or a URL "
                          f"with one of the schemes {known}")
    if not rest.strip("/"):
        raise ConfigError(f"{name}={raw!r} names no bucket")
    return scheme, rest.strip("/")


def open_root(raw: str, name: str = "checkpoint_dir", cache: str | os.PathLike[str] | None = None) -> CheckpointRoot:
    """The :class:`CheckpointRoot` for a configured value; a URL's filesystem package is checked here.

    Raises:
        ConfigError: an unknown scheme, a malformed URL, or the scheme's package is not installed.
    """
    scheme, rest = _split(raw, name)
    if not scheme:
        return CheckpointRoot(Path(rest).expanduser().resolve())
    _filesystem(f"{scheme}://{rest}", name)  # fails now, not at the first checkpoint
    if cache is None:
        cache = os.environ.get("PERSIA_CHECKPOINT_CACHE") or Path.home() / ".cache" / "persia-nats" / "checkpoints"
        cache = Path(cache) / scheme / rest
    return CheckpointRoot(Path(cache).expanduser().resolve(), f"{scheme}://{rest}")


def _filesystem(url: str, name: str = "checkpoint_dir") -> Any:
    import fsspec

    try:
        fs, _ = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        package = REMOTE_SCHEMES.get(url.split("://", 1)[0])
        raise ConfigError(f"{name}={url!r} needs the {package} package: pip install {package} ({exc})") from None
    return fs


def _remote_names(fs: Any, url: str) -> list[tuple[int, str]]:
    """``(number, name)`` of every remote ``ckpt-N``, newest first (with or without a manifest)."""
    fs.invalidate_cache()  # s3fs and gcsfs keep listings: a poller would never see a new checkpoint
    try:
        children = fs.ls(url, detail=False)
    except FileNotFoundError:
        return []
    found = []
    for child in children:
        name = child.rstrip("/").rsplit("/", 1)[-1]
        m = _FINAL.match(name)
        if m:
            found.append((int(m.group(1)), name))
    return sorted(found, reverse=True)


def publish(root: CheckpointRoot, ckpt: Path) -> str:
    """Upload the finalized local checkpoint ``ckpt`` to ``root.remote``: its files, then its manifest.

    Returns:
        The remote checkpoint's URL.
    """
    from persia_nats.common.checkpoint import read_manifest

    assert root.remote is not None, "publish() needs a URL root"
    fs = _filesystem(root.remote)
    files = read_manifest(ckpt)["files"]
    target = f"{root.remote}/{ckpt.name}"
    if fs.exists(f"{target}/{MANIFEST}"):  # a re-upload is torn until it is done
        fs.rm(f"{target}/{MANIFEST}")
    for rel in sorted(files):
        fs.put_file(str(ckpt / rel), f"{target}/{rel}")
    fs.put_file(str(ckpt / MANIFEST), f"{target}/{MANIFEST}")
    log.info("checkpoint %s uploaded to %s (%d files, manifest last)", ckpt.name, target, len(files))
    return target


def pull_newest(root: CheckpointRoot) -> Path | None:
    """Make the cache hold the newest remote checkpoint that verifies; returns it (None: there is none).

    A remote checkpoint without a manifest (torn) or whose files do not verify once downloaded is
    logged and passed by, for the one before it.
    """
    from persia_nats.common.checkpoint import read_manifest, verify

    assert root.remote is not None, "pull_newest() needs a URL root"
    fs = _filesystem(root.remote)
    for _, name in _remote_names(fs, root.remote):
        local = root.local / name
        if local.is_dir() and not verify(local):
            return local
        source = f"{root.remote}/{name}"
        if not fs.exists(f"{source}/{MANIFEST}"):
            log.warning("remote checkpoint %s has no manifest (torn): passed by", source)
            continue
        staging = root.local / f".fetch-{name}-{secrets.token_hex(4)}"
        try:
            staging.mkdir(parents=True)
            fs.get_file(f"{source}/{MANIFEST}", str(staging / MANIFEST))
            for rel in sorted(read_manifest(staging)["files"]):
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{source}/{rel}", str(staging / rel))
            problems = verify(staging)
        except (OSError, ValueError) as exc:  # CheckpointError is a ValueError
            problems = [f"download failed: {exc}"]
        if problems:
            log.warning("remote checkpoint %s rejected: %s", source, "; ".join(problems))
            shutil.rmtree(staging, ignore_errors=True)
            continue
        if local.exists():  # a local copy that failed to verify: replaced by the one that does
            shutil.rmtree(local)
        os.rename(staging, local)
        log.info("checkpoint %s downloaded from %s", name, source)
        return local
    return None


def prune_remote(root: CheckpointRoot, keep: int) -> list[str]:
    """Delete remote checkpoints beyond the newest ``keep``; each loses its manifest first, so one
    whose deletion is cut short reads as torn, never as a checkpoint with files missing."""
    assert root.remote is not None, "prune_remote() needs a URL root"
    fs = _filesystem(root.remote)
    doomed = [f"{root.remote}/{name}" for _, name in _remote_names(fs, root.remote)[keep:]]
    for url in doomed:
        if fs.exists(f"{url}/{MANIFEST}"):
            fs.rm(f"{url}/{MANIFEST}")
        fs.rm(url, recursive=True)
    return doomed
