"""Chaos soak: kill each role with SIGKILL, in turn and repeatedly, while a published stream trains.

    .venv/bin/python benchmarks/chaos.py --rounds 2 --epochs 4 --rate 40 --json

Runs an undisturbed job first, then one with the kills, both on the adult training split published
at ``--rate`` batches/s onto the job's JetStream stream (harness: ``tests/chaos.py``). Prints a
table (published, trained, lost, duplicates, final test AUC) and, with ``--json``, one JSON line
last: ``published``, ``trained``, ``lost``, ``duplicates``, ``auc_gap`` (relative to the undisturbed
run), ``auc``, ``auc_undisturbed``, ``kills``.
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
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    roles = tuple(r for r in a.roles.split(",") if r)
    unknown = set(roles) - set(ROLES)
    if unknown:
        p.error(f"unknown roles {sorted(unknown)}")
    with tempfile.TemporaryDirectory(prefix="persia-chaos-") as tmp:
        started = time.perf_counter()
        base = run_job(Path(tmp) / "calm", f"calm{uuid.uuid4().hex[:8]}", (), rate=a.rate, ps=a.ps, epochs=a.epochs,
                       log=lambda m: print(m, file=sys.stderr))
        chaos = run_job(Path(tmp) / "chaos", f"chaos{uuid.uuid4().hex[:8]}", roles * a.rounds, rate=a.rate, ps=a.ps,
                        epochs=a.epochs,
                        log=lambda m: print(m, file=sys.stderr))
        wall = time.perf_counter() - started
    gap = (chaos["auc"] - base["auc"]) / base["auc"]
    print(f"{'run':<12}{'published':>10}{'trained':>9}{'lost':>6}{'dupl.':>7}{'given back':>12}{'test AUC':>10}")
    for name, r in (("undisturbed", base), ("chaos", chaos)):
        print(f"{name:<12}{r['published']:>10}{r['trained']:>9}{r['lost']:>6}{r['duplicates']:>7}"
              f"{r['given_back']:>12}{r['auc']:>10.4f}")
    killed = ", ".join(k["role"] for k in chaos["kills"])
    print(f"kills: {len(chaos['kills'])} ({killed}); restarts {chaos['restarts']}")
    print(f"AUC gap {gap:+.4%} (relative); wall {wall:.0f}s")
    if a.json:
        print(json.dumps({"published": chaos["published"], "trained": chaos["trained"], "lost": chaos["lost"],
                          "duplicates": chaos["duplicates"], "auc_gap": gap, "auc": chaos["auc"],
                          "auc_undisturbed": base["auc"], "kills": [k["role"] for k in chaos["kills"]],
                          "restarts": chaos["restarts"]}))


if __name__ == "__main__":
    main()
