"""Training while the PS tables grow past 10^7 rows a replica, with a checkpoint every 60 s (issues 39 and 42).

    .venv/bin/python benchmarks/bench_big_tables.py [--distinct-ids 1000000 100000000] [--batch-size 4096]
        [--train-batches 800] [--checkpoint-every 60] [--json]

For each ``--distinct-ids`` value, one run of the synthetic example's job as real processes on a real
nats-server (random port), as tests/procs.py's Job and the Procfile run them: 2 PS replicas, 1 embedding
worker, 1 NN worker (examples/synthetic/train.py), 1 data loader (examples/synthetic/data_loader.py),
the sparse roles at ``PERSIA_CPU_POLICY=idle`` as in the Procfile. The case is ``distinct``
(examples/synthetic/cases.py): 10 single-id slots, each id uniform over ``distinct_ids / 10`` values,
so at 10^8 nearly every id of a batch is new and the tables grow by about batch_size x 10 rows a batch;
at 10^6 they fill within a few dozen batches and then only hit. ``initial_rows`` keeps its default
(the index doubles during the run), ``capacity`` is raised to ``--capacity`` (no eviction), and the NN
worker takes a checkpoint every ``--checkpoint-every`` seconds (``checkpointing_config.every_sec``) into
a temporary checkpoint root (``keep: 1``), removed afterwards.

Every ``--poll`` seconds (0.5) the benchmark sends one ``persia.<job>.status`` broadcast (what
``persia-launcher status`` reads) and records each instance's figures at the time its answer
arrives: the NN rank's ``samples`` (batches handed to its training loop), each PS replica's ``rows``,
``memory_bytes`` and ``index_doublings_built_ahead``; and each PS process's RSS (``VmRSS`` of
/proc/<pid>/status, the process and its children), and the checkpoint root's directories
(``ckpt-N.partial`` while one is written, ``ckpt-N`` once finalized). A PS that does not answer a
poll is counted (``ps polls unanswered``): its event loop was held.

Training rate over time: the NN rank's ``samples`` interpolated at 2 s boundaries (``--window``) from
the first sample trained to the last; per window the rate, and whether the window overlaps a
checkpoint (from rank 0's ``checkpoint ... written in Xs`` log line: its interval) or an index
doubling (the poll interval in which a replica's rows crossed a doubling of ``initial_rows``). Per
checkpoint: its seconds (rank 0's log line; the PS replicas' own ``dumped N rows ... in X s``), its bytes
on disk, the PS RSS peak during it against the last sample before it.

Per role (PS replicas, embedding worker, NN worker, loader): the CPU seconds it spent from the first
batch to the last, user and system apart (``utime`` and ``stime`` of /proc/<pid>/stat, the process and its
children, sampled with each poll), and per 1,000 samples trained: which process a larger table costs more.

Prints one table per run and a summary across runs (samples/s against the first run's, the goal of
issue 42 being >= 0.8x at 10^8 against 10^6; issue 39's goal, no 2 s window below 50% of the median).
Timings are only ever compared within one invocation (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.natsserver import start_nats_server  # noqa: E402
from tests.procs import Job, job_env  # noqa: E402

SYNTHETIC = ROOT / "examples" / "synthetic"
INITIAL_ROWS = 1024  # embedding_parameter_server_config.initial_rows' default, left as it is


# ---------------------------------------------------------------------------------------------- sampling
def rss_mib(pid: int) -> float:
    """VmRSS of ``pid`` and its descendants, MiB (0 once gone)."""
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
                    break
            for t in os.listdir(f"/proc/{p}/task"):
                try:
                    todo += [int(c) for c in open(f"/proc/{p}/task/{t}/children").read().split()]
                except OSError:
                    pass
        except OSError:
            pass
    return total


def cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid`` and its live descendants ((0, 0) once gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    user = system = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            user += int(fields[11]) / tick  # utime, stime: fields 14 and 15 of proc(5)
            system += int(fields[12]) / tick
            for t in os.listdir(f"/proc/{p}/task"):
                try:
                    todo += [int(c) for c in open(f"/proc/{p}/task/{t}/children").read().split()]
                except OSError:
                    pass
        except (OSError, IndexError, ValueError):
            pass
    return user, system


def dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


class Sampler:
    """A thread polling the job's status broadcast, the PS processes' RSS and the checkpoint root."""

    def __init__(self, url: str, job: str, ps_pids: dict[int, int], ckpt_root: Path, poll: float,
                 role_pids: dict[str, int] | None = None) -> None:
        self.url, self.job, self.ps_pids, self.ckpt_root, self.poll = url, job, ps_pids, ckpt_root, poll
        self.role_pids = role_pids or {}
        self.cpu: list[tuple[float, dict[str, tuple[float, float]]]] = []  # (time, role -> (user, system) s)
        self.status: list[tuple[float, dict[str, Any]]] = []  # (arrival, reply)
        self.polls: list[float] = []  # when each broadcast was sent
        self.rss: list[tuple[float, dict[int, float]]] = []
        self.dirs: list[tuple[float, list[str]]] = []
        self.ckpt_bytes: dict[str, tuple[float, int]] = {}  # final name -> (first seen, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        import nats
        from persia_nats.common.codec import pack
        from persia_nats.common.messages import Empty
        from persia_nats.common.rpc import decode_reply

        nc = await nats.connect(self.url, name="bench-big-tables", max_reconnect_attempts=-1)
        inbox = nc.new_inbox()

        async def on_reply(msg: Any) -> None:
            try:
                self.status.append((time.time(), dict(decode_reply(msg))))
            except Exception:  # noqa: BLE001 (one odd reply must not stop the sampling)
                pass

        await nc.subscribe(inbox, cb=on_reply)
        payload = pack(Empty().to_wire())
        subject = f"persia.{self.job}.status"
        nxt = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.time()
                self.polls.append(now)
                await nc.publish(subject, payload, reply=inbox)
                await nc.flush()
                self.rss.append((now, {i: rss_mib(pid) for i, pid in self.ps_pids.items()}))
                self.cpu.append((now, {n: cpu_s(pid) for n, pid in self.role_pids.items()}))
                try:
                    names = sorted(os.listdir(self.ckpt_root))
                except OSError:
                    names = []
                self.dirs.append((now, names))
                for name in names:
                    if name.startswith("ckpt-") and "." not in name and name not in self.ckpt_bytes:
                        self.ckpt_bytes[name] = (now, dir_bytes(self.ckpt_root / name))
                nxt += self.poll
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            await asyncio.sleep(self.poll)  # the last answers
        finally:
            await nc.close()


# ---------------------------------------------------------------------------------------------- logs
def json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def iso_time(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def checkpoints_from_log(nn_log: str, ps_logs: dict[int, str]) -> list[dict[str, Any]]:
    """Rank 0's ``checkpoint <path> written in Xs at step N`` lines (and its failures), with the PS replicas'
    ``dumped N rows into <path> in X s`` lines of the same path."""
    import re

    ps_dumps: dict[str, list[dict[str, Any]]] = {}
    for i, text in ps_logs.items():
        for rec in json_lines(text):
            m = re.match(r"PS replica \d+ dumped (\d+) rows into (\S+) in ([\d.]+) s", rec.get("event", ""))
            if m:
                ps_dumps.setdefault(Path(m.group(2)).name, []).append(
                    {"replica": i, "rows": int(m.group(1)), "s": float(m.group(3)), "end": iso_time(rec["timestamp"])})
    out = []
    for rec in json_lines(nn_log):
        ev = rec.get("event", "")
        m = re.match(r"checkpoint (\S+) written in ([\d.]+)s at step (\d+)", ev)
        if m:
            end, secs = iso_time(rec["timestamp"]), float(m.group(2))
            final = Path(m.group(1)).name
            out.append({"name": final, "step": int(m.group(3)), "start": end - secs, "end": end, "s": secs,
                        "ps": ps_dumps.get(final + ".partial", []) + ps_dumps.get(final, [])})
        elif ev.startswith("checkpoint at step") and "failed" in ev:
            end = iso_time(rec["timestamp"])
            out.append({"name": None, "failed": ev[:300], "start": end, "end": end, "s": float("nan"), "ps": []})
    return out


# ---------------------------------------------------------------------------------------------- analysis
def interp(points: list[tuple[float, float]], t: float) -> float:
    """Linear interpolation of a non-decreasing series (t, value) at ``t``."""
    if t <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return points[-1][1]


def analyse(s: Sampler, ckpts: list[dict[str, Any]], window: float, ps_replicas: int) -> dict[str, Any]:
    nn = sorted((t, float(r["stats"].get("samples", 0))) for t, r in s.status if r.get("role") == "nn-worker"
                or str(r.get("instance", "")).startswith("nn-"))
    # after training the NN rank may answer once more with a count of 0 (the test pass's context, before it
    # exits): the training is what runs up to the highest count
    final = max((v for _, v in nn), default=0.0)
    if len(nn) < 2 or final <= 0:
        answers = Counter(str(r.get("instance", r.get("role", "?"))) for _, r in s.status)
        raise RuntimeError(f"the NN rank's status answers show no training ({len(s.polls)} polls; answers by "
                           f"instance: {dict(answers)}; NN answers: {nn[:3]}...{nn[-3:]})")
    # from the last answer before the first batch (training starts within it) to the first answer at the end
    t1 = min(t for t, v in nn if v >= final)
    t0 = max((t for t, v in nn if v == 0 and t < t1), default=nn[0][0])
    series = [(t, v) for t, v in nn if t0 <= t <= t1]
    ps: dict[int, list[tuple[float, dict[str, Any]]]] = {}
    for t, r in s.status:
        if str(r.get("instance", "")).startswith("ps-"):
            ps.setdefault(int(r["replica"]), []).append((t, r["stats"]))
    for v in ps.values():
        v.sort(key=lambda x: x[0])
    # index doublings: the poll interval in which a replica's rows passed INITIAL_ROWS * 2^k
    growths: list[dict[str, Any]] = []
    for i, pts in ps.items():
        for (ta, a), (tb, b) in zip(pts, pts[1:], strict=False):
            ra, rb = int(a.get("rows", 0)), int(b.get("rows", 0))
            cap = INITIAL_ROWS
            while cap < rb:
                if ra < cap <= rb and cap >= 1 << 16:  # smaller doublings take microseconds
                    growths.append({"replica": i, "rows": cap, "start": ta, "end": tb})
                cap *= 2
    # the 2 s windows
    windows = []
    t = t0
    while t + window <= t1 + 1e-9:
        a, b = interp(series, t), interp(series, t + window)
        ck = [c for c in ckpts if c["start"] < t + window and c["end"] > t]
        gr = [g for g in growths if g["start"] < t + window and g["end"] > t]
        windows.append({"t": t - t0, "rate": (b - a) / window, "checkpoint": bool(ck), "growth": bool(gr)})
        t += window
    rates = [w["rate"] for w in windows]
    median = statistics.median(rates) if rates else float("nan")
    slowest = min(windows, key=lambda w: w["rate"]) if windows else None
    # unanswered polls per PS replica (an answer arrives within the poll interval, or the loop was held)
    # (while training: before it a replica may still be starting)
    polls = [p for p in s.polls if t0 <= p <= t1 - s.poll]
    unanswered, longest_silence = {}, {}
    for i, pts in ps.items():
        times = sorted(t for t, _ in pts)
        unanswered[i] = sum(1 for p in polls if not any(p <= x < p + s.poll for x in times))
        inside = [t0] + [t for t in times if t0 < t < t1] + [t1]
        longest_silence[i] = max(b - a for a, b in zip(inside, inside[1:], strict=False))
    # checkpoints: RSS peak during against the last sample before
    ck_rows = []
    for c in ckpts:
        before = [r for t, r in s.rss if t < c["start"]]
        during = [r for t, r in s.rss if c["start"] <= t <= c["end"]]
        rss_before = {i: before[-1][i] for i in range(ps_replicas)} if before else {}
        rss_peak = {i: max(r[i] for r in during) for i in range(ps_replicas)} if during else {}
        seen = s.ckpt_bytes.get(c["name"] or "", (None, None))
        stalled = [w for w in windows
                   if w["checkpoint"] and c["start"] < w["t"] + t0 + window and c["end"] > w["t"] + t0]
        ck_rows.append({**{k: c[k] for k in ("name", "s", "start", "end") if k in c},
                        "at_s": c["start"] - t0, "step": c.get("step"), "failed": c.get("failed"),
                        "ps_dump_s": [round(p["s"], 2) for p in sorted(c["ps"], key=lambda p: p["replica"])],
                        "ps_rows": [p["rows"] for p in sorted(c["ps"], key=lambda p: p["replica"])],
                        "bytes": seen[1], "rss_before_mib": rss_before, "rss_peak_mib": rss_peak,
                        "window_rate_min": min((w["rate"] for w in stalled), default=None)})
    # CPU seconds each role spent while training (first to last batch), user and system; a role that
    # exited before the end (the loader) counts to its last sample
    cpu_train: dict[str, list[float]] = {}
    if s.cpu:
        a = min(s.cpu, key=lambda x: abs(x[0] - t0))[1]
        for n in a:
            last = max((c[n] for t, c in s.cpu if t <= t1 + s.poll and n in c), key=sum, default=(0.0, 0.0))
            cpu_train[n] = [round(last[0] - a[n][0], 2), round(last[1] - a[n][1], 2)]
    last_rows = {i: int(pts[-1][1].get("rows", 0)) for i, pts in ps.items()}
    last_mem = {i: int(pts[-1][1].get("memory_bytes", 0)) for i, pts in ps.items()}
    doublings = {i: int(pts[-1][1].get("index_doublings_built_ahead", 0)) for i, pts in ps.items()}
    rss_peak_all = {i: max((r[i] for _, r in s.rss), default=0.0) for i in range(ps_replicas)}
    rss_end = {i: s.rss[-1][1][i] if s.rss else 0.0 for i in range(ps_replicas)}
    return {
        "train_s": t1 - t0, "samples": final, "samples_per_s_polled": final / max(t1 - t0, 1e-9),
        "windows": len(windows), "median_window_rate": median,
        "slowest_window_rate": slowest["rate"] if slowest else None,
        "slowest_window_share": (slowest["rate"] / median) if slowest and median else None,
        "slowest_window_at_s": slowest["t"] if slowest else None,
        "slowest_window_checkpoint": slowest["checkpoint"] if slowest else None,
        "slowest_window_growth": slowest["growth"] if slowest else None,
        "windows_below_half": sum(1 for r in rates if r < 0.5 * median),
        "windows_below_half_checkpoint": sum(1 for w in windows if w["rate"] < 0.5 * median and w["checkpoint"]),
        "windows_below_half_growth": sum(1 for w in windows if w["rate"] < 0.5 * median and w["growth"]),
        "windows_checkpoint": sum(1 for w in windows if w["checkpoint"]),
        "windows_growth": sum(1 for w in windows if w["growth"]),
        "median_rate_checkpoint_windows": statistics.median([w["rate"] for w in windows if w["checkpoint"]])
        if any(w["checkpoint"] for w in windows) else None,
        "median_rate_growth_windows": statistics.median([w["rate"] for w in windows if w["growth"]])
        if any(w["growth"] for w in windows) else None,
        "median_rate_other_windows": statistics.median([w["rate"] for w in windows
                                                        if not w["checkpoint"] and not w["growth"]])
        if any(not w["checkpoint"] and not w["growth"] for w in windows) else None,
        "cpu_s_training": {n: round(sum(v), 2) for n, v in cpu_train.items()},
        "cpu_s_training_user_system": cpu_train,
        "cpu_ms_per_1k_samples": {n: round(sum(v) * 1e6 / max(final, 1), 2) for n, v in cpu_train.items()},
        "rows_end": last_rows, "memory_bytes_end": last_mem, "index_doublings_built_ahead": doublings,
        "growths": [{**g, "at_s": g["start"] - t0} for g in growths],
        "ps_polls_unanswered": unanswered, "polls": len(polls), "ps_longest_silence_s": longest_silence,
        "rss_peak_mib": rss_peak_all, "rss_end_mib": rss_end,
        "checkpoints": ck_rows, "window_rates": [round(w["rate"]) for w in windows],
    }


# ---------------------------------------------------------------------------------------------- a run
def write_global_config(path: Path, job: str, capacity: int, ckpt_root: Path, every: float,
                        initial_rows: int | None = None) -> Path:
    cfg = yaml.safe_load((SYNTHETIC / "config" / "global_config.yml").read_text())
    cfg.setdefault("common_config", {})["job_name"] = job
    cfg["common_config"]["checkpointing_config"] = {"checkpoint_dir": str(ckpt_root), "every_sec": every, "keep": 1}
    cfg.setdefault("embedding_parameter_server_config", {})["capacity"] = capacity
    if initial_rows is not None:
        cfg["embedding_parameter_server_config"]["initial_rows"] = initial_rows
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_one(distinct: int, args: argparse.Namespace) -> dict[str, Any]:
    job_name = f"big{uuid.uuid4().hex[:8]}"
    server = start_nats_server()
    tmp = Path(tempfile.mkdtemp(prefix="bench-big-tables-"))
    logdir, ckpt_root = tmp / "logs", tmp / "checkpoints"
    logdir.mkdir()
    ckpt_root.mkdir()
    gcfg = write_global_config(tmp / "global_config.yml", job_name, args.capacity, ckpt_root, args.checkpoint_every,
                               args.initial_rows)
    env = job_env(server.url, job_name,
                  PERSIA_GLOBAL_CONFIG=str(gcfg),
                  PERSIA_EMBEDDING_CONFIG=str(SYNTHETIC / "config" / "embedding_config_distinct.yml"),
                  PERSIA_LOG_FORMAT="json", LOG_LEVEL="info",
                  SYNTHETIC_CASE="distinct", DISTINCT_IDS=str(distinct), BATCH_SIZE=str(args.batch_size),
                  TRAIN_BATCHES=str(args.train_batches), CURVE_POINTS="0", TEST_SAMPLES=str(args.test_samples),
                  SEED="0")
    job = Job(env, logdir)
    started = time.time()
    result: dict[str, Any] = {"distinct_ids": distinct, "batch_size": args.batch_size,
                              "train_batches": args.train_batches, "checkpoint_every_s": args.checkpoint_every}
    try:
        job.start_roles(SYNTHETIC / "train.py", SYNTHETIC / "data_loader.py", ps=args.ps_replicas, workers=1,
                        sparse_env={"PERSIA_CPU_POLICY": args.sparse_cpu_policy})
        ps_pids = {i: job.procs[f"ps{i}"].pid for i in range(args.ps_replicas)}
        role_pids = {n: p.pid for n, p in job.procs.items()}
        with Sampler(server.url, job_name, ps_pids, ckpt_root, args.poll, role_pids) as sampler:
            try:
                rc = job.wait("nn", timeout=args.timeout)
            except Exception:  # a hang: say so, with what each role logged last
                rc = None
            result["nn_rc"] = rc
            try:
                result["loader_rc"] = job.wait("loader", timeout=60)
            except Exception:  # noqa: BLE001
                result["loader_rc"] = None
        result["wall_s"] = time.time() - started
        nn_log = job.log("nn")
        ps_logs = {i: job.log(f"ps{i}") for i in range(args.ps_replicas)}
        nn_result = next((r for r in reversed(json_lines(nn_log)) if "train_samples" in r), None)
        if rc != 0 or nn_result is None:
            result["error"] = f"NN worker rc={rc}"
            result["logs_tail"] = {n: job.log(n)[-3000:] for n in job.procs}
        ckpts = checkpoints_from_log(nn_log, ps_logs)
        result.update(analyse(sampler, ckpts, args.window, args.ps_replicas))
        if nn_result is not None:
            result["samples_per_s"] = nn_result["samples_per_s"]
            result["nn_train_s"] = nn_result["train_s"]
            result["test_auc"] = nn_result.get("test_auc")
            result["nn_checkpoints"] = nn_result.get("checkpoints")
        # warnings and errors the roles logged (a stall or a timeout shows here)
        result["log_warnings"] = {n: [f"{r.get('timestamp', '')} {r.get('level')} {r.get('event', '')[:240]}"
                                      for r in json_lines(job.log(n)) if r.get("level") in ("warning", "error",
                                                                                              "critical")][:20]
                                  for n in job.procs}
        result["load_average"] = os.getloadavg()
    finally:
        codes = job.stop_all()
        result["exit_codes"] = codes
        if args.keep_logs:
            kept = Path(args.keep_logs) / f"{distinct}"
            shutil.copytree(logdir, kept, dirs_exist_ok=True)
            result["logs"] = str(kept)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return result


# ---------------------------------------------------------------------------------------------- output
def fmt(x: Any, spec: str = ",.0f") -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return format(x, spec)


def print_run(r: dict[str, Any]) -> None:
    print(f"\n== distinct ids {r['distinct_ids']:,}: batch {r['batch_size']}, {r['train_batches']} batches, "
          f"checkpoint every {r['checkpoint_every_s']:g} s; NN rc {r.get('nn_rc')}, wall {r.get('wall_s', 0):.0f} s, "
          f"load {' '.join(f'{x:.1f}' for x in r.get('load_average', ()))}")
    if r.get("error"):
        print(f"   ERROR: {r['error']}")
    rows = r.get("rows_end", {})
    table = [
        ("rows a replica at the end", " / ".join(f"{v:,}" for v in rows.values())),
        ("PS memory_bytes at the end (MiB)",
         " / ".join(f"{v / 2**20:,.0f}" for v in r.get("memory_bytes_end", {}).values())),
        ("PS RSS at the end / peak (MiB)", " / ".join(f"{r['rss_end_mib'][i]:,.0f} / {r['rss_peak_mib'][i]:,.0f}"
                                                     for i in r.get("rss_peak_mib", {}))),
        ("index doublings built ahead", " / ".join(str(v) for v in r.get("index_doublings_built_ahead", {}).values())),
        ("samples/s (NN worker's own figure)", fmt(r.get("samples_per_s"))),
        ("samples/s (polled, first to last batch)", fmt(r.get("samples_per_s_polled"))),
        ("training s (polled)", fmt(r.get("train_s"), ".1f")),
        ("2 s windows", fmt(r.get("windows"), "d")),
        ("median 2 s window, samples/s", fmt(r.get("median_window_rate"))),
        ("slowest 2 s window, samples/s", fmt(r.get("slowest_window_rate"))),
        ("slowest / median (goal >= 0.5)", fmt(r.get("slowest_window_share"), ".2f")
         + f" at {fmt(r.get('slowest_window_at_s'), '.0f')} s"
         + (" (checkpoint)" if r.get("slowest_window_checkpoint") else "")
         + (" (growth)" if r.get("slowest_window_growth") else "")),
        ("windows below half the median", f"{r.get('windows_below_half')} ({r.get('windows_below_half_checkpoint')} "
                                          f"overlap a checkpoint, {r.get('windows_below_half_growth')} a growth)"),
        ("windows overlapping a checkpoint / a growth", f"{r.get('windows_checkpoint')} / {r.get('windows_growth')}"),
        ("median rate: checkpoint / growth / other windows",
         f"{fmt(r.get('median_rate_checkpoint_windows'))} / {fmt(r.get('median_rate_growth_windows'))} / "
         f"{fmt(r.get('median_rate_other_windows'))}"),
        ("PS status polls unanswered while training",
         " / ".join(str(v) for v in r.get("ps_polls_unanswered", {}).values())
         + f" (of {r.get('polls')})"),
        ("CPU s while training, per role (user + system)",
         ", ".join(f"{n} {u + y:.1f} ({u:.1f} + {y:.1f})"
                   for n, (u, y) in r.get("cpu_s_training_user_system", {}).items())),
        ("CPU ms per 1,000 samples, per role",
         ", ".join(f"{n} {v:.1f}" for n, v in r.get("cpu_ms_per_1k_samples", {}).items())),
        ("PS longest gap between status answers (s)",
         " / ".join(f"{v:.1f}" for v in r.get("ps_longest_silence_s", {}).values())),
    ]
    w = max(len(k) for k, _ in table)
    for k, v in table:
        print(f"   {k.ljust(w)}  {v}")
    cks = r.get("checkpoints", [])
    if cks:
        print("   checkpoints:")
        print("   | # | at s | step | seconds (rank 0) | PS dump s | rows (per replica) | bytes "
              "| PS RSS before -> peak MiB "
              "| slowest window during |")
        for n, c in enumerate(cks, 1):
            if c.get("failed"):
                print(f"   | {n} | {c['at_s']:.0f} | - | FAILED: {c['failed']} |")
                continue
            rss = ", ".join(f"{c['rss_before_mib'].get(i, 0):,.0f} -> {c['rss_peak_mib'].get(i, 0):,.0f}"
                            + (f" (+{(c['rss_peak_mib'][i] / c['rss_before_mib'][i] - 1) * 100:.0f}%)"
                               if c["rss_before_mib"].get(i) and c["rss_peak_mib"].get(i) else "")
                            for i in sorted(c["rss_before_mib"] or c["rss_peak_mib"]))
            print(f"   | {n} | {c['at_s']:.0f} | {c['step']} | {c['s']:.2f} | {', '.join(map(str, c['ps_dump_s']))} | "
                  f"{', '.join(f'{x:,}' for x in c['ps_rows'])} | {fmt(c['bytes'])} | {rss} | "
                  f"{fmt(c['window_rate_min'])} |")
    gr = r.get("growths", [])
    if gr:
        print("   index doublings (rows reached, at s): " + ", ".join(
            f"ps{g['replica']} {g['rows']:,} @{g['at_s']:.0f}" for g in gr))
    for n, lines in r.get("log_warnings", {}).items():
        if lines:
            print(f"   {n} warnings/errors ({len(lines)} shown at most 20):")
            for line in lines[:8]:
                print(f"      {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--distinct-ids", type=float, nargs="+", default=[1e6, 1e8])
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--train-batches", type=int, default=800)
    ap.add_argument("--checkpoint-every", type=float, default=60.0)
    ap.add_argument("--ps-replicas", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=40_000_000, help="rows a PS replica (no eviction below it)")
    ap.add_argument("--initial-rows", type=int, default=None,
                    help="embedding_parameter_server_config.initial_rows (default: the shipped 1024, so the tables "
                         "grow, their index doubling, during the run; the rows a replica ends with: no doublings)")
    ap.add_argument("--test-samples", type=int, default=4096)
    ap.add_argument("--poll", type=float, default=0.5)
    ap.add_argument("--window", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds the NN worker gets to finish")
    ap.add_argument("--sparse-cpu-policy", default="idle",
                    help="PERSIA_CPU_POLICY of the sparse roles (Procfile: idle)")
    ap.add_argument("--keep-logs", default=None, help="copy every role's log under this directory")
    ap.add_argument("--json", action="store_true", help="one JSON line per run, then one for the summary")
    args = ap.parse_args()
    results = []
    for d in args.distinct_ids:
        r = run_one(int(d), args)
        results.append(r)
        print_run(r)
        if args.json:
            print(json.dumps({k: v for k, v in r.items() if k != "logs_tail"}, default=str), flush=True)
        sys.stdout.flush()
    base = results[0]
    print("\n== summary")
    print("| distinct ids | rows a replica (end) | samples/s | x first run | median 2 s window | slowest / median "
          "| windows < 50% median | checkpoints (s each) | PS RSS peak during a checkpoint / before "
          "| CPU ms / 1,000 samples (PS each, EW, NN) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        rows = " / ".join(f"{v:,}" for v in r.get("rows_end", {}).values())
        sps = r.get("samples_per_s")
        ratio = sps / base["samples_per_s"] if sps and base.get("samples_per_s") else None
        cks = [c for c in r.get("checkpoints", []) if not c.get("failed")]
        secs = ", ".join(f"{c['s']:.1f}" for c in cks)
        growth = []
        for c in cks:
            for i, peak in c["rss_peak_mib"].items():
                before = c["rss_before_mib"].get(i)
                if before:
                    growth.append(peak / before)
        print(f"| {r['distinct_ids']:,} | {rows} | {fmt(sps)} | {fmt(ratio, '.2f')} "
              f"| {fmt(r.get('median_window_rate'))} "
              f"| {fmt(r.get('slowest_window_share'), '.2f')} | {r.get('windows_below_half')} of {r.get('windows')} "
              f"| {len(cks)} ({secs}) | {fmt(max(growth) if growth else None, '.2f')}x max "
              f"| {', '.join(f'{v:.1f}' for n, v in r.get('cpu_ms_per_1k_samples', {}).items() if n != 'loader')} |")
    if args.json:
        print(json.dumps({"summary": [{"distinct_ids": r["distinct_ids"], "samples_per_s": r.get("samples_per_s"),
                                       "rows_end": r.get("rows_end"),
                                       "slowest_window_share": r.get("slowest_window_share")} for r in results]}))


if __name__ == "__main__":
    main()
