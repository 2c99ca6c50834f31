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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files with end-to-end runs (tests marked slow) first, each file's tests kept together and in
    their order. ``.ci/run`` hands whole files to its workers (``--dist loadscope``: a module's fixtures,
    such as a trained job to serve, are built once): a long file handed out last would keep one worker
    busy after the other has run out, so the long ones go out first and the short ones fill in."""
    slow_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_files)
