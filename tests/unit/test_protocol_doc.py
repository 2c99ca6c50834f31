"""docs/protocol.md against the message types: every field of every request and reply is documented,
with its type and whether it may be left out, and the doc names no field the types do not have.

The doc is written for client authors in other languages, as bullets: ``- **Request:** `name`
(type): meaning``. This test reads those bullets; a field added to a type without a line in the doc
(or a doc line for a field that is gone) fails here.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from persia_nats.common import messages as m
from persia_nats.common.optim_config import AdagradConfig, AdamConfig, EmbeddingHyperparams, SGDConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"

#: doc section (its heading's subject) -> {"Request"/"Reply"/"Message": the types it documents}
SECTIONS: dict[str, dict[str, tuple[type[m.Message], ...]]] = {
    "ew.ingest": {"Request": (m.IngestRequest,), "Reply": (m.IngestReply,)},
    "ew.lookup_direct": {"Request": (m.IngestRequest,), "Reply": (m.LookupDirectReply,)},
    "ew.<worker>.lookup": {"Request": (m.EwLookup,), "Reply": (m.EwLookupReply,)},
    "ew.<worker>.grad": {"Request": (m.GradRequest,), "Reply": (m.GradReply,)},
    "ew.<worker>.info": {"Request": (m.Empty,)},
    "ps.<i>.lookup": {"Request": (m.PsLookup,), "Reply": (m.PsLookupReply,)},
    "ps.<i>.update": {"Request": (m.PsUpdate,), "Reply": (m.PsUpdateReply,)},
    "hot.rows.<i>": {"Message": (m.HotRows,)},
    "hot.grads.<rank>": {"Message": (m.HotGrads,)},
    "ps.<i>.configure": {"Request": (m.PsConfigure,), "Reply": (m.Ok,)},
    "ps.<i>.info": {"Request": (m.Empty,), "Reply": (m.PsInfoReply,)},
    "ps.<i>.checkpoint": {"Request": (m.PsCheckpoint,), "Reply": (m.PsCheckpointReply,)},
    "nn.<rank>.batch": {"Request": (m.NNBatch,), "Reply": (m.Ok,)},
    "nn.<rank>.end": {"Request": (m.NNEnd,), "Reply": (m.Ok,)},
    "nn.info": {"Request": (m.Empty,), "Reply": (m.NNInfoReply,)},
    "nn.rendezvous": {"Request": (m.RendezvousRequest,), "Reply": (m.RendezvousReply,)},
    "nn.checkpoint": {"Request": (m.Empty,), "Reply": (m.NNCheckpointReply,)},
    "status": {"Request": (m.Empty,), "Reply": (m.StatusReply,)},
    "serve.predict": {"Request": (m.PredictRequest,), "Reply": (m.PredictReply,)},
    "serve.info": {"Request": (m.Empty,)},
}

#: parts documented once, in a section or table of their own that the subjects link to (checked below)
SHARED = {m.IdFeature: "Id features (jagged form)", m.SlotEmbedding: "Slot embeddings",
          m.NamedArray: None, SGDConfig: None, AdagradConfig: None, AdamConfig: None, EmbeddingHyperparams: None}

#: names the doc gives in a section that are not fields: keys inside an open map (figures, file lists),
#: or another field named in a sentence
NOT_FIELDS = {
    "ps.<i>.info": {"rows", "rows_per_dim", "memory_bytes", "evictions", "inserts", "index_miss_count",
                    "gradient_id_miss_count", "candidate_lists_built_ahead", "index_doublings_built_ahead"},
    "ps.<i>.checkpoint": {"size", "sha256", "dir"},
    "hot.rows.<i>": {"batch"},
    "ps.<i>.configure": {"type"},  # the optimizer's, in the optimizer table
    "nn.<rank>.batch": {"name", "data"},  # a dense feature's or label's (NamedArray), spelled out here once
    "ps.<i>.update": {"scaled_grads"},  # the wire name of PsUpdateGroup.grads when scaled
}

#: the doc's word for a field's wire type -> the Python types that carry it
KINDS: dict[str, tuple[object, ...]] = {
    "int": (int,), "ints": (int,), "bool": (bool,), "str": (str,), "bin": (bytes,),
    "number": (float,), "float": (float,), "array": (np.ndarray,), "arrays": (np.ndarray,),
    "list": (tuple, list), "map": (Mapping, "dataclass"), "maps": (Mapping, "dataclass"),
}
OPTIONAL_WORDS = ("default", "optional", "or nil", "only ", "absent")


def _sections() -> dict[str, dict[str, str]]:
    """subject -> {"Request"/"Reply"/"Message": the text of those bullets (their indented lines joined)}."""
    out: dict[str, dict[str, str]] = {}
    current = None
    lines = DOC.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        heading = re.match(r"^(?:### |\*\*)`persia\.<job>\.([^`]+)`", line)
        if heading:
            current = out.setdefault(heading.group(1), {})
        elif line.startswith("#"):
            current = None
        part = re.match(r"^- \*\*(Request|Reply|Message)\b", line)
        if current is not None and part:
            text = [line]
            while i + 1 < len(lines) and lines[i + 1].startswith("  "):
                i += 1
                text.append(lines[i])
            current[part.group(1)] = current.get(part.group(1), "") + " " + " ".join(t.strip() for t in text)
        i += 1
    return out


def _documented(text: str) -> dict[str, str]:
    """``name`` -> its type as written, for every "`name` (type)" and "`a`, `b` and `c` (type)"."""
    fields: dict[str, str] = {}
    for match in re.finditer(r"((?:`\w+`(?:, | and |, and ))*`\w+`) \(", text):
        depth, start = 1, match.end()
        end = start
        while end < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        for name in re.findall(r"`(\w+)`", match.group(1)):
            fields.setdefault(name, text[start:end - 1])
    return fields


def _wire_fields(cls: type) -> dict[str, tuple[object, bool]]:
    """name -> (its type hint, whether it may be left out), this type's and its parts' fields."""
    out: dict[str, tuple[object, bool]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name == "extra":  # local only: never sent
            continue
        hint = hints[f.name]
        optional = (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING) \
            and not f.metadata.get("always_sent") or bool(f.metadata.get("absent_when_default"))
        out.setdefault(f.name, (hint, optional))
        for part in _parts(hint):
            for name, value in _wire_fields(part).items():
                out.setdefault(name, value)
    return out


def _parts(hint: object) -> list[type]:
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return [] if hint in SHARED else [hint]
    return [p for a in args for p in _parts(a)]


def _carries(kind: str, hint: object) -> bool:
    options = [a for a in typing.get_args(hint) if a is not type(None)] \
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else [hint]
    for option in options:
        base = typing.get_origin(option) or option
        for allowed in KINDS.get(kind, ()):
            if allowed == "dataclass" and dataclasses.is_dataclass(base):
                return True
            if isinstance(allowed, type) and isinstance(base, type) and issubclass(base, allowed):
                return True
    return False


SECTION_TEXT = _sections()
CASES = [(subject, part, cls) for subject, parts in SECTIONS.items() for part, classes in parts.items()
         for cls in classes]


def test_every_subject_of_the_doc_is_checked():
    assert set(SECTION_TEXT) >= set(SECTIONS), sorted(set(SECTIONS) - set(SECTION_TEXT))


@pytest.mark.parametrize(("subject", "part", "cls"), CASES, ids=[f"{s}-{p}" for s, p, _ in CASES])
def test_the_doc_lists_each_field_with_its_type_and_optionality(subject, part, cls):
    documented = _documented(SECTION_TEXT[subject].get(part, ""))
    assert documented.get("v", "").startswith("int") or "`{\"v\": 1}`" in SECTION_TEXT[subject].get(part, ""), \
        f"{subject} {part}: no `v` (int)"
    documented.pop("v", None)
    fields = _wire_fields(cls)
    missing = sorted(set(fields) - set(documented))
    assert not missing, f"{subject} {part}: fields of {cls.__name__} not in docs/protocol.md: {missing}"
    extra = sorted(set(documented) - set(fields) - NOT_FIELDS.get(subject, set()))
    assert not extra, f"{subject} {part}: docs/protocol.md names fields {cls.__name__} does not have: {extra}"
    for name, (hint, optional) in fields.items():
        written = documented[name]
        kind = written.split()[0].strip(",") if written else ""
        assert _carries(kind, hint), f"{subject} {part}: `{name}` documented as {written!r}, the type says {hint}"
        said_optional = any(w in written for w in OPTIONAL_WORDS)
        assert said_optional == optional, (
            f"{subject} {part}: `{name}` is {'optional' if optional else 'required'} in {cls.__name__}, "
            f"but the doc says ({written})")


@pytest.mark.parametrize("cls", [c for c, heading in SHARED.items() if heading], ids=lambda c: c.__name__)
def test_the_shared_parts_tables_list_their_fields(cls):
    text = DOC.read_text()
    section = text[text.index(f"### {SHARED[cls]}"):]
    section = section[:section.index("\n#", 4)]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, re.M))
    fields = _wire_fields(cls)
    assert set(rows) == set(fields), f"{SHARED[cls]}: table {sorted(rows)}, {cls.__name__} {sorted(fields)}"
    for name, (hint, optional) in fields.items():
        assert _carries(rows[name].split()[0].strip(","), hint), f"{name}: {rows[name]!r} vs {hint}"
        assert any(w in rows[name] for w in OPTIONAL_WORDS) == optional, f"{name}: {rows[name]!r}"
