"""Prometheus metrics of an NN rank (``common_config.metrics_config``), like the PS's and workers'.

The figures come from :meth:`NNRuntime.stats` at scrape time (:mod:`persia_nats.common.metrics`), named
``persia_nn_worker_<key>``: the counters ``samples_total`` and ``batches_total`` (handed to the
training loop: ``rate()`` gives samples/s), ``received_total``, ``grads_applied_total``,
``grad_failures_total``, ``lookup_failures_total``, ...; the gauges ``staleness``,
``max_staleness`` and ``staleness_bound`` (the DataLoader's permits), ``queued`` and
``incoming_limit`` (the incoming batch buffer); with hot rows the ``hot_*`` counters of
:class:`~persia_nats.services.nn_worker.hot_rows.RowMirror` and the gauge ``hot_rows_held``. Two histograms
are fed as calls complete: ``persia_nn_worker_lookup_duration_seconds`` (an embedding lookup, retries included) and
``persia_nn_worker_grad_push_duration_seconds`` (from sending a batch's embedding gradients until
the embedding worker confirms the PSs applied them). The ``persia_requests_total`` family and
``persia_request_duration_seconds`` cover the subjects the rank serves (``batch``, ``end``, ...).

Ranks on one host must not collide, so rank ``r`` listens on ``metrics_config.port + r`` (with
port 0 every rank takes a free port).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from persia_nats.common.errors import StartupError
from persia_nats.common.metrics import (
    LABELS,
    LATENCY_BUCKETS,
    MetricsServer,
    build_registry,
    label_values,
    serve_registry,
)
from prometheus_client import CollectorRegistry, Histogram

if TYPE_CHECKING:
    from persia_nats.common.config import MetricsConfig
    from persia_nats.services.nn_worker.runtime import NNRuntime

log = logging.getLogger(__name__)

HISTOGRAMS = {
    "lookup": ("persia_nn_worker_lookup_duration_seconds",
               "time to look up one batch's embeddings on the embedding worker, retries included"),
    "grad": ("persia_nn_worker_grad_push_duration_seconds",
             "time from sending a batch's embedding gradients until they are applied (or given up)"),
}


class CallTimes:
    """How long a rank's lookups and gradient pushes take.

    Built before the rank's runtime, which reports every call to :meth:`observe` from then on; the
    calls are counted in histograms once an endpoint exports them (:func:`start_nn_metrics`), and
    cost nothing before (or when the endpoint could not start).
    """

    def __init__(self) -> None:
        self._children: dict[str, Any] = {}

    def observe(self, kind: str, seconds: float) -> None:
        child = self._children.get(kind)
        if child is not None:
            child.observe(seconds)

    def export(self, registry: CollectorRegistry, labels: tuple[str, str, str]) -> None:
        """Count the calls from now on in histograms of ``registry``."""
        self._children = {
            kind: Histogram(name, doc, LABELS, registry=registry, buckets=LATENCY_BUCKETS).labels(*labels)
            for kind, (name, doc) in HISTOGRAMS.items()}


def metrics_port(config: MetricsConfig, local_rank: int) -> int:
    """The rank's port: ``port + local_rank``, so the ranks of one host do not collide while a rank
    alone in its pod or container serves on ``port`` itself, the port a scrape annotation names."""
    return config.port + local_rank if config.port else 0


def start_nn_metrics(runtime: NNRuntime, config: MetricsConfig | None, *, calls: CallTimes, addr: str = "0.0.0.0",
                     local_rank: int | None = None) -> MetricsServer | None:
    """Serve the rank's ``/metrics`` when ``config.enable_metrics``; None when off or the port is taken.

    Call it on the runtime's event loop after ``runtime.start()``; ``calls``: the :class:`CallTimes`
    the runtime was built with. ``local_rank`` (default: the global rank) offsets a fixed port. A
    port that is taken (another context of the same rank still open) is logged, and training goes on
    without the endpoint.
    """
    if config is None or not config.enable_metrics:
        return None
    rank = runtime.rank
    port = metrics_port(config, rank if local_rank is None else local_rank)
    # the port first: when it is taken, nothing is timed for an endpoint that does not exist
    registry = CollectorRegistry(auto_describe=False)
    try:
        httpd, thread = serve_registry(registry, port, addr, f"nn-worker rank {rank}")
    except StartupError as exc:
        log.warning("%s; training goes on without it", exc)
        return None
    build_registry(runtime, config.job_name, replica=rank, registry=registry)  # type: ignore[arg-type]
    calls.export(registry, label_values(runtime.role, config.job_name, rank))
    server = MetricsServer(registry, httpd.server_port, httpd, thread)
    if runtime.registration is not None:
        runtime.registration.update_metadata(metrics_port=server.port)
    log.info("nn-worker rank %d metrics on http://%s:%d/metrics", rank, addr, server.port)
    return server
