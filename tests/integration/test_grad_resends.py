"""A gradient push resent while the embedding worker is still applying it, over a real nats-server.

The PS is reached through a proxy that holds every update while "paused" (as a SIGSTOPped replica
would: nothing is answered, everything is answered on resume), past both the embedding worker's PS
timeout and the NN rank's request timeout. The NN rank resends its push; the embedding worker answers
the resend with the first push's true outcome. Before, the resend found the ref taken, got 404, and the
NN rank counted that as "applied": it acknowledged the batch while the PS was still paused.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import numpy as np
from persia_nats.common.messages import BatchRef, EwLookup, PsConfigure, SlotGradient, StreamAck
from persia_nats.common.optim_config import SGDConfig
from persia_nats.common.rpc import request
from persia_nats.common.subjects import Subjects
from persia_nats.services.embedding_worker.ps_client import PsClient
from persia_nats.services.nn_worker.embedding_client import EmbeddingClient, GradPush
from persia_nats.services.nn_worker.hot_sync import HotRowSync
from persia_nats.services.nn_worker.stream_acks import StreamAcks

from tests.integration.helpers import running_job, settle
from tests.integration.test_embedding_worker import ingest


class PausedPs:
    """Replica 0 of ``paused``, answered by the real replica 0 of ``real``: the requests of ``kinds`` once
    :meth:`resume` is called, the others at once. ``updates``: the update requests that reached the proxy."""

    def __init__(self, client, paused: Subjects, real: Subjects, kinds: tuple[str, ...] = ("update",)) -> None:
        self.client, self.paused, self.real, self.kinds = client, paused, real, kinds
        self.resumed = asyncio.Event()
        self.resumed_at: float | None = None
        self.updates = 0
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        for kind in ("lookup", "update"):
            await self.client.subscribe(self.paused.ps(0, kind), cb=self._on_request)
        await settle(self.client)

    def close(self) -> None:
        """Forget the updates still held (a replica that never came back)."""
        for task in list(self._tasks):
            task.cancel()

    def resume(self) -> None:
        self.resumed_at = time.monotonic()
        self.resumed.set()

    async def _on_request(self, msg) -> None:
        kind = msg.subject.rsplit(".", 1)[1]
        if kind == "update":
            self.updates += 1
        task = asyncio.get_running_loop().create_task(self._answer(kind, msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, kind: str, msg) -> None:
        if kind in self.kinds:
            await self.resumed.wait()
        reply = await self.client.request(self.real.ps(0, kind), msg.data, timeout=10)
        await msg.respond(reply.data)


async def looked_up_batch(client, job: str, ew) -> int:
    s = Subjects(job)
    await request(client, s.ps(0, "configure"), PsConfigure(SGDConfig(lr=1.0)), 5)
    ref = (await request(client, s.ew_ingest(), ingest(), 5))["ref"]
    await request(client, s.ew_lookup(ew.worker_id), EwLookup(ref, train=True), 5)
    return int(ref)


def nn_client(client, job: str, timeout: float) -> tuple[EmbeddingClient, Counter[str]]:
    counters: Counter[str] = Counter()
    s = Subjects(job)
    hot = HotRowSync(client, s, rank=0, world_size=1, counters=counters)
    acks = StreamAcks(client, s, rank=0, counters=counters)
    return EmbeddingClient(client, s, rank=0, timeout=timeout, counters=counters, hot=hot, acks=acks), counters


async def acks_seen(client, subject: str) -> list[tuple[float, bytes]]:
    seen: list[tuple[float, bytes]] = []

    async def on_ack(msg) -> None:
        seen.append((time.monotonic(), msg.data))

    await client.subscribe(subject, cb=on_ack)
    await settle(client)
    return seen


def push(ref: int, worker: str, ack_subject: str) -> GradPush:
    return GradPush(ref=BatchRef(worker, ref), grads=(SlotGradient("a", np.ones((3, 4), np.float16)),
                                                      SlotGradient("r", np.ones((2, 2), np.float16))),
                    ack=StreamAck(ack_subject, seq=7), batch_id=7)


async def test_a_push_resent_while_the_ps_is_paused_is_acknowledged_only_once_applied(nats_server, job_name):
    async with running_job(nats_server.url, job_name, replicas=1) as (client, (ps,), ew):
        ref = await looked_up_batch(client, job_name, ew)
        proxy = PausedPs(client, Subjects(f"{job_name}-paused"), Subjects(job_name))
        await proxy.start()
        # the embedding worker resends each PS request twice, 3 s apart: the pause (4 s) outlasts the
        # NN rank's timeout (1 s) several times over, and ends before the worker gives up (9 s)
        ew.ps = PsClient(ew.nc, proxy.paused, 1, timeout=3.0, timeout_retries=2, counters=ew.counters)
        ew._timeout = 1.0  # a resend waits 0.5 s for the push in flight, then answers 425
        seen = await acks_seen(client, f"{job_name}.ack")
        embeddings, counters = nn_client(client, job_name, timeout=1.0)
        embeddings.send_grads(push(ref, ew.worker_id, f"{job_name}.ack"))
        await asyncio.sleep(4.0)
        assert not seen, seen  # nothing acknowledged while the PS is paused
        proxy.resume()
        await asyncio.wait_for(embeddings.flush_grads(), 60)
        await settle(client)
    assert counters["grads_applied"] == 1 and not counters["grad_failures"], counters
    assert counters["grad_outcome_waits"] >= 1 and counters["grad_pushes_resent"] >= 1, counters
    assert [data for _, data in seen] == [b"+ACK"] and seen[0][0] >= proxy.resumed_at, seen
    assert ew.counters["grads_applied"] == 1 and ew.counters["grad_resends_joined"] >= 1, ew.counters
    assert ew.counters["grad_resends_in_progress"] >= 1, ew.counters
    assert ps.duplicate_updates == proxy.updates - 1, (ps.duplicate_updates, proxy.updates)  # applied once
    assert ew.staleness == 0


async def test_a_push_whose_ps_never_answers_is_reported_not_applied(nats_server, job_name):
    async with running_job(nats_server.url, job_name, replicas=1) as (client, (ps,), ew):
        ref = await looked_up_batch(client, job_name, ew)
        proxy = PausedPs(client, Subjects(f"{job_name}-paused"), Subjects(job_name))
        await proxy.start()
        ew.ps = PsClient(ew.nc, proxy.paused, 1, timeout=1.0, timeout_retries=1, counters=ew.counters)
        ew._timeout = 1.0
        seen = await acks_seen(client, f"{job_name}.ack")
        embeddings, counters = nn_client(client, job_name, timeout=0.8)
        embeddings.send_grads(push(ref, ew.worker_id, f"{job_name}.ack"))
        await asyncio.wait_for(embeddings.flush_grads(), 60)
        await settle(client)
        assert not counters["grads_applied"] and counters["grad_failures"] == 1, counters
        assert [data[:4] for _, data in seen] == [b"-NAK"], seen
        assert ew.counters["ps_timeouts_failed"] >= 1 and not ew.counters["grads_applied"], ew.counters
        assert proxy.updates >= 2 and ps.duplicate_updates == 0, (proxy.updates, ps.duplicate_updates)
        # the batch stays in the gradient buffer: a later push can still apply it
        assert ew.staleness == 1
        proxy.close()


async def test_a_lookup_resent_while_the_ps_is_paused_is_answered_and_parks_the_batch_once(nats_server, job_name):
    from persia_nats.common.messages import NamedArray, NNBatch

    async with running_job(nats_server.url, job_name, replicas=1) as (client, _, ew):
        s = Subjects(job_name)
        await request(client, s.ps(0, "configure"), PsConfigure(SGDConfig(lr=1.0)), 5)
        ref = (await request(client, s.ew_ingest(), ingest(), 5))["ref"]
        proxy = PausedPs(client, Subjects(f"{job_name}-paused"), s, kinds=("lookup",))
        await proxy.start()
        ew.ps = PsClient(ew.nc, proxy.paused, 1, timeout=3.0, timeout_retries=2, counters=ew.counters)
        ew._timeout = 1.0
        embeddings, counters = nn_client(client, job_name, timeout=1.0)
        batch = NNBatch(1, 3, BatchRef(ew.worker_id, ref), labels=(NamedArray("y", np.zeros((3, 1), np.float32)),))
        looked_up = asyncio.get_running_loop().create_task(embeddings.lookup(batch, train=True))
        await asyncio.sleep(2.5)  # past the NN rank's timeout: it has resent the lookup, answered 425
        assert not looked_up.done()
        proxy.resume()
        slots, _, _ = await asyncio.wait_for(looked_up, 30)
        assert [e.name for e in slots] == ["a", "r"]
        assert ew.counters["lookup_resends_repeated"] == 1 and ew.counters["lookup_resends_in_progress"] >= 1, \
            ew.counters
        assert ew.staleness == 1 and ew.max_staleness == 1  # parked once: the resend did not make it stale twice
        embeddings.send_grads(push(ref, ew.worker_id, f"{job_name}.ack"))
        await asyncio.wait_for(embeddings.flush_grads(), 30)
        assert counters["grads_applied"] == 1 and ew.staleness == 0, counters
