"""benchmarks/cluster.py's pure helpers: the figures of a run, the partition's counters, the summary."""

from __future__ import annotations

import importlib.util
import sys

from tests.procs import ROOT

_spec = importlib.util.spec_from_file_location("cluster_bench", ROOT / "benchmarks" / "cluster.py")
assert _spec is not None and _spec.loader is not None
cluster = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("cluster_bench", cluster)
_spec.loader.exec_module(cluster)


def _notice(seq: int, at: float, trained: bool = True, delivered: int = 1) -> tuple[dict, float]:
    return {"seq": seq, "delivered": delivered, "trained": trained}, at


def test_figures_count_lost_duplicates_and_the_longest_gap() -> None:
    notices = [_notice(1, 10.0), _notice(2, 11.0), _notice(2, 30.0, delivered=2), _notice(3, 12.0, trained=False)]
    out = cluster.figures([1, 2, 3], notices)
    assert out["published"] == 3 and out["trained"] == 2 and out["lost"] == 1 and out["duplicates"] == 1
    assert out["max_stall_s"] == 19.0 and out["max_stall_at_s"] == 1.0 and out["max_stall_after_notices"] == 2


def test_stall_after_takes_only_gaps_closing_in_the_window() -> None:
    notices = [_notice(i, t) for i, t in enumerate((0.0, 1.0, 9.0, 30.0, 31.0))]
    assert cluster.stall_after(0.5, notices, 10.0) == 8.0  # 1 -> 9 closes inside, 9 -> 30 after it
    assert cluster.stall_after(0.5, notices, 40.0) == 21.0
    assert cluster.stall_after(50.0, notices, 10.0) == 0.0


def test_dropped_packets_reads_the_drop_rules_counters() -> None:
    listing = """Chain INPUT (policy ACCEPT 0 packets, 0 bytes)
    pkts      bytes target     prot opt in     out     source               destination
     412    30121 DROP       0    --  !lo    *       0.0.0.0/0            0.0.0.0/0

Chain FORWARD (policy ACCEPT 0 packets, 0 bytes)
    pkts      bytes target     prot opt in     out     source               destination

Chain OUTPUT (policy ACCEPT 0 packets, 0 bytes)
    pkts      bytes target     prot opt in     out     source               destination
      37     2664 DROP       0    --  *      !lo     0.0.0.0/0            0.0.0.0/0
"""
    assert cluster.dropped_packets(listing) == {"INPUT": 412, "OUTPUT": 37}


def _run(**kw: object) -> dict:
    base = {"scenario": "partition", "published": 10, "trained": 10, "duplicates": 0, "lost": 0, "max_stall_s": 4.0,
            "faults": [{"stall_s": 4.0}], "exit_codes": ["0", "0 (staying)"], "hung": False, "test_auc": 0.91,
            "ranks_identical": True, "account": {"trained_once": 10, "trained_more_than_once": 0, "lost": 0,
                                                 "redelivered_not_retrained": 2}, "wall_s": 60.0}
    return {**base, **kw}


def test_summary_counts_hangs_failures_and_the_partition_goal() -> None:
    runs = [_run(), _run(duplicates=3, max_stall_s=12.5), _run(hung=True, exit_codes=["running", "running"],
                                                                 test_auc=None, ranks_identical=None, account=None)]
    s = cluster.summarize("partition", runs)
    assert s["runs"] == 3 and s["ok"] == 2 and s["hangs"] == 1 and s["duplicates"] == [0, 3, 0]
    assert s["trained_twice"] == [0, 0, None]
    assert s["max_stall_s"] == 12.5 and s["partition_goal_met"] == 2
    assert not cluster.run_ok(_run(exit_codes=["1", "0 (staying)"]), "pause")
    assert not cluster.run_ok(_run(max_stall_s=20.0), "kill") and cluster.run_ok(_run(max_stall_s=20.0), "pause")
    row = cluster.table_row(3, runs[2])
    assert "HANG" in row and "running/running" in row


def test_rank_result_takes_the_last_result_line() -> None:
    log = 'noise\n{"train_samples": 1, "test_auc": 0.5}\nmore\n{"train_samples": 2, "test_auc": 0.9}\nJob failed\n'
    assert cluster.rank_result(log) == {"train_samples": 2, "test_auc": 0.9}
    assert cluster.rank_result("nothing printed") is None
