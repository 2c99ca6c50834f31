"""Request/reply over NATS with typed errors, bounded concurrency and counted refusals.

Error replies carry the ``Nats-Service-Error`` and ``Nats-Service-Error-Code`` headers and an empty
body, exactly as ``nats.micro`` sends them, so any NATS client can read them. :func:`request`
turns them back into the typed exceptions of :mod:`common.errors`; timeouts raise
:class:`~common.errors.RequestTimeout` and never hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from common.codec import DEFAULT_MAX_MESSAGE_BYTES, pack, unpack_message
from common.errors import Busy, NoResponders, RemoteError, RequestTimeout, error_from_reply

log = logging.getLogger(__name__)

ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"

Handler = Callable[[Mapping[str, Any]], Awaitable[Any]]


async def request(nc: NATS, subject: str, message: Any, timeout: float) -> Mapping[str, Any]:
    """Send one request and decode its reply.

    Raises:
        RequestTimeout: no reply within ``timeout`` seconds.
        NoResponders: nobody listens on ``subject``.
        RemoteError: the responder answered with an error (a typed subclass by code).
    """
    payload = message if isinstance(message, bytes | bytearray) else pack(message)
    try:
        msg = await nc.request(subject, payload, timeout=timeout)
    except nats.errors.NoRespondersError:
        raise NoResponders(f"no responders on {subject}") from None
    except nats.errors.TimeoutError:
        raise RequestTimeout(f"no reply on {subject} within {timeout:g}s") from None
    return decode_reply(msg)


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
    return unpack_message(msg.data)


async def request_with_retry(
    nc: NATS,
    subject: str,
    message: Any,
    timeout: float,
    deadline: float,
    retry_on: tuple[type[BaseException], ...] = (Busy, NoResponders),
    max_backoff: float = 0.5,
) -> Mapping[str, Any]:
    """Like :func:`request`, retrying with capped exponential backoff while ``retry_on`` errors occur.

    ``deadline`` is the total time budget in seconds; when it runs out the last error is raised, so a
    caller never waits forever and never loses the fact that the send failed.
    """
    payload = pack(message)
    end = time.monotonic() + deadline
    backoff = 0.002
    while True:
        try:
            return await request(nc, subject, payload, timeout)
        except retry_on:
            if time.monotonic() + backoff > end:
                raise
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
        await nc.publish(subject, pack(message), reply=inbox)
        await nc.flush()
        await asyncio.sleep(wait)
    finally:
        await sub.unsubscribe()
    return replies


class RpcServer:
    """Serves handlers on subjects; each request runs as a task under a concurrency bound.

    A handler gets the decoded message map and returns the reply object (packed here). Any
    exception becomes an error reply: :class:`RemoteError` subclasses keep their code, anything
    else is a 500 and is logged with its traceback. Every request is answered and counted.
    """

    def __init__(self, nc: NATS, max_inflight: int = 64, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._nc = nc
        self._max_bytes = max_bytes
        self._sem = asyncio.Semaphore(max_inflight)
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        # counters: requests by subject and error replies by (subject, code)
        self.requests: Counter[str] = Counter()
        self.errors: Counter[tuple[str, int]] = Counter()
        # optional latency hook ``observe(subject, seconds)``, set by common.metrics when metrics are on
        self.observe: Callable[[str, float], None] | None = None
        # served subjects -> queue group ("" for none), and seconds spent serving, by subject; both
        # are reported through ``$SRV.INFO`` / ``$SRV.STATS`` by common.discovery
        self.queues: dict[str, str] = {}
        self.busy: Counter[str] = Counter()

    async def add(self, subject: str, handler: Handler, queue: str = "", concurrent: bool = True) -> None:
        """Subscribe ``handler`` on ``subject`` (in queue group ``queue`` when given).

        ``concurrent=False`` runs requests one at a time in arrival order, for handlers whose
        effects must not interleave.
        """

        async def on_msg(msg: Msg) -> None:
            if not concurrent:
                await self._serve_one(subject, handler, msg)
                return
            await self._sem.acquire()
            task = asyncio.create_task(self._serve_one(subject, handler, msg, release=True))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        sub = await self._nc.subscribe(
            subject, queue=queue, cb=on_msg, pending_msgs_limit=65536, pending_bytes_limit=1024 * 1024 * 1024
        )
        self._subs.append(sub)
        self.queues[subject] = queue

    async def _serve_one(self, subject: str, handler: Handler, msg: Msg, release: bool = False) -> None:
        self.requests[subject] += 1
        started = time.perf_counter()
        try:
            try:
                body = unpack_message(msg.data, self._max_bytes)
                result = await handler(body)
                reply, headers = (result if isinstance(result, bytes) else pack(result)), None
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

    def summary(self) -> dict[str, int]:
        return {"requests": sum(self.requests.values()), "refused": sum(self.errors.values())}

    def stats(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "errors": {f"{s}:{c}": n for (s, c), n in self.errors.items()},
        }
