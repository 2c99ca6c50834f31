"""Dead letters: batches a job will never train, kept with the reason on ``persia.<job>.dead``.

The stream ``PERSIA_<job>_DEAD`` keeps them within bounds an outsider cannot lift: the newest
:data:`DEAD_MAX_MSGS`, ``data_loader_config.dead_max_bytes`` and ``dead_max_age_sec`` (oldest dropped
first), and no message over ``dead_max_payload_bytes`` plus room for the headers. Each holds the batch's
bytes as published, or none where they exceed ``dead_max_payload_bytes`` (whoever can publish a batch
could otherwise fill the disk with copies of junk, and push real dead letters out), and headers:
:data:`DEAD_REASON_HEADER`, one line of at most :data:`REASON_MAX_CHARS` characters
(``<what>: <field>: <detail>``, see ``docs/protocol.md``), always; :data:`DEAD_SIZE_HEADER`, the batch's
size in bytes, always; and, for a batch that came from the ingestion stream, :data:`DEAD_SEQ_HEADER`,
its stream sequence.
"""

from __future__ import annotations

import logging

from nats.aio.client import Client as NATS
from persia_nats.common.subjects import Subjects

log = logging.getLogger(__name__)

DEAD_REASON_HEADER = "Persia-Dead-Reason"
DEAD_SEQ_HEADER = "Persia-Stream-Seq"
#: the refused batch's size in bytes, also where its bytes were not kept
DEAD_SIZE_HEADER = "Persia-Dead-Size"
#: dead letters kept (oldest dropped first)
DEAD_MAX_MSGS = 10_000
REASON_MAX_CHARS = 1000
#: the default of ``data_loader_config.dead_max_payload_bytes``, for callers without the config at hand
DEAD_MAX_PAYLOAD_BYTES = 1024**2
#: what the dead-letter stream allows on top of a kept payload: the headers (a reason is at most 1000 characters)
DEAD_HEADER_ROOM = 16 * 1024


def dead_headers(reason: str, seq: int | None = None, size: int | None = None) -> dict[str, str]:
    """The headers of a dead letter: the reason on one line, cut to :data:`REASON_MAX_CHARS`."""
    headers = {DEAD_REASON_HEADER: " ".join(reason.split())[:REASON_MAX_CHARS]}
    if seq is not None:
        headers[DEAD_SEQ_HEADER] = str(seq)
    if size is not None:
        headers[DEAD_SIZE_HEADER] = str(size)
    return headers


def dead_message(payload: bytes, reason: str, seq: int | None = None,
                 max_payload: int = DEAD_MAX_PAYLOAD_BYTES) -> tuple[bytes, dict[str, str]]:
    """The body and headers of a dead letter: ``payload``, or nothing where it exceeds ``max_payload``
    (the reason then says so, so that a reader knows the batch was not lost from the letter by accident)."""
    size = len(payload)
    if size > max_payload:
        reason = f"{reason} (payload of {size} bytes not kept: over data_loader_config.dead_max_payload_bytes " \
                 f"{max_payload})"
        payload = b""
    return payload, dead_headers(reason, seq, size)


async def dead_letter(nc: NATS, subjects: Subjects, payload: bytes, reason: str, seq: int | None = None,
                      max_payload: int = DEAD_MAX_PAYLOAD_BYTES) -> None:
    """Store ``payload`` (see :func:`dead_message`) on the dead-letter stream with ``reason``; raises when the
    stream did not take it."""
    body, headers = dead_message(payload, reason, seq, max_payload)
    await nc.jetstream().publish(subjects.dead(), body, headers=headers)


async def dead_letter_from_stream(nc: NATS, subjects: Subjects, seq: int, reason: str,
                                  max_payload: int = DEAD_MAX_PAYLOAD_BYTES) -> None:
    """Dead-letter the ingestion stream's message ``seq`` (read back from the stream, which keeps it until
    it is acknowledged or terminated); raises when it could not be read or stored."""
    stored = await nc.jetstream().get_msg(subjects.stream, seq)
    await dead_letter(nc, subjects, stored.data or b"", reason, seq, max_payload)
