"""Environment variables every PERSIA process reads, parsed once into a frozen :class:`Env`.

The environment is passed in (``read_env(environ)``) rather than read from ``os.environ`` deep in
the code, and nothing is cached, so a test can run every role in one process with a different
environment for each.

An empty value counts as unset: orchestrators (docker compose, Kubernetes) commonly template a
variable to ``""`` when no value was supplied.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from persia_nats.common.config import JOB_NAME_RE
from persia_nats.common.errors import ConfigError
from persia_nats.common.subjects import inbox_prefix

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
#: seconds a role tries to reach NATS at start: it exits within 30 s, torch import and start-up included
DEFAULT_CONNECT_TIMEOUT = 15.0

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Env:
    """The process environment, validated.

    Attributes:
        nats_url: ``PERSIA_NATS_URL``: one NATS URL or a comma-separated list (see ``nats_servers``); else
            ``PERSIA_NATS_IP``, the name PERSIA's ``.honcho.env``, operator and scripts set (a URL or a bare
            host[:port]). When both are set and differ, ``PERSIA_NATS_URL`` wins (PERSIA's own later name) and
            a warning names both.
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
        checkpoint_dir: ``PERSIA_CHECKPOINT_DIR``: overrides ``checkpointing_config.checkpoint_dir`` when set.
        nats_user, nats_password: ``PERSIA_NATS_USER`` / ``PERSIA_NATS_PASSWORD``: user and
            password authentication (both or neither).
        nats_token: ``PERSIA_NATS_TOKEN``: token authentication (not with a user).
        nats_creds: ``PERSIA_NATS_CREDS``: a ``.creds`` file (user JWT and nkey seed, for servers
            run in operator mode); needs the ``nkeys`` package.
        nats_nkey_seed: ``PERSIA_NATS_NKEY_SEED``: a file holding an nkey seed (``SU...``); needs
            the ``nkeys`` package.
        nats_tls_ca: ``PERSIA_NATS_TLS_CA``: PEM file of the CA(s) that signed the server's
            certificate (unset: the system's CAs).
        nats_tls_cert, nats_tls_key: ``PERSIA_NATS_TLS_CERT`` / ``PERSIA_NATS_TLS_KEY``: this
            client's certificate and key, for servers that verify clients (both or neither).
        nats_tls_hostname: ``PERSIA_NATS_TLS_HOSTNAME``: the name to verify the server's
            certificate against, when the URL names the server otherwise (an IP, a k8s short name).
        nats_connect_timeout: ``PERSIA_NATS_CONNECT_TIMEOUT``: seconds a role keeps trying to reach
            NATS at start before it exits naming the URL (default 15).
        metrics_port: ``PERSIA_METRICS_PORT``: when set, metrics on at this port whatever
            ``metrics_config.enable_metrics`` says (0: a free port); deployments set it, one port for
            every pod or container to scrape.
        share_gpus: ``PERSIA_SHARE_GPUS``: ``1`` lets more NN ranks than GPUs on a host share them (rank
            ``LOCAL_RANK`` on GPU ``LOCAL_RANK mod GPUs``), every rank of the job all-reducing with gloo,
            which takes CUDA tensors where NCCL refuses two ranks on one GPU; ``0`` (the default): a rank
            without a GPU of its own trains on the CPU. A job-wide choice: its ranks must agree on a backend.

    The secrets (password, token) are left out of ``repr``, so logging an ``Env`` leaks nothing.
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
    checkpoint_dir: str | None = None
    nats_user: str | None = None
    nats_password: str | None = field(default=None, repr=False)
    nats_token: str | None = field(default=None, repr=False)
    nats_creds: str | None = None
    nats_nkey_seed: str | None = None
    nats_tls_ca: str | None = None
    nats_tls_cert: str | None = None
    nats_tls_key: str | None = None
    nats_tls_hostname: str | None = None
    nats_connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    metrics_port: int | None = None
    share_gpus: bool = False

    @property
    def nats_servers(self) -> list[str]:
        """The NATS server URLs in ``nats_url``, in order, blanks dropped."""
        return _split_urls(self.nats_url)

    @property
    def nats_tls(self) -> bool:
        """Whether any TLS setting is given (a ``tls://`` URL alone uses the system's CAs)."""
        return bool(self.nats_tls_ca or self.nats_tls_cert or self.nats_tls_hostname)

    def nats_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` with this environment's credentials and TLS.

        Only the options that are set appear, so ``nats.connect(servers, **env.nats_options())``
        keeps nats-py's defaults otherwise. ``tls`` is an :class:`ssl.SSLContext` that verifies the
        server against ``nats_tls_ca`` (or the system's CAs) and presents the client certificate.

        Raises:
            ConfigError: A TLS file does not hold what it should, or nkeys is not installed.
        """
        options: dict[str, Any] = {}
        if self.nats_user is not None:
            options["user"] = self.nats_user
            options["password"] = self.nats_password
            # the only inbox deploy/nats-auth.conf lets this user read, and its responders answer
            options["inbox_prefix"] = inbox_prefix(self.nats_user)
        if self.nats_token is not None:
            options["token"] = self.nats_token
        for name, value, key in (("PERSIA_NATS_CREDS", self.nats_creds, "user_credentials"),
                                 ("PERSIA_NATS_NKEY_SEED", self.nats_nkey_seed, "nkeys_seed")):
            if value is not None:
                if importlib.util.find_spec("nkeys") is None:
                    raise ConfigError(f"{name} needs the nkeys package: pip install nkeys")
                options[key] = value
        if self.nats_tls:
            options["tls"] = self._ssl_context()
        if self.nats_tls_hostname is not None:
            options["tls_hostname"] = self.nats_tls_hostname
        return options

    def _ssl_context(self) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.nats_tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"PERSIA_NATS_TLS_CA={self.nats_tls_ca!r}: not a PEM CA file ({exc})") from None
        if self.nats_tls_cert is not None:
            try:
                ctx.load_cert_chain(self.nats_tls_cert, self.nats_tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"PERSIA_NATS_TLS_CERT={self.nats_tls_cert!r} / PERSIA_NATS_TLS_KEY="
                                  f"{self.nats_tls_key!r}: not a PEM certificate and its key ({exc})") from None
        return ctx


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
        nats_url=_nats_url(environ, default.nats_url),
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
        checkpoint_dir=get("PERSIA_CHECKPOINT_DIR", _parse_str, None),
        nats_user=get("PERSIA_NATS_USER", _parse_str, None),
        nats_password=get("PERSIA_NATS_PASSWORD", _parse_str, None),
        nats_token=get("PERSIA_NATS_TOKEN", _parse_str, None),
        nats_creds=get("PERSIA_NATS_CREDS", _parse_file, None),
        nats_nkey_seed=get("PERSIA_NATS_NKEY_SEED", _parse_file, None),
        nats_tls_ca=get("PERSIA_NATS_TLS_CA", _parse_file, None),
        nats_tls_cert=get("PERSIA_NATS_TLS_CERT", _parse_file, None),
        nats_tls_key=get("PERSIA_NATS_TLS_KEY", _parse_file, None),
        nats_tls_hostname=get("PERSIA_NATS_TLS_HOSTNAME", _parse_str, None),
        nats_connect_timeout=get("PERSIA_NATS_CONNECT_TIMEOUT", _parse_seconds, default.nats_connect_timeout),
        metrics_port=get("PERSIA_METRICS_PORT", _parse_port, None),
        share_gpus=get("PERSIA_SHARE_GPUS", _parse_switch, default.share_gpus),
    )
    _check_nats_auth(env)
    if env.replica_index >= env.replica_size:
        raise ConfigError(
            f"REPLICA_INDEX={env.replica_index} must be less than REPLICA_SIZE={env.replica_size}"
        )
    if env.rank >= env.world_size:
        raise ConfigError(f"RANK={env.rank} must be less than WORLD_SIZE={env.world_size}")
    return env


def _parse_str(name: str, raw: str) -> str:
    return raw


_warned_nats_vars: set[tuple[str, str]] = set()


def _nats_url(environ: Mapping[str, str], default: str) -> str:
    """``PERSIA_NATS_URL``, else PERSIA's ``PERSIA_NATS_IP``, else ``default``; a bare host gets ``nats://``."""
    url = environ.get("PERSIA_NATS_URL", "").strip()
    ip = environ.get("PERSIA_NATS_IP", "").strip()
    if ip:
        urls = _split_urls(_parse_nats_url("PERSIA_NATS_IP", ip))  # an "IP", so often a host with no port
        ip = ",".join(u if "://" in u else f"nats://{u}" if ":" in u else f"nats://{u}:4222" for u in urls)
    if not url:
        return ip or default
    url = _parse_nats_url("PERSIA_NATS_URL", url)
    # read_env runs on every persia.env call: say it once per process, not once per call
    if ip and ip != url and (url, ip) not in _warned_nats_vars:
        _warned_nats_vars.add((url, ip))
        log.warning("PERSIA_NATS_URL=%s and PERSIA_NATS_IP=%s are both set: using PERSIA_NATS_URL", url, ip)
    return url


def _parse_port(name: str, raw: str) -> int:
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a port number (0..65535)") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{name}={raw!r}: expected a port number (0..65535)")
    return port


def _parse_file(name: str, raw: str) -> str:
    if not Path(raw).is_file():
        raise ConfigError(f"{name}={raw!r}: no such file")
    return raw


def _check_nats_auth(env: Env) -> None:
    """Refuse contradictory NATS credentials: exactly one way to authenticate, or none."""
    if (env.nats_user is None) != (env.nats_password is None):
        given, missing = (("PERSIA_NATS_USER", "PERSIA_NATS_PASSWORD") if env.nats_user is not None
                          else ("PERSIA_NATS_PASSWORD", "PERSIA_NATS_USER"))
        raise ConfigError(f"{given} is set but {missing} is not: set both or neither")
    ways = [name for name, value in (("PERSIA_NATS_USER/PERSIA_NATS_PASSWORD", env.nats_user),
                                     ("PERSIA_NATS_TOKEN", env.nats_token),
                                     ("PERSIA_NATS_CREDS", env.nats_creds),
                                     ("PERSIA_NATS_NKEY_SEED", env.nats_nkey_seed)) if value is not None]
    if len(ways) > 1:
        raise ConfigError(f"{' and '.join(ways)} cannot be combined: choose one way to authenticate to NATS")
    if ways and any(urlsplit(u if "://" in u else f"nats://{u}").username for u in env.nats_servers):
        raise ConfigError(f"PERSIA_NATS_URL holds credentials and {ways[0]} is set: give them in one place")
    if (env.nats_tls_cert is None) != (env.nats_tls_key is None):
        given, missing = (("PERSIA_NATS_TLS_CERT", "PERSIA_NATS_TLS_KEY") if env.nats_tls_cert is not None
                          else ("PERSIA_NATS_TLS_KEY", "PERSIA_NATS_TLS_CERT"))
        raise ConfigError(f"{given} is set but {missing} is not: a client certificate needs its key")


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


def _parse_switch(name: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ConfigError(f"{name}={raw!r}: expected 1 (on) or 0 (off)")
    return raw == "1"


def _parse_seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise ConfigError(f"{name}={raw!r} must be a positive number of seconds")
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
        _check_nats_url(name, url)
    return ",".join(urls)


NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def _check_nats_url(name: str, url: str) -> None:
    """A server nats-py can dial: ``SCHEME://host[:port]`` with a NATS scheme, or a bare ``host[:port]``.

    nats-py would take ``http://h:4222`` or ``nats//h`` and fail only when connecting, far from the typo.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    elif scheme.lower() not in NATS_SCHEMES:
        raise ConfigError(f"{name}: server {url!r} has scheme {scheme!r}; use one of "
                          f"{', '.join(s + '://' for s in NATS_SCHEMES)} (e.g. nats://127.0.0.1:4222)")
    host = rest.rsplit("@", 1)[-1]
    if scheme.lower() in ("ws", "wss"):  # a proxy may serve NATS under a path
        host = host.split("/", 1)[0]
    try:
        parts = urlsplit(f"nats://{host}")
        parts.port  # noqa: B018  # raises on a port that is not a number in 0..65535
    except ValueError as exc:
        raise ConfigError(f"{name}: server {url!r} is not host:port ({exc})") from None
    if not parts.hostname or parts.path or parts.query or parts.fragment:
        raise ConfigError(f"{name}: server {url!r} is not [nats://]host[:port] (e.g. nats://127.0.0.1:4222)")


def _split_urls(value: str) -> list[str]:
    return [u.strip() for u in value.split(",") if u.strip()]
