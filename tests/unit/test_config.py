"""Tests for persia_nats.common.config: defaults, strictness, validation, derived prefixes and shipped YAML."""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path

import pytest
import yaml
from persia_nats.common.config import (
    CommonConfig,
    EmbeddingConfig,
    GlobalConfig,
    HashStackConfig,
    SlotConfig,
    embedding_config_from_dict,
    global_config_from_dict,
    load_embedding_config,
    load_global_config,
)
from persia_nats.common.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "cfg.yml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def global_error(tmp_path: Path, text: str) -> tuple[str, str]:
    path = write(tmp_path, text, "global_config.yml")
    with pytest.raises(ConfigError) as info:
        load_global_config(path)
    return str(info.value), str(path)


def embedding_error(tmp_path: Path, text: str) -> tuple[str, str]:
    path = write(tmp_path, text, "embedding_config.yml")
    with pytest.raises(ConfigError) as info:
        load_embedding_config(path)
    return str(info.value), str(path)


# ----- global_config.yml ------------------------------------------------------------------------


def test_global_defaults() -> None:
    cfg = load_global_config(None)
    assert cfg == GlobalConfig() == global_config_from_dict({})
    common = cfg.common_config
    assert (common.job_name, common.job_type) == ("persia", "Train")
    m = common.metrics_config
    assert (m.enable_metrics, m.job_name, m.push_interval_seconds, m.port, m.final_scrape_seconds) == (
        False, "persia", 10, 0, 60.0)
    assert (common.infer_config.servers, common.infer_config.embedding_checkpoint) == ((), "")
    assert common.checkpointing_config.num_workers == 4
    ps = cfg.embedding_parameter_server_config
    assert (ps.capacity, ps.initial_rows, ps.num_hashmap_internal_shards, ps.enable_incremental_update,
            ps.incremental_buffer_size, ps.incremental_dir) == (
        1_000_000_000, 1024, 100, False, 1_000_000, "/workspace/incremental_dir/")
    ew = cfg.embedding_worker_config
    assert (ew.forward_buffer_size, ew.buffered_data_expired_sec, ew.wire_dtype, ew.max_inflight) == (
        1000, 1000.0, "float16", 64)
    nn = cfg.nn_worker_config
    assert (nn.sync_mode, nn.embedding_staleness, nn.request_timeout_sec) == ("hybrid", 10, 30.0)


def test_global_values_read(tmp_path: Path) -> None:
    path = write(tmp_path, """
common_config:
  job_name: my-job_1
  job_type: Infer
  infer_config: {servers: [ps0:8888, ps1:8888], embedding_checkpoint: /ckpt}
embedding_parameter_server_config: {capacity: 1e9, incremental_buffer_size: 5_000_000}
embedding_worker_config: {wire_dtype: float32, buffered_data_expired_sec: 2}
nn_worker_config: {sync_mode: sync, request_timeout_sec: 1e-1}
""")
    cfg = load_global_config(path)
    assert cfg.common_config.job_name == "my-job_1"
    assert cfg.common_config.infer_config.servers == ("ps0:8888", "ps1:8888")
    assert cfg.embedding_parameter_server_config.capacity == 1_000_000_000
    assert type(cfg.embedding_parameter_server_config.capacity) is int
    assert cfg.embedding_parameter_server_config.incremental_buffer_size == 5_000_000
    assert cfg.embedding_worker_config.buffered_data_expired_sec == 2.0
    assert cfg.nn_worker_config.request_timeout_sec == pytest.approx(0.1)


@pytest.mark.parametrize("value, expected", [
    ("1e9", 1_000_000_000), ("1.0e9", 1_000_000_000), ("1000000000", 1_000_000_000),
    ("'1_000'", 1000), ("'1E3'", 1000), ("2.0", 2),
])
def test_int_field_accepts_integral_spellings(tmp_path: Path, value: str, expected: int) -> None:
    path = write(tmp_path, f"embedding_parameter_server_config: {{capacity: {value}}}")
    assert load_global_config(path).embedding_parameter_server_config.capacity == expected


@pytest.mark.parametrize("value", ["yes", "true", "1.5", "'1e-3'", "abc", "[1]", ".inf", "null"])
def test_int_field_rejects(tmp_path: Path, value: str) -> None:
    msg, path = global_error(tmp_path, f"embedding_parameter_server_config: {{capacity: {value}}}")
    assert "'embedding_parameter_server_config.capacity'" in msg
    assert path in msg and "expected integer" in msg


def test_bool_rejected_for_int_names_value(tmp_path: Path) -> None:
    msg, path = global_error(tmp_path, "common_config: {checkpointing_config: {num_workers: yes}}")
    assert msg == (f"wrong type for 'common_config.checkpointing_config.num_workers' in {path}: "
                   "expected integer, got True (bool)")


@pytest.mark.parametrize("text, key, expected", [
    ("common_config: {metrics_config: {enable_metrics: 1}}",
     "common_config.metrics_config.enable_metrics", "boolean"),
    ("common_config: {job_name: 123}", "common_config.job_name", "string"),
    ("common_config: {job_type: train}", "common_config.job_type", "one of 'Train', 'Eval', 'Infer'"),
    ("common_config: {infer_config: {servers: ps0:8888}}", "common_config.infer_config.servers",
     "list of string"),
    ("common_config: {infer_config: {servers: [ps0, 7]}}", "common_config.infer_config.servers[1]",
     "string"),
    ("embedding_worker_config: {wire_dtype: bfloat16}", "embedding_worker_config.wire_dtype",
     "one of 'float16', 'float32'"),
    ("embedding_worker_config: {buffered_data_expired_sec: soon}",
     "embedding_worker_config.buffered_data_expired_sec", "number"),
    ("nn_worker_config: {sync_mode: semi}", "nn_worker_config.sync_mode", "one of"),
    ("nn_worker_config: {embedding_gather: gpu}", "nn_worker_config.embedding_gather",
     "one of 'auto', 'host', 'device'"),
    ("nn_worker_config: [sync]", "nn_worker_config", "mapping"),
])
def test_wrong_types(tmp_path: Path, text: str, key: str, expected: str) -> None:
    msg, path = global_error(tmp_path, text)
    assert f"wrong type for '{key}' in {path}: expected {expected}" in msg


@pytest.mark.parametrize("text, key", [
    ("common_confg: {}", "common_confg"),
    ("common_config: {jobname: x}", "common_config.jobname"),
    ("common_config: {metrics_config: {push_interval_secs: 5}}",
     "common_config.metrics_config.push_interval_secs"),
    ("common_config: {infer_config: {initial_checkpoint: /x}}",
     "common_config.infer_config.initial_checkpoint"),
    ("common_config: {checkpointing_config: {workers: 2}}", "common_config.checkpointing_config.workers"),
    ("embedding_parameter_server_config: {incremental_channel_size: 1000}",
     "embedding_parameter_server_config.incremental_channel_size"),
    ("embedding_worker_config: {forward_buffer: 3}", "embedding_worker_config.forward_buffer"),
    ("nn_worker_config: {staleness: 3}", "nn_worker_config.staleness"),
])
def test_unknown_key_at_every_level(tmp_path: Path, text: str, key: str) -> None:
    msg, path = global_error(tmp_path, text)
    assert msg.startswith(f"unknown key '{key}' in {path} (known: ")


def test_push_interval_misspelling(tmp_path: Path) -> None:
    msg, path = global_error(tmp_path, "common_config:\n  metrics_config:\n    push_interval_secs: 5\n")
    assert msg.startswith(
        f"unknown key 'common_config.metrics_config.push_interval_secs' in {path} "
        "(known: enable_metrics, job_name, push_interval_seconds, port, final_scrape_seconds)")
    # the closest key accepted is PERSIA's push_interval_sec: the suggestion is ours, which it means
    assert msg.endswith("did you mean 'push_interval_seconds'?")


@pytest.mark.parametrize("text, key", [
    ("common_config: {job_name: 'a.b'}", "common_config.job_name"),
    ("common_config: {job_name: 'a b'}", "common_config.job_name"),
    ("common_config: {job_name: ''}", "common_config.job_name"),
    ("common_config: {metrics_config: {push_interval_seconds: 0}}",
     "common_config.metrics_config.push_interval_seconds"),
    ("common_config: {metrics_config: {port: 70000}}", "common_config.metrics_config.port"),
    ("common_config: {metrics_config: {final_scrape_seconds: -1}}",
     "common_config.metrics_config.final_scrape_seconds"),
    ("common_config: {checkpointing_config: {num_workers: 0}}",
     "common_config.checkpointing_config.num_workers"),
    ("embedding_parameter_server_config: {capacity: 0}", "embedding_parameter_server_config.capacity"),
    ("embedding_parameter_server_config: {initial_rows: 0}", "embedding_parameter_server_config.initial_rows"),
    ("embedding_parameter_server_config: {num_hashmap_internal_shards: -1}",
     "embedding_parameter_server_config.num_hashmap_internal_shards"),
    ("embedding_worker_config: {forward_buffer_size: 0}", "embedding_worker_config.forward_buffer_size"),
    ("embedding_worker_config: {max_inflight: 0}", "embedding_worker_config.max_inflight"),
    ("embedding_worker_config: {buffered_data_expired_sec: 0}",
     "embedding_worker_config.buffered_data_expired_sec"),
    ("nn_worker_config: {embedding_staleness: 0}", "nn_worker_config.embedding_staleness"),
    ("nn_worker_config: {request_timeout_sec: -1}", "nn_worker_config.request_timeout_sec"),
    ("data_loader_config: {stream_replicas: 6}", "data_loader_config.stream_replicas"),
    ("data_loader_config: {stream_replicas: -1}", "data_loader_config.stream_replicas"),
])
def test_global_invalid_values(tmp_path: Path, text: str, key: str) -> None:
    msg, path = global_error(tmp_path, text)
    assert msg.startswith(f"invalid '{key}' in {path}: ")


def test_empty_sections_take_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "common_config:\n  # all commented out\nnn_worker_config:\n")
    assert load_global_config(path) == GlobalConfig()
    assert load_global_config(write(tmp_path, "# nothing set\n", "empty.yml")) == GlobalConfig()


@pytest.mark.parametrize("text, fragment", [
    ("common_config: {job_name: [unclosed", "YAML syntax error in"),
    ("- a\n- b\n", "must be a mapping, got list"),
    ("just a string\n", "must be a mapping, got str"),
    ("nn_worker_config: {sync_mode: sync}\nnn_worker_config: {}\n", "duplicate key 'nn_worker_config'"),
    ("1: x\n", "is not a string"),
])
def test_bad_files(tmp_path: Path, text: str, fragment: str) -> None:
    msg, path = global_error(tmp_path, text)
    assert fragment in msg and path in msg


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yml"
    for load in (load_global_config, load_embedding_config):
        with pytest.raises(ConfigError, match=f"not found: {re.escape(str(path))}"):
            load(path)


def test_dict_source_named_in_errors() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'bogus' in <dict>"):
        global_config_from_dict({"bogus": 1})
    with pytest.raises(ConfigError, match=r"in env:TEST"):
        global_config_from_dict({"nn_worker_config": {"sync_mode": 1}}, source="env:TEST")


# ----- embedding_config.yml ---------------------------------------------------------------------

EMB = """
feature_index_prefix_bit: 8
slots_config:
  a: {dim: 4}
  b: {dim: 8}
  c: {dim: 4, embedding_summation: false, sample_fixed_size: 3}
  d: {dim: 2, hash_stack_config: {hash_stack_rounds: 2, embedding_size: 100}}
feature_groups:
  g2: [d]
  g1: [c, a]
"""


def test_embedding_defaults_and_values(tmp_path: Path) -> None:
    cfg = load_embedding_config(write(tmp_path, EMB))
    a = cfg.slots_config["a"]
    assert a == SlotConfig(dim=4)
    assert (a.sample_fixed_size, a.embedding_summation, a.pooling, a.sqrt_scaling) == (10, True, "sum", False)
    assert a.hash_stack_config == HashStackConfig(hash_stack_rounds=0, embedding_size=0)
    assert cfg.slots_config["d"].hash_stack_config == HashStackConfig(hash_stack_rounds=2, embedding_size=100)
    assert cfg.feature_groups == {"g2": ("d",), "g1": ("c", "a")}
    only = embedding_config_from_dict({"slots_config": {"x": {"dim": 1}}})
    assert only.feature_index_prefix_bit == 8 and dict(only.feature_groups) == {}


def test_prefixes_groups_then_ungrouped_slots(tmp_path: Path) -> None:
    cfg = load_embedding_config(write(tmp_path, EMB))
    assert cfg.slot_names == ("a", "b", "c", "d")
    # Groups in file order (g2=0, g1=1), then ungrouped slots in slots_config order (b=2).
    assert cfg.group_names == ("g2", "g1", "b")
    assert [cfg.group_of(s) for s in cfg.slot_names] == ["g1", "b", "g1", "g2"]
    assert cfg.prefix_of("d") == 0x0100_0000_0000_0000 == 72057594037927936
    assert cfg.prefix_of("a") == cfg.prefix_of("c") == 0x0200_0000_0000_0000 == 144115188075855872
    assert cfg.prefix_of("b") == 0x0300_0000_0000_0000 == 216172782113783808
    with pytest.raises(KeyError, match="unknown slot 'zz'"):
        cfg.prefix_of("zz")


def test_prefixes_adult_income_12_bits() -> None:
    cfg = load_embedding_config(ROOT / "examples/adult-income/config/embedding_config.yml")
    assert cfg.slot_names == ("workclass", "education", "marital_status", "occupation",
                              "relationship", "race", "gender", "native_country")
    assert cfg.prefix_of("workclass") == 1 << 52 == 4503599627370496
    assert cfg.prefix_of("native_country") == 8 << 52 == 36028797018963968
    assert all(cfg.group_of(s) == s for s in cfg.slot_names)


def test_prefix_bits_extremes() -> None:
    cfg = embedding_config_from_dict({"feature_index_prefix_bit": 63, "slots_config": {"x": {"dim": 1}}})
    assert cfg.prefix_of("x") == 2
    # 2 bits: prefixes 1 and 2 fit, a third group would need all-ones (2**2 - 1) and is refused.
    two = {f"s{i}": {"dim": 1} for i in range(2)}
    cfg = embedding_config_from_dict({"feature_index_prefix_bit": 2, "slots_config": two})
    assert cfg.prefix_of("s1") == 2 << 62 == 9223372036854775808
    three = {f"s{i}": {"dim": 1} for i in range(3)}
    with pytest.raises(ConfigError, match=r"invalid 'feature_index_prefix_bit' in f\.yml: .*3 feature groups"):
        embedding_config_from_dict({"feature_index_prefix_bit": 2, "slots_config": three}, source="f.yml")


def test_too_many_groups_counts_groups_not_slots() -> None:
    slots = {f"s{i}": {"dim": 1} for i in range(5)}
    cfg = embedding_config_from_dict(
        {"feature_index_prefix_bit": 2, "slots_config": slots, "feature_groups": {"g": ["s0", "s1", "s2", "s3"]}})
    assert cfg.group_names == ("g", "s4")


@pytest.mark.parametrize("text, key, fragment", [
    ("feature_index_prefix_bit: 0\nslots_config: {a: {dim: 1}}", "feature_index_prefix_bit", "1..63"),
    ("feature_index_prefix_bit: 64\nslots_config: {a: {dim: 1}}", "feature_index_prefix_bit", "1..63"),
    ("feature_index_prefix_bit: 1\nslots_config: {a: {dim: 1}}", "feature_index_prefix_bit", "feature groups"),
    ("slots_config: {a: {dim: 0}}", "slots_config.a.dim", ">= 1"),
    ("slots_config: {a: {dim: 1, sample_fixed_size: 0}}", "slots_config.a.sample_fixed_size", ">= 1"),
    ("slots_config: {a: {dim: 1, hash_stack_config: {hash_stack_rounds: -1}}}",
     "slots_config.a.hash_stack_config.hash_stack_rounds", ">= 0"),
    ("slots_config: {a: {dim: 1, hash_stack_config: {hash_stack_rounds: 2}}}",
     "slots_config.a.hash_stack_config.embedding_size", "must be >= 1 when hash_stack_rounds is 2"),
    ("slots_config: {a: {dim: 1, hash_stack_config: {embedding_size: 10}}}",
     "slots_config.a.hash_stack_config.hash_stack_rounds", "must be >= 1 when embedding_size is 10"),
    ("slots_config: {a: {dim: 1, pooling: mean, embedding_summation: false}}",
     "slots_config.a.pooling", "raw embeddings are not pooled"),
    ("slots_config: {a: {dim: 1, pooling: mean, sqrt_scaling: true}}",
     "slots_config.a.sqrt_scaling", "pooling: mean"),
    ("slots_config: {a: {dim: 1}}\nfeature_groups: {a: [a]}", "feature_groups.a", "named like a slot"),
    ("slots_config: {a: {dim: 1}, b: {dim: 1}}\nfeature_groups: {g: [a], h: [b, a]}",
     "feature_groups.h", "slot 'a' is already in group 'g'"),
    ("slots_config: {a: {dim: 1}}\nfeature_groups: {g: [a, a]}", "feature_groups.g", "already in group 'g'"),
    ("slots_config: {a: {dim: 1}}\nfeature_groups: {g: [a, zz]}", "feature_groups.g", "unknown slot 'zz'"),
    ("slots_config: {a: {dim: 1}}\nfeature_groups: {g: []}", "feature_groups.g", "at least one slot"),
    ("slots_config: {}", "slots_config", "at least one slot"),
])
def test_embedding_invalid(tmp_path: Path, text: str, key: str, fragment: str) -> None:
    msg, path = embedding_error(tmp_path, text)
    assert msg.startswith(f"invalid '{key}' in {path}: ")
    assert fragment in msg


def test_index_prefix_is_derived(tmp_path: Path) -> None:
    msg, path = embedding_error(tmp_path, "slots_config: {a: {dim: 1, index_prefix: 5}}")
    assert f"'slots_config.a.index_prefix' in {path} must not be set" in msg
    assert "derived" in msg


@pytest.mark.parametrize("text, key", [
    ("slot_confg: {a: {dim: 1}}", "slot_confg"),
    ("slots_config: {a: {dim: 1, dimension: 2}}", "slots_config.a.dimension"),
    ("slots_config: {a: {dim: 1, hash_stack_config: {rounds: 2}}}", "slots_config.a.hash_stack_config.rounds"),
])
def test_embedding_unknown_keys(tmp_path: Path, text: str, key: str) -> None:
    msg, path = embedding_error(tmp_path, text)
    assert msg.startswith(f"unknown key '{key}' in {path} (known: ")


def test_slot_config_misspelling_suggests_slots_config(tmp_path: Path) -> None:
    msg, path = embedding_error(tmp_path, "slots_confg:\n  a: {dim: 1}\n")
    assert msg == (f"unknown key 'slots_confg' in {path} (known: feature_index_prefix_bit, "
                   "slots_config, feature_groups); did you mean 'slots_config'?")


@pytest.mark.parametrize("text, fragment", [
    ("feature_index_prefix_bit: 8\n", "missing required key 'slots_config'"),
    ("slots_config: {a: {sample_fixed_size: 3}}", "missing required key 'slots_config.a.dim'"),
    ("slots_config: {a: {dim: true}}", "wrong type for 'slots_config.a.dim'"),
    ("slots_config: {a: {dim: 1, pooling: max}}", "wrong type for 'slots_config.a.pooling'"),
    ("slots_config: [a, b]", "wrong type for 'slots_config'"),
    ("slots_config: {a: {dim: 1}}\nfeature_groups: {g: a}", "wrong type for 'feature_groups.g'"),
    ("slots_config: {a: {dim: 1}}\nfeature_groups: {g: [1]}", "wrong type for 'feature_groups.g[0]'"),
    ("slots_config: {1: {dim: 1}}", "must be a non-empty string"),
    ("", "missing required key 'slots_config'"),
])
def test_embedding_structure_errors(tmp_path: Path, text: str, fragment: str) -> None:
    msg, path = embedding_error(tmp_path, text)
    assert fragment in msg and path in msg


# ----- immutability -----------------------------------------------------------------------------


def test_frozen(tmp_path: Path) -> None:
    g = load_global_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.common_config = g.common_config  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.embedding_parameter_server_config.capacity = 1  # type: ignore[misc]
    e = load_embedding_config(write(tmp_path, EMB))
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.feature_index_prefix_bit = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.slots_config["a"].dim = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        e.slots_config["z"] = SlotConfig(dim=1)  # type: ignore[index]
    with pytest.raises(AttributeError):
        e.slots_config._data = {}  # type: ignore[attr-defined]
    assert isinstance(e.feature_groups["g1"], tuple)
    # CPython 3.11's frozen+slots __setattr__ raises TypeError, not AttributeError, for a new name.
    with pytest.raises((AttributeError, TypeError)):
        e.new_attribute = 1  # type: ignore[attr-defined]


def test_pickle_hash_and_direct_construction(tmp_path: Path) -> None:
    e = load_embedding_config(write(tmp_path, EMB))
    assert pickle.loads(pickle.dumps(e)) == e and pickle.loads(pickle.dumps(e)).prefix_of("b") == e.prefix_of("b")
    assert hash(e) == hash(load_embedding_config(write(tmp_path, EMB, "again.yml")))
    g = load_global_config(None)
    assert pickle.loads(pickle.dumps(g)) == g and hash(g) == hash(GlobalConfig())
    direct = EmbeddingConfig(slots_config={"a": SlotConfig(dim=1)}, feature_groups={"g": ["a"]})
    assert direct.feature_groups["g"] == ("a",) and direct.prefix_of("a") == 1 << 56
    with pytest.raises(ConfigError, match=r"invalid 'dim': must be >= 1"):
        SlotConfig(dim=0)
    with pytest.raises(ConfigError, match=r"invalid 'job_name'"):
        CommonConfig(job_name="a.b")


# ----- shipped files ----------------------------------------------------------------------------


SHIPPED = sorted([*ROOT.glob("deploy/configs/*.yml"), *ROOT.glob("examples/*/config/*.yml")])


def test_shipped_files_exist() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in SHIPPED}
    assert {"deploy/configs/global_config.yml", "deploy/configs/embedding_config.yml",
            "examples/adult-income/config/global_config.yml",
            "examples/adult-income/config/embedding_config.yml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_shipped_yaml_loads(path: Path) -> None:
    # Named files pick their schema; others (local.yml, ci.yml ...) are told apart by content.
    is_embedding = "embedding" in path.name or (
        "global" not in path.name and "slots_config" in (yaml.safe_load(path.read_text()) or {}))
    if is_embedding:
        load_embedding_config(path)
    else:
        load_global_config(path)


def test_deploy_global_config_documents_every_default() -> None:
    # The documented example must show exactly the defaults, so it cannot drift from the code.
    assert load_global_config(ROOT / "deploy/configs/global_config.yml") == GlobalConfig()
    text = (ROOT / "deploy/configs/global_config.yml").read_text()
    for f in _all_field_names(GlobalConfig):
        assert re.search(rf"^\s*{f}:", text, re.M), f"{f} is not documented"


def test_deploy_embedding_config_shows_each_feature() -> None:
    cfg = load_embedding_config(ROOT / "deploy/configs/embedding_config.yml")
    slots = cfg.slots_config.values()
    assert len(cfg.feature_groups) == 1
    assert any(s.hash_stack_config.hash_stack_rounds > 0 for s in slots)
    assert any(not s.embedding_summation for s in slots)


def test_adult_income_global_config() -> None:
    cfg = load_global_config(ROOT / "examples/adult-income/config/global_config.yml")
    assert cfg.common_config.job_name == "adult"
    assert cfg.embedding_parameter_server_config.capacity == 1_000_000
    assert cfg.embedding_worker_config.forward_buffer_size == 1000
    assert (cfg.nn_worker_config.sync_mode, cfg.nn_worker_config.embedding_staleness) == ("hybrid", 10)


def _all_field_names(cls: type) -> list[str]:
    names = []
    for f in dataclasses.fields(cls):
        names.append(f.name)
        if dataclasses.is_dataclass(f.default_factory):
            names += _all_field_names(f.default_factory)  # type: ignore[arg-type]
    return names


def test_ps_tables_start_at_initial_rows() -> None:
    """A replica's tables are built for ``initial_rows`` rows from the start, as a store built by hand."""
    import numpy as np
    from persia_nats.common.config import global_config_from_dict
    from persia_nats.core.store import EmbeddingStore
    from persia_nats.services.embedding_ps.service import EmbeddingParameterServer

    cfg = global_config_from_dict({"embedding_parameter_server_config": {"capacity": 10**6, "initial_rows": 50_000}})
    ps = EmbeddingParameterServer(None, cfg)
    ids = np.arange(10, dtype=np.uint64)
    ps.store.lookup(ids, 8, train=True)
    by_hand = EmbeddingStore(10**6, initial_rows=50_000)
    by_hand.lookup(ids, 8, train=True)
    default = EmbeddingStore(10**6)
    default.lookup(ids, 8, train=True)
    assert ps.store.tables[8].memory_bytes() == by_hand.tables[8].memory_bytes() > default.tables[8].memory_bytes()


def test_every_error_of_a_file_is_reported_at_once(tmp_path: Path) -> None:
    """Not one per run: an unknown key, a mistyped value and values breaking rules, in several sections
    and two in one section, all in the one error."""
    msg, path = global_error(tmp_path, """
common_config:
  job_name: 'a.b'
  metrics_config: {port: 70000}
embedding_parameter_server_config: {capacity: 0, initial_rows: -1}
embedding_worker_config: {forward_buffr_size: 3}
nn_worker_config: {sync_mode: semi}
""")
    lines = msg.splitlines()
    assert lines[0] == f"6 errors in {path}:"
    assert sorted(line.strip().split(" in ")[0] for line in lines[1:]) == [
        "invalid 'common_config.job_name'", "invalid 'common_config.metrics_config.port'",
        "invalid 'embedding_parameter_server_config.capacity'",
        "invalid 'embedding_parameter_server_config.initial_rows'",
        "unknown key 'embedding_worker_config.forward_buffr_size'", "wrong type for 'nn_worker_config.sync_mode'"]
    assert "did you mean 'forward_buffer_size'?" in msg and "got 70000" in msg


def test_a_broken_rule_is_reported_once_and_a_slot_missing_its_dim_with_the_others(tmp_path: Path) -> None:
    # embedding_size -5 breaks its own rule, and with its default (0) in its place the rule tied to
    # hash_stack_rounds: one line for the key, not two
    msg, path = embedding_error(tmp_path, """
slots_config:
  a: {dim: 0}
  b: {sample_fixed_size: 3}
  c: {dim: 2, hash_stack_config: {hash_stack_rounds: 2, embedding_size: -5}}
""")
    assert msg.splitlines() == [
        f"3 errors in {path}:",
        f"  invalid 'slots_config.a.dim' in {path}: must be >= 1, got 0",
        f"  missing required key 'slots_config.b.dim' in {path}",
        f"  invalid 'slots_config.c.hash_stack_config.embedding_size' in {path}: must be >= 0, got -5"]
