"""Live jobs scraped by one real Prometheus: series labelled with their own job, every dashboard query with data?

    .venv/bin/python benchmarks/prometheus_check.py [--jobs 1] [--ps 2] [--workers 1] [--nproc 1] [--epochs 5] [--json]

Runs ``--jobs`` adult-income jobs at the same time on one nats-server, each as separate processes (``--ps``
PS replicas, ``--workers`` embedding workers, an NN worker with ``--nproc`` ranks, a data loader) with
metrics on at port 0, so each role serves on a free port and announces it as ``metrics_port`` in its
``$SRV`` metadata (``--epochs`` passes over the data, so that the NN workers train through several
scrapes). Each job has its own global_config.yml, which names it only by ``common_config.job_name``
(``metrics_config.job_name`` left out, ``PERSIA_JOB_NAME`` unset): the ``persia_job`` label must follow it.
Several times a second the script reads each job's ``$SRV.INFO`` and adds the endpoints it finds to one
``file_sd`` file, which a real ``prometheus`` (Debian: ``apt-get install prometheus``; or ``--prometheus
PATH``) scrapes every second under one ``job`` label. When every NN worker has finished (trained,
evaluated, reported its test AUC), it asks Prometheus's HTTP API (a healthy job refuses nothing, so the
script sends each job's PS 0 one malformed lookup for the refusals panel to show), for each job:

- every series scraped from the job's endpoints (Prometheus's own ``up`` and ``scrape_*`` aside) carries
  ``role`` and ``persia_job`` set to this job, none carries ``exported_job`` or ``exported_instance``,
  none carries another job's name, and every endpoint discovered for the job was scraped at least once;
- the held-out AUC the job's rank 0 reports as its evaluation ends is in Prometheus, equal to the one it
  printed;
- every query of ``deploy/grafana-dashboard.json`` (``$persia_job`` set to this job, ``$__rate_interval``
  to ``--rate-interval``) returns data at some point of the run (``/api/v1/query_range``, one step a
  second), none of it labelled with another job, and the dashboard's ``$persia_job`` variable lists
  this job;

and, over everything Prometheus holds, that no series carries ``persia_job="persia_default_jobname"``
(PERSIA's default) or any ``persia_job`` that is not one of the jobs.

It prints one table (job, check, series, ok) and a summary, and exits 1 if any check failed (2 when
``prometheus`` is missing). Everything it started is stopped, by PID, on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.natsserver import start_nats_server  # noqa: E402
from tests.procs import ADULT, Job, job_env  # noqa: E402

DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
SCRAPE_JOB = "persia"  # Prometheus's own job label for the targets
# series Prometheus adds for every target itself; they never carry the target's labels
SYNTHETIC = re.compile(r"up|scrape_.*")
PERSIA_DEFAULT_JOB = "persia_default_jobname"  # PERSIA's own persia_job when metrics_config.job_name is unset
HOW_TO_INSTALL = ("no prometheus binary found: install one (Debian/Ubuntu: apt-get install prometheus; "
                  "elsewhere: https://prometheus.io/download/) and put it on the PATH or pass --prometheus PATH")


# -- pure helpers (tests/unit/test_prometheus_check.py) ----------------------------------------------


def _targets(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    for panel in panels:
        for target in panel.get("targets") or []:
            expr = target.get("expr")
            if expr:
                yield panel.get("title", ""), expr
        # a collapsed row keeps its panels inside itself
        yield from _targets(panel.get("panels") or [])


def dashboard_queries(board: dict[str, Any], job: str, rate_interval: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of a Grafana dashboard, its variables filled in.

    ``$persia_job`` (also ``${persia_job}``, ``[[persia_job]]``; named after the label it selects, not
    Prometheus' scrape ``job``) becomes ``job``, which the board matches with ``=~``: a
    job name (letters, digits, ``_``, ``-``) matches only itself as a regex, and needs no escape in a
    PromQL string; ``$__rate_interval`` and ``$__interval`` become ``rate_interval``.

    Raises:
        ValueError: a job name with other characters, a query using a variable this function does
            not know, or a board without a query.
    """
    if not re.fullmatch(r"[A-Za-z0-9_-]+", job):
        raise ValueError(f"job name {job!r}: only letters, digits, '_' and '-' (what common_config.job_name allows)")
    subs = {"persia_job": job, "__rate_interval": rate_interval, "__interval": rate_interval}
    variable = re.compile(r"\$\{(\w+)\}|\[\[(\w+)\]\]|\$(\w+)")

    def fill(expr: str) -> str:
        def one(m: re.Match[str]) -> str:
            name = m.group(1) or m.group(2) or m.group(3)
            if name not in subs:
                raise ValueError(f"dashboard query uses ${name}, which has no value here: {expr}")
            return subs[name]

        return variable.sub(one, expr)

    out = [(title, fill(expr)) for title, expr in _targets(board.get("panels") or [])]
    if not out:
        raise ValueError("the dashboard has no Prometheus query (no panel target with an expr)")
    return out


def label_problems(series: list[dict[str, str]], job: str | None = None) -> tuple[list[str], dict[str, int]]:
    """(problems, series per role) for the label sets of a scrape job's series.

    Prometheus's synthetic ``up`` and ``scrape_*`` series are skipped: they carry only the target's
    ``job`` and ``instance``. With ``job``, every other series must carry ``persia_job="<job>"``. Each
    problem names one metric and what is wrong with it.
    """
    problems: set[str] = set()
    per_role: dict[str, int] = {}
    for labels in series:
        name = labels.get("__name__", "")
        if SYNTHETIC.fullmatch(name):
            continue
        role = labels.get("role", "")
        if not role:
            problems.add(f"{name}: no role label")
        else:
            per_role[role] = per_role.get(role, 0) + 1
        for clash in ("exported_job", "exported_instance"):
            if clash in labels:
                problems.add(f"{name}: carries {clash} (the target exports a label Prometheus sets)")
        if job is not None and labels.get("persia_job") != job:
            got = labels.get("persia_job")
            problems.add(f"{name}: persia_job={got!r}, not {job!r}" if got is not None else f"{name}: no persia_job")
    return sorted(problems), dict(sorted(per_role.items()))


def file_sd(targets: dict[str, str]) -> list[dict[str, Any]]:
    """A ``file_sd_configs`` file's content for ``{host:port: role}`` (any value): one group, no extra
    labels, so that ``role`` and ``persia_job`` on a series can only come from the target itself."""
    return [{"targets": sorted(targets), "labels": {}}] if targets else []


def job_names(n: int, tag: str) -> list[str]:
    """``n`` distinct job names for one run: ``promcheck<tag>-<i>`` (``<tag>``: letters and digits).

    Raises:
        ValueError: ``n`` < 1, or a tag that would make a name common_config.job_name refuses.
    """
    if n < 1:
        raise ValueError(f"--jobs must be >= 1, got {n}")
    if not re.fullmatch(r"[A-Za-z0-9]+", tag):
        raise ValueError(f"tag {tag!r}: letters and digits only")
    return [f"promcheck{tag}-{i}" for i in range(n)]


def by_owner(series: list[dict[str, str]], owner: dict[str, str]) -> dict[str, list[dict[str, str]]]:
    """The series grouped by the job whose endpoint they were scraped from (``owner``: ``instance -> job``,
    as ``$SRV`` discovery found it, not as the series' labels say). Series of an endpoint nobody owns
    go under ``""``."""
    out: dict[str, list[dict[str, str]]] = {}
    for labels in series:
        out.setdefault(owner.get(labels.get("instance", ""), ""), []).append(labels)
    return out


def persia_jobs(series: list[dict[str, str]]) -> dict[str, int]:
    """Series per ``persia_job`` value (Prometheus's synthetic series and series without it aside)."""
    counts: dict[str, int] = {}
    for labels in series:
        if SYNTHETIC.fullmatch(labels.get("__name__", "")) or "persia_job" not in labels:
            continue
        counts[labels["persia_job"]] = counts.get(labels["persia_job"], 0) + 1
    return dict(sorted(counts.items()))


def foreign(counts: dict[str, int], allowed: list[str] | set[str]) -> dict[str, int]:
    """The entries of ``counts`` (``persia_job -> series``) whose name is not in ``allowed``."""
    return {name: n for name, n in counts.items() if name not in allowed}


# -- the run --------------------------------------------------------------------------------------


@dataclass
class Row:
    job: str  # "(all)": a check over everything Prometheus holds
    check: str
    series: int
    ok: bool
    note: str = ""
    dashboard: bool = False


@dataclass
class Endpoint:
    job: str
    role: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(prom: str, path: str, params: list[tuple[str, str]]) -> Any:
    url = f"{prom}/api/v1/{path}?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # a bad query answers 400 with the reason in the body
        body = json.loads(exc.read() or b"{}")
    if body.get("status") != "success":
        raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def wait_ready(prom: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode} before it was ready:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(f"{prom}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"prometheus not ready within {timeout:g}s")


def write_atomic(path: Path, text: str) -> None:
    # Prometheus rereads the file when it changes: never let it see half of one
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def follow(nats_url: str, jobs: dict[str, Job], sd_path: Path, seen: dict[str, Endpoint],
                 timeout: float) -> None:
    """Until every job's NN worker exits: add every metrics endpoint ``$SRV`` announces for each job to
    ``sd_path`` (``seen``: ``host:port -> Endpoint``), polling each job in turn, and send each job's
    PS 0 one malformed lookup.

    Endpoints stay in the file after their instance deregisters: an NN rank's evaluation context
    lives for a second or two, and deregisters before its final scrape.
    """
    import nats
    from nats.errors import NoRespondersError
    from persia_nats.common.discovery import discover
    from persia_nats.common.subjects import Subjects

    nc = await nats.connect(nats_url, name="prometheus-check")
    refused: set[str] = set()
    try:
        deadline = time.monotonic() + timeout
        while any(job.procs["nn"].poll() is None for job in jobs.values()):
            if time.monotonic() > deadline:
                late = [name for name, job in jobs.items() if job.procs["nn"].poll() is None]
                raise RuntimeError(f"the NN worker of {', '.join(late)} did not finish within {timeout:g}s\n"
                                   + "\n".join(jobs[name].dump_logs() for name in late))
            for job_name in jobs:
                instances = await discover(nc, job_name, None, 0.3)
                live = {f"127.0.0.1:{i['metadata']['metrics_port']}": Endpoint(job_name, i["role"])
                        for i in instances if i["metadata"].get("metrics_port")}
                clash = sorted(t for t in live.keys() & seen.keys() if seen[t].job != job_name)
                if clash:  # a port reused by another job's process: the owner would be ambiguous
                    raise RuntimeError(f"{', '.join(clash)} announced by {job_name} and by {seen[clash[0]].job}")
                if live.keys() - seen.keys():
                    seen.update(live)
                    write_atomic(sd_path, json.dumps(file_sd({t: e.role for t, e in seen.items()})))
                if job_name not in refused and any(
                        i["role"] == "embedding-parameter-server" and i["replica_index"] == 0 for i in instances):
                    # a healthy job refuses nothing, and the refusals panel would have no series to show
                    try:
                        await nc.request(Subjects(job_name).ps(0, "lookup"), b"\xc1 not msgpack", timeout=10)
                        refused.add(job_name)
                    except NoRespondersError:  # registered a moment before it subscribed: next round
                        pass
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


def check_all(prom: str, jobs: list[str], start: float, end: float) -> list[Row]:
    """The checks over everything Prometheus holds: no PERSIA default, no name but the jobs'."""
    window = [("start", f"{start:.3f}"), ("end", f"{end:.3f}")]
    default = api(prom, "series", [("match[]", f'{{persia_job="{PERSIA_DEFAULT_JOB}"}}'), *window])
    labelled = api(prom, "series", [("match[]", '{persia_job=~".+"}'), *window])
    others = foreign(persia_jobs(labelled), jobs)
    return [
        Row("(all)", f'no series carries persia_job="{PERSIA_DEFAULT_JOB}"', len(default), not default),
        Row("(all)", f"every persia_job in Prometheus is one of the {len(jobs)} job(s)", len(labelled),
            bool(labelled) and not others, ", ".join(f"{name} ({n} series)" for name, n in others.items())),
    ]


def check(prom: str, job_name: str, jobs: list[str], series: list[dict[str, str]], start: float, end: float,
          seen: dict[str, Endpoint], rate_interval: str, test_auc: float) -> tuple[list[Row], dict[str, int]]:
    """The checks of one job; ``series``: every series scraped from this job's endpoints."""
    rows: list[Row] = []
    window = [("start", f"{start:.3f}"), ("end", f"{end:.3f}")]
    problems, per_role = label_problems(series, job_name)
    named = [s for s in series if not SYNTHETIC.fullmatch(s.get("__name__", ""))]
    rows.append(Row(job_name, "every series carries role and this persia_job, none exported_job/_instance",
                    len(named), bool(named) and not problems, "; ".join(problems[:5])))
    crossed = {name: n for name, n in persia_jobs(series).items() if name in jobs and name != job_name}
    rows.append(Row(job_name, "no series of this job's endpoints carries another job's name",
                    sum(crossed.values()), not crossed, ", ".join(f"{name} ({n})" for name, n in crossed.items())))
    mine = {t: e for t, e in seen.items() if e.job == job_name}
    up = api(prom, "query_range", [("query", f'up{{job="{SCRAPE_JOB}"}} == 1'), *window, ("step", "1")])["result"]
    scraped = {r["metric"]["instance"] for r in up} & mine.keys()
    missed = sorted(mine.keys() - scraped)
    rows.append(Row(job_name, f"every endpoint found in $SRV scraped ({len(mine)})", len(scraped),
                    bool(mine) and not missed, ", ".join(f"{t} ({mine[t].role})" for t in missed)))
    # reported as eval_ctx ends: in Prometheus only if the rank waited for a last scrape
    auc = api(prom, "query", [("query", f'last_over_time(persia_nn_worker_test_auc{{persia_job="{job_name}"}}[1h])'),
                              ("time", f"{end:.3f}")])["result"]
    got = [float(r["value"][1]) for r in auc]
    rows.append(Row(job_name, f"test AUC in Prometheus is the NN worker's ({test_auc:.6f})", len(got),
                    len(got) == 1 and abs(got[0] - test_auc) < 1e-9, ", ".join(f"{g:.6f}" for g in got)))
    values = api(prom, "label/persia_job/values", [("match[]", "persia_requests_total"), *window])
    rows.append(Row(job_name, "dashboard variable $persia_job lists this job", len(values), job_name in values))
    board = json.loads(DASHBOARD.read_text())
    for title, expr in dashboard_queries(board, job_name, rate_interval):
        try:
            result = api(prom, "query_range", [("query", expr), *window, ("step", "1")])["result"]
            n, note = len(result), ""
        except RuntimeError as exc:
            result, n, note = [], 0, str(exc)
        # an aggregation may drop persia_job; what keeps it must be this job's
        wrong = sorted({r["metric"]["persia_job"] for r in result if "persia_job" in r["metric"]} - {job_name})
        if wrong:
            note = f"series of {', '.join(wrong)}"
        rows.append(Row(job_name, f"{title}: {expr}", n, n > 0 and not wrong, note, dashboard=True))
    return rows, per_role


def format_table(rows: list[Row], max_check: int = 150) -> list[str]:
    """The table's lines: job, check (cut at ``max_check`` characters), series, ok and any note."""
    width = min(max(len(r.check) for r in rows), max_check)
    job_width = max(3, *(len(r.job) for r in rows))
    lines = [f"{'job':<{job_width}}  {'check':<{width}}  series  ok"]
    for r in rows:
        check_text = r.check if len(r.check) <= width else r.check[:width - 3] + "..."
        lines.append(f"{r.job:<{job_width}}  {check_text:<{width}}  {r.series:>6}  {'ok' if r.ok else 'FAIL'}"
                     + (f"  {r.note}" if r.note else ""))
    return lines


def report(rows: list[Row], per_role: dict[str, dict[str, int]], seen: dict[str, Endpoint], as_json: bool) -> bool:
    print("\n".join(format_table(rows)))
    failed = [r for r in rows if not r.ok]
    print()
    summary: dict[str, Any] = {}
    for job_name, roles_n in per_role.items():
        dashboard = [r for r in rows if r.dashboard and r.job == job_name]
        mine = [e for e in seen.values() if e.job == job_name]
        roles = sorted({e.role for e in mine})
        print(f"{job_name}: dashboard queries with data: {sum(r.ok for r in dashboard)} of {len(dashboard)}; "
              f"endpoints scraped: {len(mine)} ({', '.join(roles)}); series per role: "
              + ", ".join(f"{role} {n}" for role, n in roles_n.items()))
        summary[job_name] = {"dashboard_queries": len(dashboard), "with_data": sum(r.ok for r in dashboard),
                             "endpoints": len(mine), "roles": roles, "series_per_role": roles_n}
    print(f"{len(rows)} checks over {len(per_role)} job(s): "
          + ("all passed" if not failed else f"{len(failed)} FAILED"))
    if as_json:
        print(json.dumps({"jobs": summary, "checks": len(rows),
                          "failed": [{"job": r.job, "check": r.check} for r in failed]}))
    return not failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", default=None, help="the prometheus binary (default: from the PATH)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="jobs run at the same time on one nats-server, each with its own common_config.job_name")
    parser.add_argument("--ps", type=int, default=2, help="PS replicas per job")
    parser.add_argument("--workers", type=int, default=1, help="embedding workers per job")
    parser.add_argument("--nproc", type=int, default=1, help="NN worker ranks per job")
    parser.add_argument("--epochs", type=int, default=5,
                        help="passes over the training split (one takes ~10 s here; Prometheus needs several "
                             "scrapes of the NN worker for its rates)")
    parser.add_argument("--rate-interval", default="10s", help="what $__rate_interval stands for")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the NN workers may take")
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    args = parser.parse_args()
    try:
        names = job_names(args.jobs, uuid.uuid4().hex[:8])
    except ValueError as exc:
        parser.error(str(exc))
    prometheus = args.prometheus or shutil.which("prometheus")
    if prometheus is None or not os.access(prometheus, os.X_OK):
        print(f"prometheus_check: {HOW_TO_INSTALL}", file=sys.stderr)
        return 2
    seen: dict[str, Endpoint] = {}
    jobs: dict[str, Job] = {}
    trained: dict[str, dict[str, Any]] = {}
    rows: list[Row] = []
    per_role: dict[str, dict[str, int]] = {}
    nats = prom = None
    with tempfile.TemporaryDirectory(prefix="prometheus-check-") as tmp:
        tmp_path = Path(tmp)
        sd_path = tmp_path / "targets.json"
        sd_path.write_text("[]")
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": SCRAPE_JOB, "file_sd_configs": [
                {"files": [str(sd_path)], "refresh_interval": "1s"}]}]}))
        prom_url = f"http://127.0.0.1:{free_port()}"
        try:
            prom = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address={prom_url.removeprefix('http://')}"],
                                    stdout=open(tmp_path / "prometheus.log", "wb"), stderr=subprocess.STDOUT)
            wait_ready(prom_url, prom, tmp_path / "prometheus.log")
            nats = start_nats_server()
            start = time.time()
            for job_name in names:
                job_dir = tmp_path / job_name
                job_dir.mkdir()
                # the job named only by common_config.job_name: metrics_config.job_name left out, so
                # persia_job must follow the job's name (not PERSIA's persia_default_jobname)
                cfg = yaml.safe_load((ADULT / "config" / "global_config.yml").read_text())
                cfg["common_config"]["job_name"] = job_name
                cfg["common_config"]["metrics_config"] = {"enable_metrics": True, "port": 0}
                (job_dir / "global_config.yml").write_text(yaml.safe_dump(cfg))
                env = job_env(nats.url, job_name, PERSIA_GLOBAL_CONFIG=str(job_dir / "global_config.yml"),
                              LOG_LEVEL="warning", EPOCHS=str(args.epochs), CURVE_PNG=str(job_dir / "curve.png"))
                del env["PERSIA_JOB_NAME"]  # it would override common_config.job_name
                jobs[job_name] = Job(env, job_dir)
                jobs[job_name].start_roles(ADULT / "train.py", ADULT / "data_loader.py", ps=args.ps,
                                           workers=args.workers, nproc=args.nproc)
            asyncio.run(follow(nats.url, jobs, sd_path, seen, args.timeout))
            for job_name, job in jobs.items():
                if job.procs["nn"].returncode != 0:
                    raise RuntimeError(f"the NN worker of {job_name} exited with {job.procs['nn'].returncode}\n"
                                       f"{job.dump_logs()}")
                # ranks share one log; rank 0 alone evaluates
                trained[job_name] = next(r for r in job.json_results("nn", '{"train_samples"') if "test_auc" in r)
            time.sleep(2)  # the other roles' last figures: two more scrapes
            end = time.time()
            scraped = api(prom_url, "series", [("match[]", f'{{job="{SCRAPE_JOB}"}}'),
                                               ("start", f"{start:.3f}"), ("end", f"{end:.3f}")])
            owned = by_owner(scraped, {t: e.job for t, e in seen.items()})
            for job_name in names:
                job_rows, per_role[job_name] = check(prom_url, job_name, names, owned.get(job_name, []), start, end,
                                                     seen, args.rate_interval, trained[job_name]["test_auc"])
                rows += job_rows
            rows += check_all(prom_url, names, start, end)
        finally:
            for job in jobs.values():
                job.stop_all()
            if prom is not None and prom.poll() is None:
                prom.terminate()
                try:
                    prom.wait(30)
                except subprocess.TimeoutExpired:
                    prom.kill()
                    prom.wait()
            if nats is not None:
                nats.stop()
    for job_name, result in trained.items():
        print(f"{job_name}: {args.ps} PS, {args.workers} embedding worker(s), {args.nproc} NN rank(s), "
              f"{args.epochs} epoch(s); rank 0 trained {result['steps']} steps in {result['train_s']:.1f}s, "
              f"test AUC {result['test_auc']:.4f}")
    print()
    return 0 if report(rows, per_role, seen, args.json) else 1


if __name__ == "__main__":
    sys.exit(main())
