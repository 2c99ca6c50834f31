"""Every figure a role exports has a real HELP line, and counters are named by Prometheus' conventions.

The keys come from the table itself, from :data:`COUNTER_KEYS`, and from the services' sources: every
literal key a role counts (``counters["..."] += ...``, ``figures.count("...")``) must be a counter of
that role with a description. ``tests/integration/test_metrics.py`` scrapes every role of a live job
for the same."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from persia_nats.common import metrics as m

ROOT = Path(__file__).parents[2]
#: the sources whose counters each role exports (a role's own package; the PS's store)
SOURCES = {
    "embedding-worker": ["services/embedding_worker"],
    "embedding-parameter-server": ["services/embedding_ps", "core/store.py"],
    "nn-worker": ["services/nn_worker"],
    "serving": ["services/serving"],
    "data-loader": ["services/data_loader"],
}
COUNTED = re.compile(r"counters\[([^\]]+)\]\s*\+=")
COUNT_CALL = re.compile(r"\bfigures\.count\(\s*\"([a-z_0-9]+)\"")
LITERAL = re.compile(r"\"([a-z_0-9]+)\"")
#: the keys of the stats() dicts the PS builds by hand (service.py and core/store.py EmbeddingStore.stats)
PS_STATS = ("configured", "configure_refused", "duplicate_updates", "refused_unconfigured_dim",
            "refused_lookup_too_large", "rows_published", "rows_publish_failed", "rows", "memory_bytes", "evictions",
            "inserts", "index_miss_count", "candidate_lists_built_ahead", "index_doublings_built_ahead",
            "gradient_id_miss_count", "incremental_pending_keys", "incremental_last_delta_age_seconds",
            "incremental_last_copy_seconds", "incremental_copy_step_max_seconds", "incremental_last_write_seconds",
            "incremental_deltas_applied", "incremental_rows_applied")
#: the gauges the roles' stats() build by hand (numbers only: strings and dicts are not exported)
GAUGES = {
    "embedding-worker": ("staleness", "max_staleness", "buffered", "buffered_bytes"),
    "nn-worker": ("world_size", "queued", "incoming_limit", "ended", "train_loss", "samples_per_second",
                  "hot_rows_held", "staleness", "max_staleness", "staleness_bound"),
    "serving": ("step", "rows", "incremental_deltas_applied", "incremental_rows_applied",
                "incremental_delta_age_seconds", "incremental_applied_timestamp_seconds"),
    "data-loader": ("left_at_end", "inflight", "end_marker"),
}


def placeholder(text: str) -> bool:
    """The old HELP, ``f"{role} {key}"`` (``nn-worker train_wait_us``), for any role."""
    return any(re.fullmatch(rf"{re.escape(role)} [a-z_0-9]+", text) for role in SOURCES)


def counted_keys(role: str) -> set[str]:
    """Every literal key the role's sources count."""
    keys: set[str] = set()
    for where in SOURCES[role]:
        path = ROOT / where
        for source in [path] if path.is_file() else sorted(path.rglob("*.py")):
            text = source.read_text()
            for expr in COUNTED.findall(text):
                # "a" if cond else "b": the keys, not what the condition compares
                parts = re.split(r"\bif\b|\belse\b", expr)
                keys.update(LITERAL.findall(parts[0]) + (LITERAL.findall(parts[-1]) if len(parts) > 1 else []))
            keys.update(COUNT_CALL.findall(text))
    return keys


def every_key() -> dict[str, set[str]]:
    keys = {role: set(m.COUNTER_KEYS.get(role, ())) | set(GAUGES.get(role, ())) for role in SOURCES}
    keys["embedding-parameter-server"] |= set(PS_STATS)
    for role in SOURCES:
        keys[role] |= counted_keys(role)
    return keys


def test_the_table_describes_figures_in_words_and_units() -> None:
    assert len(m.HELP) > 100
    for key, text in m.HELP.items():
        name = key if isinstance(key, str) else key[1]
        assert isinstance(text, str) and len(text.split()) >= 3 and not placeholder(text), key
        if name.endswith("_us"):
            assert "seconds" in text, (key, text)
        if name.endswith("_bytes"):
            assert "bytes" in text, (key, text)
        if isinstance(key, tuple):
            assert key[0] in SOURCES, key


def test_every_key_a_role_can_return_has_a_description() -> None:
    missing = sorted(f"{role}: {key}" for role, keys in every_key().items() for key in keys
                     if m.description(role, key) is None)
    assert missing == [], "figures without HELP (add them to persia_nats.common.metrics.HELP):\n" + "\n".join(missing)


def test_every_counted_key_is_exported_as_a_counter() -> None:
    """A key a role only ever adds to is a counter (``_total``): a gauge would break ``rate()``."""
    for role in SOURCES:
        not_counters = sorted(counted_keys(role) - set(m.COUNTER_KEYS.get(role, ())))
        assert not_counters == [], (role, not_counters)
    assert sorted(m.COUNTER_KEYS) == sorted(SOURCES)


def test_counter_names_follow_prometheus_conventions() -> None:
    for role, keys in m.COUNTER_KEYS.items():
        for key in keys:
            name, _ = m.exported(key, 0, role)
            assert not name.endswith(("_count", "_sum", "_bucket", "_total")), (role, key, name)
            assert not name.endswith(("_us", "_ms")), (role, key, name)
    assert m.exported("index_miss_count", 3, "embedding-parameter-server") == ("index_misses", 3)
    assert m.exported("gradient_id_miss_count", 3, "embedding-parameter-server") == ("gradient_id_misses", 3)
    assert m.exported("train_wait_us", 2_500_000, "nn-worker") == ("train_wait_seconds", 2.5)
    assert m.exported("received", 1, "data-loader") == ("received", 1)  # renames are per role
    for (role, key), name in m.EXPORT_NAMES.items():
        assert key in m.COUNTER_KEYS[role] and name != key and m.description(role, key), (role, key)


class _Service:
    def __init__(self, role: str, stats: dict[str, Any], figures: Any = None) -> None:
        self.role = role
        self._stats = stats
        self.figures = figures
        self.rpc = SimpleNamespace(requests={}, errors={}, bad_replies={})

    def stats(self) -> dict[str, Any]:
        return self._stats


def _families(service: _Service) -> dict[str, Any]:
    collector = m.ServiceCollector(service, "j", "0")  # type: ignore[arg-type]
    return {f.name: f for f in collector.collect()}


def test_a_scrape_carries_the_descriptions_and_the_new_names() -> None:
    got = _families(_Service("embedding-parameter-server", {"rows": 5, "index_miss_count": 2}))
    assert got["persia_ps_index_misses"].type == "counter"
    assert got["persia_ps_index_misses"].documentation == m.HELP[("embedding-parameter-server", "index_miss_count")]
    assert got["persia_ps_index_misses"].samples[0].value == 2
    assert "persia_ps_index_miss_count" not in got and "persia_ps_gradient_id_misses" in got
    assert got["persia_ps_rows"].documentation == "embedding rows stored by this replica"
    nn = _families(_Service("nn-worker", {"train_wait_us": 1_500_000}))
    assert nn["persia_nn_worker_train_wait_seconds"].samples[0].value == 1.5
    assert "seconds" in nn["persia_nn_worker_train_wait_seconds"].documentation
    assert "persia_nn_worker_batches_received" in nn and "persia_nn_worker_received" not in nn
    for name, family in {**got, **nn}.items():
        if name.startswith("persia_"):
            assert not placeholder(family.documentation) and "undescribed" not in family.documentation, name


def test_an_undescribed_figure_is_exported_saying_so_and_a_reported_one_says_who_reports_it() -> None:
    figures = SimpleNamespace(gauges=lambda: {"test_auc": 0.5})
    got = _families(_Service("nn-worker", {"brand_new_figure": 1, "test_auc": 0.5}, figures))
    new = got["persia_nn_worker_brand_new_figure"]
    assert new.samples[0].value == 1  # not lost
    assert "undescribed" in new.documentation and "brand_new_figure" in new.documentation
    assert m.description("nn-worker", "brand_new_figure") is None
    assert "ctx.report" in got["persia_nn_worker_test_auc"].documentation
