"""The deployments' NATS cluster, run for real: three nodes of deploy/nats-cluster.conf (compose) or of
deploy/k8s/nats.yml's ConfigMap on one host, with passwords from a real deploy/gen-credentials.sh run.

The files are copied unchanged but for what three nodes on one host cannot share: the monitoring
port, the JetStream folder and the route port (the client port is the `-p` flag's). The route URLs
are the deployment's own (nats.env for compose; for k8s, the StatefulSet's env list expanded as the
kubelet does) with only their host:port moved to 127.0.0.1. A fourth server that routes to a node
without the route password, or with a wrong one, is refused and never joins.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
import yaml

from tests.natsserver import NatsServer, free_ports, nats_server_binary, start_nats_server

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
NODE_FILES = ("nats.conf", "nats-jetstream.conf", "nats-auth.conf", "nats-cluster.conf")
K8S_PARAM = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"expected {old!r} once"
    return text.replace(old, new)


@dataclass
class Cluster:
    nodes: list[NatsServer]
    names: list[str]
    http_ports: list[int]
    route_ports: list[int]
    server_env: dict[str, str]  # the passwords the servers read (nats.env / the Secret)


@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("routes") / "credentials"
    r = subprocess.run(["bash", str(DEPLOY / "gen-credentials.sh"), str(folder)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return folder


def _nats_env(credentials: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in (credentials / "nats.env").read_text().splitlines()
                if line and not line.startswith("#"))


def _compose_node_env(credentials: Path, route_ports: list[int]) -> list[dict[str, str]]:
    """What compose gives node i: nats.env whole (env_file), its route URLs moved to this host."""
    env = _nats_env(credentials)
    for i, port in enumerate(route_ports, 1):
        env[f"PERSIA_NATS_ROUTE_{i}"] = _replace_once(env[f"PERSIA_NATS_ROUTE_{i}"], f"@nats{i}:6222",
                                                      f"@127.0.0.1:{port}")
    return [{**env, "NATS_SERVER_NAME": f"nats{i}"} for i in range(1, 4)]


def _k8s_node_env(credentials: Path, route_ports: list[int]) -> list[dict[str, str]]:
    """What the StatefulSet gives pod i: the Secret (envFrom), then its env list in order, each
    $(VAR) expanded from the entries before it; the route URLs moved to this host."""
    secret = yaml.safe_load((credentials / "secret.yml").read_text())["stringData"]
    sts = next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "nats.yml").read_text())
               if d and d["kind"] == "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    envs = []
    for i in range(len(route_ports)):
        env = dict(secret)
        listed: dict[str, str] = {}
        for e in container["env"]:
            source = e.get("valueFrom") or {}
            if "value" in e:
                value = K8S_PARAM.sub(lambda m, listed=listed: listed.get(m.group(1), m.group(0)), e["value"])
            elif "secretKeyRef" in source:
                value = secret[source["secretKeyRef"]["key"]]
            else:
                assert source["fieldRef"]["fieldPath"] == "metadata.name"
                value = f"adult-nats-{i}"
            listed[e["name"]] = value
        for j, port in enumerate(route_ports):
            var = f"PERSIA_NATS_ROUTE_{j + 1}"
            listed[var] = _replace_once(listed[var], f"@adult-nats-{j}.adult-nats-headless:6222", f"@127.0.0.1:{port}")
        envs.append({**env, **listed})
    return envs


def _k8s_files() -> dict[str, str]:
    docs = yaml.safe_load_all((DEPLOY / "k8s" / "nats.yml").read_text())
    cm = next(d for d in docs if d and d["kind"] == "ConfigMap")
    return {name: cm["data"][name] for name in NODE_FILES}


def _compose_files() -> dict[str, str]:
    return {name: (DEPLOY / name).read_text() for name in NODE_FILES}


def _start_cluster(tmp: Path, files: dict[str, str], node_env: Callable[[list[int]], list[dict[str, str]]],
                   names: list[str]) -> Cluster:
    http_ports = free_ports(3)
    route_ports = free_ports(3)
    envs = node_env(route_ports)
    nodes: list[NatsServer] = []
    try:
        for i, env in enumerate(envs):
            folder = tmp / f"node{i}"
            folder.mkdir()
            for name, text in files.items():
                if name == "nats-jetstream.conf":
                    text = _replace_once(text, "http_port: 8222\n", f"http_port: {http_ports[i]}\n")
                    text = _replace_once(text, "store_dir: /data\n", f'store_dir: "{folder}/js"\n')
                elif name == "nats-cluster.conf":
                    text = _replace_once(text, "listen: 0.0.0.0:6222\n", f"listen: 127.0.0.1:{route_ports[i]}\n")
                (folder / name).write_text(text)
            nodes.append(start_nats_server(conf_file=folder / "nats-cluster.conf", env={**os.environ, **env}))
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    server_env = {k: v for k, v in envs[0].items() if k.endswith("_PASSWORD")}
    return Cluster(nodes, names, http_ports, route_ports, server_env)


@pytest.fixture(scope="module", params=["compose", "k8s"])
def cluster(request: pytest.FixtureRequest, credentials: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp(f"cluster-{request.param}")
    if request.param == "compose":
        c = _start_cluster(tmp, _compose_files(), lambda ports: _compose_node_env(credentials, ports),
                           ["nats1", "nats2", "nats3"])
    else:
        c = _start_cluster(tmp, _k8s_files(), lambda ports: _k8s_node_env(credentials, ports),
                           ["adult-nats-0", "adult-nats-1", "adult-nats-2"])
    try:
        yield c
    finally:
        for n in c.nodes:
            n.stop()


def _routez(http_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/routez", timeout=5) as r:
        return json.load(r)


def _route_peers(http_port: int) -> set[str]:
    """The servers a node has a route to, by name (a pair of nodes may hold several pooled routes)."""
    return {r.get("remote_name") or r["remote_id"] for r in _routez(http_port)["routes"]}


def _wait_for_full_mesh(cluster: Cluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        peers = [_route_peers(p) for p in cluster.http_ports]
        if all(peers[i] == set(cluster.names) - {cluster.names[i]} for i in range(3)):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the cluster did not form: each node's routes {peers}")
        time.sleep(0.1)


def test_the_three_nodes_form_a_cluster_with_the_route_password(cluster: Cluster) -> None:
    _wait_for_full_mesh(cluster)


async def _request_across(cluster: Cluster, job: str) -> bytes:
    """An embedding worker on the first node asks a PS on the last one, each under its own user."""
    env = cluster.server_env
    ps = await nats.connect(cluster.nodes[2].url, user="ps", password=env["PERSIA_PS_PASSWORD"],
                           inbox_prefix="_INBOX.ps")
    ew = await nats.connect(cluster.nodes[0].url, user="embedding-worker", password=env["PERSIA_EW_PASSWORD"],
                           inbox_prefix="_INBOX.embedding-worker")
    try:
        subject = f"persia.{job}.ps.0.info"

        async def answer(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b"replica 0 on " + cluster.names[2].encode())

        await ps.subscribe(subject, cb=answer)
        await ps.flush()
        # the subscription reaches the other nodes over the routes a moment after the flush
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            try:
                return (await ew.request(subject, b"", timeout=0.5)).data
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                if asyncio.get_running_loop().time() > deadline:
                    raise
    finally:
        await ew.close()
        await ps.close()


def test_a_role_reaches_another_on_another_node(cluster: Cluster, job_name: str) -> None:
    _wait_for_full_mesh(cluster)
    assert asyncio.run(_request_across(cluster, job_name)) == b"replica 0 on " + cluster.names[2].encode()


@pytest.mark.parametrize("credentials_in_url", ["", "route:pw-wrong0123456789abcdef@"], ids=["none", "wrong"])
def test_a_server_without_the_route_password_is_refused_and_never_joins(
        cluster: Cluster, credentials_in_url: str, tmp_path: Path) -> None:
    _wait_for_full_mesh(cluster)
    client_port, http_port, route_port = free_ports(3)
    conf = tmp_path / "rogue.conf"
    conf.write_text(f"server_name: rogue\nlisten: 127.0.0.1:{client_port}\nhttp: 127.0.0.1:{http_port}\n"
                    f"cluster {{\n  name: persia\n  listen: 127.0.0.1:{route_port}\n"
                    f"  routes: [ nats-route://{credentials_in_url}127.0.0.1:{cluster.route_ports[0]} ]\n}}\n")
    log = tmp_path / "rogue.log"
    with log.open("w") as err:
        proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=err)
    try:
        # the node answers the rogue's route with an authorization error, which the rogue logs
        deadline = time.monotonic() + 20
        while "Route Error 'Authorization Violation'" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"the rogue never heard a refusal:\n{log.read_text()}"
            time.sleep(0.1)
        assert _routez(http_port)["num_routes"] == 0
        for i, port in enumerate(cluster.http_ports):
            assert _route_peers(port) == set(cluster.names) - {cluster.names[i]}
    finally:
        proc.terminate()
        proc.wait(10)
