"""Fault injection on a live job: kill each role with SIGKILL while it trains a published stream.

The harness plays the supervisor (what compose's ``restart:`` or Kubernetes do): it starts every
role as its own process group, publishes the adult training split onto the job's JetStream stream
at a steady rate, and while the job trains it SIGKILLs one role at a time and starts it again. The
NN worker acknowledges a batch only once it is trained and publishes a notice on
``persia.<job>.trained``; an audit stream keeps those notices, so the count survives the kills
(the nats-server's too). At the end it compares the published batches with the trained ones and
the final test AUC with an undisturbed run's.

Used by ``tests/e2e/test_faults.py`` (short) and ``benchmarks/chaos.py`` (longer soak, ``--json``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import nats
import yaml
from nats.js.api import AckPolicy, ConsumerConfig

from tests.natsserver import NatsServer, start_nats_server
from tests.procs import ADULT, ROOT, job_env, launcher_cmd

sys.path.insert(0, str(ROOT / "examples" / "clients"))
import publish_stream  # noqa: E402

ROLES = ("ps", "embedding-worker", "nn-worker", "nats-server")


@dataclass
class Proc:
    name: str
    args: tuple[str, ...]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0


@dataclass
class ChaosJob:
    """Every role of one job as a restartable process group."""

    server: NatsServer
    job: str
    workdir: Path
    ps: int = 2
    ack_wait_s: float = 4.0
    checkpoint_every: int = 20
    checkpoint_every_sec: float = 0.0
    procs: dict[str, Proc] = field(default_factory=dict)
    restarts_on_failure: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = yaml.safe_load((ADULT / "config" / "global_config.yml").read_text())
        cfg["common_config"]["checkpointing_config"] = {
            "checkpoint_dir": str(self.workdir / "checkpoints"), "every_batches": self.checkpoint_every,
            "every_sec": self.checkpoint_every_sec, "keep": 3,
            # a dump request caught by the nats-server's restart is abandoned quickly (the shards are tiny)
            "dump_timeout_sec": 10.0}
        cfg["data_loader_config"] = {"ack_wait_sec": self.ack_wait_s, "max_ack_pending": 32}
        # a request caught by a kill is never answered: the timeout bounds how long that stalls a peer
        cfg["nn_worker_config"]["request_timeout_sec"] = 5.0
        self.config = self.workdir / "global_config.yml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.env = job_env(self.server.url, self.job, PERSIA_GLOBAL_CONFIG=str(self.config))

    def add(self, name: str, *args: str) -> None:
        self.procs[name] = Proc(name, args, self.workdir / f"{name}.log")
        self.start(name)

    def start(self, name: str) -> None:
        p = self.procs[name]
        with open(p.log, "ab") as log:
            log.write(f"\n===== start {p.restarts}\n".encode())
            log.flush()
            # a process group of its own: a kill takes the launcher's children (NN ranks) with it
            p.proc = subprocess.Popen(launcher_cmd(*p.args), env=self.env, cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, name: str) -> None:
        p = self.procs[name]
        assert p.proc is not None
        try:
            os.killpg(p.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.proc.wait(10)

    def restart(self, name: str) -> None:
        self.kill(name)
        self.procs[name].restarts += 1
        self.start(name)

    def start_roles(self) -> None:
        for i in range(self.ps):
            self.add(f"ps{i}", "embedding-parameter-server", "--replica-index", str(i), "--replica-size", str(self.ps))
        self.add("ew0", "embedding-worker", "--replica-index", "0", "--replica-size", "1")
        self.add("nn", "nn-worker", str(ADULT / "train.py"))
        self.add("loader", "data-loader", "--from-stream")

    def supervise(self, until: str, timeout: float, max_restarts: int = 3) -> int:
        """Wait for ``until`` to exit 0, restarting any role that fails meanwhile, as compose's
        ``restart: on-failure`` or Kubernetes would (a role that was starting when the nats-server
        went away may give up and exit 1); returns ``until``'s last exit code."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                code = p.proc.poll() if p.proc is not None else None
                if code is None or (code == 0 and name != until):
                    continue
                if code == 0 or p.restarts >= max_restarts:
                    return code if name == until else self.supervise_failed(name, code)
                self.restarts_on_failure.append(name)
                self.procs[name].restarts += 1
                self.start(name)
            time.sleep(0.2)
        raise TimeoutError(f"{until} did not finish within {timeout}s:\n{self.dump_logs()}")

    def supervise_failed(self, name: str, code: int) -> int:
        raise AssertionError(f"{name} kept failing (last exit {code}):\n{self.dump_logs()}")

    def wait(self, name: str, timeout: float) -> int:
        proc = self.procs[name].proc
        assert proc is not None
        return proc.wait(timeout)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.proc is not None and p.proc.poll() is None:
                try:
                    os.killpg(p.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            if p.proc is None:
                continue
            try:
                p.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait()

    def log(self, name: str) -> str:
        return self.procs[name].log.read_text(errors="replace")

    def nn_result(self) -> dict:
        for line in reversed(self.log("nn").splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError("the NN worker printed no result:\n" + self.log("nn")[-3000:])

    def dump_logs(self, tail: int = 3000) -> str:
        return "\n".join(f"===== {n}\n{self.log(n)[-tail:]}" for n in self.procs)


async def _audit_stream(url: str, job: str) -> None:
    nc = await nats.connect(url)
    await nc.jetstream().add_stream(name=f"AUDIT_{job}", subjects=[f"persia.{job}.trained"])
    await nc.close()


async def _read_audit(url: str, job: str) -> list[dict]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    total = (await js.stream_info(f"AUDIT_{job}")).state.messages
    # no acks: an explicit-ack consumer stops delivering at its default 1000 unacknowledged messages
    sub = await js.pull_subscribe(f"persia.{job}.trained", durable="audit", stream=f"AUDIT_{job}",
                                  config=ConsumerConfig(ack_policy=AckPolicy.NONE))
    notices: list[dict] = []
    while len(notices) < total:
        for m in await sub.fetch(min(256, total - len(notices)), timeout=5):
            notices.append(msgpack.unpackb(m.data))
    await nc.close()
    return notices


class Publisher:
    """Publishes the adult training split ``epochs`` times at ``rate`` batches/s, then the end marker."""

    def __init__(self, url: str, job: str, rate: float, batch_size: int = 128, epochs: int = 1,
                 connect_options: dict[str, str] | None = None, end_connect_options: dict[str, str] | None = None
                 ) -> None:
        self.url, self.job, self.rate = url, job, rate
        self.connect_options = dict(connect_options or {})  # user and password, on a secure server
        # on a secure server only the operator may end the stream (persia.<job>.stream_end)
        self.end_connect_options = None if end_connect_options is None else dict(end_connect_options)
        rows = publish_stream.read_rows(ADULT / "data" / "adult.data")
        samples = publish_stream.encode(rows, *publish_stream.train_encoding(rows))
        import random

        random.Random(0).shuffle(samples)
        self.payloads = [msgpack.packb(publish_stream.batch_message(samples[i:i + batch_size]), use_bin_type=True)
                         for i in range(0, len(samples), batch_size)] * epochs
        self.seqs: list[int] = []

    async def run(self) -> None:
        nc = await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2, **self.connect_options)
        js = nc.jetstream()
        subject = f"persia.{self.job}.batches"
        start = time.monotonic()
        for i, payload in enumerate(self.payloads):
            await asyncio.sleep(max(0.0, start + i / self.rate - time.monotonic()))
            self.seqs.append(await publish_stream.publish_with_retry(js, subject, payload, patience=120))
        end = nc if self.end_connect_options is None else await nats.connect(
            self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2, **self.end_connect_options)
        await publish_stream.publish_with_retry(end.jetstream(), f"persia.{self.job}.stream_end",
                                                msgpack.packb({"v": 1, "end": True}), patience=120)
        if end is not nc:
            await end.drain()
        await nc.drain()


async def _trained_count(url: str, job: str) -> int:
    try:
        nc = await nats.connect(url, connect_timeout=1, allow_reconnect=False)
    except Exception:
        return -1
    try:
        return (await nc.jetstream().stream_info(f"AUDIT_{job}")).state.messages
    except Exception:
        return -1
    finally:
        await nc.close()


def run_job(workdir: Path, job: str, kills: tuple[str, ...], rate: float = 15.0, ps: int = 2,
            timeout: float = 400.0, epochs: int = 1, log=print) -> dict:  # noqa: ANN001
    """One job over a fresh nats-server; kills ``kills`` in turn, spaced over the training.

    The publisher paces the training (the job keeps up with ``rate`` batches/s), so the kills are
    spread in time over the first 80% of the publishing, starting from the first trained batch:
    every kill lands while batches are still coming.

    Returns figures: published, trained (distinct batches with a trained notice), lost, duplicates
    (trained notices beyond the first for a batch), the NN worker's result and the restarts.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    server = start_nats_server()
    chaos = ChaosJob(server, job, workdir, ps=ps)
    publisher = Publisher(server.url, job, rate, epochs=epochs)
    total = len(publisher.payloads)
    events: list[dict] = []
    try:
        asyncio.run(_audit_stream(server.url, job))
        chaos.start_roles()
        pub = subprocess_thread(publisher)
        deadline = time.monotonic() + timeout
        while asyncio.run(_trained_count(server.url, job)) < 1:
            if time.monotonic() > deadline or chaos.procs["nn"].proc.poll() is not None:
                raise AssertionError(f"training did not start:\n{chaos.dump_logs()}")
            time.sleep(0.1)
        started = time.monotonic()
        span = 0.8 * total / rate
        for k, role in enumerate(kills):
            at = started + span * (k + 1) / (len(kills) + 1)
            while time.monotonic() < at:
                if chaos.procs["nn"].proc.poll() is not None:
                    raise AssertionError(f"the NN worker exited early:\n{chaos.dump_logs()}")
                time.sleep(0.05)
            trained_so_far = asyncio.run(_trained_count(server.url, job))
            log(f"kill {role} at {time.monotonic() - started:.1f}s ({trained_so_far} notices)")
            events.append({"role": role, "at_s": round(time.monotonic() - started, 2), "notices": trained_so_far})
            if role == "nats-server":
                server.restart()
            else:
                name = {"ps": "ps0", "embedding-worker": "ew0", "nn-worker": "nn"}[role]
                chaos.restart(name)
        code = chaos.supervise("nn", timeout)
        if code != 0:
            raise AssertionError(f"the NN worker exited with {code}:\n{chaos.dump_logs()}")
        pub.join(60)
        result = chaos.nn_result()
        notices = asyncio.run(_read_audit(server.url, job))
        floor_lagged = chaos.log("loader").count("ack floor (")
    finally:
        chaos.stop_all()
        server.stop()
    trained = Counter(n["seq"] for n in notices if n.get("trained"))
    published = set(publisher.seqs)
    return {"published": len(published), "trained": len(published & set(trained)),
            "lost": len(published - set(trained)), "duplicates": sum(c - 1 for c in trained.values()),
            "redelivered_trained": sum(1 for n in notices if n.get("trained") and n.get("delivered", 1) > 1),
            "given_back": sum(1 for n in notices if not n.get("trained")),
            "auc": result.get("test_auc"), "result": result, "kills": events,
            "restarts": {n: p.restarts for n, p in chaos.procs.items()},
            "restarted_after_failure": chaos.restarts_on_failure,
            # ends the loader settled from the work queue because the consumer's ack floor lagged
            "ack_floor_lagged": floor_lagged}


def subprocess_thread(publisher: Publisher):  # noqa: ANN201
    import threading

    t = threading.Thread(target=lambda: asyncio.run(publisher.run()), daemon=True)
    t.start()
    return t
