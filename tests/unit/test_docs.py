"""The user docs stay true: configuration tables match the config dataclasses, and every link resolves.

A key added to a config class without a row in docs/configuration.md, a row left behind by a removed
key, or a default changed in one place only fails here, naming the key.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import re
import typing
from pathlib import Path

import pytest
from persia_nats.common.config import EmbeddingConfig, GlobalConfig, SlotConfig
from persia_nats.common.config_schema import Renamed

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CONFIG_DOC = DOCS / "configuration.md"


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    level = heading.split()[0]
    start = text.index(heading + "\n")
    nxt = re.search(rf"^#{{1,{len(level)}}} ", text[start + len(heading) + 1:], flags=re.M)
    return text[start: start + len(heading) + 1 + nxt.start()] if nxt else text[start:]


def doc_rows(heading: str) -> dict[str, str]:
    """``key -> default`` from the first column pair of every table row under ``heading``."""
    rows = {}
    for line in _section(CONFIG_DOC.read_text(), heading).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and (m := re.fullmatch(r"`([a-z0-9_.<>]+)`", cells[0])):
            rows[m.group(1)] = cells[1].strip("`")
    return rows


def leaves(cls: type, prefix: str = "") -> dict[str, object]:
    """Dotted key -> default of every user-settable field of a config dataclass, nested ones flattened."""
    out: dict[str, object] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or not f.init:
            continue
        key = prefix + f.name
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out |= leaves(kind, key + ".")
            continue
        if f.default is not dataclasses.MISSING:
            out[key] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[key] = f.default_factory()
        else:
            out[key] = dataclasses.MISSING
    return out


def render(value: object) -> set[str]:
    """The spellings the docs may use for a default."""
    if value is dataclasses.MISSING:
        return {"required"}
    if value is None:
        return {"unset", "null"}
    if isinstance(value, bool):
        return {str(value).lower()}
    if isinstance(value, int):
        return {str(value), f"{value:_}"}
    if isinstance(value, float):
        return {repr(value), f"{value:g}"}
    if isinstance(value, str):
        return {value, '""'} if value == "" else {value}
    if isinstance(value, tuple) and not value:
        return {"[]"}
    if isinstance(value, typing.Mapping) and not value:
        return {"{}"}
    raise AssertionError(f"no doc spelling for default {value!r}")


def check(table: dict[str, str], fields: dict[str, object], where: str) -> None:
    missing = sorted(set(fields) - set(table))
    stale = sorted(set(table) - set(fields))
    wrong = sorted(f"{k}: docs say {table[k]!r}, the code {fields[k]!r}"
                   for k in set(fields) & set(table) if table[k] not in render(fields[k]))
    assert not (missing or stale or wrong), (
        f"{CONFIG_DOC.name}, {where}: keys without a row {missing}; rows of no key {stale}; defaults {wrong}")


def test_global_config_table_matches_the_dataclasses() -> None:
    check(doc_rows("## global_config.yml"), leaves(GlobalConfig), "global_config.yml")


def test_embedding_config_table_matches_the_dataclasses() -> None:
    table = doc_rows("## embedding_config.yml")
    derived = {f"slots_config.<slot>.{k}" for k in SlotConfig._derived_keys}
    fields = leaves(EmbeddingConfig) | {f"slots_config.<slot>.{k}": v for k, v in leaves(SlotConfig).items()}
    check({k: v for k, v in table.items() if k not in derived}, fields, "embedding_config.yml")
    assert derived <= set(table), f"the derived keys {sorted(derived - set(table))} are not explained"


def persia_keys(cls: type, prefix: str = "") -> dict[str, object]:
    """Dotted PERSIA key -> its rule (Renamed or NoEffect), over a config dataclass and every nested one."""
    out: dict[str, object] = {prefix + k: rule for k, rule in getattr(cls, "_persia_keys", {}).items()}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if typing.get_origin(kind) is collections.abc.Mapping:  # slots_config: one row for every slot
            kind, name = typing.get_args(kind)[1], f"{f.name}.<slot>"
        else:
            name = f.name
        if dataclasses.is_dataclass(kind):
            out |= persia_keys(kind, f"{prefix}{name}.")
    return out


def test_persia_keys_table_matches_the_code() -> None:
    rows = {}
    for line in _section(CONFIG_DOC.read_text(), "## PERSIA's keys").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and (m := re.fullmatch(r"`([A-Za-z0-9_.<>]+)`", cells[0])):
            rows[m.group(1)] = cells[1]
    code = persia_keys(GlobalConfig) | persia_keys(EmbeddingConfig)
    assert sorted(rows) == sorted(code), f"{CONFIG_DOC.name}, PERSIA's keys: rows {sorted(rows)}, code {sorted(code)}"
    for key, rule in code.items():
        says = f"read as `{rule.to.rsplit('.', 1)[-1]}`" if isinstance(rule, Renamed) else "warned, no effect"
        if isinstance(rule, Renamed) and "." in rule.to:
            says = f"read as `{rule.to}`"
        assert rows[key].startswith(says), f"{CONFIG_DOC.name}: PERSIA's {key}: {rows[key]!r} should start {says!r}"


def test_the_readme_stays_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines: reference material belongs in docs/"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    bad = []
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{page.relative_to(ROOT)}: broken links: {bad}"
