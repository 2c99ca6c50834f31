"""Every crossing of an NN rank from the training thread onto its event loop, in one place.

The training loop is plain synchronous PyTorch on the user's thread; the rank's NATS traffic, its
lookups ahead and its gradient pushes run on an event loop on a thread of its own
(:class:`~persia_nats.common.bridge.LoopThread`), inside the rank's
:class:`~persia_nats.services.nn_worker.runtime.NNRuntime`. The contexts, the DataLoader, the step, the
checkpointer and the rendezvous reach that loop only through :class:`RankLoop`, one method a crossing:

======================  =====================================================  ==========
crossing                what runs on the loop                                  waits
======================  =====================================================  ==========
open / start / close    the runtime built, its subscriptions, its drain        yes
configure_ps            the embedding optimizer registered on every PS         yes
serve_metrics           the rank's Prometheus endpoint                         yes
open_pipeline           a Pipeline looking batches up ahead                    yes
next_batch              the pipeline's next looked-up batch                    a future
close_pipeline          the batches looked up and never handed out given back  yes
ingest_and_lookup       a batch of this process's own, ingested and looked up  yes
lookup_direct           an eval lookup (nothing inserted)                      yes
confirm_schema          a trained batch's schema confirmed to the inbox        no
send_grads              a batch's push made (gradients packed) and sent there  no
flush_grads             every push so far applied or failed                    yes
ps_info                 each PS replica's info                                 yes
stream_account          what the ingestion stream says became of the batches   yes
ask_to_dump             the replicas asked to dump (a checkpoint's cut)        yes
gather_dumps            their answers (a checkpoint's finish, any thread)      yes
checkpoint_done         the waiting ``checkpoint`` requests answered           no
load_ps / align_ps      the replicas loading a checkpoint                      yes
serve / find_rendez...  the dense group's rendezvous                           yes
======================  =====================================================  ==========

Calls that do not wait run on the loop in the order one thread made them, and before any call that
thread makes afterwards (:meth:`LoopThread.call_soon <persia_nats.common.bridge.LoopThread.call_soon>`):
a pushed gradient is on its way before the next lookup starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from persia_nats.common.bridge import LoopThread
from persia_nats.common.messages import (
    BatchRef,
    Empty,
    GatheredSlots,
    IngestRequest,
    PsInfoReply,
    RendezvousReply,
    RendezvousRequest,
    SlotEmbedding,
)
from persia_nats.common.rpc import request
from persia_nats.services.nn_worker import ps_checkpoint
from persia_nats.services.nn_worker.account import stream_account
from persia_nats.services.nn_worker.inbox import EndOfStream
from persia_nats.services.nn_worker.permits import StalenessGate
from persia_nats.services.nn_worker.runtime import GradPush, NNRuntime, Pipeline, TrainingBatch


class RankLoop:
    """An NN rank's event loop thread and the runtime on it, as seen from the training thread."""

    def __init__(self, io: LoopThread, runtime: NNRuntime) -> None:
        self._io = io
        #: read from the training thread (counters, figures); changed only on the loop, by its owners
        self.runtime = runtime
        self.timeout = runtime.timeout

    @classmethod
    def open(cls, name: str, build: Callable[[], Coroutine[Any, Any, NNRuntime]]) -> RankLoop:
        """A loop thread called ``name`` and the runtime ``build`` makes on it."""
        io = LoopThread(name)
        try:
            return cls(io, io.run(build()))
        except BaseException:
            io.close()
            raise

    # -- the rank's life ----------------------------------------------------------------------------

    def start(self) -> None:
        self._io.run(self.runtime.start())

    def configure_ps(self) -> int:
        """Register the embedding settings on every PS; the replica count (0 with nothing to register)."""
        reconfigure = self.runtime.embeddings.reconfigure
        return int(self._io.run(reconfigure())) if reconfigure is not None else 0

    def serve_metrics(self, start: Callable[[NNRuntime], Any]) -> Any:
        """``start(runtime)`` run on the loop: the rank's metrics endpoint, serving from there."""
        async def on_loop() -> Any:
            return start(self.runtime)

        return self._io.run(on_loop())

    def close(self) -> None:
        """Drain the runtime (gradients flushed, acknowledgements settled, subscriptions drained), then
        stop the loop thread."""
        try:
            self._io.run(self.runtime.close(), timeout=self.timeout * 4)
        finally:
            self._io.close()

    # -- batches ------------------------------------------------------------------------------------

    def open_pipeline(self, *, gate: StalenessGate | None, forward_buffer_size: int, train: bool,
                      on_demand: bool) -> Pipeline:
        async def make() -> Pipeline:
            return Pipeline(self.runtime, gate=gate, forward_buffer_size=forward_buffer_size, train=train,
                            on_demand=on_demand)

        return self._io.run(make())

    def next_batch(self, pipeline: Pipeline) -> concurrent.futures.Future[TrainingBatch | EndOfStream]:
        """The pipeline's next batch, to wait for in slices (the caller does other work between them)."""
        return self._io.submit(pipeline.next())

    def close_pipeline(self, pipeline: Pipeline) -> None:
        self._io.run(pipeline.cancel())

    def ingest_and_lookup(self, req: IngestRequest, timeout: float
                          ) -> tuple[BatchRef, tuple[SlotEmbedding, ...], tuple[GatheredSlots, ...]]:
        return self._io.run(self.runtime.embeddings.ingest_and_lookup(req), timeout=timeout)

    def lookup_direct(self, req: IngestRequest, timeout: float | None = None) -> tuple[SlotEmbedding, ...]:
        return self._io.run(self.runtime.embeddings.lookup_direct(req), timeout=timeout)

    # -- gradients ----------------------------------------------------------------------------------

    def confirm_schema(self, batch: TrainingBatch) -> None:
        """``batch`` trained: its dense features and labels are the job's schema (no wait)."""
        self._io.call_soon(self.runtime.inbox.confirm_schema, batch.batch_id, batch.non_id, batch.labels)

    def send_grads(self, make: Callable[[], GradPush]) -> None:
        """Make a batch's push on the loop (``make`` packs its gradients there, beside the training thread),
        then push it in the background (no wait), in the order of this thread's other calls."""
        self._io.call_soon(lambda: self.runtime.embeddings.send_grads(make()))

    def flush_grads(self) -> None:
        """Every gradient pushed so far applied (or reported as failed)."""
        self._io.run(self.runtime.embeddings.flush_grads())

    # -- the job ------------------------------------------------------------------------------------

    def ps_info(self) -> list[dict[str, Any]]:
        rt = self.runtime

        async def gather() -> list[dict[str, Any]]:
            first = dict(await request(rt.nc, rt.subjects.ps(0, "info"), Empty(), rt.timeout))
            size = PsInfoReply.from_wire(first).replica_size
            rest = [dict(await request(rt.nc, rt.subjects.ps(i, "info"), Empty(), rt.timeout))
                    for i in range(1, size)]
            return [first, *rest]

        return self._io.run(gather())

    def stream_account(self) -> dict[str, Any] | None:
        """The ingestion stream's account of the job (rank 0; None without a stream)."""
        rt = self.runtime
        if rt.stream_mark is None:
            return None
        return self._io.run(stream_account(rt.nc, rt.subjects, rt.stream_mark, rt.inbox.stream_ended),
                            timeout=self.timeout * 4)

    # -- checkpoints --------------------------------------------------------------------------------

    def checkpoint_asked(self) -> bool:
        """A ``checkpoint`` request waits for the next step boundary (rank 0)."""
        return bool(self.runtime.checkpoint_requests)

    def ask_to_dump(self, partial: Path, dump_timeout: float
                    ) -> tuple[int, list[asyncio.Task[Any]], dict[str, Any] | None]:
        return self._io.run(ps_checkpoint.ask_to_dump(self.runtime, str(partial.resolve()), dump_timeout),
                            timeout=self.timeout * 4 + 60)

    def gather_dumps(self, replies: list[asyncio.Task[Any]], timeout: float) -> tuple[dict[str, Any], int]:
        """The replicas' answers to :meth:`ask_to_dump`; on any failure none is left waiting on the loop."""
        try:
            return self._io.run(ps_checkpoint.gather_dumps(replies), timeout=timeout)
        except BaseException:
            for task in replies:
                self._io.call_soon(task.cancel)
            raise

    def checkpoint_done(self, path: Path | None, error: BaseException | None) -> None:
        """Answer the waiting ``checkpoint`` requests with ``path`` or ``error`` (no wait; any thread)."""
        self._io.call_soon(self.runtime.settle_checkpoint_requests, path, error)

    def load_ps(self, ckpt: Path) -> int:
        return self._io.run(ps_checkpoint.load_ps(self.runtime, ckpt, self.timeout), timeout=None)

    def align_ps(self, ckpt: Path | None) -> list[int]:
        return self._io.run(ps_checkpoint.align_ps(self.runtime, ckpt, self.timeout), timeout=None)

    # -- the dense group's rendezvous ---------------------------------------------------------------

    def serve_rendezvous(self, answer: Callable[[RendezvousRequest], RendezvousReply]) -> None:
        self._io.run(self.runtime.serve_rendezvous(answer))

    def find_rendezvous(self, deadline: float) -> RendezvousReply:
        return self._io.run(self.runtime.find_rendezvous(deadline=deadline))

    def dense_group_joined(self) -> None:
        """From now on ``nn.info`` says this rank is ready (a flag the loop reads whole: no crossing)."""
        self.runtime.joined_dense_group()
