"""Only an owner changes its own state: nothing sets or replaces a part of the NN worker's runtime
from outside once it is built.

The runtime (``NNRuntime``) is built with its owners (the parameters of ``NNRuntime.__init__`` whose
type is a class of ``services/nn_worker``: ``inbox``, ``embeddings``, ``hot``, ``acks``, ``figures``);
a callback, an observer or a setting is passed in at construction or through a method of its owner.

The rule, checked on every module of ours, tests, benchmarks and examples included: a statement
that assigns to, augments or deletes an attribute or an item (``a.b = ...``, ``a[k] += ...``,
``del a.b``, ``setattr(a, ...)``) must not reach its target through the runtime or an owner, that
is, the expression left of the last ``.b`` or ``[k]`` must not contain a name or attribute called
``runtime`` or ``rt`` (how the code base names the runtime) or one of the owners' names. An owner's
own methods change its state through ``self`` (``self.counters[k] += 1``, ``self._received = 0``);
binding a name to the runtime or an owner (``self.runtime = ...``, ``self._hot = runtime.hot``) is
not a change of their state and is allowed.
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest
from persia_nats.services.nn_worker.runtime import NNRuntime

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("common", "core", "dense", "services", "persia", "persia_nats", "benchmarks", "examples", "tests")
#: how the code base names the runtime itself
RUNTIME_NAMES = frozenset({"runtime", "rt"})


def _owner_names() -> frozenset[str]:
    hints = typing.get_type_hints(NNRuntime.__init__)
    return frozenset(name for name, kind in hints.items()
                     if isinstance(kind, type) and kind.__module__.startswith("persia_nats.services.nn_worker."))


OWNERS = _owner_names()
WATCHED = RUNTIME_NAMES | OWNERS


def _names_in(node: ast.expr) -> set[str]:
    """Every name and attribute name in the expression a target is reached through."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
    return found


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
            and node.args:
        return [ast.Attribute(value=node.args[0], attr="?", ctx=ast.Store())]
    return []


def _flatten(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        return [t for e in target.elts for t in _flatten(e)]
    if isinstance(target, ast.Starred):
        return _flatten(target.value)
    return [target]


def violations(source: str, filename: str = "<source>") -> list[str]:
    """``line: target`` of each statement in ``source`` that changes the runtime or an owner from outside."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        for target in (t for top in _targets(node) for t in _flatten(top)):
            if not isinstance(target, ast.Attribute | ast.Subscript):
                continue
            through = _names_in(target.value)
            if through & WATCHED:
                out.append(f"{node.lineno}: {ast.unparse(target)}")
    return out


def _sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_the_owners_are_read_from_the_runtime():
    """An empty set would let every change through."""
    assert {"inbox", "embeddings", "hot", "acks", "figures"} <= OWNERS
    assert len(_sources()) > 100


@pytest.mark.parametrize("code", [
    "runtime.on_grads_handed_off = self.prefetch",
    "self.runtime.observe_call = observe",
    "ctx.runtime.figures['samples_per_second'] = 1.0",
    "self.runtime.counters['batches_failed'] += 1",
    "runtime.last_loss = loss.detach()",
    "rt.inbox.incoming_limit = 4",
    "self._runtime = rt; rt.hot.mirror.optimizer = None",
    "self.embeddings._on_hand_off = None",
    "del rt.acks.ack_keeper",
    "setattr(runtime.hot, 'sent', 0)",
    "a, rt.gate = 1, None",
    "x.figures.counters['n'] = 2",
])
def test_a_change_from_outside_is_found(code):
    assert violations(code), code


@pytest.mark.parametrize("code", [
    "self.runtime = NNRuntime.build(nc, s, rank=0, world_size=1, timeout=5)",
    "self._hot = runtime.hot",
    "self.counters['grads_applied'] += 1",
    "self._received += 1",
    "ctx.runtime = SimpleNamespace(figures=TrainingFigures())",
    "runtime.figures.count('batches_failed')",
    "stats = dict(rt.counters); stats['x'] = 1",
])
def test_an_owner_changing_itself_or_a_binding_is_allowed(code):
    assert not violations(code), code


def test_nothing_changes_the_runtime_or_its_owners_from_outside():
    offenders = [f"{path.relative_to(ROOT)}:{v}" for path in _sources()
                 for v in violations(path.read_text(), str(path))]
    assert not offenders, ("the NN runtime or one of its owners is changed from outside (pass it in at "
                           "construction, or add a method to the owner):\n" + "\n".join(offenders))
