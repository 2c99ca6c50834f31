"""Error types shared by every role.

Replies that fail carry the NATS service-error headers (``Nats-Service-Error`` and
``Nats-Service-Error-Code``), as ``nats.micro`` does. :func:`error_from_reply` maps a code back to
the typed exception here, so a caller can tell "you sent garbage" (never retry) from "busy" (back
off and retry) from "the server broke" (report).
"""

from __future__ import annotations


class PersiaError(Exception):
    """Root of every error this package raises on purpose."""


class ConfigError(PersiaError, ValueError):
    """A configuration file, value or environment variable is wrong; the message names which."""


class RequestTimeout(PersiaError, TimeoutError):
    """A request got no reply in time. Never silent: the caller decides whether to retry."""


class NoResponders(PersiaError, ConnectionError):
    """Nobody is subscribed on the subject (the peer is not up yet, or has gone)."""


class StartupError(PersiaError):
    """A role could not start: what it needs did not appear within the bound it logged. Entry points
    print the message as one line and exit non-zero; retrying inside the process would not help."""


class NatsUnreachable(StartupError, ConnectionError):
    """No NATS server at the configured URLs accepted us (the message names the URLs)."""


class PeersMissing(StartupError, RequestTimeout):
    """The replicas of a role this one depends on did not all appear (the message names the role)."""


def describe(exc: BaseException) -> str:
    """``exc`` fit for one line: its message, or its type where it has none (``TimeoutError()``)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class RemoteError(PersiaError):
    """The peer answered with an error reply. ``code`` follows HTTP conventions."""

    code = 500

    def __init__(self, description: str, code: int | None = None) -> None:
        super().__init__(description)
        self.description = description
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.description}"


class BadRequest(RemoteError, ValueError):
    """The request was malformed or invalid. Retrying the same bytes can never succeed."""

    code = 400


class NotFound(RemoteError, KeyError):
    """The request named something the peer does not hold (an expired batch ref, say)."""

    code = 404

    def __str__(self) -> str:  # KeyError would repr() the message
        return f"{self.code}: {self.description}"


class Conflict(RemoteError):
    """The peer is in a state where the request cannot run (not configured yet, say)."""

    code = 409


class PayloadTooLarge(RemoteError, ValueError):
    """The request exceeds a size limit checked before decoding."""

    code = 413


class InProgress(RemoteError):
    """An earlier copy of the request is still being worked on (a gradient push resent after its
    sender's timeout, while the PSs are slow): ask again later; its outcome is not known yet."""

    code = 425


class Busy(RemoteError):
    """The peer's bounded buffer is full: back off and send again; nothing was stored."""

    code = 503


_BY_CODE: dict[int, type[RemoteError]] = {
    cls.code: cls for cls in (BadRequest, NotFound, Conflict, PayloadTooLarge, InProgress, Busy)
}


def error_from_reply(code: int, description: str) -> RemoteError:
    """Build the typed exception for an error reply's code (unknown codes give RemoteError)."""
    cls = _BY_CODE.get(code, RemoteError)
    return cls(description, code)
