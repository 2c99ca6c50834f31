"""Every series a live job exports passes promtool's naming rules and carries its role."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import urllib.request

import pytest
from persia_nats.common import metrics as metrics_mod
from persia_nats.common.config import MetricsConfig, global_config_from_dict
from persia_nats.common.env import Env
from persia_nats.common.errors import StartupError

from tests.integration.helpers import running_job
from tests.promlint import problems

ON = MetricsConfig(enable_metrics=True, job_name="names_test", port=0)


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def promtool(text: str) -> str:
    """``promtool check metrics`` output for ``text`` ("" when clean)."""
    done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    return (done.stdout + done.stderr).strip()


def test_the_rules_catch_what_the_old_names_did_wrong() -> None:
    old = ('# TYPE persia_nn_worker_train_wait_us counter\n'
           'persia_nn_worker_train_wait_us_total{job="j",replica="0"} 5.0\n'
           '# TYPE persia_ps_rows gauge\npersia_ps_rows{job="j",replica="0"} 1.0\n')
    found = problems(old)
    assert "persia_nn_worker_train_wait_us: us is not a base unit (seconds, bytes, ratios)" in found
    assert "persia_ps_rows: no 'role' label" in found
    assert "persia_ps_rows: carries 'job', which Prometheus sets itself" in found


async def test_every_role_of_a_live_job_exports_clean_names(nats_server, job_name) -> None:
    from persia_nats.services.nn_worker.ctx import eval_ctx

    gcfg = global_config_from_dict({"common_config": {"job_name": job_name, "metrics_config": {
        "enable_metrics": True, "job_name": "names_test", "port": 0}}})
    async with running_job(nats_server.url, job_name) as (_, pss, ew):
        servers = [metrics_mod.start_metrics_server(s, ON) for s in (*pss, ew)]
        try:
            def scrape_all() -> dict[str, str]:
                texts = {f"{s.role}-{i}": fetch(m.port) for i, (s, m) in enumerate(zip((*pss, ew), servers,
                                                                                       strict=True))}
                with eval_ctx(env=Env(nats_url=nats_server.url), global_config=gcfg) as ctx:
                    ctx.report(test_auc=0.5)
                    texts["nn-worker"] = fetch(ctx.metrics_server.port)
                return texts

            texts = await asyncio.to_thread(scrape_all)
        finally:
            for server in servers:
                await asyncio.to_thread(server.close)
    for who, text in texts.items():
        assert problems(text) == [], who
        assert "process_resident_memory_bytes" in text, who
    assert "persia_nn_worker_test_auc" in texts["nn-worker"]
    if shutil.which("promtool"):  # the real linter too, where it is installed (Debian: apt-get install prometheus)
        for who, text in texts.items():
            assert promtool(text) == "", who


async def test_a_fixed_port_that_is_taken_is_refused_naming_it(nats_server, job_name) -> None:
    async with running_job(nats_server.url, job_name) as (_, pss, _ew):
        with socket.socket() as taken:
            taken.bind(("0.0.0.0", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(StartupError, match=f"cannot serve metrics on 0.0.0.0:{port} .*--port"):
                metrics_mod.start_metrics_server(pss[0], MetricsConfig(enable_metrics=True, port=port))
