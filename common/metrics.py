"""Prometheus metrics for a long-running service, read from its live figures at scrape time.

Each service gets its own :class:`CollectorRegistry` (never the global one, so several services can
run in one process) holding a :class:`ServiceCollector`, which turns ``service.stats()`` and the
:class:`~persia_nats.common.rpc.RpcServer` counters into metric families when the endpoint is scraped; the hot
path only feeds the request-latency histogram, and only when metrics are enabled.

Names: ``persia_<role>_<key>`` (a gauge, or a counter ``..._total`` for figures that only grow;
figures kept in microseconds, ``<key>_us``, are exported in seconds as ``<key>_seconds``);
``persia_requests_total{subject}``, ``persia_refused_total{subject,code}``, ``persia_bad_replies_total{subject}`` and
``persia_request_duration_seconds{kind}`` (``kind`` is the subject's last token: ``lookup``,
``grad``, ``update``, ``ingest``, ...); and the process's own ``process_*`` and ``python_*``
series (prometheus-client's collectors). Every series carries ``role`` (``embedding-worker``,
``embedding-parameter-server``, ``nn-worker``, ...), ``persia_job`` (``metrics_config.job_name``;
not ``job``, which Prometheus sets to the scrape job) and ``replica``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from persia_nats.common.errors import StartupError
from prometheus_client import CollectorRegistry, Histogram, PlatformCollector, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from persia_nats.common.config import MetricsConfig
    from persia_nats.common.service import Service

log = logging.getLogger(__name__)

# short metric prefixes per role; other roles use their role name with dashes as underscores
ROLE_NAMES = {"embedding-parameter-server": "ps", "embedding-worker": "embedding_worker"}

# stats() keys that only grow: exposed as counters (``_total``)
COUNTER_KEYS = {
    "embedding-worker": ("ingested", "looked_up", "looked_up_gathered", "looked_up_direct", "grads_applied",
                         "grad_ids_missing",
                         "float32_fallbacks", "nan_skipped", "expired", "hot_rows", "ingest_refused_busy"),
    "embedding-parameter-server": ("evictions", "inserts", "index_miss_count", "gradient_id_miss_count",
                                   "duplicate_updates", "rows_published", "rows_publish_failed", "configure_refused",
                                   "refused_unconfigured_dim", "refused_lookup_too_large"),
    "nn-worker": ("received", "batches", "samples", "grads_applied", "grad_failures", "lookup_failures",
                  "grad_ids_missing", "grad_slots_skipped", "ps_reconfigured", "train_wait_us",
                  "batches_skipped", "batches_failed", "batches_refused_schema", "stream_dead_lettered",
                  # hot rows (persia_nats.services.nn_worker.hot_rows)
                  "hot_batches", "hot_rows_read", "hot_rows_fresher", "hot_rows_not_kept", "hot_publications",
                  "hot_publications_bad", "hot_grads_bad", "hot_grads", "hot_row_corrections", "hot_grads_late",
                  "hot_grads_expired", "hot_grads_forgotten", "hot_grads_unsent", "hot_grads_failed",
                  "hot_grads_wait_timeouts", "hot_grads_wait_us", "hot_corrections_failed"),
    "serving": ("predictions", "samples", "reloads", "reload_failures"),
}
# stats() keys that identify the service rather than measure it
SKIP_KEYS = {"replica", "worker"}

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


#: the labels on every series, in this order
LABELS = ("role", "persia_job", "replica")


def role_name(role: str) -> str:
    return ROLE_NAMES.get(role, role.replace("-", "_").replace(".", "_"))


def label_values(role: str, job: str, replica: str | int) -> tuple[str, str, str]:
    return role, job, str(replica)


def exported(key: str, value: float) -> tuple[str, float]:
    """A stats key and value in Prometheus's base units: microseconds (``_us``) become seconds."""
    if key.endswith("_us"):
        return f"{key[:-3]}_seconds", value / 1e6
    return key, value


class LabelledCollector(Collector):
    """Another collector's series with this service's labels added (the process collectors have none)."""

    def __init__(self, inner: Collector, labels: dict[str, str]) -> None:
        self.inner = inner
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        for metric in self.inner.collect():
            out = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            for sample in metric.samples:
                out.add_sample(sample.name, {**self.labels, **sample.labels}, sample.value, sample.timestamp)
            yield out


class ServiceCollector(Collector):
    """Reads a service's figures when scraped (from the HTTP server's thread)."""

    def __init__(self, service: Service, job: str, replica: str) -> None:
        self.service = service
        self.labels = dict(zip(LABELS, label_values(service.role, job, replica), strict=True))
        self.prefix = f"persia_{role_name(service.role)}"
        self.counter_keys = set(COUNTER_KEYS.get(service.role, ()))

    def _stats(self) -> dict[str, Any]:
        # the event loop may change a dict while this thread copies it; a retry gets a clean copy
        for attempt in range(3):
            try:
                return dict(self.service.stats())
            except RuntimeError:
                if attempt == 2:
                    raise
        return {}

    def collect(self) -> Iterator[Any]:
        names, values = list(self.labels), list(self.labels.values())
        try:
            stats = self._stats()
        except Exception:  # a scrape must never break the service
            log.exception("could not read %s stats for metrics", self.service.role)
            stats = {}
        # counters that have not been bumped yet are absent from a Counter: report them as 0
        for key in self.counter_keys:
            stats.setdefault(key, 0)
        for key in sorted(stats):
            value = stats[key]
            if key in SKIP_KEYS or not isinstance(value, int | float):  # bool is an int: 0/1
                continue
            name, value = exported(key, value)
            name = f"{self.prefix}_{name}"
            if key in self.counter_keys:
                family: Any = CounterMetricFamily(name, f"{self.service.role} {key}", labels=names)
            else:
                family = GaugeMetricFamily(name, f"{self.service.role} {key}", labels=names)
            family.add_metric(values, float(value))
            yield family
        rpc = self.service.rpc
        requests = CounterMetricFamily("persia_requests", "requests served, by subject", labels=[*names, "subject"])
        for subject, n in sorted(dict(rpc.requests).items()):
            requests.add_metric([*values, subject], n)
        yield requests
        refused = CounterMetricFamily("persia_refused", "error replies, by subject and code",
                                      labels=[*names, "subject", "code"])
        for (subject, code), n in sorted(dict(rpc.errors).items()):
            refused.add_metric([*values, subject, str(code)], n)
        yield refused
        bad = CounterMetricFamily("persia_bad_replies", "requests dropped unserved: their reply subject was no inbox",
                                  labels=[*names, "subject"])
        for subject, n in sorted(dict(rpc.bad_replies).items()):
            bad.add_metric([*values, subject], n)
        yield bad


def subject_kind(subject: str) -> str:
    return subject.rsplit(".", 1)[-1]


def build_registry(service: Service, job: str, replica: str | int | None = None,
                   registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """A fresh registry (or ``registry``, filled) with the service's figures and a request-latency
    histogram it feeds."""
    if replica is None:
        replica = getattr(service, "replica_index", 0)
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
    collector = ServiceCollector(service, job, str(replica))
    registry.register(collector)
    for process in (ProcessCollector(registry=None), PlatformCollector(registry=None)):
        registry.register(LabelledCollector(process, collector.labels))
    latency = Histogram("persia_request_duration_seconds", "time to serve one request, by subject kind",
                        [*LABELS, "kind"], registry=registry, buckets=LATENCY_BUCKETS)
    labels = label_values(service.role, job, replica)
    children: dict[str, Any] = {}

    def observe(subject: str, seconds: float) -> None:
        child = children.get(subject)
        if child is None:
            child = children[subject] = latency.labels(*labels, subject_kind(subject))
        child.observe(seconds)

    service.rpc.observe = observe
    return registry


class ScrapeClock(Collector):
    """Counts the scrapes of one registry. Registered after every other collector, so a tick means a
    scrape has read every figure; ``watched`` is set once any endpoint of this process is scraped."""

    watched = threading.Event()

    def __init__(self) -> None:
        self.scrapes = 0
        self._ticked = threading.Condition()

    def collect(self) -> Iterator[Metric]:
        with self._ticked:
            self.scrapes += 1
            self._ticked.notify_all()
        ScrapeClock.watched.set()
        return iter(())

    def wait_past(self, seen: int, timeout: float) -> bool:
        """True once a scrape after the ``seen``-th has completed; False after ``timeout`` seconds."""
        with self._ticked:
            return self._ticked.wait_for(lambda: self.scrapes > seen, timeout)


# the scrape that ended a wait is still writing its reply from the server's handler thread
REPLY_GRACE_S = 0.2


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint; :meth:`close` stops it (blocks up to ~0.5 s, or longer when
    told to wait for a last scrape)."""

    registry: CollectorRegistry
    port: int
    _httpd: Any
    _thread: threading.Thread
    clock: ScrapeClock = field(default_factory=ScrapeClock)

    def __post_init__(self) -> None:
        self.registry.register(self.clock)

    def close(self, final_scrape_s: float = 0.0, unread_since: int | None = None) -> None:
        """Stop serving. With ``unread_since`` (``clock.scrapes`` when figures changed that a scrape
        should carry) and no scrape completed since, first wait up to ``final_scrape_s`` seconds for
        one, provided this process has been scraped before: nobody is watching otherwise."""
        if unread_since is not None and final_scrape_s > 0 and self.clock.scrapes <= unread_since \
                and ScrapeClock.watched.is_set():
            log.info("waiting up to %gs for a last scrape of http://0.0.0.0:%d/metrics "
                     "(metrics_config.final_scrape_seconds)", final_scrape_s, self.port)
            if self.clock.wait_past(unread_since, final_scrape_s):
                time.sleep(REPLY_GRACE_S)
            else:
                log.warning("no scrape of port %d within %gs: its last figures were not collected",
                            self.port, final_scrape_s)
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve_registry(registry: CollectorRegistry, port: int, addr: str, who: str) -> tuple[Any, threading.Thread]:
    """Start the HTTP endpoint; a port that is taken is a :class:`StartupError` naming it."""
    try:
        return start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise StartupError(f"{who}: cannot serve metrics on {addr}:{port} ({exc.strerror or exc}); set "
                           f"metrics_config.port (or --port) to a free port, or 0 for any free one") from exc


def start_metrics_server(service: Service, config: MetricsConfig, addr: str = "0.0.0.0") -> MetricsServer:
    registry = build_registry(service, config.job_name)
    httpd, thread = serve_registry(registry, config.port, addr, service.role)
    port = httpd.server_port
    log.info("%s metrics on http://%s:%d/metrics", service.role, addr, port)
    return MetricsServer(registry, port, httpd, thread)


def maybe_start_metrics(service: Service, config: MetricsConfig | None) -> MetricsServer | None:
    """Start the endpoint when ``config.enable_metrics``; otherwise do nothing and return None."""
    if config is None or not config.enable_metrics:
        return None
    return start_metrics_server(service, config)
