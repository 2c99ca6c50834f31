"""The pure parts of benchmarks/prometheus_check.py: the dashboard's queries and the label rules."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest

from tests.procs import ROOT

_spec = importlib.util.spec_from_file_location("prometheus_check", ROOT / "benchmarks" / "prometheus_check.py")
prometheus_check = importlib.util.module_from_spec(_spec)
sys.modules["prometheus_check"] = prometheus_check
_spec.loader.exec_module(prometheus_check)


def test_every_target_of_the_shipped_dashboard_is_found_and_filled_in() -> None:
    board = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    queries = prometheus_check.dashboard_queries(board, "adult-1", "10s")
    exprs = [e for _, e in queries]
    raw = json.dumps(board)
    assert len(queries) == raw.count('"expr"')  # no target missed
    assert all("$" not in e and "[[" not in e for e in exprs)
    assert 'persia_job=~"adult-1"' in exprs[0] and "[10s]" in exprs[0]
    assert all(title for title, _ in queries)


def test_rows_nested_in_a_collapsed_row_and_every_variable_spelling() -> None:
    board = {"panels": [
        {"title": "A", "targets": [{"expr": 'rate(x{persia_job=~"$persia_job"}[$__rate_interval])'}, {"refId": "B"}]},
        {"type": "row", "title": "R", "panels": [
            {"title": "C", "targets": [{"expr": 'y{persia_job=~"${persia_job}"} + z{persia_job=~"[[persia_job]]"}'}]}]},
        {"title": "text panel"}]}
    assert prometheus_check.dashboard_queries(board, "j_1", "4s") == [
        ("A", 'rate(x{persia_job=~"j_1"}[4s])'), ("C", 'y{persia_job=~"j_1"} + z{persia_job=~"j_1"}')]


@pytest.mark.parametrize(("board", "message"), [
    ({"panels": [{"title": "A", "targets": [{"expr": 'x{instance=~"$node"}'}]}]}, r"uses \$node"),
    ({"panels": [{"title": "A"}]}, "no Prometheus query"),
    ({}, "no Prometheus query"),
])
def test_an_unknown_variable_or_an_empty_board_is_refused(board: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prometheus_check.dashboard_queries(board, "j", "10s")


@pytest.mark.parametrize("job", ["a.b", "a|b", 'a"b', ""])
def test_a_job_name_a_regex_or_a_promql_string_would_read_differently_is_refused(job: str) -> None:
    board = {"panels": [{"title": "A", "targets": [{"expr": 'x{persia_job=~"$persia_job"}'}]}]}
    with pytest.raises(ValueError, match="only letters, digits"):
        prometheus_check.dashboard_queries(board, job, "10s")


def test_label_problems_name_each_metric_once_and_skip_prometheus_own_series() -> None:
    series = [
        {"__name__": "up", "job": "persia", "instance": "h:1"},
        {"__name__": "scrape_samples_scraped", "job": "persia", "instance": "h:1"},
        {"__name__": "persia_ps_rows", "role": "embedding-parameter-server", "job": "persia"},
        {"__name__": "persia_ps_rows", "role": "embedding-parameter-server", "replica": "1"},
        {"__name__": "process_cpu_seconds_total", "job": "persia"},
        {"__name__": "process_cpu_seconds_total", "job": "persia", "instance": "h:2"},
        {"__name__": "persia_requests_total", "role": "embedding-worker", "exported_job": "x"},
    ]
    problems, per_role = prometheus_check.label_problems(series)
    assert problems == ["persia_requests_total: carries exported_job (the target exports a label Prometheus sets)",
                        "process_cpu_seconds_total: no role label"]
    assert per_role == {"embedding-parameter-server": 2, "embedding-worker": 1}
    assert prometheus_check.label_problems(series[:4]) == ([], {"embedding-parameter-server": 2})


def test_file_sd_lists_targets_without_labels_of_its_own() -> None:
    assert prometheus_check.file_sd({}) == []
    assert prometheus_check.file_sd({"127.0.0.1:2": "nn-worker", "127.0.0.1:1": "embedding-worker"}) == [
        {"targets": ["127.0.0.1:1", "127.0.0.1:2"], "labels": {}}]


def test_label_problems_with_a_job_name_every_series_whose_persia_job_is_not_that_job() -> None:
    series = [
        {"__name__": "up", "job": "persia", "instance": "h:1"},  # Prometheus's own: no persia_job, no problem
        {"__name__": "persia_ps_rows", "role": "embedding-parameter-server", "persia_job": "a"},
        {"__name__": "persia_requests_total", "role": "embedding-worker", "persia_job": "persia_default_jobname"},
        {"__name__": "process_cpu_seconds_total", "role": "nn-worker"},
    ]
    problems, per_role = prometheus_check.label_problems(series, "a")
    assert problems == ["persia_requests_total: persia_job='persia_default_jobname', not 'a'",
                        "process_cpu_seconds_total: no persia_job"]
    assert per_role == {"embedding-parameter-server": 1, "embedding-worker": 1, "nn-worker": 1}
    assert prometheus_check.label_problems(series[:2], "a") == ([], {"embedding-parameter-server": 1})
    assert prometheus_check.label_problems(series)[0] == []  # no job given: persia_job is not looked at


def test_job_names_are_distinct_and_each_one_a_job_name_and_a_dashboard_value() -> None:
    names = prometheus_check.job_names(3, "ab12")
    assert names == ["promcheckab12-0", "promcheckab12-1", "promcheckab12-2"]
    from persia_nats.common.config import JOB_NAME_RE

    board = {"panels": [{"title": "A", "targets": [{"expr": 'x{persia_job=~"$persia_job"}'}]}]}
    for name in names:
        assert JOB_NAME_RE.match(name)
        assert prometheus_check.dashboard_queries(board, name, "10s") == [("A", f'x{{persia_job=~"{name}"}}')]
    # PromQL anchors =~: as a regex, no name selects another job (...-1 does not match ...-10)
    many = prometheus_check.job_names(11, "ab12")
    assert all(not re.fullmatch(a, b) for a in many for b in many if a != b)
    with pytest.raises(ValueError, match=">= 1"):
        prometheus_check.job_names(0, "ab")
    with pytest.raises(ValueError, match="letters and digits"):
        prometheus_check.job_names(2, "a-b")


def test_series_go_to_the_job_whose_endpoint_discovery_found_not_to_the_job_they_name() -> None:
    series = [
        {"__name__": "persia_ps_rows", "instance": "h:1", "persia_job": "b"},
        {"__name__": "up", "instance": "h:2"},
        {"__name__": "persia_ps_rows", "instance": "h:2", "persia_job": "b"},
        {"__name__": "persia_ps_rows", "instance": "h:9", "persia_job": "a"},
    ]
    grouped = prometheus_check.by_owner(series, {"h:1": "a", "h:2": "b"})
    assert grouped == {"a": [series[0]], "b": series[1:3], "": [series[3]]}


def test_persia_jobs_counts_series_per_name_and_foreign_keeps_the_names_not_allowed() -> None:
    series = [
        {"__name__": "up", "persia_job": "ignored"},
        {"__name__": "scrape_duration_seconds"},
        {"__name__": "persia_ps_rows", "persia_job": "a"},
        {"__name__": "persia_ps_rows", "persia_job": "persia_default_jobname"},
        {"__name__": "persia_requests_total", "persia_job": "a"},
        {"__name__": "persia_requests_total", "persia_job": "b"},
        {"__name__": "process_cpu_seconds_total"},
    ]
    counts = prometheus_check.persia_jobs(series)
    assert counts == {"a": 2, "b": 1, "persia_default_jobname": 1}
    assert prometheus_check.foreign(counts, ["a", "b"]) == {"persia_default_jobname": 1}
    assert prometheus_check.foreign(counts, {"a"}) == {"b": 1, "persia_default_jobname": 1}
    assert prometheus_check.foreign({}, ["a"]) == {}


def test_the_table_has_a_row_per_job_and_check_and_cuts_long_checks() -> None:
    Row = prometheus_check.Row
    rows = [Row("promcheckx-0", "short", 3, True), Row("(all)", "x" * 20, 0, False, "why")]
    lines = prometheus_check.format_table(rows, max_check=10)
    assert lines == [
        "job           check       series  ok",
        "promcheckx-0  short            3  ok",
        "(all)         xxxxxxx...       0  FAIL  why",
    ]
