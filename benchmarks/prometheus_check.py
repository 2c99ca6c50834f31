"""A live job scraped by a real Prometheus: every role's series carry ``role``, every dashboard query returns data?

    .venv/bin/python benchmarks/prometheus_check.py [--ps 2] [--workers 1] [--nproc 1] [--epochs 5] [--json]

Runs the adult-income example as separate processes (a nats-server, ``--ps`` PS replicas,
``--workers`` embedding workers, an NN worker with ``--nproc`` ranks, a data loader) with metrics on
at port 0, so each role serves on a free port and announces it as ``metrics_port`` in its ``$SRV``
metadata (``--epochs`` passes over the data, so that the NN worker trains through several scrapes).
Several times a second the script reads ``$SRV.INFO`` and adds the endpoints it finds to a
``file_sd`` file, which a real ``prometheus`` (Debian: ``apt-get install prometheus``; or
``--prometheus PATH``) scrapes every second under its own ``job`` label. When the NN worker has
finished (trained, evaluated, reported its test AUC), it asks Prometheus's HTTP API (a healthy job
refuses nothing, so the script sends PS 0 one malformed lookup for the refusals panel to show):

- every series scraped from the job (Prometheus's own ``up`` and ``scrape_*`` aside) carries
  ``role``, none carries ``exported_job`` or ``exported_instance``, and every discovered endpoint
  was scraped at least once;
- the held-out AUC rank 0 reports as its evaluation ends is in Prometheus, equal to the one it printed;
- every query of ``deploy/grafana-dashboard.json`` (``$persia_job`` set to this job, ``$__rate_interval``
  to ``--rate-interval``) returns data at some point of the run (``/api/v1/query_range``, one step
  a second), and the dashboard's ``$persia_job`` variable lists this job.

It prints one table (check, series, ok) and a summary, and exits 1 if any check failed (2 when
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


def label_problems(series: list[dict[str, str]]) -> tuple[list[str], dict[str, int]]:
    """(problems, series per role) for the label sets of a scrape job's series.

    Prometheus's synthetic ``up`` and ``scrape_*`` series are skipped: they carry only the target's
    ``job`` and ``instance``. Each problem names one metric and what is wrong with it.
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
    return sorted(problems), dict(sorted(per_role.items()))


def file_sd(targets: dict[str, str]) -> list[dict[str, Any]]:
    """A ``file_sd_configs`` file's content for ``{host:port: role}``: one group, no extra labels, so
    that ``role`` on a series can only come from the target itself."""
    return [{"targets": sorted(targets), "labels": {}}] if targets else []


# -- the run --------------------------------------------------------------------------------------


@dataclass
class Row:
    check: str
    series: int
    ok: bool
    note: str = ""
    dashboard: bool = False


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


async def follow(nats_url: str, job_name: str, job: Job, sd_path: Path, seen: dict[str, str],
                 timeout: float) -> None:
    """Until the NN worker exits: add every metrics endpoint ``$SRV`` announces to ``sd_path``
    (``seen``: ``host:port -> role``), polling twice a second, and send PS 0 one malformed lookup.

    Endpoints stay in the file after their instance deregisters: an NN rank's evaluation context
    lives for a second or two, and deregisters before its final scrape.
    """
    import nats
    from nats.errors import NoRespondersError
    from persia_nats.common.discovery import discover
    from persia_nats.common.subjects import Subjects

    nc = await nats.connect(nats_url, name="prometheus-check")
    refused = False
    try:
        deadline = time.monotonic() + timeout
        while job.procs["nn"].poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the NN worker did not finish within {timeout:g}s\n{job.dump_logs()}")
            instances = await discover(nc, job_name, None, 0.3)
            live = {f"127.0.0.1:{i['metadata']['metrics_port']}": i["role"]
                    for i in instances if i["metadata"].get("metrics_port")}
            if live.keys() - seen.keys():
                seen.update(live)
                write_atomic(sd_path, json.dumps(file_sd(seen)))
            if not refused and any(i["role"] == "embedding-parameter-server" and i["replica_index"] == 0
                                   for i in instances):
                # a healthy job refuses nothing, and the refusals panel would have no series to show
                try:
                    await nc.request(Subjects(job_name).ps(0, "lookup"), b"\xc1 not msgpack", timeout=10)
                    refused = True
                except NoRespondersError:  # registered a moment before it subscribed: next round
                    pass
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


def check(prom: str, job_name: str, start: float, end: float, seen: dict[str, str],
          rate_interval: str, test_auc: float) -> tuple[list[Row], dict[str, int]]:
    rows: list[Row] = []
    window = [("start", f"{start:.3f}"), ("end", f"{end:.3f}")]
    series = api(prom, "series", [("match[]", f'{{job="{SCRAPE_JOB}"}}'), *window])
    problems, per_role = label_problems(series)
    named = [s for s in series if not SYNTHETIC.fullmatch(s.get("__name__", ""))]
    rows.append(Row("every series carries role, none exported_job/_instance", len(named), not problems,
                    "; ".join(problems[:5])))
    up = api(prom, "query_range", [("query", f'up{{job="{SCRAPE_JOB}"}} == 1'), *window, ("step", "1")])["result"]
    scraped = {r["metric"]["instance"] for r in up}
    missed = sorted(set(seen) - scraped)
    rows.append(Row(f"every endpoint found in $SRV scraped ({len(seen)})", len(scraped), bool(seen) and not missed,
                    ", ".join(f"{t} ({seen[t]})" for t in missed)))
    # reported as eval_ctx ends: in Prometheus only if the rank waited for a last scrape
    auc = api(prom, "query", [("query", f'last_over_time(persia_nn_worker_test_auc{{persia_job="{job_name}"}}[1h])'),
                              ("time", f"{end:.3f}")])["result"]
    got = [float(r["value"][1]) for r in auc]
    rows.append(Row(f"test AUC in Prometheus is the NN worker's ({test_auc:.6f})", len(got),
                    len(got) == 1 and abs(got[0] - test_auc) < 1e-9, ", ".join(f"{g:.6f}" for g in got)))
    values = api(prom, "label/persia_job/values", [("match[]", "persia_requests_total"), *window])
    rows.append(Row("dashboard variable $persia_job lists this job", len(values), job_name in values))
    board = json.loads(DASHBOARD.read_text())
    for title, expr in dashboard_queries(board, job_name, rate_interval):
        try:
            n, note = len(api(prom, "query_range", [("query", expr), *window, ("step", "1")])["result"]), ""
        except RuntimeError as exc:
            n, note = 0, str(exc)
        rows.append(Row(f"{title}: {expr}", n, n > 0, note, dashboard=True))
    return rows, per_role


def report(rows: list[Row], per_role: dict[str, int], seen: dict[str, str], as_json: bool) -> bool:
    width = min(max(len(r.check) for r in rows), 150)
    print(f"{'check':<{width}}  series  ok")
    for r in rows:
        check_text = r.check if len(r.check) <= width else r.check[:width - 3] + "..."
        print(f"{check_text:<{width}}  {r.series:>6}  {'ok' if r.ok else 'FAIL'}{'  ' + r.note if r.note else ''}")
    dashboard = [r for r in rows if r.dashboard]
    failed = [r for r in rows if not r.ok]
    roles = sorted(set(seen.values()))
    print(f"\ndashboard queries with data: {sum(r.ok for r in dashboard)} of {len(dashboard)}; "
          f"endpoints scraped: {len(seen)} ({', '.join(roles)}); series per role: "
          + ", ".join(f"{role} {n}" for role, n in per_role.items()))
    print("all checks passed" if not failed else f"{len(failed)} check(s) FAILED")
    if as_json:
        print(json.dumps({"dashboard_queries": len(dashboard), "with_data": sum(r.ok for r in dashboard),
                          "endpoints": len(seen), "roles": roles, "series_per_role": per_role,
                          "failed": [r.check for r in failed]}))
    return not failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", default=None, help="the prometheus binary (default: from the PATH)")
    parser.add_argument("--ps", type=int, default=2, help="PS replicas")
    parser.add_argument("--workers", type=int, default=1, help="embedding workers")
    parser.add_argument("--nproc", type=int, default=1, help="NN worker ranks")
    parser.add_argument("--epochs", type=int, default=5,
                        help="passes over the training split (one takes ~10 s here; Prometheus needs several "
                             "scrapes of the NN worker for its rates)")
    parser.add_argument("--rate-interval", default="10s", help="what $__rate_interval stands for")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the NN worker may take")
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    args = parser.parse_args()
    prometheus = args.prometheus or shutil.which("prometheus")
    if prometheus is None or not os.access(prometheus, os.X_OK):
        print(f"prometheus_check: {HOW_TO_INSTALL}", file=sys.stderr)
        return 2
    job_name = f"promcheck{uuid.uuid4().hex[:8]}"
    seen: dict[str, str] = {}
    nats = prom = job = None
    with tempfile.TemporaryDirectory(prefix="prometheus-check-") as tmp:
        tmp_path = Path(tmp)
        sd_path = tmp_path / "targets.json"
        sd_path.write_text("[]")
        cfg = yaml.safe_load((ADULT / "config" / "global_config.yml").read_text())
        cfg["common_config"]["metrics_config"] = {"enable_metrics": True, "job_name": job_name, "port": 0}
        (tmp_path / "global_config.yml").write_text(yaml.safe_dump(cfg))
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
            env = job_env(nats.url, job_name, PERSIA_GLOBAL_CONFIG=str(tmp_path / "global_config.yml"),
                          LOG_LEVEL="warning", EPOCHS=str(args.epochs), CURVE_PNG=str(tmp_path / "curve.png"))
            job = Job(env, tmp_path)
            start = time.time()
            job.start_roles(ADULT / "train.py", ADULT / "data_loader.py", ps=args.ps, workers=args.workers,
                            nproc=args.nproc)
            asyncio.run(follow(nats.url, job_name, job, sd_path, seen, args.timeout))
            if job.procs["nn"].returncode != 0:
                raise RuntimeError(f"the NN worker exited with {job.procs['nn'].returncode}\n{job.dump_logs()}")
            # ranks share one log; rank 0 alone evaluates
            trained = next(r for r in job.json_results("nn", '{"train_samples"') if "test_auc" in r)
            time.sleep(2)  # the other roles' last figures: two more scrapes
            rows, per_role = check(prom_url, job_name, start, time.time(), seen, args.rate_interval,
                                   trained["test_auc"])
        finally:
            if job is not None:
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
    print(f"job: {args.ps} PS, {args.workers} embedding worker(s), {args.nproc} NN rank(s), {args.epochs} epoch(s); "
          f"rank 0 trained {trained['steps']} steps in {trained['train_s']:.1f}s, test AUC {trained['test_auc']:.4f}\n")
    return 0 if report(rows, per_role, seen, args.json) else 1


if __name__ == "__main__":
    sys.exit(main())
