"""Service lifecycle: connect, start, run until told to stop, drain, exit 0.

Only :func:`run_service` (called from entry points) installs signal handlers and configures
logging; services themselves take their NATS connection and config as arguments, so one test can
run every role in one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import nats
from nats.aio.client import Client as NATS

from common.rpc import RpcServer

if TYPE_CHECKING:
    from common.config import MetricsConfig
    from common.metrics import MetricsServer

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT = 30.0  # seconds; k8s' default terminationGracePeriodSeconds is 30


async def connect(servers: list[str] | str, name: str, connect_timeout: float = 60.0, **options: Any) -> NATS:
    """Connect with unbounded reconnects; at start-up keep trying until ``connect_timeout``.

    The server may come up after us (honcho and compose start everything at once), so the first
    connection is retried instead of failing.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + connect_timeout
    delay = 0.05

    async def error_cb(exc: Exception) -> None:
        log.warning("nats error: %s: %s", type(exc).__name__, exc)

    while True:
        try:
            return await nats.connect(
                servers, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                allow_reconnect=True, error_cb=error_cb, connect_timeout=2, **options)
        except Exception as exc:
            if loop.time() + delay > end:
                raise ConnectionError(f"could not connect to NATS at {servers} within {connect_timeout:g}s: {exc}") \
                    from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


async def close_connection(nc: NATS, timeout: float = 5.0) -> None:
    """Drain (flush what is pending), or close outright when the server is already gone.

    A plain drain against a stopped server would leave the client's reconnect task pending.
    """
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
            figures = {k: v for k, v in self.stats().items() if isinstance(v, int | float | str | bool)}
            return {"v": 1, "role": self.role, "replica": replica, "instance": instance, "stats": figures}

        await self.rpc.add(subject, on_status)

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
        log.info("%s %s %s", self.role, event, " ".join(f"{k}={v}" for k, v in figures.items()))

    async def stop(self, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT) -> None:
        """Stop taking work, finish what is in flight (up to ``drain_timeout``), then release."""
        if self._stopping:
            return
        self._stopping = True
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
                      stats_interval: float = 10.0, metrics: MetricsConfig | None = None) -> int:
    """Entry-point driver: connect, build and start the service, stop on SIGTERM/SIGINT.

    The first signal drains gracefully; a second one cancels whatever is left. With
    ``metrics.enable_metrics`` the service's Prometheus endpoint runs until it has stopped.
    """
    nc = await connect(servers, name)
    try:
        service = await make(nc)
        await service.start()
    except BaseException:
        await close_connection(nc)
        raise
    if metrics is not None and metrics.enable_metrics:
        from common.metrics import start_metrics_server

        try:
            service.metrics_server = start_metrics_server(service, metrics)
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
            service.request_stop()
        else:
            log.warning("second %s: cancelling in-flight work", sig.name)
            for task in asyncio.all_tasks(loop):
                if task is not asyncio.current_task():
                    task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    log.info("%s started", service.role)
    stats_task = loop.create_task(service.log_stats_every(stats_interval))
    await service.wait_stopped()
    stats_task.cancel()
    if service.metrics_server is not None:
        await asyncio.to_thread(service.metrics_server.close)
    await close_connection(nc)
    log.info("%s stopped cleanly", service.role)
    return 0
