"""``DataCtx``: PERSIA's data-loader context, a synchronous API over :class:`BatchSender`."""

from __future__ import annotations

import logging
from types import TracebackType

from persia_nats.common.batch import BatchSchema, PersiaBatch
from persia_nats.common.bridge import LoopThread
from persia_nats.common.config import GlobalConfig, load_embedding_config
from persia_nats.common.env import Env, read_env
from persia_nats.common.service import connect_from_env
from persia_nats.common.settings import global_config_from_env
from persia_nats.common.subjects import Subjects
from persia_nats.services.data_loader.sender import BatchSender

log = logging.getLogger(__name__)


class DataCtx:
    """Send :class:`PersiaBatch`es into a running job.

    ``with DataCtx() as ctx: ctx.send_data(batch)``. On exit it waits until every batch is
    delivered and tells the NN workers the stream has ended, so they stop after the last batch.
    Identity comes from ``REPLICA_INDEX`` / ``REPLICA_SIZE``; NATS from ``PERSIA_NATS_URL``.
    """

    def __init__(self, *, env: Env | None = None, global_config: GlobalConfig | None = None,
                 max_inflight: int = 8) -> None:
        self.env = env or read_env()
        self.global_config = global_config or global_config_from_env(self.env)
        self._subjects = Subjects(self.global_config.common_config.job_name)
        self._max_inflight = max_inflight
        self._io: LoopThread | None = None
        self._sender: BatchSender | None = None

    def __enter__(self) -> DataCtx:
        self._io = LoopThread("persia-data-loader")
        timeout = self.global_config.nn_worker_config.request_timeout_sec

        async def setup() -> BatchSender:
            nc = await connect_from_env(self.env, f"data-loader-{self.env.replica_index}")
            sender = BatchSender(nc, self._subjects, self.env.replica_index, self.env.replica_size, timeout,
                                 max_inflight=self._max_inflight, schema=self._schema())
            await sender.wait_for_nn_workers()
            return sender

        self._sender = self._io.run(setup())
        return self

    def _schema(self) -> BatchSchema:
        """The job's schema: the slots of ``PERSIA_EMBEDDING_CONFIG`` (where set; the embedding worker names
        unknown ones) and ``data_loader_config``'s dense features and labels."""
        path = self.env.embedding_config
        slots = load_embedding_config(path).slot_names if path else None
        return BatchSchema.from_config(slots, self.global_config.data_loader_config)

    def send_data(self, batch: PersiaBatch) -> None:
        """Send one batch. Blocks only while ``max_inflight`` batches are still being delivered."""
        if self._io is None or self._sender is None:
            raise RuntimeError("DataCtx must be entered (use `with DataCtx() as ctx:`)")
        if not isinstance(batch, PersiaBatch):
            raise TypeError(f"send_data takes a PersiaBatch, got {type(batch).__name__}")
        self._io.run(self._sender.send(batch))

    @property
    def world_size(self) -> int:
        return self._sender.world_size if self._sender else 0

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._io is None:
            return
        try:
            if exc_type is None and self._sender is not None:
                self._io.run(self._sender.finish())
        finally:
            if self._sender is not None:
                self._io.run(self._sender.close())
            self._io.close()
            self._io = None
