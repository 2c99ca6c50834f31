"""The stream loader as a :class:`~persia_nats.common.service.Service` (``persia-launcher data-loader --from-stream``).

It starts and stops as every other role does (:func:`~persia_nats.common.service.run_service`: the first
signal drains the batches being forwarded, a second cancels them), and ends by itself once the end
marker's batches are trained.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.aio.client import Client as NATS
from persia_nats.common.config import GlobalConfig
from persia_nats.common.discovery import register
from persia_nats.common.messages import StatusReply
from persia_nats.common.service import Service
from persia_nats.common.subjects import Subjects
from persia_nats.services.data_loader.sender import BatchSender
from persia_nats.services.data_loader.stream import StreamLoader

log = logging.getLogger(__name__)


class StreamLoaderService(Service):
    """One data loader forwarding the job's stream (:class:`StreamLoader`), listed under ``$SRV``."""

    role = "data-loader"

    def __init__(self, nc: NATS, gcfg: GlobalConfig, *, replica_index: int, replica_size: int,
                 slots: tuple[str, ...] | None = None) -> None:
        super().__init__(nc)
        self.subjects = Subjects(gcfg.common_config.job_name)
        self.replica_index = replica_index
        self.replica_size = replica_size
        self.instance = f"loader-{replica_index}"
        sender = BatchSender(nc, self.subjects, replica_index, replica_size, gcfg.nn_worker_config.request_timeout_sec)
        self.loader = StreamLoader(nc, self.subjects, sender, gcfg.data_loader_config, slots)
        self._forwarding: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # listed by `persia-launcher status` and `nats micro`, with the loader's counters; no request
        # subject of its own, so no `status` broadcast handler either
        self.registration = await register(
            self.nc, job=self.subjects.job, role=self.role, replica_index=self.replica_index,
            replica_size=self.replica_size, instance=self.instance,
            status=lambda: StatusReply(self.role, self.replica_index, self.instance, self.stats()).to_wire())
        self._forwarding = asyncio.get_running_loop().create_task(self._forward())

    async def _forward(self) -> None:
        try:
            await self.loader.run(log_stats=False)  # run_service logs the counters
        except Exception as exc:
            self.failure = exc
        finally:
            await self.stop()

    def stats(self) -> dict[str, Any]:
        return self.loader.stats()

    async def teardown(self) -> None:
        self.loader.stop()
        task = self._forwarding
        if task is not None and task is not asyncio.current_task():
            await asyncio.gather(task, return_exceptions=True)
