"""The PS replicas' side of a checkpoint, on the rank's event loop: asking them to dump or load, reading
the ingestion stream's position, and making the replicas agree with the checkpoint a worker resumes from.

:class:`~persia_nats.services.nn_worker.checkpoint.Checkpointer` decides when and writes the files on the
training thread; these coroutines are what it runs on the loop, through
:class:`~persia_nats.services.nn_worker.rank_loop.RankLoop`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from persia_nats.common import checkpoint as ck
from persia_nats.common.discovery import discover_replica_size
from persia_nats.common.errors import RemoteError
from persia_nats.common.messages import Empty, PsCheckpoint, PsCheckpointReply, PsInfoReply
from persia_nats.common.rpc import request, request_with_retry
from persia_nats.services.nn_worker.runtime import NNRuntime

log = logging.getLogger(__name__)

#: loading a checkpoint into a 100M-row table reads gigabytes
PS_LOAD_TIMEOUT = 1800.0


async def ask_to_dump(rt: NNRuntime, partial: str, dump_timeout: float
                      ) -> tuple[int, list[asyncio.Task[Any]], dict[str, Any] | None]:
    """Ask every replica to dump into ``partial`` (an absolute path): (the replica count, each one's reply
    to come, the stream's position). The requests are at the server when this returns, so ahead of any update
    of a later step, which goes through an embedding worker first. ``dump_timeout`` bounds each reply: a
    request lost to a nats-server restart is never answered."""
    size = await discover_replica_size(rt.nc, rt.subjects, rt.timeout, deadline=60)
    replies = [asyncio.ensure_future(request(rt.nc, rt.subjects.ps(i, "checkpoint"),
                                             PsCheckpoint("dump", partial), dump_timeout))
               for i in range(size)]
    await asyncio.sleep(0)  # each request published
    await rt.nc.flush(timeout=max(1, int(rt.timeout)))  # and at the server
    return size, replies, await stream_position(rt)


async def gather_dumps(replies: list[asyncio.Task[Any]]) -> tuple[dict[str, Any], int]:
    """The replicas' answers to :func:`ask_to_dump`: their files (name -> size and checksum) and rows."""
    files: dict[str, Any] = {}
    rows = 0
    for raw in await asyncio.gather(*replies):
        reply = PsCheckpointReply.from_wire(raw)
        if reply.files is None:
            raise RemoteError("a PS replica answered a checkpoint dump without its files")
        files.update(reply.files)
        rows += reply.rows
    return files, rows


async def stream_position(rt: NNRuntime) -> dict[str, Any] | None:
    """The ingestion consumer's position (None when the job has no stream, or when it could not be read,
    which is logged: the checkpoint is still whole, only its record of the position is missing)."""
    from nats.js.errors import NotFoundError

    try:
        info = await rt.nc.jetstream().consumer_info(rt.subjects.stream, rt.subjects.stream_consumer, timeout=5)
    except NotFoundError:  # a job fed by plain publishes has no stream
        return None
    except Exception as exc:  # noqa: BLE001 (a checkpoint must not fail on what it only records)
        # a NATS user without $JS.API.CONSUMER.INFO (deploy/nats-auth.conf's NN_WORKER has it) times out here
        log.warning("checkpoint: the ingestion consumer %s/%s's position could not be read (%s: %s); this "
                    "checkpoint records none", rt.subjects.stream, rt.subjects.stream_consumer,
                    type(exc).__name__, exc)
        return None
    return {"stream": rt.subjects.stream, "consumer": rt.subjects.stream_consumer,
            "ack_floor": info.ack_floor.stream_seq, "delivered": info.delivered.stream_seq,
            "ack_pending": info.num_ack_pending, "pending": info.num_pending}


async def load_ps(rt: NNRuntime, ckpt: Path, timeout: float) -> int:
    """Have every PS replica load its shard of ``ckpt`` (resharding when the replica count changed)."""
    size = await discover_replica_size(rt.nc, rt.subjects, timeout, deadline=60)
    return await _load_on(rt, ckpt, range(size))


async def _load_on(rt: NNRuntime, ckpt: Path, replicas: Iterable[int]) -> int:
    """Have the PS ``replicas`` load ``ckpt`` at once; the rows they loaded."""
    path = str(await asyncio.to_thread(lambda: Path(ckpt).resolve()))
    replies = await asyncio.gather(*(
        request_with_retry(rt.nc, rt.subjects.ps(i, "checkpoint"), PsCheckpoint("load", path),
                           PS_LOAD_TIMEOUT, deadline=PS_LOAD_TIMEOUT)
        for i in replicas))
    return sum(PsCheckpointReply.from_wire(r).rows for r in replies)


#: seconds the replicas get to be found serving when a resumed worker checks what they loaded
PS_FIND_DEADLINE_S = 120.0


def _number(name: str) -> int:
    """A loaded checkpoint's number; -1 for none (or a name the job does not write)."""
    parsed = ck.checkpoint_number(name) if name else None
    return parsed[0] if parsed is not None else -1


def ahead_of(held: list[str], ckpt: Path | None) -> list[int]:
    """The replicas holding a checkpoint newer than ``ckpt``, the one the resuming worker chose.

    The worker hashes every file of a checkpoint and a replica only the files it reads, so a replica can
    accept a checkpoint the worker refused (a damaged file of another shard), never the other way round;
    and a replica that has trained on since its start loaded it at that start, before any checkpoint newer
    than the worker's could exist. So a replica ahead of the worker loaded what the job must not run on,
    and one behind it is live (an NN worker restarted alone): only the first are told to reload."""
    want = -1 if ckpt is None else _number(ckpt.name)
    return [i for i, name in enumerate(held) if _number(name) > want]


async def align_ps(rt: NNRuntime, ckpt: Path | None, timeout: float) -> list[int]:
    """Have the PS replicas that loaded a checkpoint newer than ``ckpt`` (:func:`ahead_of`) load ``ckpt``;
    returns them. Without ``ckpt`` (nothing valid to resume from) they are only reported: their rows stay,
    and the job's first checkpoint replaces them."""
    size = await discover_replica_size(rt.nc, rt.subjects, timeout, deadline=PS_FIND_DEADLINE_S)
    infos = await asyncio.gather(*(request(rt.nc, rt.subjects.ps(i, "info"), Empty(), timeout) for i in range(size)))
    held = [PsInfoReply.from_wire(raw).loaded_checkpoint for raw in infos]
    ahead = ahead_of(held, ckpt)
    if not ahead:
        return []
    found = sorted({held[i] for i in ahead})
    if ckpt is None:
        log.error("no valid checkpoint to resume from, but PS replica(s) %s loaded %s at their start (a file of "
                  "another shard is damaged): their rows stay", ahead, found)
        return ahead
    log.warning("PS replica(s) %s loaded %s, which this worker found damaged in another shard; it resumes from "
                "%s, and so do they", ahead, found, ckpt.name)
    await _load_on(rt, ckpt, ahead)
    return ahead
