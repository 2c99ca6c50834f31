"""The locks under requirements/: what `.ci/bootstrap` and the images install. `.ci/lockcheck.py` is
run on the checkout (as `.ci/run` does) and on copies broken one way each, so that every check it
makes is seen to fail."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCKS = sorted((ROOT / "requirements").glob("*.txt"))


def _lockcheck(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(root / ".ci" / "lockcheck.py"), "--root", str(root), *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "lockcheck.py", tmp_path / ".ci")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copytree(ROOT / "requirements", tmp_path / "requirements")
    return tmp_path


def test_the_locks_agree_with_pyproject() -> None:
    r = _lockcheck(ROOT)
    assert r.returncode == 0, r.stderr


def test_every_lock_is_cpu_only_and_hashed() -> None:
    names = {p.stem for p in LOCKS}
    assert {"base", "nn", "local", "s3", "gcs", "bench", "test", "ci"} <= names
    for path in LOCKS:
        text = path.read_text()
        assert not re.search(r"^(nvidia-|triton|cuda-)", text, re.M), f"{path.name} pins a CUDA package"
        torch = re.findall(r"^torch==(\S+)", text, re.M)
        assert torch in ([], ["2.13.0+cpu"]), f"{path.name}: torch {torch}"


def test_the_test_lock_holds_no_aws_client() -> None:
    """The default test install does not pull the S3 stack (and its narrow botocore pin)."""
    text = (ROOT / "requirements" / "test.txt").read_text()
    for pkg in ("botocore", "aiobotocore", "s3fs", "moto"):
        assert not re.search(rf"^{pkg}==", text, re.M), pkg
    ci = (ROOT / "requirements" / "ci.txt").read_text()
    for pkg in ("s3fs", "moto"):
        assert re.search(rf"^{pkg}==", ci, re.M), f"CI must still run the S3 tests: {pkg}"


def test_a_dependency_changed_without_relocking_is_named(copy: Path) -> None:
    py = copy / "pyproject.toml"
    py.write_text(py.read_text().replace('"msgpack>=1.0"', '"msgpack>=1.0", "rich>=13"'))
    r = _lockcheck(copy)
    assert r.returncode == 1
    assert "pyproject.toml's dependencies changed since the locks were written: run `bash .ci/lock`" in r.stderr
    # restamped by hand (as a careless edit might): the pin itself is then what is missing
    assert _lockcheck(copy, "--stamp").returncode == 0
    r = _lockcheck(copy)
    assert r.returncode == 1 and "requirements/base.txt: rich is required ('rich>=13') but not pinned" in r.stderr


def test_a_pin_outside_the_range_is_named(copy: Path) -> None:
    py = copy / "pyproject.toml"
    py.write_text(py.read_text().replace('"numpy>=1.26"', '"numpy>=99"'))
    _lockcheck(copy, "--stamp")
    r = _lockcheck(copy)
    assert r.returncode == 1
    assert re.search(r"requirements/base.txt: numpy==\S+ does not satisfy 'numpy>=99'", r.stderr), r.stderr


def test_a_cuda_torch_or_an_unhashed_pin_is_named(copy: Path) -> None:
    nn = copy / "requirements" / "nn.txt"
    text = nn.read_text()
    text = text.replace("torch==2.13.0+cpu \\", "torch==2.13.0 \\")
    text += "nvidia-cublas-cu12==12.8.4.1 \\\n    --hash=sha256:" + "0" * 64 + "\n"
    text = re.sub(r"^(msgpack==\S+) \\\n(    --hash=\S+( \\)?\n)+", r"\1\n", text, flags=re.M)
    nn.write_text(text)
    r = _lockcheck(copy)
    assert r.returncode == 1
    assert "requirements/nn.txt: torch==2.13.0, not the CPU build 2.13.0+cpu" in r.stderr
    assert "requirements/nn.txt: pins the CUDA package nvidia-cublas-cu12==12.8.4.1" in r.stderr
    assert "requirements/nn.txt: msgpack has no --hash" in r.stderr


def test_bootstrap_installs_the_lock_without_resolving() -> None:
    boot = (ROOT / ".ci" / "bootstrap").read_text()
    assert "--require-hashes --no-deps -r \"$LOCK\"" in boot
    assert "--no-deps --no-build-isolation -e ." in boot
    assert 'LOCK=${LOCK:-requirements/ci.txt}' in boot
    run = (ROOT / ".ci" / "run").read_text()
    assert run.index("bash .ci/bootstrap") < run.index(".ci/lockcheck.py") < run.index("pytest")
