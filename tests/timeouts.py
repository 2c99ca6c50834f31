"""Two time bounds for the suite: pytest-timeout's ``timeout`` (30 s) for every test, and ``slow_timeout``
(300 s) for those marked ``@pytest.mark.slow``, so that a hung fast test fails in seconds, not minutes.

A test that sets ``@pytest.mark.timeout(N)`` itself keeps its own bound. Loaded by tests/conftest.py.
"""

from __future__ import annotations

import pytest

DEFAULT_SLOW_TIMEOUT_S = 300.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("slow_timeout", "seconds a test marked slow may run (the others get pytest-timeout's timeout)",
                  default=str(DEFAULT_SLOW_TIMEOUT_S))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    raw = config.getini("slow_timeout")
    try:
        bound = float(raw)
    except ValueError:
        raise pytest.UsageError(f"slow_timeout must be a number of seconds, got {raw!r}") from None
    for item in items:
        # pytest-timeout reads the closest timeout marker when the test runs, so one added here wins over the ini
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(bound))
