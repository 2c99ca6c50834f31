"""Dead letters: batches a job will never train, kept with the reason on ``persia.<job>.dead``.

The stream ``PERSIA_<job>_DEAD`` keeps them (the newest :data:`DEAD_MAX_MSGS`, oldest dropped first).
Each holds the batch's bytes as published and two headers: :data:`DEAD_REASON_HEADER`, one line of at
most :data:`REASON_MAX_CHARS` characters (``<what>: <field>: <detail>``, see ``docs/protocol.md``), and,
for a batch that came from the ingestion stream, :data:`DEAD_SEQ_HEADER`, its stream sequence.
"""

from __future__ import annotations

import logging

from nats.aio.client import Client as NATS
from persia_nats.common.subjects import Subjects

log = logging.getLogger(__name__)

DEAD_REASON_HEADER = "Persia-Dead-Reason"
DEAD_SEQ_HEADER = "Persia-Stream-Seq"
#: dead letters kept (oldest dropped first)
DEAD_MAX_MSGS = 10_000
REASON_MAX_CHARS = 1000


def dead_headers(reason: str, seq: int | None = None) -> dict[str, str]:
    """The headers of a dead letter: the reason on one line, cut to :data:`REASON_MAX_CHARS`."""
    headers = {DEAD_REASON_HEADER: " ".join(reason.split())[:REASON_MAX_CHARS]}
    if seq is not None:
        headers[DEAD_SEQ_HEADER] = str(seq)
    return headers


async def dead_letter(nc: NATS, subjects: Subjects, payload: bytes, reason: str, seq: int | None = None) -> None:
    """Store ``payload`` on the dead-letter stream with ``reason``; raises when the stream did not take it."""
    await nc.jetstream().publish(subjects.dead(), payload, headers=dead_headers(reason, seq))


async def dead_letter_from_stream(nc: NATS, subjects: Subjects, seq: int, reason: str) -> None:
    """Dead-letter the ingestion stream's message ``seq`` (read back from the stream, which keeps it until
    it is acknowledged or terminated); raises when it could not be read or stored."""
    stored = await nc.jetstream().get_msg(subjects.stream, seq)
    await dead_letter(nc, subjects, stored.data or b"", reason, seq)
