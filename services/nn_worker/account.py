"""The job's account of its batches: what a run was given on the ingestion stream, and what became of each.

A job that exits 0 after throwing its data away is the failure nobody looks at, so the account is part
of the job's result (``TrainCtx.job_account``) and decides its exit status (:func:`verdict`):

- ``published``: the stream's batches this run was given: every message from the stream's first one
  when the run started (what earlier runs left included) to its last, less the end marker and less those
  an earlier process of the job had acknowledged already (a restarted NN worker finds gaps above the
  stream's first message: batches trained before it was killed, out of order);
- ``trained_once`` / ``trained_more_than_once``: distinct batches trained, by how often (a batch is
  redelivered to the rank that had it, so each rank counts its own; a rank that restarted forgets);
- ``dead_lettered``: batches dead-lettered during the run, by reason (the reason's first clause), each
  once: ``dead_lettered_again`` counts the further letters of a batch dead-lettered twice;
- ``left``: batches still in the stream, untrained (published after the end marker, or given up on);
- ``lost``: what none of these accounts for. Any lost batch, or a trained share (distinct batches
  trained over published) under ``data_loader_config.min_trained_share``, fails the job;
- ``stream_made_again``: the stream was deleted and made again during the run (what it held went with
  it): the job fails, as its account cannot be told.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import APIError, NotFoundError
from persia_nats.common.codec import unpack_message
from persia_nats.common.dead import DEAD_REASON_HEADER, DEAD_SEQ_HEADER
from persia_nats.common.messages import StreamEnd
from persia_nats.common.subjects import Subjects

log = logging.getLogger(__name__)

#: dead letters read one by one for their reasons; beyond it they are counted under "unread"
MAX_DEAD_READ = 10_000
#: seconds each JetStream request of the account may take
JS_TIMEOUT_S = 5.0
#: the most dead letters before the mark read back for batches dead-lettered but not yet removed from the
#: stream; the scan also ends after :data:`MARK_QUIET_LETTERS` letters in a row of batches already removed
MARK_SCAN_LETTERS = 1024
MARK_QUIET_LETTERS = 32
#: the most removed messages the mark asks the stream to list (one reply: a longer list is read message by
#: message instead)
MAX_DELETED_DETAILS = 50_000


@dataclass(frozen=True, slots=True)
class StreamMark:
    """Where the ingestion stream stood when the run started."""

    first_seq: int  # the first message the run is given (the stream's first, or the next one when empty)
    dead_last_seq: int  # the dead-letter stream's last message before the run
    #: messages between first_seq and the stream's last that were gone as the run started: acknowledged by
    #: an earlier process of the job (work-queue retention deletes a message once acknowledged)
    gone_before: int = 0
    #: dead letters before ``dead_last_seq`` whose batches the run was given all the same: a batch is
    #: dead-lettered first and removed from the stream after, so the mark can fall between the two
    dead_in_flight: tuple[int, ...] = ()
    #: when the stream was made (None: not yet made at the mark): another time at the end means it was
    #: deleted and made again during the run, and what it held then is gone with it
    created: str | None = None


async def stream_mark(nc: NATS, subjects: Subjects) -> StreamMark | None:
    """The stream's position now: its start where the data loader has not created it yet; None for a
    NATS without JetStream (a job fed by ``DataCtx`` senders)."""
    js = nc.jetstream(timeout=JS_TIMEOUT_S)
    try:
        info, removed = await _stream_info(nc, subjects.stream)
        state = info.state
        dead = (await js.stream_info(subjects.dead_stream)).state
    except NotFoundError:
        return StreamMark(1, 0)
    except Exception as exc:  # noqa: BLE001 (no JetStream: nothing to account for here)
        log.debug("no ingestion stream to account for (%s: %s)", type(exc).__name__, exc)
        return None
    first = state.first_seq if state.messages else state.last_seq + 1
    try:
        # a batch published after the first read can have been refused before the second one
        later = (await js.stream_info(subjects.stream)).state.last_seq
        in_flight = await _dead_in_flight(js, subjects, state, removed, later, dead, first)
    except Exception as exc:  # noqa: BLE001 (a lost reply: the run goes on, its account may call one batch lost)
        log.warning("stream account: the dead letters at the run's start were not read (%s: %s); a batch being "
                    "dead-lettered just then may be counted as lost", type(exc).__name__, exc)
        in_flight = ()
    return StreamMark(first, dead.last_seq, max(0, state.last_seq - first + 1 - state.messages), in_flight,
                      str(info.created))


async def _stream_info(nc: NATS, stream: str) -> tuple[api.StreamInfo, set[int] | None]:
    """The stream's info and the messages removed between its first and last, from one reply, so both are
    one instant's; None for the removed where the server did not list them (more than
    :data:`MAX_DELETED_DETAILS`, which are not worth one long reply, or a server that does not list them)."""
    info = await nc.jetstream(timeout=JS_TIMEOUT_S).stream_info(stream)
    if not info.state.num_deleted:  # nothing removed in between: this reply says all
        return info, set()
    if info.state.num_deleted > MAX_DELETED_DETAILS:
        return info, None
    reply = json.loads((await nc.request(f"{api.DEFAULT_PREFIX}.STREAM.INFO.{stream}",
                                         json.dumps({"deleted_details": True}).encode(), timeout=JS_TIMEOUT_S)).data)
    if "error" in reply:
        raise APIError.from_error(reply["error"])
    info = api.StreamInfo.from_response(reply)
    if info.state.deleted is not None:
        return info, set(info.state.deleted)
    return info, (set() if not info.state.num_deleted else None)


async def _dead_in_flight(js: Any, subjects: Subjects, state: api.StreamState, removed: set[int] | None,
                          later: int, dead: api.StreamState, first: int) -> tuple[int, ...]:
    """The dead letters up to ``dead.last_seq`` whose batches were still in the stream as ``state`` was read,
    or stored after it (up to ``later``, the stream's last message once ``dead`` was read): the run counts
    those batches as given to it, so it counts their letters too.

    A batch is removed just after its letter is stored, so such letters are the newest ones: the scan reads
    back from the last until :data:`MARK_QUIET_LETTERS` in a row are of batches removed before the mark."""
    if not dead.messages:
        return ()
    found: list[int] = []
    quiet = 0
    low = max(dead.first_seq or 1, dead.last_seq - MARK_SCAN_LETTERS + 1)
    for seq in range(dead.last_seq, low - 1, -1):
        try:
            letter = await js.get_msg(subjects.dead_stream, seq)
            batch = int((letter.headers or {}).get(DEAD_SEQ_HEADER, 0))
        except Exception as exc:  # noqa: BLE001 (removed by the stream's limits, or no stream batch's letter)
            log.debug("dead letter %d not read at the mark: %s", seq, exc)
            batch = 0
        if (state.last_seq < batch <= later
                or first <= batch <= state.last_seq and await _was_in_stream(js, subjects, batch, removed)):
            found.append(seq)
            quiet = 0
        else:
            quiet += 1
            if quiet >= MARK_QUIET_LETTERS:
                return tuple(sorted(found))
    if low > (dead.first_seq or 1):
        log.warning("stream account: %d dead letters read back from the mark and the newest batches were still "
                    "in the stream; older letters of batches given to this run are not counted", MARK_SCAN_LETTERS)
    return tuple(sorted(found))


async def _was_in_stream(js: Any, subjects: Subjects, seq: int, removed: set[int] | None) -> bool:
    """Whether the stream held ``seq`` (at or after its first message) when its state was read: from the
    state's list of removed messages; where it has none, from whether it holds the message now (a message
    removed since the state was read then counts as removed before it)."""
    if removed is not None:
        return seq not in removed
    try:
        await js.get_msg(subjects.stream, seq)
    except Exception:  # noqa: BLE001 (removed: acknowledged or terminated)
        return False
    return True


def _reason_kind(reason: str) -> str:
    """A dead letter's reason, without its particulars: its first clause, numbers as N."""
    return re.sub(r"\d+", "N", reason.split(":", 1)[0]).strip() or "unknown"


async def stream_account(nc: NATS, subjects: Subjects, mark: StreamMark, ended: bool) -> dict[str, Any] | None:
    """``published``, ``left`` and ``dead_lettered`` (by reason) since ``mark``, read from JetStream; None
    where the job has no stream. ``ended``: the run ended by the stream's end marker (one message of the
    stream that is no batch)."""
    js = nc.jetstream(timeout=JS_TIMEOUT_S)
    try:
        info = await js.stream_info(subjects.stream)
        dead_state = (await js.stream_info(subjects.dead_stream)).state
    except NotFoundError:  # fed by DataCtx senders: no stream was ever made
        return None
    state = info.state
    made_again = mark.created is not None and str(info.created) != mark.created
    published = max(0, state.last_seq - mark.first_seq + 1 - mark.gone_before - (1 if ended else 0))
    reasons: Counter[str] = Counter()
    first_dead = max(mark.dead_last_seq + 1, dead_state.first_seq or 1)
    letters = [*mark.dead_in_flight, *range(first_dead, dead_state.last_seq + 1)]
    batches: set[str] = set()
    again = 0
    for i, seq in enumerate(letters):
        if i >= MAX_DEAD_READ:
            reasons["unread"] += len(letters) - i
            break
        try:
            msg = await js.get_msg(subjects.dead_stream, seq)
        except Exception as exc:  # noqa: BLE001 (removed by the stream's limits since: still counted)
            log.debug("dead letter %d not read: %s", seq, exc)
            reasons["unread"] += 1
            continue
        headers = msg.headers or {}
        # a batch whose removal after its letter was lost (the +TERM is not acknowledged) comes back and is
        # dead-lettered again: one batch, counted once, or the second letter would hide a lost batch
        batch = headers.get(DEAD_SEQ_HEADER)
        if batch is not None:
            if batch in batches:
                again += 1
                continue
            batches.add(batch)
        reasons[_reason_kind(headers.get(DEAD_REASON_HEADER, ""))] += 1
    # end markers are no batches: those on their own subject are counted apart, wherever they stand. The
    # stream's messages and its markers come from one reply: the data loader acknowledges the marker just
    # after the ranks were told to finish, so two reads could see the marker in one and not in the other
    messages, markers = await _messages_and_markers(js, subjects)
    left = messages - markers
    if ended and left and not markers and await _is_end_marker(js, subjects, state.last_seq):
        left -= 1  # a marker on the batches subject (data_loader_config.end_marker_from: batches)
    return {"published": published, "left": left, "dead_lettered": sum(reasons.values()),
            "dead_lettered_by_reason": dict(reasons), "dead_lettered_again": again, "stream_made_again": made_again}


async def _messages_and_markers(js: Any, subjects: Subjects) -> tuple[int, int]:
    """The stream's messages now, and how many of them are end markers on ``persia.<job>.stream_end``."""
    try:
        info = await js.stream_info(subjects.stream, subjects_filter=subjects.stream_end())
    except Exception as exc:  # noqa: BLE001 (an older server: no count by subject; the last-message check is left)
        log.debug("end markers not counted: %s", exc)
        return (await js.stream_info(subjects.stream)).state.messages, 0
    return info.state.messages, int((info.state.subjects or {}).get(subjects.stream_end(), 0))


async def _is_end_marker(js: Any, subjects: Subjects, seq: int) -> bool:
    try:
        obj = unpack_message((await js.get_msg(subjects.stream, seq)).data or b"")
    except Exception:  # noqa: BLE001 (acknowledged meanwhile, or not a message of ours: not the marker)
        return False
    return StreamEnd.is_end(obj)


def verdict(account: dict[str, Any], min_trained_share: float) -> str | None:
    """One line saying why the job failed its account, or None when it did not."""
    published = account.get("published")
    if published is None:  # no stream: nothing was given to compare with
        return None
    trained = account["trained_once"] + account["trained_more_than_once"]
    if account.get("stream_made_again"):
        return (f"the ingestion stream was deleted and made again during the run: the batches it held then went "
                f"with it, and what became of them cannot be told ({trained} trained)")
    if account["lost"] > 0:
        return (f"{account['lost']} of {published} published batch(es) lost: neither trained, dead-lettered nor "
                f"left in the stream ({trained} trained, {account['dead_lettered']} dead-lettered, "
                f"{account['left']} left)")
    share = trained / published if published else 1.0
    if share < min_trained_share:
        return (f"trained {trained} of {published} published batch(es) ({share:.1%}), under "
                f"data_loader_config.min_trained_share {min_trained_share:.0%}; dead-lettered "
                f"{account['dead_lettered_by_reason']}, {account['left']} left in the stream")
    return None


__all__ = ["StreamMark", "stream_account", "stream_mark", "verdict"]
