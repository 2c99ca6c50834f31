"""The naming rules of ``promtool check metrics`` (Prometheus's promlint), for a scrape's text.

Kept here so the default suite needs no Prometheus install; where ``promtool`` is on the PATH, the
test runs it on the same text too. Two rules of ours are added: every series carries ``role``,
and none carries ``job`` or ``instance`` (Prometheus sets those; an exported one becomes
``exported_job`` unless the scrape sets ``honor_labels``).
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

NAME = re.compile(r"[a-z_:][a-z0-9_:]*")
NON_BASE_UNITS = ("_us", "_ms", "_ns", "_microseconds", "_milliseconds", "_nanoseconds", "_minutes", "_hours",
                  "_days", "_kilobytes", "_megabytes", "_gigabytes", "_percent")
RESERVED_LABELS = ("job", "instance")


def problems(text: str, required_label: str = "role") -> list[str]:
    """Every rule a scrape's families break, one line each (empty: clean)."""
    found: list[str] = []
    for family in text_string_to_metric_families(text):
        name = family.name
        if not NAME.fullmatch(name):
            found.append(f"{name}: not snake_case")
        tokens = f"_{name}_"
        for unit in NON_BASE_UNITS:
            if f"{unit}_" in tokens:
                found.append(f"{name}: {unit[1:]} is not a base unit (seconds, bytes, ratios)")
        if family.type != "counter" and name.endswith("_total"):
            found.append(f"{name}: a {family.type} must not end in _total")
        # a counter's name ends in _total, so "errors_count_total" passes, as promtool has it
        if family.type not in ("histogram", "summary", "counter") and name.endswith(("_count", "_sum", "_bucket")):
            found.append(f"{name}: only histograms and summaries end in _count, _sum or _bucket")
        for sample in family.samples:
            if required_label not in sample.labels:
                found.append(f"{sample.name}: no {required_label!r} label")
            for label in RESERVED_LABELS:
                if label in sample.labels:
                    found.append(f"{sample.name}: carries {label!r}, which Prometheus sets itself")
    return sorted(set(found))
