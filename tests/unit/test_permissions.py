"""Least privilege, derived: deploy/nats-auth.conf grants exactly what the code's subjects need.

common/permissions.py lists each right with the file whose code needs it; these tests check that
list against the code (each right's subject is used there; each subject a role's code uses is a
right of its user), against deploy/nats-auth.conf (no surplus, nothing missing) and against the
table in docs/configuration.md.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from persia_nats.common.permissions import OPERATOR, RIGHTS, USERS, overlaps, permissions, reply_rights
from persia_nats.common.subjects import Subjects

ROOT = Path(__file__).resolve().parents[2]
AUTH = ROOT / "deploy" / "nats-auth.conf"
#: user -> the packages whose every Subjects call must be covered by one of its rights
PACKAGES = {"ps": "services/embedding_ps", "embedding-worker": "services/embedding_worker",
            "nn-worker": "services/nn_worker", "data-loader": "services/data_loader", "serving": "services/serving"}
#: Subjects methods a role's code calls without sending or subscribing there, and why
NOT_SENT = {("data-loader", "batches"): "names the subject the stream it creates captures",
            ("data-loader", "dead"): "names the subject the dead-letter stream it creates captures",
            ("data-loader", "stream_end"): "names a subject the stream it creates captures, and tells a fetched "
                                            "end marker by it",
            ("nn-worker", "stream_end"): "counts the end markers in the stream for the job's account",
            ("nn-worker", "hot"): "parses the subject of a hot-row message it received"}
SUBJECT_METHODS = {name for name in dir(Subjects) if not name.startswith("_") and callable(getattr(Subjects, name))}
CONF_USER = re.compile(r"\{user: ([\w-]+), password: \$\w+, permissions: \$(\w+)\}")


def conf_permissions(text: str) -> dict[str, dict[str, set[str]]]:
    """user -> {"publish", "subscribe"} -> subjects, as deploy/nats-auth.conf grants them."""
    body = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    blocks: dict[str, dict[str, set[str]]] = {}
    for m in re.finditer(r"^\s*(\w+) = \{(.*?)\n\s*\}", body, re.S | re.M):
        rights: dict[str, set[str]] = {"publish": set(), "subscribe": set()}
        for kind, value in re.findall(r"(publish|subscribe): (\[[^\]]*\]|\"[^\"]*\")", m.group(2)):
            rights[kind] = set(re.findall(r'"([^"]+)"', value))
        assert "allow_responses" not in m.group(2), f"{m.group(1)}: allow_responses lets a reply go anywhere"
        blocks[m.group(1)] = rights
    return {user: blocks[perm] for user, perm in CONF_USER.findall(body)}


def test_nats_auth_conf_grants_each_user_exactly_the_derived_rights() -> None:
    granted = conf_permissions(AUTH.read_text())
    assert set(granted) == {*USERS, OPERATOR}
    needed = permissions()
    surplus = {u: {k: sorted(granted[u][k] - needed[u][k]) for k in needed[u]} for u in USERS}
    missing = {u: {k: sorted(needed[u][k] - granted[u][k]) for k in needed[u]} for u in USERS}
    assert all(not v for s in surplus.values() for v in s.values()), f"surplus rights: {surplus}"
    assert all(not v for s in missing.values() for v in s.values()), f"missing rights: {missing}"


def test_a_surplus_right_in_the_conf_is_caught() -> None:
    text = AUTH.read_text().replace('"persia.*.trained"]', '"persia.*.trained", "persia.*.ps.*.update"]', 1)
    granted = conf_permissions(text)
    assert "persia.*.ps.*.update" in granted["nn-worker"]["publish"] - permissions()["nn-worker"]["publish"]


def test_no_user_may_publish_where_a_reply_could_act() -> None:
    """No responder holds a right on the JetStream API's destructive verbs, $SYS, or a job subject it
    does not send itself: its replies go to inboxes only."""
    for user, rights in permissions().items():
        for subject in rights["publish"]:
            for forbidden in ("$JS.API.STREAM.PURGE.*", "$JS.API.STREAM.DELETE.*", "$JS.API.STREAM.UPDATE.*",
                              "$JS.API.CONSUMER.DELETE.*.*", "$JS.API.STREAM.LEADER.STEPDOWN.*", "$SYS.>",
                              "$JS.API.CONSUMER.CREATE.*.*"):
                assert not overlaps(subject, forbidden), (user, subject, forbidden)
        inboxes = {s for s in rights["publish"] if s.startswith("_INBOX")}
        assert inboxes == reply_rights().get(user, set()), user
    # the outside users read only their own inbox, and no job traffic but the trained notices
    assert permissions()["publisher"]["subscribe"] == {"_INBOX.publisher.>", "persia.*.trained"}
    assert permissions()["predict-client"]["subscribe"] == {"_INBOX.predict-client.>"}


def _is_subjects(node: ast.expr) -> bool:
    """Whether an expression names a Subjects instance, by the names the code gives them."""
    if isinstance(node, ast.Name):
        return node.id in ("s", "S", "subjects")
    return isinstance(node, ast.Attribute) and node.attr in ("subjects", "_subjects")


def _subject_calls(path: Path) -> set[str]:
    """The Subjects methods a module calls (``x.ps(...)``, ``s.ew_ingest()``, ...), with the PS verb."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SUBJECT_METHODS
                and _is_subjects(node.func.value)):
            name = node.func.attr
            if name == "ps" and len(node.args) == 2 and isinstance(node.args[1], ast.Constant):
                name = f"ps:{node.args[1].value}"
            found.add(name)
    return found


@pytest.mark.parametrize("right", RIGHTS, ids=lambda r: f"{r.user}:{r.kind}:{r.subject}")
def test_each_right_is_needed_by_the_code_it_names(right) -> None:
    text = (ROOT / right.where).read_text()
    if right.needle:
        assert right.needle in text, f"{right.where} has no {right.needle!r}: is {right.subject} still needed?"
    else:
        assert right.subject in _subject_calls(ROOT / right.where) or (
            right.subject.startswith("ps:") and "ps" in _subject_calls(ROOT / right.where)), \
            f"{right.where} calls no Subjects.{right.subject}: is it still needed?"


@pytest.mark.parametrize("user", sorted(PACKAGES))
def test_every_subject_a_role_uses_is_a_right_of_its_user(user: str) -> None:
    covered = {r.subject for r in RIGHTS if r.user == user}
    for path in sorted((ROOT / PACKAGES[user]).rglob("*.py")):
        for name in _subject_calls(path):
            assert name in covered or (user, name) in NOT_SENT or (name == "ps" and any(
                c.startswith("ps:") for c in covered)), \
                f"{path.relative_to(ROOT)} uses Subjects.{name}, which no right of {user} covers"


def test_docs_list_every_right() -> None:
    docs = (ROOT / "docs" / "configuration.md").read_text()
    for user, rights in permissions().items():
        for kind, subjects in rights.items():
            for subject in subjects:
                assert f"| `{user}` | {kind} | `{subject}` |" in docs, (user, kind, subject)
