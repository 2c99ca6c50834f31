"""What an operator sees when a role cannot start: one line naming the cause, a non-zero exit.

Every role runs as a real process through the launcher, as honcho or a pod would run it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.natsserver import NatsServer
from tests.procs import ADULT, ROOT, launcher_cmd

CONFIGS = {"PERSIA_GLOBAL_CONFIG": str(ADULT / "config" / "global_config.yml"),
           "PERSIA_EMBEDDING_CONFIG": str(ADULT / "config" / "embedding_config.yml")}

ROLES = {
    "ps": ["embedding-parameter-server"],
    "embedding-worker": ["embedding-worker"],
    "nn-worker": ["nn-worker", str(ADULT / "train.py")],
    "data-loader": ["data-loader", str(ADULT / "data_loader.py")],
    "stream-loader": ["data-loader", "--from-stream"],
    "serve": ["serve", "--model", f"{ADULT / 'model.py'}:DNN", "--checkpoint-dir", "unused"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(url: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERSIA_", "REPLICA_", "RANK", "WORLD_"))}
    return {**env, **CONFIGS, "PERSIA_NATS_URL": url, "PYTHONUNBUFFERED": "1"}


def run(args: list[str], env: dict[str, str], cwd: Path = ROOT, timeout: float = 90) -> tuple[int, list[str]]:
    done = subprocess.run(launcher_cmd(*args), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return done.returncode, (done.stdout + done.stderr).splitlines()


@pytest.mark.slow
def test_every_role_names_the_unreachable_url_in_at_most_three_lines() -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nobody listens there
    env = {**base_env(url), "PERSIA_NATS_CONNECT_TIMEOUT": "2"}
    procs = {name: subprocess.Popen(launcher_cmd(*args), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for name, args in ROLES.items()}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=90)
        lines = out.splitlines()
        assert proc.returncode == 1, (name, out)
        assert len(lines) <= 3, (name, out)
        assert "Traceback" not in out, (name, out)
        assert f"no NATS server at {url}" in lines[-1] and "within 2s" in lines[-1], (name, out)


@pytest.mark.parametrize("url, expected", [("http://127.0.0.1:4222", "scheme 'http'"),
                                           ("nats//127.0.0.1:4222", "is not [nats://]host[:port]")])
def test_a_url_with_a_wrong_scheme_is_refused_at_start(url: str, expected: str) -> None:
    code, lines = run(["embedding-worker"], base_env(url))
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith("persia-launcher: PERSIA_NATS_URL") and expected in lines[0]


def test_version() -> None:
    from persia_nats.common.discovery import project_version

    assert run(["--version"], base_env("nats://127.0.0.1:4222")) == (0, [f"persia-launcher {project_version()}"])


def test_health_names_the_role_that_does_not_answer(nats_server: NatsServer, job_name: str) -> None:
    env = {**base_env(nats_server.url), "PERSIA_JOB_NAME": job_name}
    code, lines = run(["health", "embedding-worker", "--timeout", "1"], env)
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith("unhealthy: embedding-worker 0 (") and "NoResponders" in lines[0]


def test_persias_own_procfile_line_runs(nats_server: NatsServer, job_name: str, tmp_path: Path) -> None:
    """The seed tutorial's PS line, flags as PERSIA writes them, config paths relative to the job's folder."""
    (tmp_path / "config").mkdir()
    for name in ("embedding_config.yml", "global_config.yml"):
        shutil.copy(ADULT / "config" / name, tmp_path / "config" / name)
    env = {**base_env(nats_server.url), "PERSIA_JOB_NAME": job_name, "PYTHONPATH": str(ROOT)}
    del env["PERSIA_GLOBAL_CONFIG"], env["PERSIA_EMBEDDING_CONFIG"]
    ps = subprocess.Popen(
        [sys.executable, "-m", "persia.launcher", "embedding-parameter-server", "--embedding-config",
         "config/embedding_config.yml", "--global-config", "config/global_config.yml", "--replica-index", "0",
         "--replica-size", "3", "--port", "10000"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        health = {**env, "PERSIA_GLOBAL_CONFIG": str(tmp_path / "config" / "global_config.yml")}
        for _ in range(60):  # the PS compiles its kernels before it answers
            code, lines = run(["health", "embedding-parameter-server", "--replica-index", "0", "--timeout", "1"],
                              health, cwd=tmp_path)
            if code == 0 or ps.poll() is not None:
                break
        assert code == 0, (lines, ps.poll())
        assert '"replica_size": 3' in lines[0]
    finally:
        ps.terminate()
        out, _ = ps.communicate(timeout=30)
    assert ps.returncode == 0, out
