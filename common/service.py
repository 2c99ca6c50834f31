"""Service lifecycle: connect, start, run until told to stop, drain, exit 0.

Only :func:`run_service` (called from entry points) installs signal handlers and configures
logging; services themselves take their NATS connection and config as arguments, so one test can
run every role in one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import nats
import nats.errors
from nats.aio.client import Client as NATS
from persia_nats.common import taskdump
from persia_nats.common.discovery import Registration, register
from persia_nats.common.env import DEFAULT_CONNECT_TIMEOUT
from persia_nats.common.errors import NatsUnreachable, describe
from persia_nats.common.logs import figures as as_fields
from persia_nats.common.messages import Empty, StatusReply
from persia_nats.common.rpc import RpcServer
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_delay, wait_random_exponential

if TYPE_CHECKING:
    from persia_nats.common.config import MetricsConfig
    from persia_nats.common.env import Env
    from persia_nats.common.metrics import MetricsServer

log = logging.getLogger(__name__)

_CLOSING = "_persia_closing"  # set on a connection its owner is closing (see closing())
DEFAULT_DRAIN_TIMEOUT = 30.0  # seconds; k8s' default terminationGracePeriodSeconds is 30
#: a client pings its server this often (seconds) and counts the connection stale, and reconnects to another
#: node, after this many pings without a PONG: nats-py's 120 s default left a role whose node froze or was
#: cut off waiting 20-28 s for it (benchmarks/cluster.py --scenario pause/partition) while the stream had a
#: new leader within seconds. It moves within 3-4 s now, before its peers' first resend (a request timeout
#: later) goes out, so a cut-off node costs one request timeout, as a killed one does; 2 s pings (6-8 s)
#: cost two. Any PONG clears the count and the count only grows while the loop runs its timer, so a loop
#: blocked for seconds raises no false alarm: only a server that answers nothing for 3 s does.
PING_INTERVAL_S = 1
MAX_OUTSTANDING_PINGS = 3



async def connect(servers: list[str] | str, name: str, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                  **options: Any) -> NATS:
    """Connect, retrying quietly until ``connect_timeout``; once connected, reconnect without bound.

    The server may come up after us (honcho and compose start everything at once), so failed
    attempts are retried, with jittered exponential backoff (tenacity) so that a whole job's roles
    do not knock in step, and logged only at debug: the one line a person sees is the bound, logged
    first, and then either nothing or the :class:`NatsUnreachable` the entry point prints. A
    refusal that retrying cannot cure (wrong credentials, a certificate that does not verify) fails
    at once. ``options`` go to ``nats.connect`` (credentials and TLS:
    :meth:`persia_nats.common.env.Env.nats_options`).

    Raises:
        NatsUnreachable: The server refused us, or none answered within ``connect_timeout``.
    """
    where = _redact(servers)
    log.info("connecting to NATS at %s as %r (giving up after %gs)", where, name, connect_timeout)
    jitter = wait_random_exponential(multiplier=0.1, max=2.0)

    def wait(state: RetryCallState) -> float:  # the last try falls on the bound, not a sleep before it
        return min(jitter(state), max(connect_timeout - (state.seconds_since_start or 0.0), 0.0))

    attempts = AsyncRetrying(stop=stop_after_delay(connect_timeout), wait=wait, reraise=True,
                             retry=retry_if_exception(lambda exc: not _is_refusal(exc)))
    try:
        async for attempt in attempts:
            with attempt:
                return await _connect_once(servers, name, min(2.0, connect_timeout), options)
    except Exception as exc:
        if _is_refusal(exc):
            raise NatsUnreachable(
                f"NATS at {where} refused {name!r}: {describe(exc)} (check PERSIA_NATS_USER/PASSWORD, "
                f"PERSIA_NATS_TOKEN, PERSIA_NATS_CREDS, PERSIA_NATS_NKEY_SEED, PERSIA_NATS_TLS_*)") from exc
        raise NatsUnreachable(f"no NATS server at {where} accepted {name!r} within {connect_timeout:g}s "
                              f"(last error: {describe(exc)})") from exc
    raise AssertionError("unreachable: tenacity either returns an attempt's result or raises")


async def _connect_once(servers: list[str] | str, name: str, timeout: float, options: Mapping[str, Any]) -> NATS:
    """One try at every server (twice each, by nats-py); raises why the last one failed."""
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[BaseException] = loop.create_future()
    state: dict[str, Any] = {"connected": False, "last": None}

    async def error_cb(exc: Exception) -> None:
        if state["connected"]:
            # a service shutting down loses its server too (honcho stops them all at once): that is no news
            level = logging.DEBUG if getattr(nc, _CLOSING, False) else logging.WARNING
            log.log(level, "nats error: %s", describe(exc))
            return
        state["last"] = exc  # a failed attempt: retried by connect(), which reports the outcome
        log.debug("nats connect attempt: %s", describe(exc))
        if _is_refusal(exc) and not refused.done():
            refused.set_result(exc)

    nc = NATS()
    liveness = {"ping_interval": PING_INTERVAL_S, "max_outstanding_pings": MAX_OUTSTANDING_PINGS, **options}
    # nats-py catches a TLS failure and tries again, and its handshake has no timeout of its own: bound it here
    attempt = loop.create_task(nc.connect(
        servers, name=name, allow_reconnect=False, max_reconnect_attempts=1, reconnect_time_wait=0,
        # nats-py annotates connect_timeout as int but uses it only as asyncio timeouts, where float seconds work
        error_cb=error_cb, connect_timeout=timeout, **liveness))  # type: ignore[arg-type]
    first: set[asyncio.Future[Any]] = {attempt, refused}
    try:
        await asyncio.wait(first, timeout=2 * timeout + 1, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not attempt.done():
            attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)
    if not attempt.cancelled() and attempt.exception() is None:
        state["connected"] = True
        # nats-py reads these on each reconnect: bounded while we start, unbounded for a running role
        nc.options.update(allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
        return nc
    await _discard(nc)
    if refused.done():
        raise refused.result()
    failed = None if attempt.cancelled() else attempt.exception()
    if isinstance(failed, nats.errors.NoServersError) and state["last"] is not None:
        failed = state["last"]  # says why (refused, TLS, timeout), where NoServersError does not
    raise failed or TimeoutError(f"no answer within {2 * timeout + 1:g}s")


async def _discard(nc: NATS) -> None:
    """Release a client whose connect failed; bounded, since closing a TLS socket whose handshake
    failed can wait forever for the peer's close_notify."""
    if not nc.is_closed:
        try:
            await asyncio.wait_for(nc.close(), 1.0)
        except Exception as exc:  # a timeout too: half-open, nothing left to release
            log.debug("close after a failed connect: %s", describe(exc))


async def connect_from_env(env: Env, name: str, connect_timeout: float | None = None, **options: Any) -> NATS:
    """:func:`connect` to ``env``'s servers with its credentials and TLS settings (``PERSIA_NATS_*``)."""
    timeout = env.nats_connect_timeout if connect_timeout is None else connect_timeout
    return await connect(env.nats_servers, name, timeout, **{**env.nats_options(), **options})


_TLS_REFUSALS = frozenset({"TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_BAD_CERTIFICATE",
                           "SSLV3_ALERT_CERTIFICATE_UNKNOWN", "TLSV1_ALERT_UNKNOWN_CA"})


def _is_refusal(exc: BaseException) -> bool:
    """An error on connecting that no retry can cure: bad credentials, or a certificate not trusted
    (the server's by us, or ours, or its absence, by the server)."""
    if isinstance(exc, nats.errors.AuthorizationError | ssl.SSLCertVerificationError):
        return True
    if isinstance(exc, ssl.SSLError) and getattr(exc, "reason", None) in _TLS_REFUSALS:
        return True
    text = str(exc).lower()
    return any(s in text for s in ("authorization violation", "authentication timeout",
                                   "authentication expired", "authentication revoked"))


def _redact(servers: list[str] | str) -> str:
    """The server URLs without any ``user:password@`` they hold, fit for a log line."""
    urls = [servers] if isinstance(servers, str) else list(servers)
    return ",".join(re.sub(r"(://)[^@/]*@", r"\1***@", u) for u in urls)


def closing(nc: NATS) -> None:
    """Mark ``nc`` as being closed: its connection errors are logged at debug level from now on."""
    setattr(nc, _CLOSING, True)


async def close_connection(nc: NATS, timeout: float = 5.0) -> None:
    """Drain (flush what is pending), or close outright when the server is already gone.

    A plain drain against a stopped server would leave the client's reconnect task pending.
    """
    closing(nc)
    if nc.is_closed:
        return
    try:
        if nc.is_connected:
            await asyncio.wait_for(nc.drain(), timeout)
    except Exception as exc:
        log.debug("drain failed (%s); closing", exc)
    finally:
        if not nc.is_closed:
            try:
                await nc.close()
            except Exception as exc:  # the server went away mid-close; the socket is gone either way
                log.debug("close failed: %s", exc)


class Service:
    """Base for the long-running roles: owns an :class:`RpcServer` and a stop event."""

    role = "service"
    metrics_server: MetricsServer | None = None  # set by run_service when metrics are enabled
    registration: Registration | None = None  # its $SRV (nats.micro) registration, set by serve_status
    #: what ended a service that stops by itself (a loader whose run raised); run_service raises it
    failure: BaseException | None = None

    def __init__(self, nc: NATS, max_inflight: int = 64) -> None:
        self.nc = nc
        self.rpc = RpcServer(nc, max_inflight=max_inflight)
        self._stopped = asyncio.Event()
        self._stopping = False

    async def start(self) -> None:
        """Subscribe handlers."""

    def stats(self) -> dict[str, Any]:
        """Figures for the periodic stats log line (and the shutdown summary)."""
        return {}

    async def serve_status(self, subject: str, replica: int, instance: str) -> None:
        """Answer the job-wide status broadcast (``persia-launcher status``) with this instance's figures."""

        async def on_status(_msg: Any) -> dict[str, Any]:
            return self.status_map(replica, instance)

        await self.rpc.add(subject, on_status, request=Empty)
        # and register with the NATS services API ($SRV.PING/INFO/STATS): see persia_nats.common.discovery
        subjects = getattr(self, "subjects", None)
        if subjects is not None and self.registration is None:
            self.registration = await register(
                self.nc, job=subjects.job, role=self.role, replica_index=replica, instance=instance, rpc=self.rpc,
                replica_size=getattr(self, "replica_size", None), status=lambda: self.status_map(replica, instance))

    def status_map(self, replica: int, instance: str) -> dict[str, Any]:
        """This instance's answer to the status broadcast (and its ``$SRV.STATS`` data)."""
        figures = {k: v for k, v in self.stats().items() if isinstance(v, int | float | str | bool)}
        figures.update(self.rpc.summary())
        return StatusReply(self.role, replica, instance, figures).to_wire()

    async def log_stats_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self._log_stats("stats")

    def _log_stats(self, event: str) -> None:
        try:
            figures = {**self.stats(), **self.rpc.summary()}
        except Exception:  # a figure that cannot be read must never stop a shutdown
            log.exception("could not collect %s stats", self.role)
            return
        log.info("%s %s", self.role, event, extra=as_fields(figures))

    async def stop(self, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT) -> None:
        """Stop taking work, finish what is in flight (up to ``drain_timeout``), then release."""
        if self._stopping:
            return
        self._stopping = True
        if self.registration is not None:  # peers stop finding it before it stops answering
            await self.registration.stop()
        await self.rpc.drain(drain_timeout)
        await self.teardown()
        self._log_stats("stopped")
        self._stopped.set()

    async def teardown(self) -> None:
        """Subclass hook run after draining."""

    def request_stop(self) -> None:
        asyncio.get_running_loop().create_task(self.stop())

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def __aenter__(self) -> Service:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def run_service(make: Callable[[NATS], Awaitable[Service]], servers: list[str], name: str,
                      stats_interval: float = 10.0, metrics: MetricsConfig | None = None,
                      connect_options: Mapping[str, Any] | None = None,
                      connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> int:
    """Entry-point driver: connect, build and start the service, stop on SIGTERM/SIGINT.

    ``connect_options`` go to ``nats.connect``: the credentials and TLS of ``Env.nats_options()``.

    The first signal drains gracefully; a second one cancels whatever is left. With
    ``metrics.enable_metrics`` the service's Prometheus endpoint runs until it has stopped.
    """
    nc = await connect(servers, name, connect_timeout, **(connect_options or {}))
    try:
        service = await make(nc)
        await service.start()
    except BaseException:
        await close_connection(nc)
        raise
    if metrics is not None and metrics.enable_metrics:
        from persia_nats.common.metrics import start_metrics_server

        try:
            service.metrics_server = start_metrics_server(service, metrics)
            if service.registration is not None:
                service.registration.update_metadata(metrics_port=service.metrics_server.port)
        except BaseException:
            await service.stop()
            await close_connection(nc)
            raise
    loop = asyncio.get_running_loop()
    signals_seen = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            log.info("stopping on %s: draining", sig.name)
            closing(nc)
            service.request_stop()
        else:
            log.warning("second %s: cancelling in-flight work", sig.name)
            for task in asyncio.all_tasks(loop):
                if task is not asyncio.current_task():
                    task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    taskdump.install()
    taskdump.register(loop)
    log.info("%s started", service.role)
    stats_task = loop.create_task(service.log_stats_every(stats_interval))
    await service.wait_stopped()
    stats_task.cancel()
    if service.metrics_server is not None:
        await asyncio.to_thread(service.metrics_server.close)
    await close_connection(nc)
    if service.failure is not None:
        raise service.failure
    log.info("%s stopped cleanly", service.role)
    return 0
