"""The convergence study: sync vs hybrid (k = 1, 4, 16) vs async with 2 NN workers.

For each dataset (the adult-income example; the synthetic example's Criteo-like stream, its
rating-like ``ratings`` case with popular items and a multi-hot slot, and its id-only ``ids`` case),
mode and seed it
runs one whole job as real processes over its own nats-server, one job at a time: 1 embedding PS,
1 embedding worker, ``nn-worker --nproc-per-node 2`` and 1 data loader, started with
``persia-launcher`` exactly as in production. Each run gets its own job name and a global_config.yml
(the example's, with ``nn_worker_config.sync_mode`` / ``embedding_staleness`` replaced); ``SEED``
sets the example's seed (adult: the shuffle and the model init; synthetic: the stream and the init).

It prints a table per dataset: test AUC, log loss and training samples/s per mode (mean over seeds;
per seed with ``--verbose``), each mode's relative AUC gap to sync, ``(auc - auc_sync) / auc_sync``
in %, and its samples/s as a multiple of sync's, both measured in this same invocation. Samples/s is
every rank's training samples over the slowest rank's training time (startup and the final
evaluation excluded). "NN waits for batches" is the share of that time the ranks' training loops
spent waiting for their next batch (``train_wait_us``): what looking up ahead did not hide. It saves a
plot of test AUC against samples seen (``--plot``). With ``--json``
the last line printed is a JSON list of ``{dataset, mode, seed, auc, logloss, samples_per_s}``.

A mode may end in ``-ahead-<n>`` (``hybrid-4-ahead-1``): the example's DataLoader then looks up at
most n batches ahead of the one it trains (``forward_buffer_size``; the default is 10), so embeddings
are read later and are staler by fewer updates, while the staleness bound k still lets gradients
stay in flight. It may end in ``-hot-<c>`` (``hybrid-16-hot-4``): rows a batch reads c or more
times come back apart from the pooled sums, and the NN worker adds the newest copy it holds (kept
current by the PS's publications) just before the batch trains
(``embedding_worker_config.hot_row_min_count``). Without it a mode keeps the example's own setting:
none for adult, 4 for the synthetic stream, whose skewed slots need it; ``-hot-0`` turns it off.
Sync mode never asks for hot rows. Plain ``hybrid`` is hybrid at the defaults: the example's own
``embedding_staleness`` and hot-row setting are removed, so the bound is 10 and the embedding worker
picks the hot rows itself. Mode ``torch`` is no job: it runs the dataset's ``reference.py``, one torch
process with torch's optimizers on the same batches (compare it with sync at ``--nproc-per-node 1``).

    .venv/bin/python benchmarks/convergence.py --quick          # smoke run: 1 seed, 3 modes
    .venv/bin/python benchmarks/convergence.py --json           # the full study (36 runs)

Any failed run stops the study with a non-zero exit and that run's logs on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from tests.natsserver import start_nats_server  # noqa: E402
from tests.procs import Job, job_env  # noqa: E402

EXAMPLES = ROOT / "examples"
ALL_MODES = ("sync", "hybrid-1", "hybrid-4", "hybrid-4-ahead-1", "hybrid-16", "async")
QUICK_MODES = ("sync", "hybrid-4", "async")
GOAL_AUC_GAP_PCT = 0.1  # hybrid within 0.1% (relative) of sync's test AUC
GOAL_SPEEDUP = 1.15  # hybrid samples/s >= 1.15x sync's (issue 21; 1.3x before, see RESULTS.md "The ceiling")
GOAL_TORCH_GAP_PCT = 0.05  # sync within 0.05% (relative) of one torch process's test AUC
# environment variables of the examples that must come from this script only
_EXAMPLE_VARS = ("SEED", "EMBEDDING_STALENESS", "FORWARD_BUFFER", "BATCH_SIZE", "TRAIN_BATCHES", "TEST_SAMPLES",
                 "CURVE_SAMPLES", "CURVE_POINTS", "LOG_LEVEL")


@dataclass(frozen=True)
class Dataset:
    name: str
    directory: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def train_script(self) -> Path:
        return self.directory / "train.py"

    @property
    def loader_script(self) -> Path:
        return self.directory / "data_loader.py"

    @property
    def global_config(self) -> Path:
        return self.directory / "config" / "global_config.yml"

    @property
    def embedding_config(self) -> Path:
        case = self.env.get("SYNTHETIC_CASE")  # a job's batches carry every configured slot: one file per case
        return self.directory / "config" / (f"embedding_config_{case}.yml" if case else "embedding_config.yml")

    @property
    def reference_script(self) -> Path:
        """The single-process torch trainer of the same data and model (mode ``torch``)."""
        return self.directory / "reference.py"


# The synthetic example's ratings and ids cases in batches of 128, as the public click and rating data
# sets that showed sync trailing one process were trained.
_SMALL_BATCHES = {"BATCH_SIZE": "128", "TRAIN_BATCHES": "400"}
DATASETS = {
    "adult": Dataset("adult", EXAMPLES / "adult-income"),
    "synthetic": Dataset("synthetic", EXAMPLES / "synthetic"),
    "ratings": Dataset("ratings", EXAMPLES / "synthetic", {"SYNTHETIC_CASE": "ratings", **_SMALL_BATCHES}),
    "ids": Dataset("ids", EXAMPLES / "synthetic", {"SYNTHETIC_CASE": "ids", **_SMALL_BATCHES}),
}


@dataclass
class RunResult:
    dataset: str
    mode: str
    seed: int
    auc: float
    logloss: float
    samples_per_s: float
    train_samples: int
    wall_s: float
    max_staleness_ew: int | None
    max_staleness_ranks: list[int]
    auc_curve: list[list[float]]
    load_avg: float  # the host's 1-minute load average when the run ended (2 cores: above 2 = contended)
    #: share of the training time the ranks' loops waited for their next batch (mean over ranks, %)
    train_wait_pct: float = math.nan

    def row(self) -> dict:
        return {"dataset": self.dataset, "mode": self.mode, "seed": self.seed, "auc": self.auc,
                "logloss": self.logloss, "samples_per_s": self.samples_per_s}


class RunFailed(RuntimeError):
    pass


_MODE = re.compile(r"(sync|async|hybrid|hybrid-(\d+))(?:-ahead-(\d+))?(?:-hot-(\d+))?")
#: the single-process torch trainer (the dataset's reference.py), not a job
TORCH = "torch"


def mode_config(mode: str) -> dict:
    """``nn_worker_config`` keys for a mode string: sync, hybrid, hybrid-<k>, async (optionally ``-ahead-<n>``)."""
    if mode == TORCH:
        return {}
    m = _MODE.fullmatch(mode)
    if not m or (m.group(2) is not None and int(m.group(2)) < 1) or (m.group(3) is not None and (
            int(m.group(3)) < 1 or m.group(1) == "sync")) or (m.group(4) is not None and (
            int(m.group(4)) < 0 or m.group(1) == "sync")):
        raise ValueError(f"unknown mode {mode!r}: expected torch, sync, hybrid (the defaults), hybrid-<k> (k >= 1) "
                         "or async, the last three optionally with -ahead-<n> (n >= 1 batches looked up ahead) and "
                         "then -hot-<c> (rows read c or more times by a batch are added at their newest value just "
                         "before it trains; 0: none are)")
    if m.group(2) is None:
        return {"sync_mode": m.group(1)}
    return {"sync_mode": "hybrid", "embedding_staleness": int(m.group(2))}


def mode_ew_config(mode: str) -> dict:
    """``embedding_worker_config`` keys for a mode: ``-hot-<c>`` sets ``hot_row_min_count``."""
    m = _MODE.fullmatch(mode)
    return {"hot_row_min_count": int(m.group(4))} if m and m.group(4) else {}


def mode_env(mode: str) -> dict[str, str]:
    """The example's environment for a mode: ``-ahead-<n>`` sets its DataLoader's forward_buffer_size."""
    m = _MODE.fullmatch(mode)
    return {"FORWARD_BUFFER": m.group(3)} if m and m.group(3) else {}


def write_global_config(ds: Dataset, mode: str, path: Path, wire_dtype: str | None = None) -> Path:
    cfg = yaml.safe_load(ds.global_config.read_text()) or {}
    if wire_dtype is not None:
        cfg.setdefault("embedding_worker_config", {})["wire_dtype"] = wire_dtype
    nn = cfg.setdefault("nn_worker_config", {})
    if "embedding_staleness" not in mode_config(mode):
        nn.pop("embedding_staleness", None)  # not read in these modes, or left at its default in plain hybrid
    if _MODE.fullmatch(mode) and _MODE.fullmatch(mode).group(1) == "hybrid" and not mode_ew_config(mode):
        cfg.get("embedding_worker_config", {}).pop("hot_row_min_count", None)  # the default: chosen by the worker
    nn.update(mode_config(mode))
    if mode_ew_config(mode):
        cfg.setdefault("embedding_worker_config", {}).update(mode_ew_config(mode))
    path.write_text(yaml.safe_dump(cfg))
    return path


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _ew_max_staleness(text: str) -> int | None:
    values = [int(m.group(1)) for line in text.splitlines() if "stopped" in line
              for m in [re.search(r"\bmax_staleness=(\d+)", line)] if m]
    return values[-1] if values else None


def _wait_for_nn_workers(job: Job, timeout: float) -> str | None:
    """Wait for the NN workers to finish; a failure message if they fail, time out, or a role dies first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = job.procs["nn"].poll()
        if code is not None:
            return None if code == 0 else f"nn-worker exited with {code}"
        for name, proc in job.procs.items():
            code = proc.poll()
            if name != "nn" and code is not None and (code != 0 or name != "loader"):
                return f"{name} exited with {code} while the NN workers were still training"
        time.sleep(0.2)
    return f"the NN workers did not finish within {timeout:.0f} s"


def run_reference(ds: Dataset, seed: int, timeout: float, example_env: dict[str, str] | None = None) -> RunResult:
    """The dataset's single-process torch trainer on the same batches (mode ``torch``)."""
    env = {k: v for k, v in os.environ.items() if k not in _EXAMPLE_VARS}
    env.update(SEED=str(seed), **ds.env, **(example_env or {}))
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ds.reference_script), "--seed", str(seed), "--json"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    lines = _json_lines(proc.stdout)
    if proc.returncode != 0 or not lines:
        raise RunFailed(f"run {ds.name} / {TORCH} / seed {seed} failed with {proc.returncode}:\n"
                        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    r = lines[-1]
    return RunResult(dataset=ds.name, mode=TORCH, seed=seed, auc=float(r["test_auc"]),
                     logloss=float(r["test_logloss"]), samples_per_s=float(r["samples_per_s"]),
                     train_samples=int(r["train_samples"]), wall_s=time.perf_counter() - started,
                     max_staleness_ew=None, max_staleness_ranks=[], auc_curve=[], load_avg=os.getloadavg()[0])


def run_once(nats_url: str, ds: Dataset, mode: str, seed: int, nproc: int, ps_replicas: int, timeout: float,
             keep_logs: Path | None, example_env: dict[str, str] | None = None, wire_dtype: str | None = None
             ) -> RunResult:
    """One job: start every role, wait for the NN workers, stop the services, parse the result."""
    if mode == TORCH:
        return run_reference(ds, seed, timeout, example_env)
    workdir = Path(tempfile.mkdtemp(prefix=f"conv-{ds.name}-{mode}-s{seed}-"))
    job_name = f"conv-{ds.name}-{mode}-s{seed}-{uuid.uuid4().hex[:8]}"
    cfg = write_global_config(ds, mode, workdir / "global_config.yml", wire_dtype)
    env = job_env(nats_url, job_name, PERSIA_GLOBAL_CONFIG=str(cfg), PERSIA_EMBEDDING_CONFIG=str(ds.embedding_config))
    for key in _EXAMPLE_VARS:  # the examples' knobs come from here only, never from the caller's shell
        env.pop(key, None)
    env.update(SEED=str(seed), LOG_LEVEL="info", **ds.env, **mode_env(mode), **(example_env or {}))
    job = Job(env, workdir)
    started = time.perf_counter()
    failure = None
    codes: dict[str, int] = {}
    try:
        for i in range(ps_replicas):
            job.start(f"ps{i}", "embedding-parameter-server", "--replica-index", str(i),
                      "--replica-size", str(ps_replicas))
        job.start("ew0", "embedding-worker")
        job.start("nn", "nn-worker", str(ds.train_script), "--nproc-per-node", str(nproc))
        job.start("loader", "data-loader", str(ds.loader_script))
        failure = _wait_for_nn_workers(job, timeout)
        if failure is None:
            try:
                if (code := job.wait("loader", timeout=60)) != 0:
                    failure = f"data loader exited with {code}"
            except Exception as exc:  # noqa: BLE001 (a hung loader is a failed run)
                failure = f"data loader: {type(exc).__name__}: {exc}"
    finally:
        codes = job.stop_all()
    wall = time.perf_counter() - started
    if failure is None:
        bad = {name: c for name, c in codes.items() if c != 0}
        if bad:
            failure = f"processes exited non-zero on SIGTERM: {bad}"
    lines = _json_lines(job.log("nn")) if (workdir / "nn.log").exists() else []
    by_rank = {r.get("rank"): r for r in lines if "rank" in r}
    if failure is None and set(by_rank) != set(range(nproc)):
        failure = f"expected a JSON result from ranks 0..{nproc - 1}, got ranks {sorted(by_rank)}"
    if failure is None and not all(math.isfinite(by_rank[0].get(k, math.nan)) for k in ("test_auc", "test_logloss")):
        failure = f"rank 0 reported no finite test_auc / test_logloss: {by_rank[0]}"
    if failure is not None:
        raise RunFailed(f"run {ds.name} / {mode} / seed {seed} failed: {failure}\n"
                        f"logs in {workdir}\n{job.dump_logs()}")
    rank0 = by_rank[0]
    samples = sum(int(r["train_samples"]) for r in by_rank.values())
    # rank 0's evaluations during training stall every rank (the dense all-reduce waits): leave them out
    train_s = max(float(r["train_s"]) for r in by_rank.values()) - float(rank0.get("eval_during_train_s", 0.0))
    result = RunResult(
        dataset=ds.name, mode=mode, seed=seed, auc=float(rank0["test_auc"]), logloss=float(rank0["test_logloss"]),
        samples_per_s=samples / max(train_s, 1e-9), train_samples=samples, wall_s=wall,
        max_staleness_ew=_ew_max_staleness(job.log("ew0")),
        max_staleness_ranks=[int(by_rank[r].get("max_staleness", 0)) for r in sorted(by_rank)],
        auc_curve=[list(p) for p in rank0.get("auc_curve", [])],
        load_avg=os.getloadavg()[0],
        train_wait_pct=_mean([100.0 * r["counters"]["train_wait_us"] / 1e6 / max(float(r["train_s"]), 1e-9)
                              for r in by_rank.values() if "train_wait_us" in r.get("counters", {})]),
    )
    if keep_logs is not None:
        dest = keep_logs / workdir.name
        shutil.copytree(workdir, dest, dirs_exist_ok=True)
    shutil.rmtree(workdir, ignore_errors=True)
    return result


# ---------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def summarize(results: list[RunResult], modes: list[str]) -> dict:
    """Per dataset and mode: mean/std of auc, logloss, samples/s, and gap/ratio vs sync."""
    out: dict[str, dict[str, dict]] = {}
    for ds in dict.fromkeys(r.dataset for r in results):
        per_mode = {}
        for mode in modes:
            rs = [r for r in results if r.dataset == ds and r.mode == mode]
            if not rs:
                continue
            per_mode[mode] = {
                "n": len(rs), "auc": _mean([r.auc for r in rs]), "auc_std": _std([r.auc for r in rs]),
                "logloss": _mean([r.logloss for r in rs]), "samples_per_s": _mean([r.samples_per_s for r in rs]),
                "sps_std": _std([r.samples_per_s for r in rs]),
                "max_staleness_ew": max((r.max_staleness_ew or 0) for r in rs),
                "train_wait_pct": _mean([r.train_wait_pct for r in rs]),
            }
        sync = per_mode.get("sync")
        for row in per_mode.values():
            row["auc_gap_pct"] = 100.0 * (row["auc"] - sync["auc"]) / sync["auc"] if sync else math.nan
            row["speedup"] = row["samples_per_s"] / sync["samples_per_s"] if sync else math.nan
        out[ds] = per_mode
    return out


def format_table(results: list[RunResult], summary: dict, verbose: bool, nproc: int = 2) -> str:
    lines = []
    for ds, per_mode in summary.items():
        n = max(row["n"] for row in per_mode.values())
        workers = f"{nproc} NN worker{'s' if nproc > 1 else ''}"
        lines.append(f"\n## {ds}  (mean over {n} seed{'s' if n > 1 else ''}; {workers})\n")
        lines.append("| mode | test AUC (± sd) | AUC gap vs sync | log loss | samples/s (± sd) | × sync | "
                     "max staleness (EW) | NN waits for batches |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for mode, row in per_mode.items():
            gap = "—" if mode == "sync" else f"{row['auc_gap_pct']:+.3f}%"
            ratio = "1.00" if mode == "sync" else f"{row['speedup']:.2f}"
            lines.append(f"| {mode} | {row['auc']:.4f} ± {row['auc_std']:.4f} | {gap} | {row['logloss']:.4f} | "
                         f"{row['samples_per_s']:.0f} ± {row['sps_std']:.0f} | {ratio} | {row['max_staleness_ew']} | "
                         f"{row['train_wait_pct']:.0f}% |")
        if verbose:
            lines.append("\n| mode | seed | test AUC | log loss | samples/s | max staleness (EW / ranks) | "
                         "run wall s | load avg |")
            lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
            for r in results:
                if r.dataset == ds:
                    lines.append(f"| {r.mode} | {r.seed} | {r.auc:.4f} | {r.logloss:.4f} | {r.samples_per_s:.0f} | "
                                 f"{r.max_staleness_ew} / {r.max_staleness_ranks} | {r.wall_s:.1f} | "
                                 f"{r.load_avg:.1f} |")
        lines.append("")
        lines.extend(goal_lines(ds, per_mode))
    return "\n".join(lines)


def goal_lines(ds: str, per_mode: dict) -> list[str]:
    if "sync" not in per_mode:
        return [f"{ds}: no sync run, so no gap or speed-up against sync"]
    out = []
    for mode, row in per_mode.items():
        if not mode.startswith("hybrid"):
            continue
        auc_ok = row["auc_gap_pct"] >= -GOAL_AUC_GAP_PCT  # a hybrid above sync loses nothing
        speed_ok = row["speedup"] >= GOAL_SPEEDUP
        out.append(f"- {ds} {mode}: AUC gap {row['auc_gap_pct']:+.3f}% "
                   f"({'meets' if auc_ok else 'MISSES'} the goal: no worse than -{GOAL_AUC_GAP_PCT}%); "
                   f"speed {row['speedup']:.2f}x sync ({'meets' if speed_ok else 'MISSES'} the "
                   f">= {GOAL_SPEEDUP}x goal)")
    if "async" in per_mode:
        row = per_mode["async"]
        out.append(f"- {ds} async: AUC gap {row['auc_gap_pct']:+.3f}%, speed {row['speedup']:.2f}x sync")
    if TORCH in per_mode:
        ref = per_mode[TORCH]["auc"]
        gap = 100.0 * (per_mode["sync"]["auc"] - ref) / ref
        ok = abs(gap) < GOAL_TORCH_GAP_PCT
        out.append(f"- {ds} sync against one torch process: AUC gap {gap:+.3f}% ({'meets' if ok else 'MISSES'} the "
                   f"goal: within {GOAL_TORCH_GAP_PCT}%)")
    return out


def plot(results: list[RunResult], modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r.dataset for r in results))
    fig, axes = plt.subplots(1, len(datasets), figsize=(6.5 * len(datasets), 4.6), squeeze=False)
    colors = {m: plt.cm.viridis(i / max(len(modes) - 1, 1)) for i, m in enumerate(modes)}
    for ax, ds in zip(axes[0], datasets, strict=True):
        rs = [r for r in results if r.dataset == ds]
        has_curve = any(len(r.auc_curve) > 1 for r in rs)
        for i, mode in enumerate(modes):
            mrs = [r for r in rs if r.mode == mode]
            if not mrs:
                continue
            if has_curve and not any(r.auc_curve for r in mrs):  # the torch reference measures the end only
                ax.axhline(_mean([r.auc for r in mrs]), color=colors[mode], linestyle="--", label=f"{mode} (end)")
            elif has_curve:
                for r in mrs:  # each seed, faint
                    xs, ys = zip(*r.auc_curve, strict=True)
                    ax.plot(xs, ys, color=colors[mode], alpha=0.25, linewidth=0.8)
                n = min(len(r.auc_curve) for r in mrs)
                xs = [_mean([r.auc_curve[j][0] for r in mrs]) for j in range(n)]
                ys = [_mean([r.auc_curve[j][1] for r in mrs]) for j in range(n)]
                ax.plot(xs, ys, color=colors[mode], marker="o", markersize=3, linewidth=1.8, label=mode)
            else:
                aucs = [r.auc for r in mrs]
                ax.scatter([i] * len(aucs), aucs, color=colors[mode], alpha=0.5, s=18)
                ax.errorbar([i], [_mean(aucs)], yerr=[_std(aucs)], color=colors[mode], marker="D", capsize=4,
                            label=mode)
        if has_curve:
            ax.set_xlabel("training samples seen (all NN ranks)")
            ax.set_ylabel("AUC on the held-out curve sample")
            ax.set_title(f"{ds}: AUC during training (mean over seeds; faint = per seed)")
        else:
            n = rs[0].train_samples if rs else 0
            ax.set_xticks(range(len(modes)), modes)
            ax.set_ylabel("test AUC")
            ax.set_title(f"{ds}: final test AUC after {n} samples (one pass)\n"
                         "(the example's train.py measures only the end)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------


def _csv(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", type=_csv, default=["adult", "synthetic"],
                   help=f"comma-separated, of {','.join(DATASETS)} (default adult,synthetic)")
    p.add_argument("--seeds", type=_csv, default=None, help="comma-separated ints (default 0,1,2; --quick: 0)")
    p.add_argument("--modes", type=_csv, default=None,
                   help=f"comma-separated (default {','.join(ALL_MODES)}; --quick: {','.join(QUICK_MODES)})")
    p.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "convergence.png", help="PNG to write")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON line, last")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 3 modes")
    p.add_argument("--verbose", action="store_true", help="also print every run")
    p.add_argument("--nproc-per-node", type=int, default=2, help="NN worker ranks (default 2)")
    p.add_argument("--ps", type=int, default=1, help="embedding PS replicas (default 1)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--wire-dtype", choices=("float16", "float32"), default=None,
                   help="embedding_worker_config.wire_dtype of every job (default: the example's, float16): the "
                        "embeddings and the gradients on the wire")
    p.add_argument("--keep-logs", type=Path, default=None, help="copy every run's logs into this folder")
    p.add_argument("--example-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the example scripts of every run, e.g. TRAIN_BATCHES=600 "
                        "(repeatable; for exploring, the study itself uses the examples' defaults)")
    args = p.parse_args(argv)
    args.seeds = list(dict.fromkeys(int(s) for s in (args.seeds or (["0"] if args.quick else ["0", "1", "2"]))))
    args.modes = list(dict.fromkeys(args.modes or (QUICK_MODES if args.quick else ALL_MODES)))
    args.datasets = list(dict.fromkeys(args.datasets))
    for mode in args.modes:
        try:
            mode_config(mode)
        except ValueError as exc:
            p.error(str(exc))
    try:
        args.example_env = dict(kv.split("=", 1) for kv in args.example_env)
    except ValueError:
        p.error("--example-env takes KEY=VALUE")
    unknown = [d for d in args.datasets if d not in DATASETS]
    if unknown:
        p.error(f"unknown dataset(s) {unknown}: choose from {list(DATASETS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    total = len(args.datasets) * len(args.seeds) * len(args.modes)
    log = sys.stderr  # progress goes to stderr so stdout is the table (and the JSON line last)
    print(f"convergence study: {total} runs ({args.datasets} x seeds {args.seeds} x {args.modes}), "
          f"{args.nproc_per_node} NN ranks, {args.ps} PS", file=log, flush=True)
    server = start_nats_server()
    results: list[RunResult] = []
    started = time.perf_counter()
    try:
        done = 0
        for ds_name in args.datasets:
            ds = DATASETS[ds_name]
            # seed-major: every mode of a seed runs back to back, so slow drift on a shared machine
            # hits all modes alike rather than one
            for seed in args.seeds:
                for mode in args.modes:
                    r = run_once(server.url, ds, mode, seed, args.nproc_per_node, args.ps, args.timeout, args.keep_logs,
                                 args.example_env, args.wire_dtype)
                    results.append(r)
                    done += 1
                    print(f"[{done}/{total}] {ds_name} {mode} seed={seed}: auc={r.auc:.4f} logloss={r.logloss:.4f} "
                          f"samples/s={r.samples_per_s:.0f} max_staleness(ew)={r.max_staleness_ew} "
                          f"wall={r.wall_s:.1f}s load={r.load_avg:.1f}", file=log, flush=True)
    except RunFailed as exc:
        if results:
            print(format_table(results, summarize(results, args.modes), True, args.nproc_per_node), file=sys.stderr)
        print(f"\nFAILED after {len(results)} good runs: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        server.stop()
    wall = time.perf_counter() - started
    summary = summarize(results, args.modes)
    print(format_table(results, summary, args.verbose, args.nproc_per_node))
    print(f"\n{len(results)} runs in {wall:.0f} s")
    plot(results, args.modes, args.plot)
    print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps([r.row() for r in results]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
