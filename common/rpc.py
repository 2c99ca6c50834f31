"""Request/reply over NATS with typed errors, bounded concurrency and counted refusals.

Error replies carry the ``Nats-Service-Error`` and ``Nats-Service-Error-Code`` headers and an empty
body, exactly as ``nats.micro`` sends them, so any NATS client can read them. :func:`request`
turns them back into the typed exceptions of :mod:`persia_nats.common.errors`; timeouts raise
:class:`~persia_nats.common.errors.RequestTimeout` and never hang.

Requests and replies larger than the server's ``max_payload`` travel in parts (:mod:`persia_nats.common.chunking`),
on subjects without a queue group; a small message costs one length check and carries no header.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from persia_nats.common.chunking import (
    CHUNK_BYTES_HEADER,
    CHUNK_FETCH_HEADER,
    CHUNK_HEADER,
    CHUNK_ID_HEADER,
    CHUNKED_HEADER,
    DEFAULT_MAX_CHUNKED_BYTES,
    MAX_PARTS,
    Assembler,
    ChunkSettings,
    ReplyStore,
    chunk_size,
    new_chunk_id,
    parse_chunk_id,
    parse_count,
    parse_total,
    part_headers,
    split,
)
from persia_nats.common.codec import DEFAULT_MAX_MESSAGE_BYTES, pack, unpack_message
from persia_nats.common.errors import (
    BadRequest,
    Busy,
    NoResponders,
    PayloadTooLarge,
    RemoteError,
    RequestTimeout,
    error_from_reply,
)
from persia_nats.common.messages.base import Message
from persia_nats.common.subjects import INBOX_ROOT, is_inbox

log = logging.getLogger(__name__)

ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"

#: takes the request decoded into the type it was registered with (the raw map with ``request=None``)
Handler = Callable[[Any], Awaitable[Any]]


def _payload(message: Any) -> bytes:
    """The bytes to send: a typed message in its envelope, a map as is, bytes already packed."""
    if isinstance(message, bytes):
        return message
    if isinstance(message, bytearray):
        return bytes(message)
    return pack(message.to_wire() if isinstance(message, Message) else message)


async def request(
    nc: NATS,
    subject: str,
    message: Any,
    timeout: float,
    *,
    chunk_bytes: int | None = None,
    max_bytes: int = DEFAULT_MAX_CHUNKED_BYTES,
) -> Mapping[str, Any]:
    """Send one request and decode its reply.

    A request larger than ``chunk_bytes`` (default: the server's ``max_payload`` less a margin for
    headers) is published in parts, and a reply the responder announces as chunked is fetched part
    by part (:mod:`persia_nats.common.chunking`); the caller sees one ordinary reply either way. ``timeout``
    bounds each NATS request (the last part of the request, and each fetched part of the reply).
    ``max_bytes`` bounds a chunked reply.

    Raises:
        RequestTimeout: no reply within ``timeout`` seconds.
        NoResponders: nobody listens on ``subject``.
        RemoteError: the responder answered with an error (a typed subclass by code).
    """
    payload = _payload(message)
    limit = chunk_bytes or chunk_size(nc.max_payload)
    if len(payload) > limit:
        msg = await _send_in_parts(nc, subject, payload, limit, timeout)
    else:
        msg = await _request(nc, subject, payload, timeout)
    if msg.headers and CHUNKED_HEADER in msg.headers and ERROR_CODE_HEADER not in msg.headers:
        return await _fetch_parts(nc, subject, msg.headers, timeout, max_bytes)
    return decode_reply(msg)


async def _request(nc: NATS, subject: str, payload: Any, timeout: float,
                   headers: dict[str, str] | None = None) -> Msg:
    try:
        return await nc.request(subject, payload, timeout=timeout, headers=headers)
    except nats.errors.NoRespondersError:
        raise NoResponders(f"no responders on {subject}") from None
    except nats.errors.TimeoutError:
        raise RequestTimeout(f"no reply on {subject} within {timeout:g}s") from None


async def _send_in_parts(nc: NATS, subject: str, payload: bytes | bytearray, part_bytes: int, timeout: float) -> Msg:
    """Publish parts 1..n-1, then request with part n (NATS keeps them in order to the responder)."""
    parts = split(payload, part_bytes)
    if len(parts) > MAX_PARTS:
        raise PayloadTooLarge(f"request of {len(payload)} bytes needs {len(parts)} parts of {part_bytes} "
                              f"bytes; at most {MAX_PARTS}")
    chunk_id = new_chunk_id()
    for index, part in enumerate(parts[:-1], 1):
        # nats-py annotates payloads as bytes but only takes their len() and joins them: a view saves a copy
        await nc.publish(subject, part, headers=part_headers(chunk_id, index, len(parts), len(payload)))  # type: ignore[arg-type]
    return await _request(nc, subject, parts[-1], timeout,
                          part_headers(chunk_id, len(parts), len(parts), len(payload)))


async def _fetch_parts(nc: NATS, subject: str, headers: Mapping[str, str], timeout: float,
                       max_bytes: int) -> Mapping[str, Any]:
    """Fetch a chunked reply's parts 1..n from its responder and decode the joined reply."""
    try:
        chunk_id = parse_chunk_id(headers.get(CHUNK_ID_HEADER))
        count = parse_count(headers.get(CHUNKED_HEADER))
        total = parse_total(headers.get(CHUNK_BYTES_HEADER))
    except BadRequest as exc:
        raise RemoteError(f"malformed chunked reply on {subject}: {exc}") from None
    if total > max_bytes:
        raise PayloadTooLarge(f"chunked reply of {total} bytes on {subject} exceeds the limit of {max_bytes}")
    joined = bytearray()  # grown as parts arrive: an announced total costs nothing until its bytes come
    for index in range(1, count + 1):
        msg = await _request(nc, subject, b"", timeout, {CHUNK_FETCH_HEADER: chunk_id, CHUNK_HEADER: str(index)})
        part = msg.data
        if msg.headers and ERROR_CODE_HEADER in msg.headers:
            decode_reply(msg)  # raises the typed error
        if len(joined) + len(part) > total:
            raise RemoteError(f"chunked reply {chunk_id} on {subject}: parts exceed the announced {total} bytes")
        joined += part
    if len(joined) != total:
        raise RemoteError(f"chunked reply {chunk_id} on {subject}: {len(joined)} bytes of the announced {total}")
    return unpack_message(joined, max_bytes)


def decode_reply(msg: Msg) -> Mapping[str, Any]:
    """Raise the typed error an error reply carries, or decode a normal reply."""
    headers = msg.headers or {}
    code = headers.get(ERROR_CODE_HEADER)
    if code is not None:
        try:
            numeric = int(code)
        except ValueError:
            numeric = 500
        raise error_from_reply(numeric, headers.get(ERROR_HEADER, "unknown error"))
    if CHUNKED_HEADER in headers:
        raise RemoteError(f"the reply on {msg.subject} is chunked ({headers[CHUNKED_HEADER]} parts): "
                          "only request() fetches it")
    return unpack_message(msg.data)


async def request_with_retry(
    nc: NATS,
    subject: str,
    message: Any,
    timeout: float,
    deadline: float,
    retry_on: tuple[type[BaseException], ...] = (Busy, NoResponders),
    max_backoff: float = 0.5,
    *,
    chunk_bytes: int | None = None,
    on_retry: Callable[[BaseException], None] | None = None,
) -> Mapping[str, Any]:
    """Like :func:`request`, retrying with capped exponential backoff while ``retry_on`` errors occur.

    ``deadline`` is the total time budget in seconds; when it runs out the last error is raised, so a
    caller never waits forever and never loses the fact that the send failed. ``on_retry`` is told
    of each error that is retried (to count the resends).
    """
    payload = _payload(message)
    end = time.monotonic() + deadline
    backoff = 0.002
    while True:
        try:
            return await request(nc, subject, payload, timeout, chunk_bytes=chunk_bytes)
        except retry_on as exc:
            if time.monotonic() + backoff > end:
                raise
            if on_retry is not None:
                on_retry(exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max_backoff)


async def gather(nc: NATS, subject: str, message: Any, wait: float) -> list[Mapping[str, Any]]:
    """Publish once and collect every reply that arrives within ``wait`` seconds (scatter-gather)."""
    inbox = nc.new_inbox()
    replies: list[Mapping[str, Any]] = []

    async def on_reply(msg: Msg) -> None:
        try:
            replies.append(decode_reply(msg))
        except Exception as exc:  # one broken instance must not hide the others
            log.warning("bad reply on %s: %s", subject, exc)

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subject, _payload(message), reply=inbox)
        await nc.flush()
        await asyncio.sleep(wait)
    finally:
        await sub.unsubscribe()
    return replies


class RpcServer:
    """Serves handlers on subjects; each request runs as a task under a concurrency bound.

    A handler is registered with its request type: it gets the request decoded into it (a
    :class:`~persia_nats.common.messages.base.Message`, or the map itself with ``request=None``), so
    a malformed request is refused (400, the field named) before any handler code runs. It returns
    the reply: a message (sent in its envelope), a map, or bytes already packed. Any
    exception becomes an error reply: :class:`RemoteError` subclasses keep their code, anything
    else is a 500 and is logged with its traceback. Every request is answered and counted.

    On a subject without a queue group, a request that arrives in parts is joined before it is
    decoded (up to ``chunking.max_message_bytes``; a single message is bounded by ``max_bytes``),
    and a reply larger than one message is kept and fetched in parts (:mod:`persia_nats.common.chunking`). On a
    queue-group subject parts could reach different members, so both are refused there (400 for a
    chunked request, 413 for a reply above ``max_payload``).
    """

    def __init__(self, nc: NATS, max_inflight: int = 64, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 chunking: ChunkSettings | None = None) -> None:
        self._nc = nc
        self._max_bytes = max_bytes
        self.chunking = chunking or ChunkSettings()
        #: chunking figures: chunked_requests, chunked_replies, chunk_expired, chunk_refused, ...
        self.chunks: Counter[str] = Counter()
        self._assembler = Assembler(self.chunking, self.chunks)
        self._replies = ReplyStore(self.chunking, self.chunks)
        self._sem = asyncio.Semaphore(max_inflight)
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        # counters: requests by subject and error replies by (subject, code)
        self.requests: Counter[str] = Counter()
        self.errors: Counter[tuple[str, int]] = Counter()
        #: requests dropped unserved because their reply subject is no inbox, by subject (see _aimed_elsewhere)
        self.bad_replies: Counter[str] = Counter()
        # optional latency hook ``observe(subject, seconds)``, set by persia_nats.common.metrics when metrics are on
        self.observe: Callable[[str, float], None] | None = None
        # served subjects -> queue group ("" for none), and seconds spent serving, by subject; both
        # are reported through ``$SRV.INFO`` / ``$SRV.STATS`` by persia_nats.common.discovery
        self.queues: dict[str, str] = {}
        self.busy: defaultdict[str, float] = defaultdict(float)  # seconds spent per subject

    async def add(self, subject: str, handler: Handler, queue: str = "", concurrent: bool = True, *,
                  request: type[Message] | None) -> None:
        """Subscribe ``handler`` on ``subject`` (in queue group ``queue`` when given).

        ``request`` is the type each request is decoded into before ``handler`` sees it; None hands
        over the raw map (for a subject whose body is not one of ours, such as a relay).

        ``concurrent=False`` runs requests one at a time in arrival order, for handlers whose
        effects must not interleave.
        """

        async def on_msg(msg: Msg) -> None:
            if self._aimed_elsewhere(subject, msg):
                return
            data: bytes | bytearray | None = msg.data
            refusal = None
            if msg.headers:  # chunk traffic is taken here, synchronously, in NATS's delivery order
                if CHUNK_FETCH_HEADER in msg.headers:
                    await self._serve_part(subject, msg, queue)
                    return
                if CHUNK_HEADER in msg.headers:
                    try:
                        data = self._take_part(subject, queue, msg)
                    except RemoteError as exc:
                        data, refusal = b"", exc
                    if data is None:
                        return  # a part before the last
            if not concurrent:
                serve = self._serve_one(subject, handler, msg, data, refusal=refusal, queue=queue, request=request)
                del data  # the coroutine holds a joined request's buffer, and frees it once decoded
                await serve
                return
            await self._sem.acquire()
            task = asyncio.create_task(
                self._serve_one(subject, handler, msg, data, release=True, refusal=refusal, queue=queue,
                                request=request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        sub = await self._nc.subscribe(
            subject, queue=queue, cb=on_msg, pending_msgs_limit=65536, pending_bytes_limit=1024 * 1024 * 1024
        )
        self._subs.append(sub)
        self.queues[subject] = queue

    def _aimed_elsewhere(self, subject: str, msg: Msg) -> bool:
        """Drop (count, log) a request whose reply subject is not an inbox, before any handler runs.

        A reply, an error reply's empty body included, published on ``$JS.API.STREAM.PURGE.<stream>``
        or a job subject would act there with this role's rights: JetStream takes an empty body as a
        valid request. deploy/nats-auth.conf already keeps responders to their callers' inboxes; this
        holds where a deployment grants wider rights (the open configuration, an admin user).
        Fire-and-forget messages (no reply) and the parts of a chunked request pass.
        """
        if not msg.reply or is_inbox(msg.reply):
            return False
        self.bad_replies[subject] += 1
        log.warning("dropped a request on %s whose reply subject %r is not an inbox (%s.>): not served, "
                    "not answered (%d so far)", subject, msg.reply[:200], INBOX_ROOT, self.bad_replies[subject])
        return True

    def _take_part(self, subject: str, queue: str, msg: Msg) -> bytes | bytearray | None:
        """One part of a chunked request: the joined request after its last part, None before.

        Raises:
            RemoteError: the last part of a sequence that is refused (400, 413, 503).
        """
        headers = msg.headers or {}
        if not queue:
            return self._assembler.add(subject, headers, msg.data, bool(msg.reply))
        # in a queue group the parts could reach different members: drop them, refuse the last
        index, _, count = str(headers.get(CHUNK_HEADER, "")).partition("/")
        if index == count == "1":
            return msg.data  # a whole message in one part: nothing to join
        if index != count and not msg.reply:
            self.chunks["chunk_parts_dropped"] += 1
            return None
        self.chunks["chunk_refused"] += 1
        raise BadRequest(f"{subject} is served by queue group {queue!r}, whose members could each get some of "
                         "a chunked request's parts: send at most the server's max_payload here")

    async def _serve_part(self, subject: str, msg: Msg, queue: str) -> None:
        """Answer a fetch of one part of a kept reply (the handler is not called)."""
        try:
            if queue:
                raise BadRequest(f"{subject} is served by queue group {queue!r}: it keeps no chunked replies")
            reply, headers = self._replies.part(msg.headers or {}), None
        except RemoteError as exc:
            self.errors[(subject, exc.code)] += 1
            log.debug("refused a chunk fetch on %s: %s", subject, exc)
            reply, headers = memoryview(b""), {ERROR_HEADER: exc.description[:1024], ERROR_CODE_HEADER: str(exc.code)}
        if msg.reply:
            try:
                # a view of the kept reply, not a copy: see _send_in_parts
                await self._nc.publish(msg.reply, reply, headers=headers)  # type: ignore[arg-type]
            except Exception:
                log.exception("could not send a chunk of a reply on %s", subject)

    def _chunk_reply(self, subject: str, queue: str, reply: bytes) -> dict[str, str]:
        """Keep a reply too large for one message; the headers that announce it (empty body)."""
        if queue:
            raise PayloadTooLarge(f"reply of {len(reply)} bytes exceeds the server's max_payload, and {subject} "
                                  f"is served by queue group {queue!r}, which cannot send it in parts: "
                                  "ask for less at a time")
        return self._replies.keep(reply, self._chunk_bytes())

    def _chunk_bytes(self) -> int:
        return self.chunking.chunk_bytes or chunk_size(self._nc.max_payload)

    async def _serve_one(self, subject: str, handler: Handler, msg: Msg, data: bytes | bytearray | None = None,
                         release: bool = False, refusal: RemoteError | None = None, queue: str = "",
                         request: type[Message] | None = None) -> None:
        self.requests[subject] += 1
        started = time.perf_counter()
        try:
            try:
                if refusal is not None:
                    raise refusal
                if data is None or data is msg.data:
                    body = unpack_message(msg.data, self._max_bytes)
                else:  # joined from parts, whose declared size was checked against the chunking limit
                    body = unpack_message(data, self.chunking.max_message_bytes)
                data = None  # a joined request's buffer is not needed any more
                result = await handler(body if request is None else request.from_wire(body))
                reply, headers = _payload(result), None
                if msg.reply and len(reply) > self._chunk_bytes():
                    reply, headers = b"", self._chunk_reply(subject, queue, reply)
            except RemoteError as exc:
                self.errors[(subject, exc.code)] += 1
                log.debug("refused request on %s: %s", subject, exc)
                reply, headers = b"", {ERROR_HEADER: exc.description[:1024], ERROR_CODE_HEADER: str(exc.code)}
            except Exception as exc:  # a bug or hostile input we did not foresee: answer, log, keep serving
                self.errors[(subject, 500)] += 1
                log.exception("handler for %s failed", subject)
                reply = b""
                description = f"internal error: {type(exc).__name__}: {exc}"[:1024]
                headers = {ERROR_HEADER: description, ERROR_CODE_HEADER: "500"}
            if msg.reply:
                try:
                    await self._nc.publish(msg.reply, reply, headers=headers)
                except Exception:
                    log.exception("could not send the reply for %s", subject)
        finally:
            if release:
                self._sem.release()
            elapsed = time.perf_counter() - started
            self.busy[subject] += elapsed
            if self.observe is not None:
                try:
                    self.observe(subject, elapsed)
                except Exception:  # a metrics bug must never break serving
                    log.exception("could not record the latency for %s", subject)

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout: float = 30.0) -> None:
        """Stop taking requests, then wait (up to ``timeout``) for those in flight to finish."""
        # with the server gone a drain would wait for a reconnect that may never come, so the
        # unsubscribe step is bounded (a process manager stopping everything at once kills stragglers)
        if self._subs and self._nc.is_connected:
            try:
                await asyncio.wait_for(asyncio.gather(*(sub.drain() for sub in self._subs)), min(timeout, 2.0))
            except Exception:  # lost the connection mid-drain: nothing more can arrive anyway
                pass
        self._subs.clear()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                log.warning("cancelled %d requests still running after %.0fs", len(pending), timeout)
        self._assembler.clear()
        self._replies.clear()

    def summary(self) -> dict[str, int]:
        return {"requests": sum(self.requests.values()), "refused": sum(self.errors.values()),
                "bad_replies": sum(self.bad_replies.values()),
                "chunked_requests": self.chunks["chunked_requests"], "chunked_replies": self.chunks["chunked_replies"]}

    def stats(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "errors": {f"{s}:{c}": n for (s, c), n in self.errors.items()},
            "bad_replies": dict(self.bad_replies),
            "chunks": dict(self.chunks),
        }
