"""Day-2 use of a running job from a shell: JSON logs a collector can read line by line, and the
launcher's read-only commands piped into ``head`` (real nats-server, roles as real processes)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import nats
import yaml
from persia_nats.common.discovery import cluster_status

from tests.integration.helpers import running_job
from tests.procs import ROOT, job_env, launcher_cmd


async def _listed(url: str, job: str, role: str) -> None:
    nc = await nats.connect(url)
    try:
        for _ in range(300):  # about 30 s: a cold start compiles or loads the numba kernels first
            if any(r["role"] == role for r in await cluster_status(nc, job, 0.2)):
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{role} never listed")
    finally:
        await nc.close()


def _json_lines(text: str) -> list[dict]:
    """Every line of ``text`` as a JSON object; any other line fails, naming it."""
    lines = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"not a JSON line: {line!r}\nin:\n{text[-3000:]}") from None
        assert isinstance(obj, dict) and isinstance(obj.get("event"), str) and obj.get("level"), line
        lines.append(obj)
    return lines


def _run_until_listed_then_stop(env: dict[str, str], log: Path, role: str, *args: str) -> int:
    with open(log, "wb") as out:
        proc = subprocess.Popen(launcher_cmd(*args), env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        asyncio.run(_listed(env["PERSIA_NATS_URL"], env["PERSIA_JOB_NAME"], role))
        proc.send_signal(signal.SIGTERM)
        return proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_in_json_mode_every_line_of_a_ps_is_json_and_its_figures_are_fields(nats_server, job_name, tmp_path):
    config = tmp_path / "global_config.yml"
    # a key of PERSIA's that does nothing here: the config loader warns through logging
    config.write_text(yaml.safe_dump({"common_config": {"job_name": job_name, "num_embedding_io_workers": 4},
                                      "embedding_parameter_server_config": {"capacity": 1000}}))
    # a variable of PERSIA's that nothing reads: the launcher warns before logging is set up
    env = job_env(nats_server.url, job_name, PERSIA_GLOBAL_CONFIG=str(config), PERSIA_LOG_FORMAT="json",
                  PERSIA_CKPT_DIR=str(tmp_path / "ckpt"))
    code = _run_until_listed_then_stop(env, tmp_path / "ps.log", "embedding-parameter-server",
                                       "embedding-parameter-server", "--replica-index", "0", "--replica-size", "1")
    lines = _json_lines((tmp_path / "ps.log").read_text())
    assert code == 0, lines
    events = [line["event"] for line in lines]
    assert any(line.get("logger") == "persia-launcher" and "PERSIA_CKPT_DIR" in line["event"]
               and line["level"] == "warning" for line in lines), events
    assert any("num_embedding_io_workers" in e for e in events), events
    stopped = [line for line in lines if line["event"] == "embedding-parameter-server stopped"]
    assert len(stopped) == 1, events
    # the figures are fields with their types, and none is left in the message
    assert stopped[0]["rows"] == 0 and stopped[0]["configured"] is False and stopped[0]["role"] == "ps"
    assert all("=" not in e for e in events if "stats" in e or "stopped" in e), events


def test_in_json_mode_the_stream_loaders_last_line_is_json_too(nats_server, job_name, tmp_path):
    env = job_env(nats_server.url, job_name, PERSIA_LOG_FORMAT="json")
    code = _run_until_listed_then_stop(env, tmp_path / "loader.log", "data-loader", "data-loader", "--from-stream")
    lines = _json_lines((tmp_path / "loader.log").read_text())
    assert code == 0, lines
    last = lines[-1]
    assert last["event"] == "stream loader 0 stopped:" and last["logger"] == "persia-launcher", last
    assert last.get("forwarded", 0) == 0 and "{" not in last["event"], last


def test_in_json_mode_a_config_error_is_one_json_line(tmp_path):
    config = tmp_path / "global_config.yml"
    config.write_text("common_config: {job_name: 'a.b'}\nnn_worker_config: {staleness: 3}\n")
    env = job_env("nats://127.0.0.1:1", "unused", PERSIA_GLOBAL_CONFIG=str(config), PERSIA_LOG_FORMAT="json")
    done = subprocess.run(launcher_cmd("embedding-parameter-server", "--replica-index", "0", "--replica-size", "1"),
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done
    (line,) = _json_lines(done.stderr)
    assert line["level"] == "error" and line["event"].startswith(f"2 errors in {config}:"), line


def test_in_json_mode_warnings_and_uncaught_exceptions_are_json_lines(tmp_path):
    code = ("import logging, threading, warnings\n"
            "from persia_nats.common.logs import configure_logging, figures\n"
            "configure_logging('info', role='ps', replica=0)\n"
            "warnings.warn('a library warns')\n"
            "logging.getLogger('x').info('stats', extra=figures({'rows': 3, 'name': 'n', 'message': 'm'}))\n"
            "t = threading.Thread(target=lambda: 1 / 0)\nt.start()\nt.join()\n"
            "raise KeyError('the end')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PERSIA_LOG_FORMAT": "json"})
    assert done.returncode == 1
    warned, stats, thread, uncaught = _json_lines(done.stderr)
    assert "UserWarning: a library warns" in warned["event"] and warned["level"] == "warning"
    # figures keep their types; names a log record keeps for itself get an underscore
    assert (stats["rows"], stats["name_"], stats["message_"]) == (3, "n", "m")
    assert thread["level"] == "critical" and "ZeroDivisionError" in thread["exception"]
    assert uncaught["event"] == "uncaught KeyError" and "KeyError: 'the end'" in uncaught["exception"]


# -- SIGPIPE ---------------------------------------------------------------------------------------


def _with_reader_gone(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run the launcher with its stdout a pipe whose reader has already gone (``| head`` that exited)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.Popen(launcher_cmd(*args), env=env, cwd=ROOT, stdout=write, stderr=subprocess.PIPE,
                                text=True)
    finally:
        os.close(write)
    _, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err)


async def test_status_and_health_piped_into_head_say_nothing_of_a_broken_pipe(nats_server, job_name):
    env = job_env(nats_server.url, job_name)
    async with running_job(nats_server.url, job_name, replicas=1):
        head = await asyncio.to_thread(
            subprocess.run, ["bash", "-o", "pipefail", "-c", " ".join([*launcher_cmd("status", "--wait", "0.5"),
                                                                         "| head -1"])],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert head.stdout.split()[:2] == ["role", "replica"] and head.stderr == "", head
        for args in (("status", "--wait", "0.5"), ("status", "--json", "--wait", "0.5"),
                     ("health", "embedding-parameter-server", "--replica-index", "0")):
            gone = await asyncio.to_thread(_with_reader_gone, env, *args)
            # what a command killed by SIGPIPE reports, and no traceback
            assert gone.returncode == 128 + signal.SIGPIPE and gone.stderr == "", (args, gone.stderr)


async def test_checkpoint_says_what_it_waits_for_when_rank_0_takes_none(nats_server, job_name, monkeypatch):
    """A rank 0 that never reaches a step boundary (its script not iterating its DataLoader): the command
    says what it waits for once the answer is slow, and why it failed at its timeout."""
    from persia_nats.common.subjects import Subjects
    from persia_nats.services.nn_worker.runtime import NNRuntime

    import persia.commands
    import persia.launcher

    nc = await nats.connect(nats_server.url)
    rt = NNRuntime.build(nc, Subjects(job_name), rank=0, world_size=1, timeout=5, incoming_limit=4,
                         checkpoint_enabled=True)
    await rt.start()
    monkeypatch.setattr(persia.commands, "CHECKPOINT_NOTICE_S", 1.0)  # the same process: the notice's bound

    def ask() -> tuple[int, str, float]:
        import contextlib
        import io
        import time

        err = io.StringIO()
        started = time.monotonic()
        with contextlib.redirect_stderr(err), monkeypatch.context() as env:
            env.setenv("PERSIA_NATS_URL", nats_server.url)
            env.setenv("PERSIA_JOB_NAME", job_name)
            code = persia.launcher.main(["checkpoint", "--timeout", "3"])
        return code, err.getvalue(), time.monotonic() - started

    try:
        code, err, took = await asyncio.to_thread(ask)
    finally:
        await rt.close()
        await nc.close()
    # the command's own lines (a logging handler an earlier test set up may write here too)
    notice, failed = [line for line in err.splitlines() if line.startswith("persia-launcher: ")]
    assert code == 1 and took < 10
    assert notice == (f"persia-launcher: waiting up to 3 s for the checkpoint: NN rank 0 of job '{job_name}' takes it "
                      "at its next training step, or at once while it waits for batches")
    assert failed.startswith("persia-launcher: checkpoint failed: no checkpoint within 3 s (")
    assert failed.endswith("the training script is not iterating its DataLoader")
