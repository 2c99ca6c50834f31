"""Prometheus metrics for a long-running service, read from its live figures at scrape time.

Each service gets its own :class:`CollectorRegistry` (never the global one, so several services can
run in one process) holding a :class:`ServiceCollector`, which turns ``service.stats()`` and the
:class:`~persia_nats.common.rpc.RpcServer` counters into metric families when the endpoint is scraped; the hot
path only feeds the request-latency histogram, and only when metrics are enabled.

Names: ``persia_<role>_<key>`` (a gauge, or a counter ``..._total`` for figures that only grow;
figures kept in microseconds, ``<key>_us``, are exported in seconds as ``<key>_seconds``; a few keys
are exported under another name, :data:`EXPORT_NAMES`, so that counters name what they count and none
ends in ``_count``: ``index_miss_count`` is ``persia_ps_index_misses_total``), each with the HELP
line :data:`HELP` gives it;
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
    "embedding-worker": ("ingested", "ingest_waited", "ingest_refused_busy", "ingest_refused_bounds", "looked_up",
                         "looked_up_gathered", "looked_up_direct", "lookup_resends_waited",
                         "lookup_resends_in_progress", "lookup_resends_repeated", "grads_applied", "grad_ids_missing",
                         "grad_resends_applied", "grad_resends_in_progress", "grad_resends_joined",
                         "grad_outcomes_forgotten", "ps_timeouts_retried", "ps_timeouts_failed",
                         "float32_fallbacks", "nan_skipped", "expired", "hot_rows"),
    "embedding-parameter-server": ("evictions", "inserts", "index_miss_count", "gradient_id_miss_count",
                                   "candidate_lists_built_ahead", "index_doublings_built_ahead",
                                   "duplicate_updates", "rows_published", "rows_publish_failed", "configure_refused",
                                   "refused_unconfigured_dim", "refused_lookup_too_large",
                                   # incremental updates (persia_nats.services.embedding_ps.incremental)
                                   "incremental_deltas_written", "incremental_rows_written",
                                   "incremental_written_bytes", "incremental_write_failures", "incremental_rows_gone",
                                   "incremental_deltas_pruned"),
    "nn-worker": ("received", "batches", "samples", "grads_applied", "grad_failures", "lookup_failures",
                  "grad_ids_missing", "grad_slots_skipped", "grad_pushes_resent", "grad_outcome_waits",
                  "grad_outcomes_unknown", "ps_reconfigured", "train_wait_us", "train_host_cpu_us",
                  "batches_waited", "batches_refused_busy", "batches_skipped", "batches_failed",
                  "batches_refused_schema",
                  # JetStream acknowledgements (persia_nats.services.nn_worker.stream_acks)
                  "stream_acked", "stream_nacked", "stream_ack_failures", "stream_redelivered_trained",
                  "stream_redelivered_not_retrained", "stream_dead_lettered", "dead_letter_failures",
                  # hot rows (persia_nats.services.nn_worker.hot_rows)
                  "hot_batches", "hot_rows_read", "hot_rows_fresher", "hot_rows_not_kept", "hot_publications",
                  "hot_publications_bad", "hot_grads_bad", "hot_grads", "hot_row_corrections", "hot_grads_late",
                  "hot_grads_expired", "hot_grads_forgotten", "hot_grads_unsent", "hot_grads_failed",
                  "hot_grads_wait_timeouts", "hot_grads_wait_us", "hot_corrections_failed"),
    "serving": ("predictions", "samples", "reloads", "reload_failures", "incremental_delta_failures"),
    # no endpoint of its own (its figures are its $SRV status), described all the same
    "data-loader": ("received", "redelivered", "forwarded", "forward_failures", "over_bounds", "schema_refused",
                    "decode_errors", "end_markers_refused", "dead_lettered", "dead_letter_failures", "fetch_errors",
                    "ended", "ack_floor_lagged"),
}
# stats() keys that identify the service rather than measure it
SKIP_KEYS = {"replica", "worker"}

#: exported names that differ from the stats() key (which logs and status replies keep): a counter
#: names what it counts, as a plural noun, and never ends in ``_count`` (histograms' and summaries' suffix)
EXPORT_NAMES: dict[tuple[str, str], str] = {
    ("embedding-parameter-server", "index_miss_count"): "index_misses",
    ("embedding-parameter-server", "gradient_id_miss_count"): "gradient_id_misses",
    # publications that failed, not rows
    ("embedding-parameter-server", "rows_publish_failed"): "row_publication_failures",
    ("embedding-worker", "expired"): "batches_expired",
    ("nn-worker", "received"): "batches_received",
    ("nn-worker", "ps_reconfigured"): "ps_reconfigurations",
}

_EW, _PS, _NN = "embedding-worker", "embedding-parameter-server", "nn-worker"
#: what each figure measures and in which unit, as its HELP line says: by ``(role, stats key)``, else by
#: ``stats key`` where every role means the same by it. ``_us`` figures are exported in seconds.
HELP: dict[str | tuple[str, str], str] = {
    # -- shared ---------------------------------------------------------------------------------------
    "staleness": "batches looked up for training whose gradients have not come back yet",
    "max_staleness": "the most batches ever awaiting their gradients at once",
    "grads_applied": "gradient pushes (one per batch) the parameter servers applied",
    "grad_ids_missing": "ids in applied gradients that no parameter server stored (evicted meanwhile): rows",
    "samples": "samples (rows of a batch) handled",
    # -- embedding worker -------------------------------------------------------------------------------
    (_EW, "buffered"): "batches held in the forward and gradient buffers",
    (_EW, "buffered_bytes"): "bytes held in the forward and gradient buffers",
    (_EW, "ingested"): "batches ingested from the data loaders",
    (_EW, "ingest_waited"): "batches held until the full forward buffer had room (answered without a resend)",
    (_EW, "ingest_refused_busy"): "batches refused while the forward buffer was full (the loader resends them)",
    (_EW, "ingest_refused_bounds"): "batches refused for exceeding the job's size bounds",
    (_EW, "looked_up"): "batch lookups for training served",
    (_EW, "looked_up_gathered"): "lookups that sent single-id widths as their distinct rows, once each",
    (_EW, "looked_up_direct"): "direct lookups (evaluation: features sent with the request) served",
    (_EW, "lookup_resends_waited"): "resent lookups that waited for the first lookup of their batch",
    (_EW, "lookup_resends_in_progress"): "resent lookups answered 'in progress' (the first still running)",
    (_EW, "lookup_resends_repeated"): "resent lookups served again from the buffered batch",
    (_EW, "grad_resends_applied"): "resent gradient pushes answered with the first push's outcome",
    (_EW, "grad_resends_in_progress"): "resent gradient pushes answered 'in progress' (the first still applied)",
    (_EW, "grad_resends_joined"): "resent gradient pushes that waited for the first push of their batch",
    (_EW, "grad_outcomes_forgotten"): "outcomes of ended gradient pushes forgotten to bound memory",
    (_EW, "ps_timeouts_retried"): "parameter-server requests retried after a timeout",
    (_EW, "ps_timeouts_failed"): "parameter-server requests that failed after their last timeout",
    (_EW, "float32_fallbacks"): "lookup replies sent in float32 because values overflowed float16",
    (_EW, "nan_skipped"): "slot gradients skipped for holding NaN or infinite values",
    (_EW, "expired"): "batches dropped from the buffers after waiting unclaimed past their expiry",
    (_EW, "hot_rows"): "hot rows served from the NN workers' copies instead of the parameter servers: rows",
    # -- parameter server -----------------------------------------------------------------------------
    (_PS, "configured"): "1 once the job's optimizer and widths are configured, else 0",
    (_PS, "rows"): "embedding rows stored by this replica",
    (_PS, "memory_bytes"): "bytes of memory the replica's embedding tables take",
    (_PS, "evictions"): "rows evicted to make room for new ones",
    (_PS, "inserts"): "rows inserted (ids seen for the first time)",
    (_PS, "index_miss_count"): "ids looked up that were not stored",
    (_PS, "gradient_id_miss_count"): "gradient ids that were not stored (evicted since their lookup)",
    (_PS, "candidate_lists_built_ahead"): "eviction candidate lists built ahead of need",
    (_PS, "index_doublings_built_ahead"): "index doublings built ahead of need",
    (_PS, "duplicate_updates"): "gradient updates received again and not applied twice",
    (_PS, "rows_published"): "updated hot rows published to the NN workers: rows",
    (_PS, "rows_publish_failed"): "publications of updated hot rows that failed",
    (_PS, "configure_refused"): "configure requests refused (they would change the optimizer, "
                                "hyperparameters or widths mid-run)",
    (_PS, "refused_unconfigured_dim"): "requests refused for an embedding width the job does not configure",
    (_PS, "refused_lookup_too_large"): "lookups refused because their reply would exceed max_reply_bytes",
    (_PS, "incremental_deltas_written"): "incremental updates (deltas of the updated rows) written",
    (_PS, "incremental_rows_written"): "rows written into incremental updates: rows",
    (_PS, "incremental_written_bytes"): "bytes written into incremental updates",
    (_PS, "incremental_write_failures"): "incremental updates that failed to write (their rows go into the next)",
    (_PS, "incremental_deltas_pruned"): "incremental updates deleted as older than every checkpoint kept",
    (_PS, "incremental_rows_gone"): "updated rows evicted before their incremental update copied them: rows",
    (_PS, "incremental_pending_keys"): "updated keys waiting for the next incremental update (repeats since the "
                                       "last merge included)",
    (_PS, "incremental_last_delta_age_seconds"): "seconds since the newest written incremental update copied its "
                                                 "rows (-1: none yet)",
    (_PS, "incremental_last_copy_seconds"): "seconds the newest incremental update took to copy its rows, in "
                                            "steps between requests",
    (_PS, "incremental_copy_step_max_seconds"): "seconds of the longest step of an incremental update's copy (the "
                                                "replica serves nothing during a step)",
    (_PS, "incremental_last_write_seconds"): "seconds the newest incremental update took to write (while serving)",
    (_PS, "incremental_deltas_applied"): "incremental updates applied after the checkpoint this replica loaded",
    (_PS, "incremental_rows_applied"): "rows of the incremental updates applied after the loaded checkpoint",
    # -- NN worker --------------------------------------------------------------------------------------
    (_NN, "world_size"): "NN ranks in the job",
    (_NN, "received"): "batches received from the data loaders",
    (_NN, "queued"): "batches waiting in the incoming buffer",
    (_NN, "incoming_limit"): "batches the incoming buffer holds at most",
    (_NN, "ended"): "1 once this rank's data stream has ended, else 0",
    (_NN, "batches"): "batches handed to the training loop",
    (_NN, "samples"): "samples handed to the training loop",
    (_NN, "staleness"): "batches holding a staleness permit (gradients not yet applied)",
    (_NN, "max_staleness"): "the most staleness permits ever held at once",
    (_NN, "staleness_bound"): "the staleness permits the DataLoader grants at most",
    (_NN, "train_loss"): "loss of the latest backward()",
    (_NN, "samples_per_second"): "samples per second trained since the first batch",
    (_NN, "train_wait_us"): "seconds the training loop waited for its next batch",
    (_NN, "train_host_cpu_us"): "seconds of CPU the training thread spent in the runtime's own work (taking each "
                                "batch, with any step joined without one; making it tensors; handing off its "
                                "gradients, which the rank's loop packs), outside the model and the dense step",
    (_NN, "lookup_failures"): "embedding lookups that failed",
    (_NN, "grad_failures"): "gradient pushes that failed",
    (_NN, "grad_slots_skipped"): "slot gradients the embedding worker skipped (NaN or infinite values)",
    (_NN, "grad_pushes_resent"): "gradient pushes resent after a timeout or a busy reply",
    (_NN, "grad_outcome_waits"): "gradient pushes that waited for an earlier push of the same batch",
    (_NN, "grad_outcomes_unknown"): "gradient pushes given up with their outcome unknown",
    (_NN, "ps_reconfigured"): "times the optimizer was registered again with a restarted parameter server",
    (_NN, "batches_waited"): "batches held until the incoming buffer had room",
    (_NN, "batches_refused_busy"): "batches refused while the incoming buffer was full",
    (_NN, "batches_refused_schema"): "batches refused for not matching the job's schema",
    (_NN, "batches_skipped"): "batches the training loop skipped",
    (_NN, "batches_failed"): "batches whose training step failed",
    (_NN, "stream_acked"): "stream batches acknowledged as trained",
    (_NN, "stream_nacked"): "stream batches handed back to the stream untrained",
    (_NN, "stream_ack_failures"): "stream acknowledgements that could not be sent",
    (_NN, "stream_redelivered_trained"): "redelivered stream batches trained",
    (_NN, "stream_redelivered_not_retrained"): "stream batches delivered again after they trained here, or while "
                                               "another delivery was held here: given its outcome, not trained again",
    (_NN, "stream_dead_lettered"): "stream batches dead-lettered",
    (_NN, "dead_letter_failures"): "stream batches that could not be dead-lettered",
    (_NN, "hot_rows_held"): "hot rows held in this rank's copy",
    (_NN, "hot_batches"): "batches that read hot rows from this rank's copy",
    (_NN, "hot_rows_read"): "hot rows read from this rank's copy: rows",
    (_NN, "hot_rows_fresher"): "hot rows whose copy was fresher than the looked-up row: rows",
    (_NN, "hot_rows_not_kept"): "published hot rows not kept for lack of room: rows",
    (_NN, "hot_publications"): "hot-row publications received from the parameter servers",
    (_NN, "hot_publications_bad"): "malformed hot-row publications ignored (from a parameter server)",
    (_NN, "hot_grads"): "hot-row gradient messages received from other ranks",
    (_NN, "hot_grads_bad"): "malformed hot-row gradient messages ignored (from another NN rank)",
    (_NN, "hot_grads_late"): "hot-row gradient messages arriving after their rows were published",
    (_NN, "hot_grads_expired"): "pending hot-row gradient messages dropped to bound memory",
    (_NN, "hot_grads_forgotten"): "pending hot-row gradient messages dropped because their push failed",
    (_NN, "hot_grads_unsent"): "hot-row gradient messages that could not be published",
    (_NN, "hot_grads_failed"): "hot-row gradient messages that could not be prepared",
    (_NN, "hot_grads_wait_timeouts"): "waits for the other ranks' hot-row gradients that timed out",
    (_NN, "hot_grads_wait_us"): "seconds spent waiting for the other ranks' hot-row gradients",
    (_NN, "hot_row_corrections"): "hot-row values corrected with pending gradients",
    (_NN, "hot_corrections_failed"): "hot-row corrections not applied (state not fitting the optimizer)",
    # -- serving ----------------------------------------------------------------------------------------
    ("serving", "step"): "training step of the loaded checkpoint (-1: none or unknown)",
    ("serving", "rows"): "embedding rows of the loaded checkpoint",
    ("serving", "predictions"): "predict requests answered",
    ("serving", "samples"): "samples predicted (rows of the predict requests)",
    ("serving", "reloads"): "newer checkpoints swapped in for the one served (the first load not counted)",
    ("serving", "reload_failures"): "checkpoints that failed to load",
    ("serving", "incremental_deltas_applied"): "incremental updates applied to the served checkpoint",
    ("serving", "incremental_rows_applied"): "rows of the incremental updates applied to the served checkpoint",
    ("serving", "incremental_delta_age_seconds"): "seconds since the newest applied incremental update copied its "
                                                  "rows on its parameter server (-1: none applied)",
    ("serving", "incremental_applied_timestamp_seconds"): "when the newest incremental update was applied here "
                                                          "(Unix time; 0: none)",
    ("serving", "incremental_delta_failures"): "incremental updates skipped as unreadable or corrupt",
    # -- data loader (from a stream) --------------------------------------------------------------------
    ("data-loader", "received"): "stream messages received",
    ("data-loader", "redelivered"): "stream messages received again (redelivered)",
    ("data-loader", "forwarded"): "batches forwarded to the embedding workers and NN workers",
    ("data-loader", "forward_failures"): "batches that could not be forwarded (handed back to the stream)",
    ("data-loader", "over_bounds"): "stream messages refused for exceeding the job's size bounds",
    ("data-loader", "schema_refused"): "stream batches refused for not matching the job's schema",
    ("data-loader", "decode_errors"): "stream messages that could not be decoded",
    ("data-loader", "end_markers_refused"): "end markers refused for arriving on the batch subject",
    ("data-loader", "dead_lettered"): "stream messages dead-lettered",
    ("data-loader", "dead_letter_failures"): "stream messages that could not be dead-lettered",
    ("data-loader", "fetch_errors"): "stream fetches that failed",
    ("data-loader", "ended"): "end markers handled",
    ("data-loader", "left_at_end"): "batches left in the stream at its end marker",
    ("data-loader", "ack_floor_lagged"): "end-marker checks that found the ack floor lagging",
    ("data-loader", "inflight"): "batches being forwarded now",
    ("data-loader", "end_marker"): "stream sequence of the end marker, once seen",
}
#: descriptions of keys made up at run time, by prefix (the data loader's ``resent_<kind>_<error>``)
HELP_PREFIXES = {("data-loader", "resent_"): "batches sent again after an error (by kind and error)"}

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


#: the labels on every series, in this order
LABELS = ("role", "persia_job", "replica")


def role_name(role: str) -> str:
    return ROLE_NAMES.get(role, role.replace("-", "_").replace(".", "_"))


def label_values(role: str, job: str, replica: str | int) -> tuple[str, str, str]:
    return role, job, str(replica)


def exported(key: str, value: float, role: str | None = None) -> tuple[str, float]:
    """A stats key and value as exported: renamed (:data:`EXPORT_NAMES`, given the ``role``) and in
    Prometheus's base units: microseconds (``_us``) become seconds."""
    if role is not None:
        key = EXPORT_NAMES.get((role, key), key)
    if key.endswith("_us"):
        return f"{key[:-3]}_seconds", value / 1e6
    return key, value


#: the HELP of a figure nobody described: exported all the same, and caught by tests/unit/test_metric_help.py
UNDESCRIBED = "undescribed figure {key} of the {role}: add its description to persia_nats.common.metrics.HELP"
#: the HELP of a figure the training script reports (``EmbeddingCtx.report``)
REPORTED = "{key}, as the training script reports it (ctx.report)"


def description(role: str, key: str) -> str | None:
    """What figure ``key`` of ``role`` measures, in the unit it is exported in; None when undescribed."""
    found = HELP.get((role, key)) or HELP.get(key)
    if found is None:
        found = next((text for (r, prefix), text in HELP_PREFIXES.items() if r == role and key.startswith(prefix)),
                     None)
    return found


def help_text(role: str, key: str, reported: bool = False) -> str:
    """A figure's HELP line: its description, else what says it has none (never empty)."""
    found = description(role, key)
    if found is not None:
        return found
    return (REPORTED if reported else UNDESCRIBED).format(key=key, role=role)


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
        role = self.service.role
        figures = getattr(self.service, "figures", None)  # an NN rank's: what its training script reports
        reported = set(figures.gauges()) if figures is not None and hasattr(figures, "gauges") else set()
        # counters that have not been bumped yet are absent from a Counter: report them as 0
        for key in self.counter_keys:
            stats.setdefault(key, 0)
        for key in sorted(stats):
            value = stats[key]
            if key in SKIP_KEYS or not isinstance(value, int | float):  # bool is an int: 0/1
                continue
            name, value = exported(key, value, role)
            name = f"{self.prefix}_{name}"
            doc = help_text(role, key, key in reported)
            if key in self.counter_keys:
                family: Any = CounterMetricFamily(name, doc, labels=names)
            else:
                family = GaugeMetricFamily(name, doc, labels=names)
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
