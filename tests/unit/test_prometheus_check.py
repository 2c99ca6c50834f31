"""The pure parts of benchmarks/prometheus_check.py: the dashboard's queries and the label rules."""

from __future__ import annotations

import importlib.util
import json
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
