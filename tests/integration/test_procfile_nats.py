"""The Procfile's nats-server line, run as honcho runs it (``sh -c``): the server process runs with the
project's Go garbage-collector settings, and a value from the environment (.env) wins."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from persia_nats.common.cpu_policy import NATS_SERVER_GO_ENV

from tests.natsserver import free_ports, nats_server_binary

ROOT = Path(__file__).resolve().parents[2]


def _nats_line() -> str:
    line = next(x for x in (ROOT / "Procfile").read_text().splitlines() if x.startswith("nats:"))
    return line.split(": ", 1)[1]


def _environ_of_server(tmp_path: Path, extra: dict[str, str]) -> dict[str, str]:
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if k not in NATS_SERVER_GO_ENV}
    env.update(extra, PERSIA_NATS_URL=f"nats://127.0.0.1:{port}",
               PATH=f"{Path(nats_server_binary()).parent}{os.pathsep}{env.get('PATH', '')}")
    (tmp_path / "deploy").symlink_to(ROOT / "deploy")  # the line names deploy/nats.conf and runs/nats
    proc = subprocess.Popen(["sh", "-c", _nats_line()], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, "nats-server exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "nats-server never listened"
                time.sleep(0.05)
        # `exec env ... nats-server`: the shell's process became the server's
        assert Path(f"/proc/{proc.pid}/exe").resolve() == Path(nats_server_binary()).resolve()
        raw = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        return dict(x.decode().split("=", 1) for x in raw if b"=" in x)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads the server's environment from /proc")
@pytest.mark.parametrize("extra", [{}, {"GOGC": "150"}], ids=["defaults", "from-env"])
def test_the_procfile_starts_nats_server_with_the_go_runtime_settings(tmp_path: Path, extra: dict[str, str]) -> None:
    seen = _environ_of_server(tmp_path, extra)
    assert {k: seen.get(k) for k in NATS_SERVER_GO_ENV} == {**NATS_SERVER_GO_ENV, **extra}
