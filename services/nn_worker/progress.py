"""A live progress line on a terminal that log lines never glue onto.

The line is redrawn in place (``\\r``, then erase-to-end-of-line), so it has no newline of its own
while it is shown; anything else written to the terminal would continue it. While a
:class:`LiveLine` is open, a filter on every logging handler that writes to the same terminal
erases the line before the record is written; the next :meth:`LiveLine.draw` brings it back.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TextIO

ERASE = "\r\x1b[K"


class LiveLine:
    """One self-overwriting status line on ``stream`` (a terminal)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.visible = False
        self._lock = threading.Lock()
        self._filter = _EraseFirst(self)
        self._handlers: list[logging.Handler] = []

    def __enter__(self) -> LiveLine:
        for handler in logging.getLogger().handlers:
            if _same_terminal(getattr(handler, "stream", None), self.stream):
                handler.addFilter(self._filter)
                self._handlers.append(handler)
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()
        for handler in self._handlers:
            handler.removeFilter(self._filter)
        self._handlers.clear()

    def draw(self, text: str) -> None:
        with self._lock:
            self.stream.write(ERASE + text)
            self.stream.flush()
            self.visible = True

    def erase(self) -> None:
        with self._lock:
            if self.visible:
                self.stream.write(ERASE)
                self.stream.flush()
                self.visible = False

    def end(self, text: str | None = None) -> None:
        """Leave ``text`` (or the line as it is) on screen and move below it."""
        with self._lock:
            if text is not None:
                self.stream.write(ERASE + text)
                self.visible = True
            if self.visible:
                self.stream.write("\n")
                self.stream.flush()
                self.visible = False


class _EraseFirst(logging.Filter):
    """Erases the live line before its handler writes a record (a filter runs just before emit)."""

    def __init__(self, line: LiveLine) -> None:
        super().__init__()
        self.line = line

    def filter(self, record: logging.LogRecord) -> bool:
        self.line.erase()
        return True


def _same_terminal(a: object, b: object) -> bool:
    if a is b:
        return True
    try:
        return os.path.sameopenfile(a.fileno(), b.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False
