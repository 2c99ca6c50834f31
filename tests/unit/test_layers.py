"""The tower of layers of ``persia_nats`` and ``persia``, bottom first; a module may import from its
own layer and the layers below it, never from one above:

1. ``base``: the NATS-free half of ``common`` (:data:`BASE`: what a message, a config, a subject, a
   process's identity and settings and a checkpoint file are), and ``persia_nats`` itself;
2. ``core``: the maths, with no NATS and no torch (the PS table, optimizers, batch plans and pooling,
   a looked-up batch's forward transform and its adjoint, float16 packing, sharding, stacked rows);
3. ``common``: the rest of ``common``, the NATS half (rpc, service, discovery, metrics, health, acks,
   the roles' shared launch plumbing);
4. ``dense``: the torch side the NN worker and serving share;
5. ``roles``: ``services`` (one package per role, its entry point and composition root in its
   ``main``), no role reaching into another's package;
6. ``persia``: the user API and PERSIA's command line, imported by nothing inside ``persia_nats``.

Beside the order, what each layer must not load from outside: ``base`` and ``core`` neither NATS nor
torch, ``common`` no torch, ``dense`` no NATS. Every import statement counts, lazy and
``TYPE_CHECKING`` ones too, and for the outside names so does what the imported module imports in turn.
A module of ``common`` not named in :data:`BASE` is in the NATS half: naming it there moves it down,
and the rules then hold it to the base's imports."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: installed name -> folder in the repository (as pyproject's package-dir maps them)
FOLDERS = {"persia": "persia", "persia_nats": "persia_nats", "persia_nats.common": "common",
           "persia_nats.core": "core", "persia_nats.dense": "dense", "persia_nats.services": "services"}
#: the NATS-free half of common, the bottom of the tower (each name with its submodules)
BASE = tuple(f"persia_nats.common.{m}" for m in (
    "batch", "bridge", "checkpoint", "chunking", "codec", "config", "config_schema", "cpu_policy", "env", "errors",
    "logs", "malloc", "messages", "optim_config", "permissions", "settings", "storage", "subjects", "taskdump",
))
#: packages that are base themselves, without their submodules (``persia_nats.data_file``; an empty ``__init__``)
BASE_PACKAGES = ("persia_nats", "persia_nats.common")
#: the tower, bottom first: layer -> the names of its modules (each with its submodules; the most
#: specific name a module falls under decides its layer)
LAYERS = {
    "base": BASE,
    "core": ("persia_nats.core",),
    "common": ("persia_nats.common",),
    "dense": ("persia_nats.dense",),
    "roles": ("persia_nats.services",),
    "persia": ("persia",),
}
RANK = {layer: i for i, layer in enumerate(LAYERS)}
#: layer -> what it must not load from outside the tower, directly or through any module of ours it imports
FORBIDDEN = {
    "base": ("nats", "torch"),
    "core": ("nats", "torch"),
    "common": ("torch",),
    "dense": ("nats",),
}


def _modules() -> dict[str, Path]:
    """Every module of ours, by its installed name."""
    out = {}
    for name, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((name, *parts))] = path
    return out


MODULES = _modules()


@functools.cache
def _imports(module: str) -> frozenset[tuple[str, int]]:
    """(imported name, line) of every import statement in ``module``; ``from x import y`` gives
    ``x.y`` (a submodule or a name in ``x``: both are checked against the prefixes)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(a.name, node.lineno) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found |= {(f"{base}.{a.name}", node.lineno) for a in node.names}
            found.add((base, node.lineno))
    return frozenset(found)


def _ours(name: str) -> str | None:
    """The module of ours that importing ``name`` loads last (``x.y`` may name ``y`` inside ``x``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _layer(module: str) -> str:
    """The layer of a module of ours: the layer of the most specific name it falls under."""
    if module in BASE_PACKAGES:
        return "base"
    found = [(len(name), layer) for layer, names in LAYERS.items() for name in names if _under(module, name)]
    assert found, f"{module} is in no layer: add it to LAYERS"
    return max(found)[1]


def _role(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["persia_nats", "services"] else None


def _reaches(start: str, banned: tuple[str, ...]) -> list[str]:
    """Import chains from ``start`` to a banned name, through modules of ours."""
    chains, seen, todo = [], {start}, [(start, [start])]
    while todo:
        module, chain = todo.pop()
        for name, line in sorted(_imports(module)):
            hit = next((b for b in banned if _under(name, b)), None)
            if hit is not None:
                chains.append(" -> ".join(chain) + f" -> {name} (line {line})")
                continue
            ours = _ours(name)
            if ours is not None and ours not in seen:
                seen.add(ours)
                todo.append((ours, [*chain, ours]))
    return chains


def test_the_walk_sees_the_imports_it_checks():
    """A walk that found nothing would pass every rule below."""
    assert "persia_nats.core.store" in MODULES and "persia_nats.services.nn_worker.ctx" in MODULES
    names = {n for n, _ in _imports("persia_nats.services.nn_worker.ctx")}
    assert "torch" in names and "persia_nats.dense.tensors.embedding_tensors" in names
    assert _reaches("persia_nats.services.embedding_ps.service", ("nats",))
    assert _reaches("persia_nats.services.nn_worker.ctx", ("persia_nats.core.optim",))


def test_no_role_imports_another_roles_package():
    offenders = []
    for module in MODULES:
        role = _role(module)
        if role is None:
            continue
        for name, line in _imports(module):
            ours = _ours(name) or ""
            other = _role(ours)
            if other is not None and other != role:
                offenders.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {ours}")
    assert not offenders, "a role imports another role's package:\n" + "\n".join(sorted(set(offenders)))


def test_no_module_imports_another_modules_private_names():
    """A name one module needs from another is part of that module's API, and named so."""
    offenders = []
    for module, path in MODULES.items():
        for name, line in _imports(module):
            ours = _ours(name)
            private = name.rpartition(".")[2].startswith("_")
            if ours is not None and ours != module and private and name != ours + ".__version__":
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not offenders, "\n".join(sorted(offenders))


def test_every_module_has_a_layer_and_every_base_name_a_module():
    assert {_layer(m) for m in MODULES} == set(LAYERS)
    assert not [name for name in BASE if name not in MODULES], "BASE names a module that is not there"
    assert _layer("persia_nats.common.codec") == "base" and _layer("persia_nats.common.messages.ps") == "base"
    assert _layer("persia_nats.common.rpc") == "common" and _layer("persia_nats.common") == "base"
    assert _layer("persia_nats.services.nn_worker.ctx") == "roles" and _layer("persia.launcher") == "persia"


def _arrows_up(layer: str) -> list[str]:
    """``file:line: imported (its layer)`` of each import in ``layer`` of a module of a layer above it."""
    out = []
    for module, path in MODULES.items():
        if _layer(module) != layer:
            continue
        for name, line in _imports(module):
            ours = _ours(name)
            if ours is not None and RANK[_layer(ours)] > RANK[layer]:
                out.append(f"{path.relative_to(ROOT)}:{line}: {ours} ({_layer(ours)})")
    return sorted(set(out))


@pytest.mark.parametrize("layer", list(LAYERS))
def test_a_layer_imports_nothing_above_it(layer):
    offenders = _arrows_up(layer)
    assert not offenders, f"{layer} imports from a layer above it (tower: {' < '.join(LAYERS)}):\n" + \
        "\n".join(offenders)


def test_nothing_inside_persia_nats_imports_persia():
    offenders = [f"{MODULES[m].relative_to(ROOT)}:{line}: {name}" for m in MODULES if _under(m, "persia_nats")
                 for name, line in _imports(m) if _under(name, "persia")]
    assert not offenders, "persia_nats imports the user API:\n" + "\n".join(sorted(offenders))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_loads_nothing_it_must_not(layer):
    chains = [c for m in MODULES if _layer(m) == layer for c in _reaches(m, FORBIDDEN[layer])]
    assert not chains, f"{layer} reaches what it must not import:\n" + "\n".join(sorted(set(chains)))


def test_the_base_and_the_core_load_neither_nats_nor_torch():
    """What the interpreter actually loads, third-party imports included."""
    core = sorted(m for m in MODULES if _layer(m) in ("base", "core"))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in core) +
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'nats', 'torch', 'persia'}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
