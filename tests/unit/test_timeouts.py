"""The suite's time bounds (tests/timeouts.py): a test marked slow gets ``slow_timeout``, the others ``timeout``."""

from __future__ import annotations

import pytest

SUITE = """
import pytest

def test_fast():
    pass

@pytest.mark.slow
def test_slow():
    pass

@pytest.mark.slow
@pytest.mark.timeout(7)
def test_slow_with_its_own_bound():
    pass

@pytest.mark.slow
class TestSlowClass:
    def test_in_class(self):
        pass
"""


def _bounds(pytester: pytest.Pytester, *args: str) -> dict[str, tuple[object, ...] | None]:
    pytester.makepyfile(test_suite=SUITE)
    items = pytester.inline_genitems("-p", "tests.timeouts", "-p", "no:asyncio", *args)[0]
    out: dict[str, tuple[object, ...] | None] = {}
    for item in items:
        marker = item.get_closest_marker("timeout")
        out[item.name] = None if marker is None else marker.args
    return out


def test_slow_tests_get_the_slow_bound_and_others_keep_the_default(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntimeout = 30\nslow_timeout = 120\nmarkers = slow: long\n")
    assert _bounds(pytester) == {
        "test_fast": None,  # pytest-timeout's ini timeout applies
        "test_slow": (120.0,),
        "test_slow_with_its_own_bound": (7,),
        "test_in_class": (120.0,),
    }


def test_slow_bound_defaults_to_300_seconds(pytester: pytest.Pytester) -> None:
    assert _bounds(pytester)["test_slow"] == (300.0,)


def test_a_slow_bound_that_is_not_a_number_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nslow_timeout = soon\n")
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_inprocess("-p", "tests.timeouts", "-p", "no:asyncio", "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*slow_timeout must be a number of seconds, got 'soon'*"])


def test_this_suite_bounds_slow_tests_by_the_configured_slow_timeout(request: pytest.FixtureRequest) -> None:
    """The project's own settings, as loaded for this run: a hung fast test fails well before a slow one may."""
    fast = float(request.config.getini("timeout"))
    slow = float(request.config.getini("slow_timeout"))
    assert 0 < fast < slow
