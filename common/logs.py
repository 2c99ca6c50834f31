"""structlog set-up for entry points: one line per event, key=value, or JSON with ``PERSIA_LOG_FORMAT=json``."""

from __future__ import annotations

import logging
import os
import sys

import structlog
from structlog.typing import Processor

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


def configure_logging(level: str = "info", json: bool | None = None, **context: object) -> None:
    """Route stdlib logging and structlog through one renderer, stamping ``context`` on every line.

    Library modules log with ``logging.getLogger(__name__)``; only entry points call this.
    """
    if json is None:
        json = os.environ.get("PERSIA_LOG_FORMAT", "").lower() == "json"
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.contextvars.bind_contextvars(**context)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS.get(level.lower(), logging.INFO))
    logging.getLogger("nats").setLevel(max(root.level, logging.WARNING))
