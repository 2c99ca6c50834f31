"""Run the roles of a job as real processes, the way the launcher runs them in production."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ADULT = ROOT / "examples" / "adult-income"


def launcher_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "persia.launcher", *args]


@dataclass
class Job:
    """A set of role processes sharing one environment; stopped with SIGTERM on exit."""

    env: dict[str, str]
    logdir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.logdir / f"{name}.log", "wb")
        proc = subprocess.Popen(launcher_cmd(*args), env={**self.env, **(extra_env or {})}, cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_roles(self, nn_script: Path, loader_script: Path, ps: int = 1, workers: int = 1, nproc: int = 1,
                    loader_args: tuple[str, ...] = (), sparse_env: dict[str, str] | None = None) -> None:
        """PS replicas ps0.., embedding workers ew0.., the NN worker ranks ("nn") and one data loader ("loader");
        ``sparse_env`` is added to the environment of every role but the NN worker's."""
        for i in range(ps):
            self.start(f"ps{i}", "embedding-parameter-server", "--replica-index", str(i), "--replica-size", str(ps),
                       extra_env=sparse_env)
        for i in range(workers):
            self.start(f"ew{i}", "embedding-worker", "--replica-index", str(i), "--replica-size", str(workers),
                       extra_env=sparse_env)
        self.start("nn", "nn-worker", str(nn_script), "--nproc-per-node", str(nproc))
        self.start("loader", "data-loader", str(loader_script), *loader_args, extra_env=sparse_env)

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")

    def wait(self, name: str, timeout: float) -> int:
        return self.procs[name].wait(timeout)

    def json_result(self, name: str) -> dict:
        for line in reversed(self.log(name).splitlines()):
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"{name} printed no JSON result:\n{self.log(name)[-3000:]}")

    def json_results(self, name: str, marker: str = '{"rank"') -> list[dict]:
        """Every JSON object in the log that starts with ``marker``: ranks share one log, and two ranks'
        last lines can run together on one line."""
        text, decoder, out, start = self.log(name), json.JSONDecoder(), [], 0
        while (i := text.find(marker, start)) >= 0:
            obj, start = decoder.raw_decode(text, i)
            out.append(obj)
        return out

    def stop_all(self, timeout: float = 30) -> dict[str, int]:
        codes = {}
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes

    def dump_logs(self) -> str:
        return "\n".join(f"===== {n}\n{self.log(n)[-4000:]}" for n in self.procs)


def job_env(nats_url: str, job_name: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERSIA_", "REPLICA_", "RANK", "WORLD_SIZE"))}
    env.update(
        PERSIA_NATS_URL=nats_url,
        PERSIA_JOB_NAME=job_name,
        PERSIA_GLOBAL_CONFIG=str(ADULT / "config" / "global_config.yml"),
        PERSIA_EMBEDDING_CONFIG=str(ADULT / "config" / "embedding_config.yml"),
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
        LOG_LEVEL="info",
    )
    env.update(extra)
    return env


def write_global_config(path: Path, embedding_worker_config: dict[str, object] | None = None, *,
                        base: Path = ADULT / "config" / "global_config.yml",
                        embedding_parameter_server_config: dict[str, object] | None = None,
                        **nn_worker_config: object) -> Path:
    """``base`` (the adult example's global_config.yml) with ``nn_worker_config`` (and
    ``embedding_worker_config``, ``embedding_parameter_server_config``) keys replaced."""
    import yaml

    cfg = yaml.safe_load(base.read_text())
    cfg.setdefault("nn_worker_config", {}).update(nn_worker_config)
    cfg.setdefault("embedding_worker_config", {}).update(embedding_worker_config or {})
    cfg.setdefault("embedding_parameter_server_config", {}).update(embedding_parameter_server_config or {})
    path.write_text(yaml.safe_dump(cfg))
    return path


def logged_figure(text: str, event: str, key: str) -> int:
    """The last ``key=N`` on a log line containing ``event``."""
    import re

    values = [int(m.group(1)) for line in text.splitlines() if event in line
              for m in [re.search(rf"\b{key}=(\d+)", line)] if m]
    if not values:
        raise AssertionError(f"no {key}= on a '{event}' line in:\n{text[-3000:]}")
    return values[-1]
