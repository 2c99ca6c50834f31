"""The layers of ``persia_nats`` and which may import which: ``core`` (no NATS, no torch) below
``common`` and ``dense``, the roles (``services/<role>``) above them, and no role reaching into
another. Every import statement counts, lazy and ``TYPE_CHECKING`` ones too, and so does what the
imported module imports in turn."""

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
#: layer -> names its modules must not import, directly or through any module of ours they import
FORBIDDEN = {
    "persia_nats.core": ("nats", "torch", "persia", "persia_nats.common.rpc", "persia_nats.common.service",
                         "persia_nats.dense", "persia_nats.services"),
    "persia_nats.common": ("torch", "persia", "persia_nats.dense", "persia_nats.services"),
    "persia_nats.dense": ("nats", "persia", "persia_nats.services"),
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


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(layer):
    chains = [c for m in MODULES if _under(m, layer) for c in _reaches(m, FORBIDDEN[layer])]
    assert not chains, f"{layer} reaches what it must not import:\n" + "\n".join(sorted(set(chains)))


def test_the_core_loads_neither_nats_nor_torch():
    """What the interpreter actually loads, third-party imports included."""
    core = sorted(m for m in MODULES if _under(m, "persia_nats.core"))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in core) +
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'nats', 'torch', 'persia'}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
