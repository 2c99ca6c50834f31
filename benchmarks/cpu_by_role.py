"""CPU seconds each role of a convergence run spends, read from /proc while the run goes.

On a machine where every process shares two cores, throughput follows the CPU a sample costs
across all of them, so this is where a mode's speed goes. It runs ``benchmarks/convergence.py``
for one dataset, mode and seed, samples ``/proc/<pid>/stat`` of the job's processes every 0.3 s,
and prints per role the CPU seconds of the whole run (start-up and evaluation included, which are
the same in every mode) and, for the NN ranks, per thread: the training thread and the I/O loop's.
With ``--timeline`` it also prints, every 0.5 s, the cores each role kept busy since the last line:
the training phase shows as the stretch where every role is busy, and its total is how much of the
machine a mode uses.

    .venv/bin/python benchmarks/cpu_by_role.py --mode hybrid-16-hot-4 --seed 1 [--timeline]

Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def role(args: str) -> str | None:
    if "nats-server" in args:
        return "nats-server"
    if "embedding-parameter-server" in args:
        return "embedding PS"
    if "embedding-worker" in args:
        return "embedding worker"
    if "launcher" in args:
        return "launchers"
    if "train.py" in args:
        return "NN ranks"
    if "data_loader.py" in args:
        return "data loader"
    return None


def cpu_seconds(path: str) -> float:
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="hybrid-16-hot-4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--timeline", action="store_true", help="print the cores each role keeps busy every 0.5 s")
    args = p.parse_args()
    run = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--datasets", args.dataset,
                            "--modes", args.mode, "--seeds", str(args.seed), "--verbose",
                            "--plot", os.devnull], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mine = {os.getpid(), run.pid}
    last: dict[int, tuple[str, float]] = {}
    threads: dict[tuple[int, int], float] = {}
    roles = ("NN ranks", "embedding worker", "embedding PS", "nats-server", "data loader", "launchers")
    if args.timeline:
        print("| s | all | " + " | ".join(roles) + " |\n|" + "---|" * (len(roles) + 2))
    started = previous_at = time.monotonic()
    previous: dict[int, float] = {}
    while run.poll() is None:
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in mine:
                continue
            pid = int(name)
            try:
                r = role(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "))
                if r is None:
                    continue
                last[pid] = (r, cpu_seconds(f"/proc/{pid}/stat"))
                if r == "NN ranks":
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        threads[(pid, int(tid))] = cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
            except OSError:  # the process ended between the listing and the read
                continue
        now = time.monotonic()
        if args.timeline and now - previous_at >= 0.5:
            busy: Counter[str] = Counter()
            for pid, (r, seconds) in last.items():
                busy[r] += seconds - previous.get(pid, seconds)  # a process first seen counts from now
            cores = {r: busy[r] / (now - previous_at) for r in roles}
            print(f"| {now - started:.1f} | {sum(cores.values()):.2f} | "
                  + " | ".join(f"{cores[r]:.2f}" for r in roles) + " |", flush=True)
            previous, previous_at = {pid: seconds for pid, (_, seconds) in last.items()}, now
        time.sleep(0.25 if args.timeline else 0.3)
    out = run.stdout.read() if run.stdout else ""
    by_role: Counter[str] = Counter()
    for r, seconds in last.values():
        by_role[r] += seconds
    print(f"{args.dataset} {args.mode} seed {args.seed}: CPU seconds over the whole run\n")
    print("| role | CPU s |\n|---|---|")
    for r, seconds in sorted(by_role.items(), key=lambda kv: -kv[1]):
        print(f"| {r} | {seconds:.1f} |")
    print(f"| all | {sum(by_role.values()):.1f} |\n")
    ranks = sorted({pid for pid, _ in threads})
    if ranks:
        print("| NN rank (pid) | training thread | busiest other thread (the I/O loop) |\n|---|---|---|")
        for pid in ranks:
            main_s = threads.get((pid, pid), 0.0)
            other = max((s for (p_, t), s in threads.items() if p_ == pid and t != pid), default=0.0)
            print(f"| {pid} | {main_s:.2f} | {other:.2f} |")
    rows = [line for line in out.splitlines() if line.startswith(f"| {args.mode} |")]
    if rows:
        print("\n" + rows[-1])
    if run.returncode:
        print(out[-2000:], file=sys.stderr)
        sys.exit(run.returncode)


if __name__ == "__main__":
    main()
