"""``python -m persia_nats.services.<role>``: each role starts as ``persia-launcher <subcommand>`` does."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import nats
import pytest
from persia_nats.common.discovery import cluster_status

from tests.procs import ROOT, job_env

ROLES = {"embedding_ps": "embedding-parameter-server", "embedding_worker": "embedding-worker",
         "serving": "serve", "data_loader": "data-loader", "nn_worker": "nn-worker"}


@pytest.mark.parametrize("package, subcommand", sorted(ROLES.items()))
def test_every_role_has_a_python_m_entry_point_with_the_launchers_flags(package, subcommand):
    done = subprocess.run([sys.executable, "-m", f"persia_nats.services.{package}", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"persia-launcher {subcommand}" in done.stdout and "--global-config" in done.stdout


def test_a_bad_flag_exits_2_naming_it():
    done = subprocess.run([sys.executable, "-m", "persia_nats.services.embedding_ps", "--replica-index", "3",
                           "--replica-size", "2"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=job_env("nats://127.0.0.1:1", "unused"))
    assert done.returncode == 2 and "--replica-index 3 must be in 0..1" in done.stderr, done.stderr


async def _listed(url: str, job: str, role: str, present: bool) -> None:
    nc = await nats.connect(url)
    try:
        for _ in range(300):  # about 30 s: a cold start imports torch and numba first
            if any(r["role"] == role for r in await cluster_status(nc, job, 0.2)) == present:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{role} {'never listed' if present else 'still listed'}")
    finally:
        await nc.close()


def test_a_role_started_with_python_m_is_listed_and_drains_on_sigterm(nats_server, job_name, tmp_path):
    log = open(tmp_path / "stream-loader.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "persia_nats.services.data_loader", "--from-stream"], cwd=ROOT,
                            env=job_env(nats_server.url, job_name), stdout=log, stderr=subprocess.STDOUT)
    try:
        asyncio.run(_listed(nats_server.url, job_name, "data-loader", True))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "stream-loader.log").read_text()
        asyncio.run(_listed(nats_server.url, job_name, "data-loader", False))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    assert "data-loader stopped" in (tmp_path / "stream-loader.log").read_text()
