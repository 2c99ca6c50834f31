from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.natsserver import NatsServer, start_nats_server

# tests.timeouts: the bound of tests marked slow; pytester: tests/unit/test_timeouts.py collects a suite of its own
pytest_plugins = ["pytester", "tests.timeouts"]


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    server = start_nats_server()
    yield server
    server.stop()


@pytest.fixture
def job_name() -> str:
    """A unique job per test, so subjects never collide on the shared server."""
    return f"t{uuid.uuid4().hex[:12]}"
