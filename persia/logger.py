"""Logging for training and data-loader scripts, as PERSIA's ``persia.logger`` offers it.

``configure_logging`` routes the script's own loggers and the library's through one renderer (plain
``key=value`` lines, or JSON lines with ``PERSIA_LOG_FORMAT=json``), so a script's lines and the
roles' lines read alike in honcho, compose and a log collector.
"""

from __future__ import annotations

import logging
import os

from persia_nats.common.logs import configure_logging

__all__ = ["configure_logging", "get_default_logger", "get_logger"]


def get_logger(name: str) -> logging.Logger:
    """The logger ``name``; call :func:`configure_logging` (or :func:`get_default_logger`) once first."""
    return logging.getLogger(name)


def get_default_logger(name: str = "persia", level: str | None = None) -> logging.Logger:
    """Configure logging at ``level`` (default ``$LOG_LEVEL``, else ``info``) and return ``name``'s logger."""
    configure_logging(level or os.environ.get("LOG_LEVEL", "info"))
    return logging.getLogger(name)
