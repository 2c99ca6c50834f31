"""What the distribution installs: our internals under ``persia_nats``, no generic top-level names,
and torch only where the dense model lives."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: installed name -> folder in the repository
FOLDERS = {"persia": "persia", "persia_nats": "persia_nats", "persia_nats.common": "common",
           "persia_nats.core": "core", "persia_nats.dense": "dense", "persia_nats.services": "services"}
#: modules a PS, embedding worker or data loader host runs; none of them may need torch
TORCHLESS = [
    "persia.launcher", "persia.ctx", "persia.embedding.data", "persia.env", "persia.logger",
    "persia_nats.services.embedding_ps.service", "persia_nats.services.embedding_worker.service",
    "persia_nats.services.data_loader.stream", "persia_nats.services.data_loader.sender",
    "persia_nats.services.data_loader.ctx",
]


def _source_files() -> list[Path]:
    skip = {".venv", "runs", ".git", "build"}
    return [p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts)]


def test_every_package_folder_is_listed_under_its_installed_name():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for name, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert listed == found, f"missing from pyproject: {sorted(found - listed)}; not a folder: {sorted(listed - found)}"


def test_no_module_imports_the_bare_folder_names():
    """``import common`` would work from a checkout and fail once installed (and load a second copy)."""
    offenders = []
    for path in _source_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                          if n.split(".")[0] in ("common", "core", "dense", "services")]
    assert not offenders, "\n".join(offenders)


def test_the_wheel_holds_no_generic_top_level_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=120)
    (wheel,) = tmp_path.glob("persia_nats-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"persia", "persia_nats"}, tops
    for module in ("persia_nats/common/codec.py", "persia_nats/core/store.py", "persia/ctx.py"):
        assert module in names, module
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: torch")]
    assert requires and all("extra == " in line for line in requires), requires


@pytest.mark.parametrize("module", TORCHLESS)
def test_the_roles_without_a_dense_model_import_without_torch(module):
    blocker = ("import sys\n"
               "class NoTorch:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name == 'torch' or name.startswith('torch.'):\n"
               "            raise ImportError('torch is not installed here')\n"
               "sys.meta_path.insert(0, NoTorch())\n"
               f"import {module}\n")
    r = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
