"""Messages larger than the NATS server's ``max_payload``, sent in parts (docs/protocol.md "Size limits").

NATS refuses a message above the server's ``max_payload`` (64 MB in ``deploy/nats.conf``), while a
batch of 65,535 samples x 26 slots x dim 64 is 218 MB of embeddings. :mod:`persia_nats.common.rpc` therefore
splits what is larger than a *chunk size* (``max_payload`` minus a margin for headers):

- **A request** is published in parts ``1..n`` on the request's own subject, each with the headers
  ``Persia-Chunk-Id`` (random), ``Persia-Chunk`` (``"i/n"``, 1-based) and ``Persia-Chunk-Bytes``
  (the whole message's size); only part ``n`` carries the reply inbox. NATS delivers one
  connection's messages to one subscription in order, so the responder's :class:`Assembler` sees
  parts 1..n-1 before the last, and dispatches the joined message as one request. On a queue-group
  subject consecutive parts may reach different members, so chunked requests are refused there.
- **A reply** is kept by the responder's :class:`ReplyStore`, which answers with an empty body and
  the headers ``Persia-Chunked: n``, ``Persia-Chunk-Id`` and ``Persia-Chunk-Bytes``; the requester
  fetches parts ``1..n`` with empty requests on the same subject carrying ``Persia-Chunk-Fetch: <id>``
  and ``Persia-Chunk: i``. A fetch on a queue-group subject could reach another member, so a reply
  that needs chunking there is refused with 413.

Fetching (rather than pushing the parts to the reply inbox) keeps the subjects' access rules as
they are (a responder may answer each request once, ``allow_responses``) and paces the transfer by
the requester. Both sides are bounded: a size limit per joined message (1 GiB), a limit on the ids
being assembled at once and their bytes, on the replies kept and their bytes, and expiry of what is
left incomplete or unfetched (counted and logged, its memory freed).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from persia_nats.common.errors import BadRequest, Busy, NotFound, PayloadTooLarge, RemoteError

log = logging.getLogger(__name__)

CHUNK_ID_HEADER = "Persia-Chunk-Id"
CHUNK_HEADER = "Persia-Chunk"
CHUNK_BYTES_HEADER = "Persia-Chunk-Bytes"
CHUNKED_HEADER = "Persia-Chunked"
CHUNK_FETCH_HEADER = "Persia-Chunk-Fetch"

#: Largest joined message (request or reply) by default.
DEFAULT_MAX_CHUNKED_BYTES = 1024 * 1024 * 1024
#: Room left below ``max_payload`` for a part's headers (the server counts them in the limit).
HEADER_MARGIN = 8 * 1024
MAX_PARTS = 65536
MAX_ID_CHARS = 64
#: refusals remembered for ids whose last part has not arrived yet (each a few hundred bytes)
MAX_REFUSED_IDS = 1024


def chunk_size(max_payload: int) -> int:
    """The largest part that fits in one message of a server with this ``max_payload``."""
    return max(max_payload - min(HEADER_MARGIN, max_payload // 8), 1)


def new_chunk_id() -> str:
    return secrets.token_hex(12)


def split(payload: bytes | bytearray, size: int) -> list[memoryview]:
    """``payload`` cut into consecutive parts of at most ``size`` bytes (views, no copies)."""
    view = memoryview(payload)
    return [view[k:k + size] for k in range(0, len(payload), size)] or [view]


def part_headers(chunk_id: str, index: int, count: int, total: int) -> dict[str, str]:
    return {CHUNK_ID_HEADER: chunk_id, CHUNK_HEADER: f"{index}/{count}", CHUNK_BYTES_HEADER: str(total)}


def _int(text: str | None, what: str, low: int, high: int) -> int:
    if text is None or not text.isascii() or not text.isdigit() or len(text) > 12:
        raise BadRequest(f"{what}: expected a decimal integer, got {text!r}")
    value = int(text)
    if not low <= value <= high:
        raise BadRequest(f"{what}: {value} is outside {low}..{high}")
    return value


def parse_chunk_id(text: str | None, header: str = CHUNK_ID_HEADER) -> str:
    if not text or len(text) > MAX_ID_CHARS or not text.isascii() or not text.isprintable():
        raise BadRequest(f"{header}: expected 1 to {MAX_ID_CHARS} printable ASCII characters, got {text!r}")
    return text


def parse_part(text: str | None) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with ``1 <= i <= n <= MAX_PARTS``."""
    index, sep, count = (text or "").partition("/")
    if not sep:
        raise BadRequest(f"{CHUNK_HEADER}: expected \"i/n\", got {text!r}")
    n = _int(count, f"{CHUNK_HEADER} n", 1, MAX_PARTS)
    return _int(index, f"{CHUNK_HEADER} i", 1, n), n


def parse_total(text: str | None) -> int:
    return _int(text, CHUNK_BYTES_HEADER, 0, 10**12)


def parse_count(text: str | None) -> int:
    """The part count a chunked reply announces."""
    return _int(text, CHUNKED_HEADER, 1, MAX_PARTS)


@dataclass
class ChunkSettings:
    """Limits of one :class:`~persia_nats.common.rpc.RpcServer`'s chunking; read live, so a test may change them."""

    #: part size; None: the connection's ``max_payload`` minus :data:`HEADER_MARGIN`
    chunk_bytes: int | None = None
    #: largest joined request, and largest reply sent in parts
    max_message_bytes: int = DEFAULT_MAX_CHUNKED_BYTES
    #: requests being assembled at once, and the bytes of their parts received so far
    max_assembling: int = 16
    max_assembling_bytes: int = 2 * DEFAULT_MAX_CHUNKED_BYTES
    #: an assembly with no new part for this long is dropped
    assembly_timeout_s: float = 30.0
    #: replies kept for fetching, their bytes, and how long one is kept
    max_kept_replies: int = 64
    max_kept_bytes: int = 2 * DEFAULT_MAX_CHUNKED_BYTES
    reply_keep_s: float = 60.0


class _Assembly:
    __slots__ = ("count", "total", "next", "buffer", "timer")

    def __init__(self, count: int, total: int) -> None:
        self.count = count
        self.total = total
        self.next = 2
        # grown as parts arrive, never sized by the declared total: a 1-byte part claiming 1 GiB costs 1 byte
        self.buffer = bytearray()
        self.timer: asyncio.TimerHandle | None = None

    @property
    def filled(self) -> int:
        return len(self.buffer)


class Assembler:
    """Joins the parts of chunked requests, per chunk id; everything it holds is bounded and expires.

    :meth:`add` runs synchronously in the subscription's callback, so parts are taken in the order
    NATS delivered them. A refusal (too large, too many at once, malformed or out of order) frees
    what the id held at once and is remembered until the id's last part arrives, which is answered
    with it; later parts of a refused id are dropped unread.
    """

    def __init__(self, settings: ChunkSettings, counts: Counter[str]) -> None:
        self.settings = settings
        self.counts = counts
        self._open: dict[str, _Assembly] = {}
        self._refused: OrderedDict[str, RemoteError] = OrderedDict()
        self.reserved_bytes = 0

    @property
    def assembling(self) -> int:
        return len(self._open)

    def add(self, subject: str, headers: Mapping[str, str], data: bytes, has_reply: bool) -> bytearray | bytes | None:
        """Take one part: the joined message after the last part, None before it.

        Raises:
            RemoteError: the last part (``i == n``; or, when the headers are unreadable, a part with a
                reply inbox) of a refused or malformed sequence: 400, 413 or 503.
        """
        self.counts["chunk_parts_received"] += 1
        chunk_id, last = None, has_reply
        try:
            chunk_id = parse_chunk_id(headers.get(CHUNK_ID_HEADER))
            index, count = parse_part(headers.get(CHUNK_HEADER))
            last = index == count
            return self._add(chunk_id, index, count, parse_total(headers.get(CHUNK_BYTES_HEADER)), data)
        except RemoteError as exc:
            if chunk_id is not None:
                self._drop(chunk_id)
            if last:
                if chunk_id is not None:
                    self._refused.pop(chunk_id, None)
                self.counts["chunk_refused"] += 1
                raise
            if chunk_id is None:
                self.counts["chunk_parts_dropped"] += 1
                log.warning("dropped a chunk on %s: %s", subject, exc)
                return None
            self._refuse(subject, chunk_id, exc)
            return None

    def _add(self, chunk_id: str, index: int, count: int, total: int, data: bytes) -> bytearray | bytes | None:
        limits = self.settings
        entry = self._open.get(chunk_id)
        if index == 1:
            if entry is not None or chunk_id in self._refused:
                raise BadRequest(f"chunk id {chunk_id} began twice")
            if total > limits.max_message_bytes:
                raise PayloadTooLarge(f"chunked message of {total} bytes exceeds the limit of "
                                      f"{limits.max_message_bytes}")
            if len(data) > total:
                raise BadRequest(f"chunk 1/{count} holds {len(data)} bytes of a message of {total}")
            if count == 1:
                if len(data) != total:
                    raise BadRequest(f"chunk 1/1 holds {len(data)} bytes, {CHUNK_BYTES_HEADER} says {total}")
                return data
            if len(self._open) >= limits.max_assembling:
                raise Busy(f"{len(self._open)} chunked requests are being assembled already "
                           f"(limit {limits.max_assembling})")
            entry = self._open[chunk_id] = _Assembly(count, total)
        elif entry is None:
            refused = self._refused.get(chunk_id)
            if refused is None:
                refused = BadRequest(f"chunk {index}/{count} of id {chunk_id}: its earlier parts never arrived "
                                     f"(or expired after {limits.assembly_timeout_s:g}s)")
            if index == count:
                self._refused.pop(chunk_id, None)
                raise refused
            self.counts["chunk_parts_dropped"] += 1
            return None
        elif index != entry.next or count != entry.count or total != entry.total:
            raise BadRequest(f"chunk {index}/{count} ({total} bytes) of id {chunk_id} arrived where part "
                             f"{entry.next}/{entry.count} ({entry.total} bytes) was due")
        end = entry.filled + len(data)
        if end > entry.total or (index == count and end != entry.total):
            raise BadRequest(f"chunks of id {chunk_id} hold {end} bytes by part {index}/{count}, "
                             f"{CHUNK_BYTES_HEADER} says {entry.total}")
        if self.reserved_bytes + len(data) > limits.max_assembling_bytes:
            self.counts["chunk_refused_bytes"] += 1
            raise Busy(f"chunked requests being assembled hold {self.reserved_bytes} bytes already; part {index}/"
                       f"{count} of id {chunk_id} would pass the limit of {limits.max_assembling_bytes}")
        entry.buffer += data
        self.reserved_bytes += len(data)
        entry.next = index + 1
        if entry.timer is not None:
            entry.timer.cancel()
        if index < count:
            entry.timer = asyncio.get_running_loop().call_later(limits.assembly_timeout_s, self._expire, chunk_id)
            return None
        self._drop(chunk_id)
        self.counts["chunked_requests"] += 1
        return entry.buffer

    def _drop(self, chunk_id: str) -> None:
        entry = self._open.pop(chunk_id, None)
        if entry is not None:
            self.reserved_bytes -= entry.filled
            if entry.timer is not None:
                entry.timer.cancel()

    def _refuse(self, subject: str, chunk_id: str, exc: RemoteError) -> None:
        log.warning("refused chunked request %s on %s: %s", chunk_id, subject, exc)
        self._refused[chunk_id] = exc
        while len(self._refused) > MAX_REFUSED_IDS:
            self._refused.popitem(last=False)

    def _expire(self, chunk_id: str) -> None:
        entry = self._open.get(chunk_id)
        if entry is None:
            return
        self._drop(chunk_id)
        self.counts["chunk_expired"] += 1
        log.warning("dropped chunked request %s: part %d of %d not received within %gs (%d of %d bytes)",
                    chunk_id, entry.next, entry.count, self.settings.assembly_timeout_s, entry.filled, entry.total)

    def clear(self) -> None:
        for chunk_id in list(self._open):
            self._drop(chunk_id)
        self._refused.clear()


class _Kept:
    __slots__ = ("data", "part_bytes", "count", "timer")

    def __init__(self, data: bytes, part_bytes: int, timer: asyncio.TimerHandle) -> None:
        self.data = data
        self.part_bytes = part_bytes
        self.count = -(-len(data) // part_bytes)
        self.timer = timer


class ReplyStore:
    """Replies too large for one message, kept until their last part is fetched or they expire.

    Bounded by count and bytes: making room evicts the oldest kept replies (counted and logged; a
    fetch of them then gets 404), since refusing the new one would discard a handler's finished work.
    """

    def __init__(self, settings: ChunkSettings, counts: Counter[str]) -> None:
        self.settings = settings
        self.counts = counts
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self.kept_bytes = 0

    @property
    def kept(self) -> int:
        return len(self._kept)

    def keep(self, data: bytes, part_bytes: int) -> dict[str, str]:
        """Keep ``data``; return the headers of the empty-bodied answer that announces it."""
        limits = self.settings
        if len(data) > min(limits.max_message_bytes, limits.max_kept_bytes):
            raise PayloadTooLarge(f"reply of {len(data)} bytes exceeds the limit of "
                                  f"{min(limits.max_message_bytes, limits.max_kept_bytes)} for chunked replies: "
                                  "ask for less at a time")
        while self._kept and (len(self._kept) >= limits.max_kept_replies
                              or self.kept_bytes + len(data) > limits.max_kept_bytes):
            old_id = next(iter(self._kept))
            self._free(old_id)
            self.counts["chunk_replies_evicted"] += 1
            log.warning("evicted chunked reply %s before it was fetched, to keep a new one", old_id)
        chunk_id = new_chunk_id()
        timer = asyncio.get_running_loop().call_later(limits.reply_keep_s, self._expire, chunk_id)
        kept = self._kept[chunk_id] = _Kept(data, part_bytes, timer)
        self.kept_bytes += len(data)
        self.counts["chunked_replies"] += 1
        return {CHUNKED_HEADER: str(kept.count), CHUNK_ID_HEADER: chunk_id, CHUNK_BYTES_HEADER: str(len(data))}

    def part(self, headers: Mapping[str, str]) -> memoryview:
        """The part a fetch asks for; the reply is freed once its last part was served.

        Raises:
            BadRequest: malformed fetch headers or a part number out of range.
            NotFound: no reply kept under that id (never, already fetched in full, or expired).
        """
        chunk_id = parse_chunk_id(headers.get(CHUNK_FETCH_HEADER), CHUNK_FETCH_HEADER)
        kept = self._kept.get(chunk_id)
        if kept is None:
            raise NotFound(f"no chunked reply {chunk_id} (never sent, fully fetched, or expired after "
                           f"{self.settings.reply_keep_s:g}s)")
        index = _int(headers.get(CHUNK_HEADER), CHUNK_HEADER, 1, kept.count)
        start = (index - 1) * kept.part_bytes
        part = memoryview(kept.data)[start:start + kept.part_bytes]
        self.counts["chunk_parts_sent"] += 1
        if index == kept.count:
            self._free(chunk_id)
        return part

    def _free(self, chunk_id: str) -> None:
        kept = self._kept.pop(chunk_id, None)
        if kept is not None:
            kept.timer.cancel()
            self.kept_bytes -= len(kept.data)

    def _expire(self, chunk_id: str) -> None:
        if chunk_id in self._kept:
            self._free(chunk_id)
            self.counts["chunk_replies_expired"] += 1
            log.warning("dropped chunked reply %s: not fetched in full within %gs", chunk_id,
                        self.settings.reply_keep_s)

    def clear(self) -> None:
        for chunk_id in list(self._kept):
            self._free(chunk_id)
