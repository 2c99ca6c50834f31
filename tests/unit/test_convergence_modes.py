"""The convergence study's mode strings."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import yaml

from tests.procs import ROOT

_spec = importlib.util.spec_from_file_location("convergence", ROOT / "benchmarks" / "convergence.py")
convergence = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("convergence", convergence)  # its dataclasses look their module up
_spec.loader.exec_module(convergence)


@pytest.mark.parametrize(("mode", "nn", "env", "ew"), [
    ("sync", {"sync_mode": "sync"}, {}, {}),
    ("async", {"sync_mode": "async"}, {}, {}),
    ("hybrid-4", {"sync_mode": "hybrid", "embedding_staleness": 4}, {}, {}),
    ("hybrid-4-ahead-1", {"sync_mode": "hybrid", "embedding_staleness": 4}, {"FORWARD_BUFFER": "1"}, {}),
    ("async-ahead-2", {"sync_mode": "async"}, {"FORWARD_BUFFER": "2"}, {}),
    ("hybrid-16-hot-4", {"sync_mode": "hybrid", "embedding_staleness": 16}, {}, {"hot_row_min_count": 4}),
    ("async-ahead-2-hot-3", {"sync_mode": "async"}, {"FORWARD_BUFFER": "2"}, {"hot_row_min_count": 3}),
    ("hybrid-16-hot-0", {"sync_mode": "hybrid", "embedding_staleness": 16}, {}, {"hot_row_min_count": 0}),
    ("hybrid", {"sync_mode": "hybrid"}, {}, {}),
    ("torch", {}, {}, {}),
])
def test_modes(mode, nn, env, ew):
    assert convergence.mode_config(mode) == nn
    assert convergence.mode_env(mode) == env
    assert convergence.mode_ew_config(mode) == ew


@pytest.mark.parametrize("mode", ["hybrid-0", "hybrid-", "torch-ahead-1",
                                  "sync-ahead-1", "hybrid-4-ahead-0", "hybrid-4-ahead-", "fast",
                                  "sync-hot-4", "hybrid-4-hot--1", "hybrid-4-hot-1-ahead-1"])
def test_bad_modes_are_refused(mode):
    with pytest.raises(ValueError, match="unknown mode"):
        convergence.mode_config(mode)


def test_plain_hybrid_leaves_the_bound_and_the_hot_rows_at_their_defaults(tmp_path):
    ds = convergence.DATASETS["synthetic"]  # its config sets embedding_staleness and hot_row_min_count
    cfg = yaml.safe_load(convergence.write_global_config(ds, "hybrid", tmp_path / "g.yml").read_text())
    assert cfg["nn_worker_config"] == {"sync_mode": "hybrid"}
    assert "hot_row_min_count" not in cfg.get("embedding_worker_config", {})
    cfg = yaml.safe_load(convergence.write_global_config(ds, "hybrid-16", tmp_path / "g.yml").read_text())
    assert cfg["embedding_worker_config"]["hot_row_min_count"] == 4  # a numbered bound keeps the example's
