"""The live progress line on a real terminal (a pseudo-terminal): log lines never continue it."""

from __future__ import annotations

import logging
import os
import pty

import pytest
from persia_nats.services.nn_worker.progress import ERASE, LiveLine


@pytest.fixture
def terminal():
    """A writable terminal and a function returning all that was written to it so far."""
    leader, follower = pty.openpty()
    stream = os.fdopen(follower, "w", buffering=1)

    def written() -> str:
        stream.flush()
        chunks = []
        os.set_blocking(leader, False)
        try:
            while True:
                chunks.append(os.read(leader, 65536))
        except BlockingIOError:
            pass
        return b"".join(chunks).decode().replace("\r\n", "\n")  # the terminal turns \n into \r\n

    yield stream, written
    stream.close()
    os.close(leader)


@pytest.fixture
def log_to(terminal):
    stream, _ = terminal
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    level, root.level = root.level, logging.INFO
    yield logging.getLogger("progress-test")
    root.removeHandler(handler)
    root.setLevel(level)


def test_a_log_line_erases_the_live_line_instead_of_continuing_it(terminal, log_to):
    stream, written = terminal
    with LiveLine(stream) as line:
        line.draw("batches 1")
        log_to.info("a log record")
        line.draw("batches 2")
        line.end("batches 3 (final)")
    log_to.info("after the line")
    assert written() == (f"{ERASE}batches 1{ERASE}a log record\n{ERASE}batches 2{ERASE}batches 3 (final)\n"
                         "after the line\n")


def test_the_filter_is_gone_after_the_line_ends(terminal, log_to):
    stream, written = terminal
    with LiveLine(stream) as line:
        line.draw("x")
    handlers = [h for h in logging.getLogger().handlers if getattr(h, "stream", None) is stream]
    assert handlers and all(not h.filters for h in handlers)
    log_to.info("plain")
    assert written().endswith("x\nplain\n")


def test_a_handler_on_another_stream_is_left_alone(terminal, tmp_path):
    stream, _ = terminal
    with open(tmp_path / "log", "w") as other:
        handler = logging.StreamHandler(other)
        logging.getLogger().addHandler(handler)
        try:
            with LiveLine(stream):
                assert not handler.filters
        finally:
            logging.getLogger().removeHandler(handler)
