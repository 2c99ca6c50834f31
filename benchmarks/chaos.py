"""Chaos soak: kill each role with SIGKILL, in turn and repeatedly, while a published stream trains.

    .venv/bin/python benchmarks/chaos.py --rounds 2 --epochs 4 --rate 40 --json

Runs an undisturbed job first, then one with the kills, both on the adult training split published
at ``--rate`` batches/s onto the job's JetStream stream (harness: ``tests/chaos.py``). Prints a
table (published, trained, lost, duplicates, final test AUC) and, with ``--json``, one JSON line
last: ``published``, ``trained``, ``lost``, ``duplicates``, ``auc_gap`` (relative to the undisturbed
run), ``auc``, ``auc_undisturbed``, ``kills``.

``--repeat N`` runs the disturbed job N times (one undisturbed run still sets the AUC reference):
for hunting rare stalls. A run that does not finish within ``--timeout`` counts as failed, with
its reason; the JSON line then sums published, trained, lost and duplicates over the finished runs,
gives the worst AUC gap, and adds ``runs``, ``failed`` and ``failures``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.chaos import ROLES, run_job  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="times each role is killed")
    p.add_argument("--roles", default=",".join(ROLES), help=f"comma-separated, from {', '.join(ROLES)}")
    p.add_argument("--rate", type=float, default=40.0, help="batches published per second")
    p.add_argument("--epochs", type=int, default=4, help="passes over the adult training split")
    p.add_argument("--ps", type=int, default=2, help="PS replicas")
    p.add_argument("--repeat", type=int, default=1, help="disturbed runs (default 1)")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds one run may take")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    roles = tuple(r for r in a.roles.split(",") if r)
    unknown = set(roles) - set(ROLES)
    if unknown:
        p.error(f"unknown roles {sorted(unknown)}")
    if a.repeat < 1:
        p.error("--repeat must be >= 1")
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    runs: list[dict] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="persia-chaos-") as tmp:
        started = time.perf_counter()
        base = run_job(Path(tmp) / "calm", f"calm{uuid.uuid4().hex[:8]}", (), rate=a.rate, ps=a.ps, epochs=a.epochs,
                       timeout=a.timeout, log=say)
        for i in range(a.repeat):
            try:
                runs.append(run_job(Path(tmp) / f"chaos{i}", f"chaos{uuid.uuid4().hex[:8]}", roles * a.rounds,
                                    rate=a.rate, ps=a.ps, epochs=a.epochs, timeout=a.timeout, log=say))
            except (AssertionError, TimeoutError) as exc:
                failures.append(f"run {i}: {str(exc).splitlines()[0][:200]}")
                say(f"run {i} failed: {exc}")
        wall = time.perf_counter() - started
    gaps = [(r["auc"] - base["auc"]) / base["auc"] for r in runs]
    print(f"{'run':<12}{'published':>10}{'trained':>9}{'lost':>6}{'dupl.':>7}{'given back':>12}{'floor lag':>10}"
          f"{'test AUC':>10}")
    for name, r in [("undisturbed", base)] + [(f"chaos {i}", r) for i, r in enumerate(runs)]:
        print(f"{name:<12}{r['published']:>10}{r['trained']:>9}{r['lost']:>6}{r['duplicates']:>7}"
              f"{r['given_back']:>12}{r['ack_floor_lagged']:>10}{r['auc']:>10.4f}")
    for f in failures:
        print(f"FAILED {f}")
    if runs:
        killed = ", ".join(k["role"] for k in runs[0]["kills"])
        print(f"kills per run: {len(runs[0]['kills'])} ({killed}); restarts {runs[0]['restarts']}")
        worst = max(gaps, key=abs)
        print(f"runs {len(runs)} finished, {len(failures)} failed; worst AUC gap {worst:+.4%} (relative); "
              f"wall {wall:.0f}s")
    if a.json:
        out = {"published": sum(r["published"] for r in runs), "trained": sum(r["trained"] for r in runs),
               "lost": sum(r["lost"] for r in runs), "duplicates": sum(r["duplicates"] for r in runs),
               "auc_gap": max(gaps, key=abs) if gaps else None, "auc": runs[0]["auc"] if runs else None,
               "auc_undisturbed": base["auc"], "kills": [k["role"] for k in runs[0]["kills"]] if runs else [],
               "restarts": runs[0]["restarts"] if runs else {}}
        if a.repeat > 1:
            out.update(runs=a.repeat, failed=len(failures), failures=failures,
                       ack_floor_lagged=sum(r["ack_floor_lagged"] for r in runs))
        print(json.dumps(out))
    if failures:
        sys.exit(1)

if __name__ == "__main__":
    main()
