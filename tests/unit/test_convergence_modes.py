"""The convergence study's mode strings."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.procs import ROOT

_spec = importlib.util.spec_from_file_location("convergence", ROOT / "benchmarks" / "convergence.py")
convergence = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("convergence", convergence)  # its dataclasses look their module up
_spec.loader.exec_module(convergence)


@pytest.mark.parametrize(("mode", "nn", "env"), [
    ("sync", {"sync_mode": "sync"}, {}),
    ("async", {"sync_mode": "async"}, {}),
    ("hybrid-4", {"sync_mode": "hybrid", "embedding_staleness": 4}, {}),
    ("hybrid-4-ahead-1", {"sync_mode": "hybrid", "embedding_staleness": 4}, {"FORWARD_BUFFER": "1"}),
    ("async-ahead-2", {"sync_mode": "async"}, {"FORWARD_BUFFER": "2"}),
])
def test_modes(mode, nn, env):
    assert convergence.mode_config(mode) == nn
    assert convergence.mode_env(mode) == env


@pytest.mark.parametrize("mode", ["hybrid-0", "hybrid", "sync-ahead-1", "hybrid-4-ahead-0", "hybrid-4-ahead-", "fast"])
def test_bad_modes_are_refused(mode):
    with pytest.raises(ValueError, match="unknown mode"):
        convergence.mode_config(mode)
