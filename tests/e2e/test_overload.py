"""Bounded under overload: a publisher 10x faster than training keeps every process's memory bounded.

Every role runs as a process: nats-server, and as process groups of their own the PS, the embedding
worker, the NN worker (the launcher and the rank running ``examples/adult-income/train.py``) and
``data-loader --from-stream``, with ``data_loader_config`` ``stream_max_msgs: 200`` and
``max_ack_pending: 32``. After 16 warm-up batches are trained, a nats-py publisher floods the stream
with the adult training split 4 times over (1,020 batches of 128 samples, about 16 KB each) as fast
as the stream takes them: 64 publishes in flight at once, each refused one tried again after 20 ms
(the stream's discard policy "new" refuses a publish beyond 200 messages: those refusals are the
backpressure the publisher feels), then the end marker. A thread samples the RSS of every process
every 0.2 s (``tests/rss.py``), the publisher's event loop samples the stream's message count.

Asserted:

- the publisher is at least 10x faster than training: its rate over the first 200 publishes of the
  flood (training already runs, the stream not yet full, so nothing slows the publisher but its own
  work and the server's) against trained batches/s (the larger of the NN result's steps/train_s and
  the trained notices counted over the flood). Nothing slows training artificially: the batches are
  the example's own, on 2 shared cores. The nats-server runs with the JetStream settings of
  ``deploy/nats-jetstream.conf`` (the default sync interval), not with the test harness's
  ``sync_interval: always``, which the fault tests need to survive SIGKILL and which ties every
  publish to an fsync, making the publisher as slow as the disk (290 to 1,280 publishes/s measured
  here, depending on what else uses the disk);
- every batch is trained once (the NN worker's ``stream_acked`` counter and the trained notices equal
  the batches published), the stream refused publishes and never held more than ``stream_max_msgs``;
- memory does not grow with the backlog: for each process, its peak RSS over the flood is at most its
  RSS early in training (sampled after the warm-up batches are trained, just before the flood) plus a
  margin. The Python roles get ``MARGIN_MB`` (8 MB): they grew by 0 to 1.8 MB in the measured runs,
  while the backlog the stream refused (some 800 batches, 13 MB of payload, more once decoded) would
  exceed it if one of them held it. The nats-server gets ``NATS_MARGIN_MB`` (192 MB): JetStream keeps
  the stream on disk (file storage) with a cache of recent blocks, and a Go process's RSS follows its
  garbage collector, which the project runs at ``GOGC=400`` (``cpu_policy.NATS_SERVER_GO_ENV``, as the
  Procfile does): the heap grows to five times the live heap while the server reads and drops some
  13 MB/s of refused publishes. It grew by 83 to 117 MB in the measured runs (35 to 43 MB at Go's
  default, ``GOGC=100``). That margin only shows the server stays bounded, not that the stream bound
  is what bounds it: with the stream unbounded (``stream_max_msgs`` 100000, the whole flood taken at
  once) it grew by 73 MB (55 MB at ``GOGC=100``), since file storage keeps a backlog on disk. The
  stream bound itself is asserted directly, by its message count.

``OVERLOAD_TRACE=1`` also prints the sampled RSS over time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import nats
import pytest
import yaml
from nats.errors import NoRespondersError, TimeoutError
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from tests.natsserver import start_nats_server
from tests.procs import ADULT, ROOT, job_env, launcher_cmd
from tests.rss import RssSampler, mb

sys.path.insert(0, str(ROOT / "examples" / "clients"))
import publish_stream  # noqa: E402

STREAM_MAX_MSGS = 200
MAX_ACK_PENDING = 32
PASSES = 4
BATCH = 128
CONCURRENCY = 64  # publishes in flight at once
RETRY_S = 0.02  # a refused publish is tried again this soon: the publisher keeps pushing while the stream is full
WARMUP = 16  # batches trained before the flood, so that the flood's rates are measured while training runs
PEAK_WINDOW = 200  # publishes over which the publisher's own rate is measured
MARGIN_MB = 8.0  # the Python roles
NATS_MARGIN_MB = 192.0  # the nats-server (Go): see the module docstring
ROLES = {"ps", "ew", "nn", "nn/train.py", "loader", "nats-server"}


def _payloads() -> list[bytes]:
    rows = publish_stream.read_rows(ADULT / "data" / "adult.data")
    samples = publish_stream.encode(rows, *publish_stream.train_encoding(rows))
    out = []
    for p in range(PASSES):
        random.Random(p).shuffle(samples)
        out += [msgpack.packb(publish_stream.batch_message(samples[i:i + BATCH]), use_bin_type=True)
                for i in range(0, len(samples), BATCH)]
    return out


class Flood:
    """The fast publisher, the stream-count sampler and the trained-notice counter of one run."""

    def __init__(self, url: str, job: str, payloads: list[bytes], nn: subprocess.Popen[bytes]) -> None:
        self.url, self.job, self.payloads, self.nn = url, job, payloads, nn
        self.subject = f"persia.{job}.batches"
        self.attempts: list[float] = []  # when each publish attempt was answered (taken or refused)
        self.refusals = 0
        self.refusal_kinds: set[str] = set()
        self.trained: list[float] = []  # when each trained notice arrived
        self.stream_msgs: list[tuple[float, int]] = []
        self.t_flood = self.t_published = 0.0
        self._sampling = True

    async def run(self, timeout: float) -> None:
        nc = await nats.connect(self.url)
        js = nc.jetstream()
        await nc.subscribe(f"persia.{self.job}.trained", cb=self._on_trained)
        deadline = time.monotonic() + timeout
        while True:  # the data loader creates the stream when it starts
            try:
                await js.stream_info(f"PERSIA_{self.job}")
                break
            except NotFoundError:
                assert time.monotonic() < deadline, "the data loader never created the stream"
                await asyncio.sleep(0.1)
        sampler = asyncio.get_running_loop().create_task(self._sample_stream())
        try:
            for payload in self.payloads[:WARMUP]:
                await self._publish(js, payload)
            while len(self.trained) < WARMUP:
                assert time.monotonic() < deadline and self.nn.poll() is None, "the warm-up batches were not trained"
                await asyncio.sleep(0.05)
            # leave the RSS sampler time for a fresh sample of every process: "early in training"
            await asyncio.sleep(0.5)
            self.t_flood = time.monotonic()
            todo = iter(self.payloads[WARMUP:])

            async def worker() -> None:
                for payload in todo:
                    await self._publish(js, payload)

            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(CONCURRENCY))),
                                   deadline - time.monotonic())
            self.t_published = time.monotonic()
            end_subject = self.subject.replace(".batches", ".stream_end")
            await self._publish(js, msgpack.packb({"v": 1, "end": True}), end_subject)
            while self.nn.poll() is None:
                assert time.monotonic() < deadline, "the NN worker did not finish"
                await asyncio.sleep(0.2)
        finally:
            self._sampling = False
            await sampler
            await nc.drain()

    async def _publish(self, js, payload: bytes, subject: str | None = None) -> None:  # noqa: ANN001
        while True:
            try:
                await js.publish(subject or self.subject, payload, timeout=10)
                self.attempts.append(time.monotonic())
                return
            except APIError as exc:  # the stream is full (discard "new"): refused, the publisher waits
                self.attempts.append(time.monotonic())
                self.refusals += 1
                self.refusal_kinds.add(f"{exc.code} {exc.err_code} {exc.description}")
            except (NoRespondersError, NoStreamResponseError, TimeoutError):
                self.attempts.append(time.monotonic())
            await asyncio.sleep(RETRY_S)

    async def _on_trained(self, msg) -> None:  # noqa: ANN001
        if msgpack.unpackb(msg.data).get("trained"):
            self.trained.append(time.monotonic())

    async def _sample_stream(self) -> None:
        nc = await nats.connect(self.url)
        js = nc.jetstream()
        try:
            while self._sampling:
                info = await js.stream_info(f"PERSIA_{self.job}")
                self.stream_msgs.append((time.monotonic(), info.state.messages))
                await asyncio.sleep(0.2)
        finally:
            await nc.close()


def _start(name: str, args: list[str], env: dict[str, str], logdir: Path) -> subprocess.Popen[bytes]:
    with open(logdir / f"{name}.log", "wb") as log:
        # a process group of its own: the sampler finds the launcher's children through it
        return subprocess.Popen(launcher_cmd(*args), env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for p in procs.values():
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs.values():
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _nn_result(log: str) -> dict:
    for line in reversed(log.splitlines()):
        if line.strip().startswith("{"):
            return json.loads(line)
    raise AssertionError("the NN worker printed no result:\n" + log[-3000:])


def _logs(logdir: Path) -> str:
    return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(logdir.glob("*.log")))


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_publisher_10x_faster_than_training_keeps_every_process_memory_bounded(tmp_path):
    job = "overload"
    cfg = yaml.safe_load((ADULT / "config" / "global_config.yml").read_text())
    cfg["common_config"]["job_name"] = job
    cfg["data_loader_config"] = {"stream_max_msgs": STREAM_MAX_MSGS, "max_ack_pending": MAX_ACK_PENDING}
    config = tmp_path / "global_config.yml"
    config.write_text(yaml.safe_dump(cfg))
    payloads = _payloads()
    # the JetStream settings of deploy/nats-jetstream.conf, its files in the test's directory
    conf = tmp_path / "nats.conf"
    conf.write_text(f'max_payload: 64MB\nmax_pending: 256MB\njetstream {{ store_dir: "{tmp_path / "js"}", '
                    "max_memory_store: 256MB, max_file_store: 10GB }\n")
    server = start_nats_server(conf_file=conf)
    # the NN worker on the CPU even where there is a GPU: there torch's pinned-memory cache and its lazily made
    # CUDA workspaces grow through the first hundred steps (36 MB on an H100), which is not the backlog measured
    env = job_env(server.url, job, PERSIA_GLOBAL_CONFIG=str(config), CURVE_PNG=str(tmp_path / "curve.png"),
                  CUDA_VISIBLE_DEVICES="")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    sampler = None
    try:
        procs["ps"] = _start("ps", ["embedding-parameter-server", "--replica-index", "0", "--replica-size", "1"],
                             env, tmp_path)
        procs["ew"] = _start("ew", ["embedding-worker", "--replica-index", "0", "--replica-size", "1"], env, tmp_path)
        procs["nn"] = _start("nn", ["nn-worker", str(ADULT / "train.py")], env, tmp_path)
        procs["loader"] = _start("loader", ["data-loader", "--from-stream"], env, tmp_path)
        sampler = RssSampler({n: p.pid for n, p in procs.items()}, {"nats-server": server.proc.pid}).start()
        flood = Flood(server.url, job, payloads, procs["nn"])
        try:
            asyncio.run(flood.run(timeout=180))
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_logs(tmp_path)}") from exc
        assert procs["nn"].wait(5) == 0, _logs(tmp_path)
        assert procs["loader"].wait(30) == 0, _logs(tmp_path)
        result = _nn_result((tmp_path / "nn.log").read_text(errors="replace"))
    finally:
        if sampler is not None:
            sampler.stop()
        _stop(procs)
        server.stop()

    total = len(payloads)
    t_done = flood.trained[-1]
    # -- the publisher's own rate against training's
    flood_attempts = [t for t in flood.attempts if t >= flood.t_flood]
    peak_rate = PEAK_WINDOW / (flood_attempts[PEAK_WINDOW - 1] - flood.t_flood)
    attempt_rate = len(flood_attempts) / (flood.t_published - flood.t_flood)
    accept_rate = (total - WARMUP) / (flood.t_published - flood.t_flood)
    train_rate_notices = sum(1 for t in flood.trained if t > flood.t_flood) / (t_done - flood.t_flood)
    train_rate_result = result["steps"] / result["train_s"]
    train_rate = max(train_rate_notices, train_rate_result)
    max_stream = max(n for _, n in flood.stream_msgs)
    # -- memory: early in training against the peak over the flood
    early = sampler.latest(flood.t_flood)
    peak = sampler.peak(flood.t_flood, t_done)
    print(f"\n{total} batches, flood {t_done - flood.t_flood:.1f} s; publisher: first {PEAK_WINDOW} publishes "
          f"at {peak_rate:.0f}/s, {attempt_rate:.0f} attempts/s and {accept_rate:.0f} taken/s over the flood, "
          f"{flood.refusals} refusals {sorted(flood.refusal_kinds)}; training: {train_rate_notices:.0f} batches/s "
          f"over the flood, {train_rate_result:.0f}/s in the NN result ({result['samples_per_s']:.0f} samples/s); "
          f"publisher/training {peak_rate / train_rate:.1f}x; stream held at most {max_stream} messages; "
          f"test AUC {result.get('test_auc', float('nan')):.4f}")
    print(f"{'process':<14}{'early MB':>10}{'peak MB':>10}{'growth MB':>11}{'margin MB':>11}")
    for k in sorted(peak):
        margin = NATS_MARGIN_MB if k == "nats-server" else MARGIN_MB
        print(f"{k:<14}{mb(early.get(k, 0)):>10}{mb(peak[k]):>10}{mb(peak[k] - early.get(k, 0)):>11}{margin:>11.0f}")
    if os.environ.get("OVERLOAD_TRACE"):
        for t, s in sampler.window(flood.t_flood - 1, t_done + 1):
            n = sum(1 for x in flood.trained if x <= t)
            rss = " ".join(f"{k}={mb(v)}" for k, v in sorted(s.items()))
            print(f"{t - flood.t_flood:6.1f} s trained={n:5d} {rss}")

    assert result["counters"]["stream_acked"] == total, result
    assert len(flood.trained) == total, (len(flood.trained), total)
    assert result["train_samples"] == PASSES * 32561, result
    assert flood.refusals > 0, "the stream never refused a publish: no backpressure was exercised"
    assert all("maximum messages exceeded" in k for k in flood.refusal_kinds), flood.refusal_kinds
    assert max_stream <= STREAM_MAX_MSGS, flood.stream_msgs
    assert peak_rate >= 10 * train_rate, (peak_rate, train_rate)
    assert ROLES <= set(early) and ROLES <= set(peak), (early, peak)
    grown = {k: f"{mb(early[k])} -> {mb(peak[k])}" for k in ROLES
             if peak[k] > early[k] + (NATS_MARGIN_MB if k == "nats-server" else MARGIN_MB) * 2**20}
    assert not grown, f"RSS grew beyond its margin during the flood (MB): {grown}"
