"""Discovery and health through the NATS services API (``$SRV``, the ``nats.micro`` protocol).

Every long-running instance (PS replica, embedding worker, NN rank) registers itself as a
``nats.micro`` service, so ``$SRV.PING``, ``$SRV.INFO`` and ``$SRV.STATS`` (and the official
``nats micro ls|info|stats``) list it:

- **name** per role: ``persia-ps``, ``persia-embedding-worker``, ``persia-nn-worker``;
  **version**: the installed ``persia-nats`` version;
- **metadata** (strings, as the protocol requires): ``job``, ``role``, ``replica_index``,
  ``replica_size`` (where the instance knows it), ``instance``, ``host``, ``pid``,
  ``status_subject`` and, once its Prometheus endpoint is up, ``metrics_port``. Several jobs share
  one NATS, so every reader filters by ``job``;
- **endpoints**: one real micro endpoint, ``status`` on ``persia.<job>.srv.<instance>.status``,
  answering the map of the ``persia.<job>.status`` broadcast (msgpack), and, listed for
  documentation only, every subject the instance's :class:`~persia_nats.common.rpc.RpcServer` serves, with its
  queue group. Those handlers stay on the RpcServer: a micro endpoint always subscribes in a queue
  group, which would change how requests are routed;
- **stats**: the ``status`` endpoint's ``data`` is the same status map (micro's stats handler),
  and each RpcServer subject reports its requests, error replies and processing time from the
  RpcServer's own counters.

:class:`InstanceService` is ``nats.micro``'s ``Service`` (what ``nats.micro.add_service`` builds)
with ``info()`` and ``stats()`` extended by those RpcServer subjects.

Readers: :func:`discover` lists a job's instances of a role, :func:`wait_for` waits until enough
distinct replicas are up (peers use it instead of sleeping), :func:`stats` reads ``$SRV.STATS``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.micro.request import Request
from nats.micro.service import (
    NAME_REGEX,
    SEMVER_REGEX,
    EndpointInfo,
    EndpointStats,
    ServiceConfig,
    ServiceInfo,
    ServiceStats,
)
from nats.micro.service import Service as MicroService
from persia_nats.common.codec import pack
from persia_nats.common.errors import BadRequest, NoResponders, PeersMissing, RemoteError, RequestTimeout
from persia_nats.common.messages import Empty, PsInfoReply
from persia_nats.common.rpc import RpcServer, request
from persia_nats.common.subjects import Subjects

log = logging.getLogger(__name__)

SRV_PREFIX = "$SRV"
SERVICE_PREFIX = "persia-"
DEFAULT_VERSION = "0.1.0"  # when the package metadata cannot be read (a bare checkout)

#: role (``Service.role``) -> nats.micro service name
SERVICE_NAMES = {
    "embedding-parameter-server": "persia-ps",
    "embedding-worker": "persia-embedding-worker",
    "nn-worker": "persia-nn-worker",
}
_ALIASES = {"ps": "embedding-parameter-server", "ew": "embedding-worker", "nn": "nn-worker"}

StatusFn = Callable[[], Mapping[str, Any]]


class DiscoveryTimeout(RequestTimeout):
    """:func:`wait_for` ran out of time before enough instances registered."""


def service_name(role: str) -> str:
    """The micro service name of a role (a role name, an alias or a ``persia-`` name)."""
    if role.startswith(SERVICE_PREFIX):
        return role
    role = _ALIASES.get(role, role)
    name = SERVICE_NAMES.get(role) or SERVICE_PREFIX + re.sub(r"[^A-Za-z0-9_-]", "-", role)
    if not NAME_REGEX.match(name):
        raise ValueError(f"role {role!r} gives no valid micro service name")
    return name


@functools.cache
def project_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        found = version("persia-nats")
    except (ImportError, PackageNotFoundError):
        return DEFAULT_VERSION
    return found if SEMVER_REGEX.match(found) else DEFAULT_VERSION


def _json_safe(obj: Any) -> Any:
    """Plain JSON values (micro serialises stats with ``json.dumps``; NaN is not JSON)."""
    if isinstance(obj, Mapping):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        try:
            obj = obj.item()
        except (TypeError, ValueError):
            return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)


def _endpoint_name(subject: str, prefix: str) -> str:
    """``persia.<job>.ps.0.lookup`` -> ``ps_0_lookup`` (micro names allow A-Z a-z 0-9 - _)."""
    tail = subject[len(prefix) + 1:] if subject.startswith(prefix + ".") else subject
    return re.sub(r"[^A-Za-z0-9_-]", "_", tail.replace(".", "_")) or "subject"


class InstanceService(MicroService):
    """A ``nats.micro`` service whose INFO and STATS also list the subjects an RpcServer serves."""

    def __init__(self, nc: NATS, config: ServiceConfig, rpc: RpcServer | None, subject_prefix: str) -> None:
        super().__init__(nc, config)
        self.rpc = rpc
        self.subject_prefix = subject_prefix

    def _rpc_subjects(self, taken: set[str]) -> list[tuple[str, str, str]]:
        """(endpoint name, subject, queue group) of every RpcServer subject; ``taken``: micro's names."""
        if self.rpc is None:
            return []
        out = []
        for subject, queue in sorted(self.rpc.queues.items()):
            name = _endpoint_name(subject, self.subject_prefix)
            out.append((f"{name}_rpc" if name in taken else name, subject, queue))
        return out

    def info(self) -> ServiceInfo:
        info = super().info()
        info.endpoints.extend(
            EndpointInfo(name=name, subject=subject, queue_group=queue, metadata={"served_by": "persia-rpc"})
            for name, subject, queue in self._rpc_subjects({e.name for e in info.endpoints}))
        return info

    def stats(self) -> ServiceStats:
        stats = super().stats()  # the micro endpoints, their data from the stats handler
        if self.rpc is None:
            return stats
        errors: dict[str, dict[str, int]] = {}
        for (subject, code), n in list(self.rpc.errors.items()):
            errors.setdefault(subject, {})[str(code)] = n
        for name, subject, queue in self._rpc_subjects({e.name for e in stats.endpoints}):
            n = self.rpc.requests.get(subject, 0)
            busy_ns = int(self.rpc.busy.get(subject, 0.0) * 1e9)
            by_code = errors.get(subject, {})
            stats.endpoints.append(EndpointStats(
                name=name, subject=subject, queue_group=queue, num_requests=n, num_errors=sum(by_code.values()),
                processing_time=busy_ns,
                average_processing_time=busy_ns // n if n else 0,
                data={"errors_by_code": by_code} if by_code else None))
        return stats


@dataclass
class Registration:
    """A registered instance; :meth:`stop` unregisters it (it vanishes from ``$SRV``)."""

    nc: NATS
    service: InstanceService
    metadata: dict[str, str]
    status_subject: str
    _stopped: bool = field(default=False, repr=False)

    @property
    def id(self) -> str:
        return self.service.id

    def update_metadata(self, **values: object) -> None:
        """Add or change metadata (call from the event loop that serves the instance)."""
        self.metadata.update({k: str(v) for k, v in values.items()})  # micro holds this very dict

    async def stop(self, timeout: float = 2.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.service.stop(), timeout)
        except Exception as exc:  # the connection is going away anyway: nothing more can be asked
            log.debug("could not unregister %s: %s", self.status_subject, exc)


async def register(nc: NATS, *, job: str, role: str, replica_index: int, instance: str, status: StatusFn,
                   rpc: RpcServer | None = None, replica_size: int | None = None,
                   metadata: Mapping[str, object] | None = None) -> Registration:
    """Register one instance under its role's micro service name; see the module docstring."""
    subjects = Subjects(job)
    name = service_name(role)
    status_subject = subjects.srv_status(instance)
    meta = {"job": job, "role": role, "replica_index": str(int(replica_index)), "instance": instance,
            "host": socket.gethostname(), "pid": str(os.getpid()), "status_subject": status_subject}
    if replica_size is not None:
        meta["replica_size"] = str(int(replica_size))
    meta.update({k: str(v) for k, v in (metadata or {}).items()})

    def safe_status() -> Any:
        try:
            return _json_safe(status())
        except Exception as exc:  # a figure that cannot be read must not break STATS
            log.exception("could not read the status of %s", instance)
            return {"error": f"{type(exc).__name__}: {exc}"}

    config = ServiceConfig(name=name, version=project_version(), metadata=meta,
                           description=f"PERSIA {role} {instance} of job {job}",
                           stats_handler=lambda _endpoint: safe_status())
    service = InstanceService(nc, config, rpc, subjects.prefix)

    async def on_status(req: Request) -> None:
        await req.respond(pack(safe_status()))

    # the endpoint first, then the $SRV subscriptions: once discoverable, the instance is complete
    await service.add_endpoint(name="status", subject=status_subject, handler=on_status,
                               metadata={"encoding": "msgpack"})
    try:
        await service.start()
    except BaseException:
        await service.stop()
        raise
    log.debug("registered %s %s (%s) as %s", name, instance, job, service.id)
    return Registration(nc, service, meta, status_subject)


# -- readers ---------------------------------------------------------------------------------------


async def _collect(nc: NATS, subject: str, wait: float,
                   enough: Callable[[list[dict[str, Any]]], bool] | None = None) -> list[dict[str, Any]]:
    """Publish an empty request and collect the JSON replies for up to ``wait`` seconds.

    Returns early once ``enough(replies)`` holds, or when the server says nobody listens.
    """
    inbox = nc.new_inbox()
    replies: list[dict[str, Any]] = []
    done = asyncio.Event()

    async def on_reply(msg: Msg) -> None:
        if not msg.data:
            if msg.headers and msg.headers.get("Status") == "503":  # no responders at all
                done.set()
            return
        try:
            reply = json.loads(msg.data)
        except ValueError:
            log.debug("ignoring a non-JSON reply on %s", subject)
            return
        if isinstance(reply, dict):
            replies.append(reply)
            if enough is not None and enough(replies):
                done.set()

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subject, b"", reply=inbox)
        try:
            await asyncio.wait_for(done.wait(), wait)
        except TimeoutError:
            pass
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # the connection closed meanwhile
            pass
    return list(replies)


def _instance(reply: Mapping[str, Any], job: str, name: str | None) -> dict[str, Any] | None:
    """The reply with its identity parsed out, or None when it is not an instance of this job."""
    meta = reply.get("metadata")
    sname = reply.get("name")
    if not isinstance(meta, Mapping) or not isinstance(sname, str) or meta.get("job") != job:
        return None
    if not sname.startswith(SERVICE_PREFIX) or (name is not None and sname != name):
        return None
    try:
        index = int(meta.get("replica_index", ""))
    except ValueError:
        return None
    try:
        size: int | None = int(meta["replica_size"])
    except (KeyError, ValueError):
        size = None
    return {**reply, "job": job, "role": str(meta.get("role", "")), "replica_index": index, "replica_size": size,
            "instance": str(meta.get("instance", "")), "metadata": dict(meta)}


def _order(instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(instances, key=lambda i: (i["role"], i["replica_index"], i["instance"], str(i.get("id"))))


async def _find(nc: NATS, verb: str, job: str, role: str | None, timeout: float,
                enough: Callable[[list[dict[str, Any]]], bool] | None) -> list[dict[str, Any]]:
    name = service_name(role) if role is not None else None
    subject = f"{SRV_PREFIX}.{verb}.{name}" if name else f"{SRV_PREFIX}.{verb}"

    def parse(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [i for i in (_instance(r, job, name) for r in replies) if i is not None]

    test = (lambda replies: enough(parse(replies))) if enough is not None else None
    return _order(parse(await _collect(nc, subject, timeout, test)))


async def discover(nc: NATS, job: str, role: str | None = None, timeout: float = 0.5, *,
                   enough: Callable[[list[dict[str, Any]]], bool] | None = None) -> list[dict[str, Any]]:
    """The registered instances of ``job`` (of ``role`` when given), from ``$SRV.INFO``.

    Each is micro's INFO reply (``id``, ``name``, ``version``, ``endpoints``, ``metadata``) plus
    ``job``, ``role``, ``replica_index`` (int), ``replica_size`` (int or None) and ``instance``,
    ordered by role, replica index and instance. Collects replies for ``timeout`` seconds, or
    until ``enough(instances)`` holds.
    """
    return await _find(nc, "INFO", job, role, timeout, enough)


async def stats(nc: NATS, job: str, role: str | None = None, timeout: float = 0.5) -> list[dict[str, Any]]:
    """Like :func:`discover`, from ``$SRV.STATS``: ``started`` and per-endpoint counters instead."""
    return await _find(nc, "STATS", job, role, timeout, None)


def replica_indexes(instances: list[dict[str, Any]]) -> set[int]:
    return {i["replica_index"] for i in instances}


PS_ROLE = "embedding-parameter-server"  # Service.role of a PS replica


def _agreed_size(known: Mapping[int, int]) -> int | None:
    """The replica count every known replica reports (None while none is known)."""
    sizes = set(known.values())
    if len(sizes) > 1:
        raise RemoteError(f"PS replicas disagree on the replica count: {dict(sorted(known.items()))} (index: size)")
    if not sizes:
        return None
    size = sizes.pop()
    if size < 1 or max(known) >= size:
        raise RemoteError(f"PS replicas report indexes {sorted(known)} of a replica count {size}")
    return size


async def _probe_info(nc: NATS, subjects: Subjects, index: int, timeout: float) -> int | None:
    """An unregistered (older) replica: its replica_size from ``ps.<i>.info``, or None when absent."""
    try:
        raw = await request(nc, subjects.ps(index, "info"), Empty(), min(timeout, 1.0))
    except (NoResponders, RequestTimeout):
        return None
    try:
        info = PsInfoReply.from_wire(raw)
    except BadRequest as exc:  # its answer, not our request, is malformed
        raise RemoteError(f"PS replica {index} answered a malformed info reply: {exc}") from None
    if info.replica_index != index:
        raise RemoteError(f"PS replica {index} reports index {info.replica_index!r} of {info.replica_size!r}")
    # a replica answers info while it still loads its shard: found only once it serves lookups
    return info.replica_size if info.ready else None


async def discover_replica_size(nc: NATS, subjects: Subjects, timeout: float, deadline: float) -> int:
    """How many PS replicas the job has, once every one of them is up and they all agree.

    Replicas are found through the NATS services API (``$SRV.INFO.persia-ps``, filtered by job:
    :func:`discover`); each reports its ``replica_index`` and ``replica_size`` in its
    metadata. A replica that is not registered (an older build) is asked on ``ps.<i>.info``
    instead. Waits with backoff, up to ``deadline`` seconds, so start-up order does not matter.

    Raises:
        PeersMissing: not every replica was up within ``deadline`` seconds.
        RemoteError: the replicas disagree on their count, or report an impossible index.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    delay = 0.05
    log.info("waiting for every %s replica of job %r (giving up after %gs)", PS_ROLE, subjects.job, deadline)
    known: dict[int, int] = {}  # replica index -> the replica count it reports

    def complete(found: list[dict[str, Any]]) -> bool:
        sizes = {i["replica_size"] for i in found} | set(known.values())
        return len(sizes) == 1 and None not in sizes and \
            set(range(int(next(iter(sizes))))) <= replica_indexes(found) | known.keys()

    while True:
        found = await discover(nc, subjects.job, PS_ROLE, timeout=max(min(0.25, end - loop.time()), 0.01),
                               enough=complete)
        known.update({i["replica_index"]: i["replica_size"] for i in found if i["replica_size"] is not None})
        size = _agreed_size(known)
        for index in [0] if size is None else [i for i in range(size) if i not in known]:
            probed = await _probe_info(nc, subjects, index, timeout)
            if probed is not None:
                known[index] = probed
        size = _agreed_size(known)
        if size is not None and set(range(size)) <= known.keys():
            return size
        if loop.time() + delay > end:
            raise PeersMissing(f"not every PS replica ({PS_ROLE}) of job {subjects.job!r} was up within "
                               f"{deadline:g}s: found indexes {sorted(known)} of {size if size is not None else '?'}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


async def wait_for(nc: NATS, job: str, role: str, count: int, deadline: float,
                   poll: float = 0.25) -> list[dict[str, Any]]:
    """Wait until ``count`` distinct replica indexes of ``role`` are registered in ``job``.

    Polls ``$SRV.INFO.<name>`` with capped exponential backoff; returns every instance found.

    Raises:
        DiscoveryTimeout: fewer than ``count`` replicas within ``deadline`` seconds (the message
            says which were found).
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    delay = 0.05

    def enough(found: list[dict[str, Any]]) -> bool:
        return len(replica_indexes(found)) >= count

    while True:
        remaining = end - loop.time()
        found = await discover(nc, job, role, timeout=max(min(poll, remaining), 0.01), enough=enough)
        if enough(found):
            return found
        if loop.time() + delay >= end:
            name = service_name(role)
            raise DiscoveryTimeout(
                f"waited {deadline:g}s for {count} {name} instance(s) of job {job!r} on "
                f"{SRV_PREFIX}.INFO.{name}; found replica indexes {sorted(replica_indexes(found))}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


# -- the cluster view of ``persia-launcher status`` ------------------------------------------------


def _uptime_s(started: object, now: datetime) -> float | None:
    if not isinstance(started, str):
        return None
    try:
        when = datetime.strptime(started, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    except ValueError:
        return None
    return max((now - when).total_seconds(), 0.0)


def format_uptime(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s // 60 % 60:02d}m"


def _port(value: Any) -> int | None:
    """A metadata port (metadata values are strings), or None where the instance serves no metrics."""
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


async def cluster_status(nc: NATS, job: str, wait: float = 1.0) -> list[dict[str, Any]]:
    """Every live instance of ``job``, from ``$SRV.INFO`` and ``$SRV.STATS``, one map each.

    Each map has the status broadcast's ``role``, ``replica``, ``instance`` and ``stats`` (the
    ``status`` endpoint's data), plus ``id``, ``name``, ``version``, ``host``, ``started``,
    ``uptime_s``, ``subjects``, ``metrics_port`` (None without a Prometheus endpoint) and
    ``source: "srv"``. ``$SRV`` is the one registry read: an instance that does not register is not
    listed (the ``persia.<job>.status`` broadcast, which every role answers, reaches it).
    Both requests run at once, for ``wait`` seconds.
    """
    infos, stat_replies = await asyncio.gather(discover(nc, job, None, wait), stats(nc, job, None, wait))
    now = datetime.now(UTC)
    by_id: dict[str, dict[str, Any]] = {}
    for reply in infos:
        by_id[str(reply.get("id"))] = {"info": reply}
    for reply in stat_replies:
        by_id.setdefault(str(reply.get("id")), {})["stats"] = reply
    out: list[dict[str, Any]] = []
    for sid, parts in by_id.items():
        info, st = parts.get("info"), parts.get("stats")
        base = info or st
        assert base is not None
        status: Mapping[str, Any] = {}
        for endpoint in (st or {}).get("endpoints") or []:
            if endpoint.get("subject") == base["metadata"].get("status_subject") and isinstance(
                    endpoint.get("data"), Mapping):
                status = endpoint["data"]
        out.append({
            "v": status.get("v", 1), "role": base["role"], "replica": base["replica_index"],
            "instance": base["instance"], "stats": dict(status.get("stats") or {}), "id": sid,
            "name": base.get("name"), "version": base.get("version"), "host": base["metadata"].get("host"),
            "replica_size": base["replica_size"], "started": (st or {}).get("started"),
            "uptime_s": _uptime_s((st or {}).get("started"), now),
            "subjects": [e.get("subject") for e in (info or {}).get("endpoints") or []],
            "metrics_port": _port(base["metadata"].get("metrics_port")), "source": "srv"})
    out.sort(key=lambda r: (str(r.get("role")), r.get("replica") if isinstance(r.get("replica"), int) else -1,
                            str(r.get("instance"))))
    return out
