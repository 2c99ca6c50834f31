"""A live job scraped by a real Prometheus: every series carries ``role``, every dashboard query returns data?

    .venv/bin/python benchmarks/metrics_live.py [--train-batches 3000] [--json]

Runs the synthetic example as separate processes (nats-server, 2 PS replicas, an embedding worker,
an NN worker, a data loader) with metrics on, each role on a fixed port (``--port``; the NN rank on
``metrics_config.port``), and a ``prometheus`` server (Debian: ``apt-get install prometheus``)
scraping all of them every second under its own ``job="persia"``. While the NN worker trains it
evaluates every query of ``deploy/grafana-dashboard.json`` (``$job`` set to this job,
``$__rate_interval`` to 10s) plus the label checks, and prints one table: query, series returned.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.natsserver import start_nats_server  # noqa: E402
from tests.procs import Job, job_env  # noqa: E402

SYNTHETIC = ROOT / "examples" / "synthetic"
METRICS_JOB = "metrics_live"
CHECKS = {
    "series without a role label": f'count({{persia_job="{METRICS_JOB}", role=""}})',
    "series with exported_job": 'count({exported_job!=""})',
    "roles seen": f'count by (role) ({{persia_job="{METRICS_JOB}"}})',
}


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def dashboard_queries() -> list[str]:
    board = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", []) if t.get("expr")]
    return [e.replace("$job", METRICS_JOB).replace("$__rate_interval", "10s") for e in exprs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-batches", type=int, default=3000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        sys.exit("metrics_live: no prometheus binary on the PATH (Debian: apt-get install prometheus)")
    ps0, ps1, ew, nn, prom_port = free_ports(5)
    nats = start_nats_server()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        cfg = yaml.safe_load((SYNTHETIC / "config" / "global_config.yml").read_text())
        cfg["common_config"]["metrics_config"] = {"enable_metrics": True, "job_name": METRICS_JOB, "port": nn}
        (tmp_path / "global_config.yml").write_text(yaml.safe_dump(cfg))
        targets = [f"127.0.0.1:{p}" for p in (ps0, ps1, ew, nn)]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "persia", "static_configs": [{"targets": targets}]}]}))
        prom = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        env = job_env(nats.url, f"m{uuid.uuid4().hex[:10]}", PERSIA_GLOBAL_CONFIG=str(tmp_path / "global_config.yml"),
                      PERSIA_EMBEDDING_CONFIG=str(SYNTHETIC / "config" / "embedding_config.yml"),
                      TRAIN_BATCHES=str(args.train_batches), LOG_LEVEL="warning")
        job = Job(env, tmp_path)
        try:
            for i, port in enumerate((ps0, ps1)):
                job.start(f"ps{i}", "embedding-parameter-server", "--replica-index", str(i), "--replica-size", "2",
                          "--port", str(port))
            job.start("ew0", "embedding-worker", "--port", str(ew))
            job.start("nn", "nn-worker", str(SYNTHETIC / "train.py"))
            job.start("loader", "data-loader", str(SYNTHETIC / "data_loader.py"))
            results = watch(f"http://127.0.0.1:{prom_port}", job)
        finally:
            job.stop_all()
            prom.terminate()
            prom.wait(30)
            nats.stop()
    report(results, args.json)


def watch(prom: str, job: Job) -> dict[str, int]:
    """Once every query has returned data (or the NN worker ended): series per query."""
    queries = [*CHECKS.values(), *dashboard_queries()]
    counts: dict[str, int] = {}
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(3)
        try:
            counts = {q: sum(1 for _ in query(prom, q)) for q in queries}
            for q in (CHECKS["series without a role label"], CHECKS["series with exported_job"]):
                counts[q] = int(sum(float(r["value"][1]) for r in query(prom, q)))  # the count itself
        except OSError:  # prometheus still starting
            continue
        data = [q for q in dashboard_queries() if counts[q] == 0]
        if not data and counts[CHECKS["roles seen"]] >= 3:
            break
        if job.procs["nn"].poll() is not None:
            raise RuntimeError(f"the NN worker ended before every query had data: {data}\n{job.dump_logs()}")
    counts["roles: " + ", ".join(sorted(r["metric"].get("role", "?") for r in query(prom, CHECKS["roles seen"])))] = 0
    return counts


def report(counts: dict[str, int], as_json: bool) -> None:
    width = max(len(q) for q in counts)
    for q, n in counts.items():
        print(f"{q:<{width}}  {n}")
    dashboard = [q for q in counts if q not in CHECKS.values() and not q.startswith("roles: ")]
    empty = sum(1 for q in dashboard if counts[q] == 0)
    no_role, exported = counts[CHECKS["series without a role label"]], counts[CHECKS["series with exported_job"]]
    print(f"dashboard queries with data: {len(dashboard) - empty} of {len(dashboard)}; "
          f"series without role: {no_role}; with exported_job: {exported}")
    if as_json:
        print(json.dumps({"dashboard_queries": len(dashboard), "with_data": len(dashboard) - empty}))


if __name__ == "__main__":
    main()
