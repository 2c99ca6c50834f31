"""Environment variables every PERSIA process reads, parsed once into a frozen :class:`Env`.

The environment is passed in (``read_env(environ)``) rather than read from ``os.environ`` deep in
the code, and nothing is cached, so a test can run every role in one process with a different
environment for each.

An empty value counts as unset: orchestrators (docker compose, Kubernetes) commonly template a
variable to ``""`` when no value was supplied.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from common.config import JOB_NAME_RE
from common.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class Env:
    """The process environment, validated.

    Attributes:
        nats_url: ``PERSIA_NATS_URL``: one NATS URL or a comma-separated list (see ``nats_servers``).
        global_config: ``PERSIA_GLOBAL_CONFIG``: path of ``global_config.yml`` (None: defaults).
        embedding_config: ``PERSIA_EMBEDDING_CONFIG``: path of ``embedding_config.yml``.
        nn_worker_entry: ``PERSIA_NN_WORKER_ENTRY``: the user's training script.
        dataloader_entry: ``PERSIA_DATALOADER_ENTRY``: the user's data loader script.
        log_level: ``LOG_LEVEL``, lower-cased: one of debug, info, warning, error, critical.
        replica_index: ``REPLICA_INDEX``: this replica among ``replica_size`` of its role.
        replica_size: ``REPLICA_SIZE``: number of replicas of this role.
        rank: ``RANK``: global rank of an NN worker.
        local_rank: ``LOCAL_RANK``: rank of an NN worker on its host (picks the GPU).
        world_size: ``WORLD_SIZE``: number of NN workers.
        job_name: ``PERSIA_JOB_NAME``: overrides ``common_config.job_name`` when set.
    """

    nats_url: str = "nats://127.0.0.1:4222"
    global_config: str | None = None
    embedding_config: str | None = None
    nn_worker_entry: str | None = None
    dataloader_entry: str | None = None
    log_level: str = "info"
    replica_index: int = 0
    replica_size: int = 1
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    job_name: str | None = None

    @property
    def nats_servers(self) -> list[str]:
        """The NATS server URLs in ``nats_url``, in order, blanks dropped."""
        return _split_urls(self.nats_url)


def read_env(environ: Mapping[str, str] = os.environ) -> Env:
    """Parse the PERSIA environment variables from ``environ``.

    Args:
        environ: The environment to read; pass a dict in tests.

    Returns:
        The validated environment; unset (or empty) variables take the :class:`Env` defaults.

    Raises:
        ConfigError: Naming the variable and its value, if a value is malformed or out of range.
    """

    def get(name: str, parse: Callable[[str, str], T], default: T) -> T:
        raw = environ.get(name, "").strip()
        return parse(name, raw) if raw else default

    default = Env()
    env = Env(
        nats_url=get("PERSIA_NATS_URL", _parse_nats_url, default.nats_url),
        global_config=get("PERSIA_GLOBAL_CONFIG", _parse_str, None),
        embedding_config=get("PERSIA_EMBEDDING_CONFIG", _parse_str, None),
        nn_worker_entry=get("PERSIA_NN_WORKER_ENTRY", _parse_str, None),
        dataloader_entry=get("PERSIA_DATALOADER_ENTRY", _parse_str, None),
        log_level=get("LOG_LEVEL", _parse_log_level, default.log_level),
        replica_index=get("REPLICA_INDEX", _parse_count, default.replica_index),
        replica_size=get("REPLICA_SIZE", _parse_positive, default.replica_size),
        rank=get("RANK", _parse_count, default.rank),
        local_rank=get("LOCAL_RANK", _parse_count, default.local_rank),
        world_size=get("WORLD_SIZE", _parse_positive, default.world_size),
        job_name=get("PERSIA_JOB_NAME", _parse_job_name, None),
    )
    if env.replica_index >= env.replica_size:
        raise ConfigError(
            f"REPLICA_INDEX={env.replica_index} must be less than REPLICA_SIZE={env.replica_size}"
        )
    if env.rank >= env.world_size:
        raise ConfigError(f"RANK={env.rank} must be less than WORLD_SIZE={env.world_size}")
    return env


def _parse_str(name: str, raw: str) -> str:
    return raw


def _parse_count(name: str, raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < 0:
        raise ConfigError(f"{name}={raw!r} must be >= 0")
    return value


def _parse_positive(name: str, raw: str) -> int:
    value = _parse_count(name, raw)
    if value < 1:
        raise ConfigError(f"{name}={raw!r} must be >= 1")
    return value


def _parse_log_level(name: str, raw: str) -> str:
    level = raw.lower()
    if level not in LOG_LEVELS:
        raise ConfigError(f"{name}={raw!r} is not a log level (one of {', '.join(LOG_LEVELS)})")
    return level


def _parse_job_name(name: str, raw: str) -> str:
    if not JOB_NAME_RE.match(raw):
        raise ConfigError(f"{name}={raw!r} must match {JOB_NAME_RE.pattern} (it is a NATS subject token)")
    return raw


def _parse_nats_url(name: str, raw: str) -> str:
    urls = _split_urls(raw)
    if not urls:
        raise ConfigError(f"{name}={raw!r} names no server")
    for url in urls:
        if any(c.isspace() for c in url):
            raise ConfigError(f"{name}={raw!r}: server {url!r} contains whitespace")
    return ",".join(urls)


def _split_urls(value: str) -> list[str]:
    return [u.strip() for u in value.split(",") if u.strip()]
