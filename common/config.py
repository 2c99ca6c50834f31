"""Typed, strict configuration: ``global_config.yml`` and ``embedding_config.yml``.

The schema is PERSIA's (``persia-embedding-config``), with its defects fixed:

* Unknown keys are errors naming the dotted key path and the file (PERSIA ignored them, so a typo
  silently did nothing). PERSIA's own keys are not unknown: each class's ``_persia_keys`` reads its
  spellings as ours (``push_interval_sec``, ``slot_config``) and accepts, with a warning saying why,
  those that do nothing here; ``_unused_keys`` warns of ours that nothing reads yet
  (:mod:`persia_nats.common.config_schema`). docs/configuration.md lists them all.
* ``1e9`` is accepted for integer fields although PyYAML reads it as a string.
* ``index_prefix`` is derived, never read from the file.

Every dataclass is frozen and slotted; mappings are :class:`FrozenMapping` and sequences tuples,
so a config passed around can never be changed under a running service. The conversion from YAML
is generic (:mod:`persia_nats.common.config_schema`), so adding a key is one annotated field here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import yaml
from persia_nats.common.config_schema import FieldViolation, FrozenMapping, NoEffect, PersiaKey, Renamed, build
from persia_nats.common.errors import ConfigError
from persia_nats.common.storage import check_root

JOB_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
"""A job name becomes a NATS subject token (``persia.<job>.…``), so no dots, spaces or wildcards."""

JobType = Literal["Train", "Eval", "Infer"]
WireDtype = Literal["float16", "float32"]
SyncMode = Literal["sync", "hybrid", "async"]
BatchErrorPolicy = Literal["auto", "skip", "stop"]
GatherPlace = Literal["auto", "host", "device"]
EndMarkerFrom = Literal["stream_end", "batches"]
Pooling = Literal["sum", "mean"]


def _require(ok: bool, key: str, reason: str) -> None:
    if not ok:
        raise FieldViolation(key, reason)


DEFAULT_JOB_NAME = "persia"


class JobsOwnName(str):
    """``metrics_config.job_name`` left unset: the job's name, which :class:`CommonConfig` fills in (and
    refills when ``PERSIA_JOB_NAME`` replaces it), so that jobs sharing a Prometheus are told apart; a
    name the user set is a plain ``str`` and stays."""

    __slots__ = ()


_IO_WORKERS = NoEffect("PERSIA's threads for embedding dump, load and incremental I/O; here each PS replica "
                       "reads and writes its own checkpoint shards (checkpointing_config)")
_PERSIA_01_CHECKPOINTS = NoEffect("a checkpoint setting of PERSIA 0.1's; checkpoints here: checkpointing_config "
                                  "(docs/checkpoints.md)")
_ONE_WRITER = ("each PS replica writes its incremental updates itself, one at a time, in the order it copied them "
               "(docs/checkpoints.md#incremental-updates)")


def check_job_name(name: str, key: str = "job_name") -> None:
    """Raise a FieldViolation for ``key`` unless ``name`` is usable as a NATS subject token."""
    _require(bool(JOB_NAME_RE.match(name)), key, f"{name!r} must match {JOB_NAME_RE.pattern}")


# ---------------------------------------------------------------------------------------------
# global_config.yml
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsConfig:
    """Prometheus metrics (``common_config.metrics_config``)."""

    enable_metrics: bool = False
    job_name: str = JobsOwnName(DEFAULT_JOB_NAME)  # left out: the job's name, not PERSIA's persia_default_jobname
    push_interval_seconds: int = 10
    port: int = 0  # 0: an ephemeral port, so several roles can share a host in tests.
    # An NN context's figures reported at its very end (a held-out AUC) would otherwise vanish before
    # any scrape: it waits up to this long for one, when this process has been scraped before.
    final_scrape_seconds: float = 60.0

    _persia_keys = FrozenMapping[str, PersiaKey]({"push_interval_sec": Renamed("push_interval_seconds")})
    _unused_keys = FrozenMapping({"push_interval_seconds": "nothing is pushed: every role serves /metrics for "
                                                           "Prometheus to scrape"})

    def __post_init__(self) -> None:
        _require(self.push_interval_seconds >= 1, "push_interval_seconds", "must be >= 1")
        _require(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}")
        _require(0 <= self.final_scrape_seconds <= 3600, "final_scrape_seconds",
                 f"must be in 0..3600, got {self.final_scrape_seconds}")


@dataclass(frozen=True, slots=True, kw_only=True)
class InferConfig:
    """Inference-only settings (``common_config.infer_config``)."""

    servers: tuple[str, ...] = ()
    embedding_checkpoint: str = ""

    _persia_keys = FrozenMapping[str, PersiaKey]({"initial_sparse_checkpoint": Renamed("embedding_checkpoint")})
    _unused_keys = FrozenMapping(dict.fromkeys(
        ("servers", "embedding_checkpoint"),
        "inference here is `persia-launcher serve`, which finds the PS replicas over NATS and loads the newest "
        "checkpoint of checkpointing_config.checkpoint_dir (docs/checkpoints.md)"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "servers", tuple(self.servers))


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointingConfig:
    """Checkpoints (``common_config.checkpointing_config``; layout in ``docs/checkpoints.md``).

    ``checkpoint_dir`` is the checkpoint root ("": none; ``PERSIA_CHECKPOINT_DIR`` overrides it): a
    PS loads its shard of the newest valid checkpoint there at start, and refuses checkpoint paths
    outside it. ``keep`` is how many final checkpoints pruning keeps. The NN workers take one every
    ``every_batches`` training steps and every ``every_sec`` seconds (0: never), and resume from the
    newest valid one when ``resume`` is true. ``dump_timeout_sec`` bounds the wait for the PS replicas'
    shards: a checkpoint not written by then is abandoned (training goes on; the previous one stands).
    ``final_required``: a final checkpoint (``TrainCtx.dump_checkpoint``, the one serving is meant to
    serve) that fails raises :class:`~persia_nats.common.checkpoint.CheckpointError` instead of returning
    None, so the job fails with it; false only logs it, as a periodic checkpoint's failure is.
    """

    num_workers: int = 4
    checkpoint_dir: str = ""
    keep: int = 3
    every_batches: int = 0
    every_sec: float = 0.0
    resume: bool = True
    dump_timeout_sec: float = 600.0
    final_required: bool = True

    _unused_keys = FrozenMapping({"num_workers": "each PS replica reads and writes its own checkpoint shards"})

    def __post_init__(self) -> None:
        _require(self.num_workers >= 1, "num_workers", f"must be >= 1, got {self.num_workers}")
        _require(self.keep >= 1, "keep", f"must be >= 1, got {self.keep}")
        _require(self.every_batches >= 0, "every_batches", f"must be >= 0, got {self.every_batches}")
        _require(self.every_sec >= 0, "every_sec", f"must be >= 0, got {self.every_sec}")
        _require(self.dump_timeout_sec > 0, "dump_timeout_sec", f"must be > 0, got {self.dump_timeout_sec}")
        if self.checkpoint_dir:
            check_root(self.checkpoint_dir, "checkpointing_config.checkpoint_dir")


@dataclass(frozen=True, slots=True, kw_only=True)
class CommonConfig:
    """Settings every role reads (``common_config``)."""

    job_name: str = DEFAULT_JOB_NAME
    job_type: JobType = "Train"
    metrics_config: MetricsConfig = field(default_factory=MetricsConfig)
    infer_config: InferConfig = field(default_factory=InferConfig)
    checkpointing_config: CheckpointingConfig = field(default_factory=CheckpointingConfig)

    _persia_keys = FrozenMapping[str, PersiaKey]({
        "num_embedding_io_workers": _IO_WORKERS,
        "intent": NoEffect("PERSIA 0.1's name of job_type; every job here trains (see job_type)"),
    })
    _unused_keys = FrozenMapping({"job_type": "every job here trains; serve a checkpoint with "
                                              "`persia-launcher serve` (docs/checkpoints.md)"})

    def __post_init__(self) -> None:
        check_job_name(self.job_name)
        metrics = self.metrics_config
        if isinstance(metrics.job_name, JobsOwnName) and metrics.job_name != self.job_name:
            object.__setattr__(self, "metrics_config", replace(metrics, job_name=JobsOwnName(self.job_name)))


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddingParameterServerConfig:
    """The embedding PS store (``embedding_parameter_server_config``)."""

    capacity: int = 1_000_000_000  # rows per PS replica; least recently used rows are evicted.
    # rows each table's hash index is built for, and whose memory is committed, at the start (at most
    # ``capacity``); past that the index doubles, the doubled one built ahead in steps beside lookups
    # (docs/capacity.md, "While a table grows")
    initial_rows: int = 1024
    num_hashmap_internal_shards: int = 100
    # incremental updates (docs/checkpoints.md#incremental-updates): each replica writes the rows its updates
    # changed under incremental_dir/s<i>/ once more than incremental_buffer_size distinct keys wait or the
    # oldest change waited incremental_interval_sec; `persia-launcher serve` applies them every
    # incremental_poll_interval_sec
    enable_incremental_update: bool = False
    incremental_buffer_size: int = 1_000_000
    incremental_dir: str = "/workspace/incremental_dir/"
    incremental_interval_sec: float = 10.0
    incremental_poll_interval_sec: float = 2.0
    # rows one lookup may ask for, in bytes of the reply; a larger one is refused (413) before any row is read
    max_reply_bytes: int = 512 * 1024**2

    _persia_keys = FrozenMapping[str, PersiaKey]({
        "num_embedding_io_workers": _IO_WORKERS,
        "incremental_channel_capacity": NoEffect("PERSIA parsed it and used a constant; " + _ONE_WRITER),
        "full_amount_manager_buffer_size": NoEffect("removed from PERSIA's own code (its PR #128); checkpoints "
                                                    "here copy rows in batches"),
        **dict.fromkeys(("embedding_recycle_pool_capacity", "num_persistence_workers", "num_signs_per_file",
                         "storage", "local_buffer_dir"), _PERSIA_01_CHECKPOINTS),
    })
    _unused_keys = FrozenMapping({
        "num_hashmap_internal_shards": "each table here is one flat hash index",
    })

    def __post_init__(self) -> None:
        for key in ("capacity", "initial_rows", "num_hashmap_internal_shards", "incremental_buffer_size",
                    "max_reply_bytes"):
            value = getattr(self, key)
            _require(value >= 1, key, f"must be >= 1, got {value}")
        for key in ("incremental_interval_sec", "incremental_poll_interval_sec"):
            value = getattr(self, key)
            _require(0 < value <= 86400, key, f"must be in (0, 86400] seconds, got {value}")
        _require(bool(self.incremental_dir) and "://" not in self.incremental_dir, "incremental_dir",
                 f"must be a directory path (on a volume the PS replicas and servers share), "
                 f"got {self.incremental_dir!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddingWorkerConfig:
    """The embedding worker (``embedding_worker_config``).

    ``wire_dtype`` is the dtype of the embeddings sent to NN workers and of the gradients the NN
    workers send back (float16 gradients carry a per-batch power-of-two scale; the PS always stores
    float32); ``max_inflight`` bounds the requests one worker handles concurrently.

    ``hot_row_min_count``: hot rows (a head id of a skewed slot) are returned apart from the pooled
    sums, with their PS version, and the PS publishes their value and optimizer state after each
    update that touches them (``hot.rows.<i>``); the NN worker adds the newest value it holds, with
    the gradients still in flight applied, when the batch is about to train, so look-ahead does not
    make the rows that every batch updates stale. Unset (the default), the worker picks them from the
    batches in flight (:mod:`persia_nats.services.embedding_worker.hot_window`: read at least once per batch on
    average, at most the 512 most read); a count c makes hot the rows that
    one training batch's pooled slots read c or more times; 0 turns hot rows off.

    The forward buffer (batches ingested, not yet looked up) and the gradient buffer (looked up, their
    gradients not yet applied) each hold at most ``forward_buffer_size`` batches and
    ``forward_buffer_bytes`` bytes (ids and the lookup plan made from them); beyond either, an ingest
    (or a lookup) is refused with 503. A batch expires after ``buffered_data_expired_sec``, or, while
    its buffer is full, after ``buffered_data_full_expired_sec``: batches that nobody claims cannot
    keep a later job's batches out for longer than that.
    """

    forward_buffer_size: int = 1000
    forward_buffer_bytes: int = 512 * 1024**2
    buffered_data_expired_sec: float = 1000.0
    buffered_data_full_expired_sec: float = 30.0
    wire_dtype: WireDtype = "float16"
    max_inflight: int = 64
    hot_row_min_count: int | None = None

    def __post_init__(self) -> None:
        _require(self.forward_buffer_size >= 1, "forward_buffer_size", "must be >= 1")
        _require(self.forward_buffer_bytes >= 1 << 20, "forward_buffer_bytes",
                 f"must be >= 1 MiB (1048576), got {self.forward_buffer_bytes}")
        _require(self.buffered_data_full_expired_sec > 0, "buffered_data_full_expired_sec", "must be > 0")
        count = self.hot_row_min_count
        _require(count is None or count >= 0, "hot_row_min_count", f"must be >= 0 or unset (automatic), got {count}")
        _require(self.buffered_data_expired_sec > 0, "buffered_data_expired_sec", "must be > 0")
        _require(self.max_inflight >= 1, "max_inflight", f"must be >= 1, got {self.max_inflight}")


@dataclass(frozen=True, slots=True, kw_only=True)
class NNWorkerConfig:
    """The NN worker's sync mode (``nn_worker_config``).

    ``embedding_staleness`` bounds the batches in flight per NN worker in ``hybrid`` mode (``sync``
    behaves as 1 and ``async`` ignores it). ``hot_row_cache_bytes`` bounds each rank's copies of hot
    rows (``embedding_worker_config.hot_row_min_count``); without hot rows a rank holds none.
    """

    sync_mode: SyncMode = "hybrid"
    embedding_staleness: int = 10
    request_timeout_sec: float = 30.0
    hot_row_cache_bytes: int = 64 * 1024**2
    #: what an error in the model's forward or backward does to the job: ``skip`` the batch, ``stop``
    #: the job, or ``auto``: skip a batch from the ingestion stream, stop on any other
    on_batch_error: BatchErrorPolicy = "auto"
    #: where a width whose slots read one row each is built from its distinct rows: ``device`` (the model's,
    #: as a gather in the autograd graph), ``host`` (the rank's I/O thread), or ``auto``: the device when the
    #: rank trains on a GPU, the host otherwise
    embedding_gather: GatherPlace = "auto"

    def __post_init__(self) -> None:
        _require(self.embedding_staleness >= 1, "embedding_staleness", "must be >= 1")
        _require(self.hot_row_cache_bytes >= 0, "hot_row_cache_bytes", f"must be >= 0, got {self.hot_row_cache_bytes}")
        _require(self.request_timeout_sec > 0, "request_timeout_sec", "must be > 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class ArrayConfig:
    """A dense feature or label of the batch schema: its dtype and its shape after the batch dimension."""

    dtype: str
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        try:
            kind: str = np.dtype(self.dtype).kind
        except TypeError:
            kind = ""
        _require(kind in ("b", "i", "u", "f"), "dtype",
                 f"{self.dtype!r} is not a bool, integer or float dtype (float32, int64, <f4 ...)")
        _require(all(n >= 0 for n in self.shape), "shape", f"must hold sizes >= 0, got {list(self.shape)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataLoaderConfig:
    """The durable ingestion stream (``data_loader_config``; used by ``data-loader --from-stream``).

    ``ack_wait_sec``: a batch not trained this long after delivery is delivered again.
    ``max_ack_pending``: batches delivered but not yet trained, across all loaders (backpressure).
    ``max_deliveries``: deliveries after which an untrained batch is dead-lettered.
    ``stream_max_msgs`` / ``stream_max_bytes``: the stream's bound; publishers are refused beyond it.
    ``max_inflight``: batches one loader forwards at once.
    ``non_id_features`` / ``labels``: the batch schema's dense features and labels, by name, in the
    order the model takes them; left empty, the first batch that trains fixes them (never one the model
    failed on: :class:`~persia_nats.common.batch.BatchSchema`).
    ``min_trained_share``: a job that trained fewer distinct stream batches than this share of those
    published fails its account and exits non-zero (``TrainCtx.job_account``); so does one that lost any.
    ``stream_replicas``: copies of the batch and dead-letter streams in a NATS cluster; 0 (auto) is 3
    when the server is part of a cluster (a cluster needs 3 nodes to keep a quorum with one down), else 1.
    ``max_batch_bytes`` / ``max_batch_samples`` / ``max_batch_distinct_ids``: what one batch may hold; the
    stream refuses a larger publish, and the loader dead-letters (``ew.ingest`` refuses, 400) a batch over
    any bound before an embedding worker or PS holds it. The distinct ids (summed over slots) bound the
    rows one batch can insert into the PSs.
    ``end_marker_from``: where an end marker ends the stream: ``stream_end`` (``persia.<job>.stream_end`` only,
    which the secure deployment lets only the operator publish), or ``batches`` (also the batches subject,
    as before: then whoever may publish a batch may end the job).
    ``dead_max_bytes`` / ``dead_max_age_sec``: what the dead-letter stream keeps (oldest dropped first);
    ``dead_max_payload_bytes``: a dead letter keeps a refused batch's bytes up to this size, and beyond
    it only its reason and size: an outsider's junk cannot fill the disk or push real reasons out.
    """

    ack_wait_sec: float = 60.0
    max_ack_pending: int = 64
    max_deliveries: int = 10
    stream_max_msgs: int = 100_000
    stream_max_bytes: int = 4 * 1024**3
    max_inflight: int = 16
    non_id_features: Mapping[str, ArrayConfig] = field(default_factory=dict)
    labels: Mapping[str, ArrayConfig] = field(default_factory=dict)
    stream_replicas: int = 0
    min_trained_share: float = 0.5
    max_batch_bytes: int = 32 * 1024**2
    max_batch_samples: int = 65535
    max_batch_distinct_ids: int = 1 << 18
    dead_max_bytes: int = 256 * 1024**2
    dead_max_age_sec: float = 7 * 86400.0
    dead_max_payload_bytes: int = 1024**2
    end_marker_from: EndMarkerFrom = "stream_end"

    def __post_init__(self) -> None:
        object.__setattr__(self, "non_id_features", FrozenMapping(self.non_id_features))
        object.__setattr__(self, "labels", FrozenMapping(self.labels))
        _require(self.ack_wait_sec >= 1, "ack_wait_sec", "must be >= 1")
        # JetStream's own bound: a stream has at most 5 replicas
        replicas = self.stream_replicas
        _require(0 <= replicas <= 5, "stream_replicas", f"must be 0 (auto) to 5, got {replicas}")
        share = self.min_trained_share
        _require(0 <= share <= 1, "min_trained_share", f"must be 0 to 1, got {share}")
        for name in ("max_ack_pending", "max_deliveries", "stream_max_msgs", "stream_max_bytes", "max_inflight",
                     "max_batch_bytes", "max_batch_distinct_ids", "dead_max_bytes", "dead_max_age_sec"):
            _require(getattr(self, name) >= 1, name, "must be >= 1")
        # the wire format's own limit (common.messages.base.MAX_BATCH_SIZE)
        _require(1 <= self.max_batch_samples <= 65535, "max_batch_samples",
                 f"must be 1 to 65535, got {self.max_batch_samples}")
        _require(self.dead_max_payload_bytes >= 0, "dead_max_payload_bytes", "must be >= 0")
        _require(self.dead_max_payload_bytes <= self.dead_max_bytes, "dead_max_payload_bytes",
                 f"must be at most dead_max_bytes ({self.dead_max_bytes})")


@dataclass(frozen=True, slots=True, kw_only=True)
class GlobalConfig:
    """The whole of ``global_config.yml``; every section may be omitted."""

    common_config: CommonConfig = field(default_factory=CommonConfig)
    embedding_parameter_server_config: EmbeddingParameterServerConfig = field(
        default_factory=EmbeddingParameterServerConfig
    )
    embedding_worker_config: EmbeddingWorkerConfig = field(default_factory=EmbeddingWorkerConfig)
    nn_worker_config: NNWorkerConfig = field(default_factory=NNWorkerConfig)
    data_loader_config: DataLoaderConfig = field(default_factory=DataLoaderConfig)

    # PERSIA 0.1's section names, and the section its monitoring tutorial documents at the top level
    _persia_keys = FrozenMapping[str, PersiaKey]({
        "middleware_config": Renamed("embedding_worker_config"),
        "embedding_server_config": Renamed("embedding_parameter_server_config"),
        "shard_server_config": Renamed("embedding_parameter_server_config"),
        "PersiaMetricsConfig": Renamed("common_config.metrics_config"),
    })


# ---------------------------------------------------------------------------------------------
# embedding_config.yml
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class HashStackConfig:
    """Hash stacking: each ID becomes ``hash_stack_rounds`` rows out of ``embedding_size`` buckets
    per round, summed. Both zero disables it."""

    hash_stack_rounds: int = 0
    embedding_size: int = 0

    def __post_init__(self) -> None:
        rounds, size = self.hash_stack_rounds, self.embedding_size
        _require(rounds >= 0, "hash_stack_rounds", f"must be >= 0, got {rounds}")
        _require(size >= 0, "embedding_size", f"must be >= 0, got {size}")
        _require(size >= 1 or rounds == 0, "embedding_size", f"must be >= 1 when hash_stack_rounds is {rounds}")
        _require(rounds >= 1 or size == 0, "hash_stack_rounds", f"must be >= 1 when embedding_size is {size}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotConfig:
    """One ID feature (``slots_config.<name>``).

    ``embedding_summation: false`` gives raw embeddings, ``(batch, sample_fixed_size, dim + 1)``
    with a 0/1 mask channel, and keeps at most ``sample_fixed_size`` IDs per sample. Otherwise the
    IDs of a sample are pooled by ``pooling``; ``sqrt_scaling`` divides a sum by sqrt(#ids).
    """

    dim: int
    sample_fixed_size: int = 10
    embedding_summation: bool = True
    pooling: Pooling = "sum"
    sqrt_scaling: bool = False
    hash_stack_config: HashStackConfig = field(default_factory=HashStackConfig)

    # Read by config_schema: keys a user may not set, and why.
    _derived_keys = FrozenMapping(
        {"index_prefix": "it is derived from feature_groups and feature_index_prefix_bit"}
    )
    _persia_keys = FrozenMapping[str, PersiaKey]({
        "capacity": NoEffect("PERSIA's code has no per-slot capacity either (its examples set it, its parser "
                             "ignored it); a PS replica's row bound is embedding_parameter_server_config.capacity"),
    })

    def __post_init__(self) -> None:
        _require(self.dim >= 1, "dim", f"must be >= 1, got {self.dim}")
        _require(self.sample_fixed_size >= 1, "sample_fixed_size", f"must be >= 1, got {self.sample_fixed_size}")
        _require(
            self.embedding_summation or self.pooling == "sum",
            "pooling",
            "'mean' needs embedding_summation: true (raw embeddings are not pooled)",
        )
        _require(
            not (self.pooling == "mean" and self.sqrt_scaling),
            "sqrt_scaling",
            "cannot be combined with pooling: mean (pick one normalisation)",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddingConfig:
    """The whole of ``embedding_config.yml``.

    Groups are numbered in order: first ``feature_groups`` in file order, then each slot in no group
    (in ``slots_config`` order) as a group of its own. A slot's ID prefix is
    ``(group_index + 1) << (64 - feature_index_prefix_bit)``; slots in one group share a prefix, and
    so share rows for equal IDs.
    """

    feature_index_prefix_bit: int = 8
    slots_config: Mapping[str, SlotConfig]
    feature_groups: Mapping[str, tuple[str, ...]] = field(default_factory=FrozenMapping)
    # the tutorials' spelling, and PERSIA 0.1's
    _persia_keys = FrozenMapping[str, PersiaKey]({"slot_config": Renamed("slots_config"),
                                                  "slot_configs": Renamed("slots_config")})
    _group_index: Mapping[str, int] = field(init=False, repr=False, compare=False)
    _group_names: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        groups = FrozenMapping({g: tuple(s) for g, s in self.feature_groups.items()})
        object.__setattr__(self, "slots_config", FrozenMapping(self.slots_config))
        object.__setattr__(self, "feature_groups", groups)
        bits = self.feature_index_prefix_bit
        _require(1 <= bits <= 63, "feature_index_prefix_bit", f"must be in 1..63, got {bits}")
        _require(len(self.slots_config) >= 1, "slots_config", "needs at least one slot")
        names = self._group_names_checked()
        index = {g: i for i, g in enumerate(names)}
        slot_index = {s: index[g] for g, members in self.feature_groups.items() for s in members}
        slot_index.update({s: index[s] for s in self.slots_config if s not in slot_index})
        object.__setattr__(self, "_group_names", names)
        object.__setattr__(self, "_group_index", FrozenMapping({s: slot_index[s] for s in self.slots_config}))
        _require(
            len(names) < 2**bits - 1,
            "feature_index_prefix_bit",
            f"{bits} bits cannot number {len(names)} feature groups (at most 2**{bits} - 2)",
        )

    def _group_names_checked(self) -> tuple[str, ...]:
        """Check feature_groups; return all group names in number order."""
        owner: dict[str, str] = {}
        for group, members in self.feature_groups.items():
            key = f"feature_groups.{group}"
            _require(group not in self.slots_config, key, "a group may not be named like a slot")
            _require(len(members) >= 1, key, "a group needs at least one slot")
            for slot in members:
                _require(slot in self.slots_config, key, f"unknown slot {slot!r} (not in slots_config)")
                _require(slot not in owner, key, f"slot {slot!r} is already in group {owner.get(slot)!r}")
                owner[slot] = group
        return (*self.feature_groups, *(s for s in self.slots_config if s not in owner))

    @property
    def slot_names(self) -> tuple[str, ...]:
        """Slot names in file order."""
        return tuple(self.slots_config)

    @property
    def group_names(self) -> tuple[str, ...]:
        """Group names in number order (an ungrouped slot's group is named after the slot)."""
        return self._group_names

    @property
    def index_bits(self) -> int:
        """Bits left for the ID below the prefix: ``64 - feature_index_prefix_bit``."""
        return 64 - self.feature_index_prefix_bit

    def group_of(self, slot: str) -> str:
        """The group ``slot`` belongs to (the slot's own name if it is in no group)."""
        return self._group_names[self._index(slot)]

    def prefix_of(self, slot: str) -> int:
        """The ID prefix of ``slot``: ``(group_index + 1) << (64 - feature_index_prefix_bit)``."""
        return (self._index(slot) + 1) << self.index_bits

    def _index(self, slot: str) -> int:
        try:
            return self._group_index[slot]
        except KeyError:
            raise KeyError(f"unknown slot {slot!r} (known: {', '.join(self.slot_names)})") from None


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def global_config_from_dict(data: Mapping[str, Any] | None, source: str = "<dict>") -> GlobalConfig:
    """Build a GlobalConfig from parsed YAML; ``source`` names the origin in errors."""
    return build(GlobalConfig, data, source=source)


def embedding_config_from_dict(data: Mapping[str, Any] | None, source: str = "<dict>") -> EmbeddingConfig:
    """Build an EmbeddingConfig from parsed YAML; ``source`` names the origin in errors."""
    return build(EmbeddingConfig, data, source=source)


def load_global_config(path: str | os.PathLike[str] | None) -> GlobalConfig:
    """Read ``global_config.yml``; ``None`` gives all defaults.

    Raises:
        ConfigError: The file is missing or unreadable, is not YAML, its top level is not a
            mapping, or a key is unknown, mistyped or invalid.
    """
    if path is None:
        return GlobalConfig()
    return global_config_from_dict(read_yaml(path), source=os.fspath(path))


def load_embedding_config(path: str | os.PathLike[str]) -> EmbeddingConfig:
    """Read ``embedding_config.yml``.

    Raises:
        ConfigError: As :func:`load_global_config`; also when the file defines no slot.
    """
    return embedding_config_from_dict(read_yaml(path), source=os.fspath(path))


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, which PyYAML resolves silently to the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML file whose top level is a mapping (an empty file reads as ``{}``).

    Raises:
        ConfigError: Naming the file, if it cannot be read or parsed or is not a mapping.
    """
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {name}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {name}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"YAML syntax error in {name}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"top level of {name} must be a mapping, got {type(data).__name__}")
    return data
