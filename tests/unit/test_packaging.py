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
    "persia_nats.services.data_loader.ctx", "persia_nats.services.embedding_ps.main",
    "persia_nats.services.embedding_worker.main", "persia_nats.services.data_loader.main", "persia.commands",
]


def _source_files() -> list[Path]:
    skip = {".venv", "runs", ".git", "build"}
    return [p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts)]


#: folders of data files only, installed as packages so that setuptools ships them
DATA_PACKAGES = {"persia_nats.data", "persia_nats.data.configs"}
#: the shipped copies (persia_nats/data/...) and the repository files they copy
SHIPPED = {"nats.conf": "deploy/nats.conf", "nats-jetstream.conf": "deploy/nats-jetstream.conf",
           "nats-auth.conf": "deploy/nats-auth.conf", "nats-secure.conf": "deploy/nats-secure.conf",
           "configs/global_config.yml": "deploy/configs/global_config.yml",
           "configs/embedding_config.yml": "deploy/configs/embedding_config.yml",
           "configs/adult_global_config.yml": "examples/adult-income/config/global_config.yml",
           "configs/adult_embedding_config.yml": "examples/adult-income/config/embedding_config.yml"}


def test_every_package_folder_is_listed_under_its_installed_name():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set(DATA_PACKAGES)
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


def test_the_shipped_files_are_copies_of_the_repository_files():
    data = ROOT / "persia_nats" / "data"
    shipped = {str(p.relative_to(data)) for p in data.rglob("*") if p.is_file()}
    assert shipped == set(SHIPPED)
    for name, src in SHIPPED.items():
        assert (data / name).read_bytes() == (ROOT / src).read_bytes(), f"persia_nats/data/{name} differs from {src}"


def test_the_wheel_holds_no_generic_top_level_package(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, text=True, timeout=120)
    # setuptools stops building deprecated forms (the table form of project.license on 2027-02-18)
    assert "Warning" not in built.stdout + built.stderr, built.stdout + built.stderr
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


@pytest.mark.slow  # about 55 s: a venv, pip install, the roles' first numba compile
def test_the_wheel_alone_runs_a_ps_and_an_embedding_worker_without_torch(tmp_path):
    """A fresh venv, `pip install` of the built wheel (its dependencies from the package index, torch
    not among them), then a PS and an embedding worker from that venv, outside any checkout, on the
    shipped configs and a nats-server run with the shipped nats.conf: both answer their health
    checks and serve an ingest and a lookup; the generated Procfile names a config that exists."""
    import os
    import signal
    import time

    from tests.natsserver import nats_server_binary, start_nats_server

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("persia_nats-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    py, launcher = venv / "bin" / "python", venv / "bin" / "persia-launcher"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    outside = tmp_path / "elsewhere"  # no checkout here: nothing but the venv can be imported
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERSIA_", "PYTHON", "REPLICA_", "VIRTUAL_ENV"))}
    probe = subprocess.run([str(py), "-c", "import importlib.util, persia_nats; "
                            "print(importlib.util.find_spec('torch') is None, persia_nats.DATA)"],
                           capture_output=True, text=True, cwd=outside, env=env, timeout=60, check=True)
    no_torch, data = probe.stdout.split()
    assert no_torch == "True", "the wheel pulled torch in"
    data_dir = Path(data)
    assert venv in data_dir.parents  # the installed copy, not the checkout's

    procfile = subprocess.run([str(launcher), "procfile"], capture_output=True, text=True, cwd=outside, env=env,
                              timeout=60, check=True).stdout
    nats_line = next(line for line in procfile.splitlines() if line.startswith("nats:"))
    assert f"-c {data_dir / 'nats.conf'} " in nats_line
    check = subprocess.run([nats_server_binary(), "-t", "-c", str(data_dir / "nats.conf")], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr

    server = start_nats_server(conf_file=data_dir / "nats.conf")
    env.update(PERSIA_NATS_URL=server.url, PERSIA_JOB_NAME=f"wheel{os.getpid()}",
               PERSIA_GLOBAL_CONFIG=str(data_dir / "configs" / "adult_global_config.yml"),
               PERSIA_EMBEDDING_CONFIG=str(data_dir / "configs" / "adult_embedding_config.yml"))
    procs = {}
    try:
        for name, args in (("ps", ["embedding-parameter-server", "--replica-index", "0", "--replica-size", "1"]),
                           ("ew", ["embedding-worker", "--replica-index", "0", "--replica-size", "1"])):
            procs[name] = subprocess.Popen([str(launcher), *args], cwd=outside, env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True)
        for target in ("embedding-parameter-server", "embedding-worker"):
            for _ in range(120):  # until the role is up (numba's first compile included); health asks once
                health = subprocess.run([str(launcher), "health", target, "--timeout", "5"], capture_output=True,
                                        text=True, cwd=outside, env=env, timeout=30)
                if health.returncode == 0 or any(p.poll() is not None for p in procs.values()):
                    break
                time.sleep(0.5)
            assert health.returncode == 0, (health.stdout, health.stderr)
        # an ingest and its lookup, through the embedding worker to the PS, with the installed client code
        client = ("import asyncio, numpy as np\n"
                  "from persia_nats.common.codec import WIRE_VERSION\n"
                  "from persia_nats.common.env import read_env\n"
                  "from persia_nats.common.messages import IdFeature, IngestRequest, embeddings_from_wire\n"
                  "from persia_nats.common.rpc import request\n"
                  "from persia_nats.common.service import connect_from_env\n"
                  "from persia_nats.common.subjects import Subjects\n"
                  "import os\n"
                  "async def main():\n"
                  "    nc = await connect_from_env(read_env(), 'wheel-client', connect_timeout=10)\n"
                  "    s = Subjects(os.environ['PERSIA_JOB_NAME'])\n"
                  # a batch carries every slot of the adult embedding config
                  "    names = ('workclass', 'education', 'marital_status', 'occupation', 'relationship', 'race',"
                  " 'gender', 'native_country')\n"
                  "    fs = tuple(IdFeature(n, np.array([3, 5, 3], np.uint64), np.array([2, 1], np.int32))"
                  " for n in names)\n"
                  "    ref = await request(nc, s.ew_ingest(), IngestRequest(fs, True).to_wire(), 10)\n"
                  "    reply = await request(nc, s.ew_lookup(ref['worker']),"
                  " {'v': WIRE_VERSION, 'ref': ref['ref'], 'train': True}, 10)\n"
                  "    emb = embeddings_from_wire(reply['embeddings'])[0]\n"
                  "    print(emb.emb.shape)\n"
                  "    await nc.close()\n"
                  "asyncio.run(main())\n")
        looked_up = subprocess.run([str(py), "-c", client], capture_output=True, text=True, cwd=outside, env=env,
                                   timeout=60)
        assert looked_up.returncode == 0 and looked_up.stdout.strip() == "(2, 8)", looked_up.stdout + looked_up.stderr
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        logs = {name: proc.communicate(timeout=60)[0] for name, proc in procs.items()}
        server.stop()
    assert all(proc.returncode == 0 for proc in procs.values()), logs
    assert not any("Traceback" in text for text in logs.values()), logs
