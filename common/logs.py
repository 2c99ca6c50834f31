"""structlog set-up for entry points: one line per event, key=value, or JSON with ``PERSIA_LOG_FORMAT=json``.

In JSON mode every line a role writes is one JSON object: the stdlib loggers of every library, Python
warnings, uncaught exceptions (their traceback a field) and the launcher's own lines (:func:`say`) alike.
Figures go in as fields (:func:`figures`), never as text in the message, so a log collector reads them
without parsing prose.
"""

from __future__ import annotations

import datetime
import json as jsonlib
import logging
import os
import sys
import threading
from collections.abc import Mapping
from types import TracebackType

import structlog
from structlog.typing import Processor

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}

#: a LogRecord's own attributes and structlog's keys: ``extra`` naming one would raise or be overwritten
_TAKEN = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "event", "level", "timestamp"}

log = logging.getLogger(__name__)


def json_mode() -> bool:
    """Whether ``PERSIA_LOG_FORMAT=json`` asks for JSON lines."""
    return os.environ.get("PERSIA_LOG_FORMAT", "").lower() == "json"


def figures(values: Mapping[str, object]) -> dict[str, object]:
    """``values`` as a log call's ``extra``: each one a field (a JSON key, or ``key=value`` after the
    message); a name the log record keeps for itself gets a trailing underscore."""
    return {f"{k}_" if k in _TAKEN else k: v for k, v in values.items()}


def say(prog: str, message: str, level: str = "error", **fields: object) -> None:
    """A line of a command-line program on stderr, before or without logging: ``prog: message`` (with
    ``fields`` as ``key=value``), or in JSON mode one JSON object shaped as the log lines are."""
    if json_mode():
        stamp = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
        line = jsonlib.dumps({"event": message, "logger": prog, **fields, "level": level, "timestamp": stamp},
                             default=repr)
    else:
        line = f"{prog}: {message}" + "".join(f" {k}={v}" for k, v in fields.items())
    print(line, file=sys.stderr)


def _log_uncaught(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    log.critical("uncaught %s", kind.__name__, exc_info=(kind, value, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    log.critical("uncaught %s in thread %s", args.exc_type.__name__, getattr(args.thread, "name", "?"),
                 exc_info=(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback))


def configure_logging(level: str = "info", json: bool | None = None, **context: object) -> None:
    """Route stdlib logging and structlog through one renderer, stamping ``context`` on every line.

    Library modules log with ``logging.getLogger(__name__)``; only entry points call this.
    """
    if json is None:
        json = json_mode()
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # the console renderer draws a traceback itself; JSON carries it as one string field
    rendering: list[Processor] = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()] \
        if json else [structlog.dev.ConsoleRenderer(colors=False)]
    structlog.contextvars.bind_contextvars(**context)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *rendering],
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS.get(level.lower(), logging.INFO))
    logging.getLogger("nats").setLevel(max(root.level, logging.WARNING))
    if json:  # else Python prints warnings and tracebacks as plain text lines between the JSON ones
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread
