"""A PERSIA user's files, variables and API calls work here unchanged; a typo still fails.

PERSIA's published configs (tests/data/persia/, verbatim) load: its spellings of our keys are read as
ours, its keys that do nothing here are accepted with one warning each naming the key and why.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
from persia_nats.common.config import (
    GlobalConfig,
    MetricsConfig,
    embedding_config_from_dict,
    global_config_from_dict,
    load_embedding_config,
    load_global_config,
)
from persia_nats.common.env import read_env
from persia_nats.common.errors import ConfigError
from persia_nats.common.settings import global_config_from_env

from persia.stay import cat_follows

PERSIA = Path(__file__).resolve().parents[1] / "data" / "persia"
GLOBAL = PERSIA / "getting_started_global_config.yml"
EMBEDDING = PERSIA / "adult_income_embedding_config.yml"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_persias_getting_started_global_config_loads(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        cfg = load_global_config(GLOBAL)
    ps = cfg.embedding_parameter_server_config
    assert (ps.capacity, ps.num_hashmap_internal_shards, ps.incremental_buffer_size) == (1_000_000, 1, 5_000_000)
    assert cfg.embedding_worker_config.forward_buffer_size == 1000
    assert cfg.common_config.metrics_config.push_interval_seconds == 10
    warned = warnings_of(caplog)
    # PERSIA's keys with no effect, and ours set to a value nothing reads: one line each, naming key and why
    for key in ("common_config.num_embedding_io_workers", "embedding_parameter_server_config.num_embedding_io_workers",
                "embedding_parameter_server_config.incremental_channel_capacity",
                "embedding_parameter_server_config.num_hashmap_internal_shards"):
        assert sum(f"'{key}'" in w and "no effect here: " in w for w in warned) == 1, (key, warned)
    # incremental updates are built: their keys are read, not warned of
    assert not any("incremental_buffer_size" in w for w in warned), warned
    assert len(warned) == 4, warned
    assert any("'common_config.metrics_config.push_interval_sec'" in r.getMessage() and "spelling of" in r.getMessage()
               for r in caplog.records if r.levelno == logging.INFO)


def test_persias_adult_income_embedding_config_loads(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = load_embedding_config(EMBEDDING)
    assert cfg.feature_index_prefix_bit == 12 and len(cfg.slot_names) == 8
    assert {s.dim for s in cfg.slots_config.values()} == {8}
    warned = warnings_of(caplog)
    assert len(warned) == 8 and all("capacity' in" in w and "no per-slot capacity" in w for w in warned), warned


@pytest.mark.parametrize("persia, ours", [
    ({"common_config": {"metrics_config": {"push_interval_sec": 30}}},
     {"common_config": {"metrics_config": {"push_interval_seconds": 30}}}),
    ({"common_config": {"infer_config": {"initial_sparse_checkpoint": "/c"}}},
     {"common_config": {"infer_config": {"embedding_checkpoint": "/c"}}}),
    ({"middleware_config": {"forward_buffer_size": 7}}, {"embedding_worker_config": {"forward_buffer_size": 7}}),
    ({"embedding_server_config": {"capacity": 9}}, {"embedding_parameter_server_config": {"capacity": 9}}),
    ({"shard_server_config": {"capacity": 9}}, {"embedding_parameter_server_config": {"capacity": 9}}),
    ({"PersiaMetricsConfig": {"enable_metrics": True, "job_name": "dlrm_v1"}, "common_config": {"job_name": "j"}},
     {"common_config": {"job_name": "j", "metrics_config": {"enable_metrics": True, "job_name": "dlrm_v1"}}}),
])
def test_persia_spellings_mean_ours(persia: dict, ours: dict) -> None:
    assert global_config_from_dict(persia) == global_config_from_dict(ours)


@pytest.mark.parametrize("key", ["slot_config", "slot_configs"])
def test_persia_spellings_of_slots_config(key: str) -> None:
    assert embedding_config_from_dict({key: {"a": {"dim": 4}}}) == embedding_config_from_dict(
        {"slots_config": {"a": {"dim": 4}}})


@pytest.mark.parametrize("data, both", [
    ({"common_config": {"metrics_config": {"push_interval_sec": 5, "push_interval_seconds": 5}}},
     "'common_config.metrics_config.push_interval_sec' (PERSIA's spelling of 'common_config.metrics_config."
     "push_interval_seconds') and 'common_config.metrics_config.push_interval_seconds' are both set"),
    ({"middleware_config": {}, "embedding_worker_config": {}}, "'middleware_config'"),
    ({"embedding_server_config": {}, "shard_server_config": {}}, "'embedding_server_config' are both set"),
    ({"PersiaMetricsConfig": {}, "common_config": {"metrics_config": {}}}, "'common_config.metrics_config'"),
])
def test_a_persia_spelling_and_ours_together_are_refused(data: dict, both: str) -> None:
    with pytest.raises(ConfigError, match="keep one") as info:
        global_config_from_dict(data, source="g.yml")
    assert both in str(info.value)


def test_every_typo_of_a_file_is_reported_at_once_with_its_closest_key() -> None:
    with pytest.raises(ConfigError) as info:
        global_config_from_dict({
            "common_config": {"jobname": "x", "num_embedding_io_worker": 4},
            "embedding_parameter_server_config": {"incremental_channel_capactiy": 1},
            "embedding_worker_config": {"forward_bufer_size": 1},
        }, source="g.yml")
    lines = str(info.value).splitlines()
    assert lines[0] == "4 unknown keys in g.yml:"
    assert [line.split("'")[1] for line in lines[1:]] == [
        "common_config.jobname", "common_config.num_embedding_io_worker",
        "embedding_parameter_server_config.incremental_channel_capactiy", "embedding_worker_config.forward_bufer_size"]
    # the closest key accepted, PERSIA's included
    assert [line.rsplit("did you mean ", 1)[1] for line in lines[1:]] == [
        "'job_name'?", "'num_embedding_io_workers'?", "'incremental_channel_capacity'?", "'forward_buffer_size'?"]


def test_unknown_keys_of_every_slot_are_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        embedding_config_from_dict({"slots_config": {"a": {"dim": 1, "capcity": 2}, "b": {"dim": 1, "dimm": 1}}})
    text = str(info.value)
    assert text.startswith("2 unknown keys in <dict>:")
    assert "'slots_config.a.capcity'" in text and "did you mean 'capacity'?" in text
    assert "'slots_config.b.dimm'" in text and "did you mean 'dim'?" in text


def test_our_unused_keys_warn_only_when_set_otherwise(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        global_config_from_dict({"common_config": {"job_type": "Train", "checkpointing_config": {"num_workers": 4}}})
    assert warnings_of(caplog) == []
    with caplog.at_level(logging.WARNING):
        global_config_from_dict({"common_config": {"job_type": "Infer"}}, source="g.yml")
    (line,) = warnings_of(caplog)
    assert line.startswith("config key 'common_config.job_type' in g.yml is set to 'Infer', which has no effect here")
    assert "persia-launcher serve" in line


# ----- metrics_config.job_name -------------------------------------------------------------------


def test_metrics_job_name_defaults_to_the_jobs_name() -> None:
    assert GlobalConfig().common_config.metrics_config.job_name == "persia"
    assert MetricsConfig().job_name == "persia"
    cfg = global_config_from_dict({"common_config": {"job_name": "ctr-v2"}})
    assert cfg.common_config.metrics_config.job_name == "ctr-v2"


def test_metrics_job_name_follows_persia_job_name_unless_set(tmp_path: Path) -> None:
    path = tmp_path / "g.yml"
    path.write_text("common_config: {job_name: a, metrics_config: {enable_metrics: true}}\n")
    env = read_env({"PERSIA_GLOBAL_CONFIG": str(path), "PERSIA_JOB_NAME": "b", "PERSIA_METRICS_PORT": "0"})
    assert global_config_from_env(env).common_config.metrics_config.job_name == "b"
    path.write_text("common_config: {job_name: a, metrics_config: {job_name: mine}}\n")
    common = global_config_from_env(env).common_config
    assert (common.job_name, common.metrics_config.job_name) == ("b", "mine")
    # replaced again later (the launcher's --port), it still follows the job
    metrics = dataclasses.replace(common.metrics_config, port=9)
    assert dataclasses.replace(common, metrics_config=metrics).metrics_config.job_name == "mine"
    derived = GlobalConfig().common_config
    moved = dataclasses.replace(derived, metrics_config=dataclasses.replace(derived.metrics_config, port=9))
    assert dataclasses.replace(moved, job_name="c").metrics_config.job_name == "c"


# ----- PERSIA_NATS_IP ----------------------------------------------------------------------------


@pytest.mark.parametrize("environ, url", [
    ({"PERSIA_NATS_IP": "nats://0.0.0.0:4222"}, "nats://0.0.0.0:4222"),  # PERSIA's .honcho.env
    ({"PERSIA_NATS_IP": "10.0.0.5"}, "nats://10.0.0.5:4222"),
    ({"PERSIA_NATS_IP": "nats-svc:5222"}, "nats://nats-svc:5222"),
    ({"PERSIA_NATS_IP": "a:1, b:2"}, "nats://a:1,nats://b:2"),
    ({"PERSIA_NATS_IP": "  "}, "nats://127.0.0.1:4222"),
    ({"PERSIA_NATS_URL": "nats://x:1", "PERSIA_NATS_IP": "nats://x:1"}, "nats://x:1"),
])
def test_persia_nats_ip_is_read(environ: dict[str, str], url: str) -> None:
    assert read_env(environ).nats_url == url


def test_persia_nats_url_wins_over_persia_nats_ip_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        env = read_env({"PERSIA_NATS_URL": "nats://ours:1", "PERSIA_NATS_IP": "nats://theirs:2"})
        read_env({"PERSIA_NATS_URL": "nats://ours:1", "PERSIA_NATS_IP": "nats://theirs:2"})
    assert env.nats_url == "nats://ours:1"
    assert warnings_of(caplog) == ["PERSIA_NATS_URL=nats://ours:1 and PERSIA_NATS_IP=nats://theirs:2 are both set: "
                                   "using PERSIA_NATS_URL"]  # once, however often the environment is read


def test_a_bad_persia_nats_ip_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^PERSIA_NATS_IP: server 'http://h:1' has scheme 'http'"):
        read_env({"PERSIA_NATS_IP": "http://h:1"})


# ----- the user API as PERSIA's tutorials and examples write it ----------------------------------


def test_dataloader_spelling() -> None:
    from persia.data import DataLoader, Dataloader

    assert Dataloader is DataLoader


@pytest.mark.parametrize("cls_name", ["IDTypeFeature", "IDTypeFeatureWithSingleID"])
def test_id_feature_takes_name_and_data_in_either_order(cls_name: str) -> None:
    import persia.embedding.data as data

    cls = getattr(data, cls_name)
    ids = np.array([3, 4], dtype=np.uint64) if cls_name.endswith("SingleID") else [np.array([3], np.uint64)] * 2
    a, b = cls("slot", ids), cls(ids, "slot")
    assert a.name == b.name == "slot" and a.batch_size == b.batch_size == 2
    assert np.array_equal(a.jagged.values, b.jagged.values)
    with pytest.raises(TypeError, match=rf"{cls_name} takes a non-empty str name and the ids, in either order"):
        cls(ids, ids)
    with pytest.raises(TypeError, match=rf"{cls_name} 'slot': data must be the ids"):
        cls("slot", "other")
    with pytest.raises(TypeError, match="got str and"):
        cls("", ids)


# ----- PERSIA's Procfile line `python3 data_loader.py && cat` ------------------------------------


@pytest.mark.parametrize("argv, follows", [
    (["/bin/sh", "-c", "python3 data_loader.py && cat "], True),  # PERSIA's line, its trailing blank included
    (["sh", "-c", "python3 data_loader.py &&cat"], True),
    (["/bin/sh", "-c", "python3 data_loader.py"], False),
    (["/bin/sh", "-c", "python3 data_loader.py && cat log.txt"], False),
    (["/bin/sh", "-c", "python3 data_loader.py && catalog"], False),
    ([".venv/bin/python", "-m", "persia.launcher", "data-loader", "x.py"], False),
    ([], False),
])
def test_cat_follows(argv: list[str], follows: bool) -> None:
    assert cat_follows(argv) is follows


# ----- the rest of PERSIA's Python API: honoured, accepted with a warning, or refused saying what instead -----


def test_setup_seed_seeds_every_generator() -> None:
    import random

    import torch

    from persia.utils import setup_seed

    try:
        draws = []
        for _ in range(2):
            setup_seed(3)
            draws.append((random.random(), float(np.random.rand()), float(torch.rand(1))))
        assert draws[0] == draws[1]
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_yaml_helpers_and_free_port(tmp_path: Path) -> None:
    from persia.utils import dump_yaml, find_free_port, load_yaml

    dump_yaml({"slots_config": {"a": {"dim": 8}}}, tmp_path / "c.yml")
    assert load_yaml(tmp_path / "c.yml") == {"slots_config": {"a": {"dim": 8}}}
    with pytest.raises(FileNotFoundError, match="missing.yml not found"):
        load_yaml(tmp_path / "missing.yml")
    assert 0 < find_free_port() < 65536


def _model_and_optimizers() -> tuple[object, object, object]:
    import torch

    from persia.embedding.optim import Adagrad

    model = torch.nn.Linear(2, 1)
    return model, Adagrad(lr=1e-2), torch.optim.SGD(model.parameters(), lr=0.1)


def test_train_ctx_takes_persias_engine_arguments_with_one_warning_each(caplog: pytest.LogCaptureFixture) -> None:
    from persia.ctx import TrainCtx

    model, emb, dense = _model_and_optimizers()
    with caplog.at_level(logging.WARNING):
        # PERSIA's positional order: grad_scalar_update_factor, backward_buffer_size, backward_workers_size,
        # grad_update_buffer_size, lookup_emb_directly, mixed_precision, distributed_option
        ctx = TrainCtx(emb, dense, 4, 10, 8, 60, True, False, None, model=model, threadpool_worker_size=10)
    assert ctx.mixed_precision is False and ctx.model is model
    warned = warnings_of(caplog)
    for name in ("grad_scalar_update_factor", "backward_buffer_size", "backward_workers_size",
                 "grad_update_buffer_size", "lookup_emb_directly", "threadpool_worker_size"):
        assert sum(f"TrainCtx({name}=" in w and "has no effect here: " in w for w in warned) == 1, (name, warned)


def test_train_ctx_still_refuses_what_persia_refused_and_what_neither_has() -> None:
    from persia.ctx import TrainCtx

    model, emb, dense = _model_and_optimizers()
    with pytest.raises(ValueError, match=r"grad_scalar_update_factor=0\): must be greater than zero"):
        TrainCtx(emb, dense, grad_scalar_update_factor=0, model=model)
    with pytest.raises(TypeError, match="unexpected keyword argument 'backward_bufer_size'"):
        TrainCtx(emb, dense, model=model, backward_bufer_size=10)
    with pytest.raises(TypeError, match="multiple values for argument 'mixed_precision'"):
        TrainCtx(emb, dense, 4, 10, 8, 60, True, False, model=model, mixed_precision=True)
    with pytest.raises(TypeError, match="at most 9 positional arguments"):
        TrainCtx(emb, dense, 4, 10, 8, 60, True, False, None, "extra", model=model)


def test_distributed_options(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from persia.ctx import TrainCtx
    from persia.distributed import BaguaDistributedOption, DDPOption, get_default_distributed_option

    with pytest.raises(NotImplementedError, match=r"Bagua is not supported here.*persia.distributed.DDPOption\(\)"):
        BaguaDistributedOption("gradient_allreduce")
    with pytest.raises(ValueError, match=r"backend='mpi'"):
        DDPOption(backend="mpi")
    with pytest.raises(TypeError, match=r"unexpected options \['bucket_size'\]"):
        DDPOption(bucket_size=1)
    assert get_default_distributed_option().backend == "gloo" and get_default_distributed_option(0).backend == "nccl"
    model, emb, dense = _model_and_optimizers()
    with pytest.raises(TypeError, match="distributed_option must be a persia.distributed.DDPOption, got str"):
        TrainCtx(emb, dense, distributed_option="ddp", model=model, device_id=None)
    monkeypatch.delenv("PERSIA_MASTER_ADDR", raising=False)
    with caplog.at_level(logging.WARNING):
        TrainCtx(emb, dense, distributed_option=DDPOption(backend="nccl", master_port=1234, master_addr="10.0.0.1"),
                 model=model, device_id=None)
    warned = "\n".join(warnings_of(caplog))
    assert "DDPOption(backend='nccl') has no effect here: this rank trains on cpu and all-reduces with gloo" in warned
    assert "DDPOption(master_port=1234) has no effect here" in warned
    assert os.environ["PERSIA_MASTER_ADDR"] == "10.0.0.1"  # where rank 0's store listens (dense_sync)


@pytest.mark.parametrize("module, name, instead", [
    ("persia.ctx", "BaseCtx", "use DataCtx in data loaders"),
    ("persia.prelude", "PersiaBatchDataSender", "use an IterableDataset subclass"),
    ("persia.prelude", "PyPersiaBatchData", "use persia.embedding.data.PersiaBatch("),
    ("persia.prelude", "is_cuda_feature_available", "use torch.cuda.is_available()"),
    ("persia.data", "PersiaDataset", "subclass persia.data.IterableDataset"),
])
def test_persia_names_not_here_say_what_to_use(module: str, name: str, instead: str) -> None:
    import importlib

    with pytest.raises(AttributeError, match=re.escape(instead)):
        getattr(importlib.import_module(module), name)


def test_persia_services_not_here_say_what_to_use() -> None:
    from persia.ctx import InferCtx
    from persia.helper import PersiaServiceCtx, ensure_persia_service
    from persia.service import get_embedding_worker_services

    with pytest.raises(NotImplementedError, match="persia-launcher serve"):
        InferCtx(["embedding_worker:8887"])
    with pytest.raises(NotImplementedError, match="EMBEDDING_WORKER_SERVICE is not read"):
        get_embedding_worker_services()
    for refused in (ensure_persia_service, PersiaServiceCtx):
        with pytest.raises(NotImplementedError, match="persia-launcher procfile"):
            refused()


def test_persias_other_spellings() -> None:
    from persia.data import DataLoader, Dataloder
    from persia.embedding.data import IDTypeFeature, IDTypeFeatureSparse

    assert Dataloder is DataLoader and IDTypeFeatureSparse is IDTypeFeature


def test_env_set_and_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    from persia.env import get_rank, get_world_size, reload_env, set_env

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    set_env(rank=1, world_size=2)
    reload_env()
    assert (get_rank(), get_world_size()) == (1, 2)
    with pytest.raises(TypeError, match=r"unknown names \['rnak'\]"):
        set_env(rnak=1)


def test_persia_only_variables_each_get_a_line() -> None:
    from persia.env import PERSIA_ONLY_VARS, persia_only_vars

    lines = persia_only_vars({**{name: "x" for name in PERSIA_ONLY_VARS}, "PERSIA_CKPT_DIR": "/ckpt"})
    assert len(lines) == len(PERSIA_ONLY_VARS) + 1
    assert lines[0].startswith("PERSIA_METRICS_GATEWAY_ADDR='x' has no effect here: nothing pushes to a Prometheus")
    assert "set PERSIA_CHECKPOINT_DIR to it too" in lines[-1]
    assert persia_only_vars({"PERSIA_CKPT_DIR": "/ckpt", "PERSIA_CHECKPOINT_DIR": "/ckpt", "PERSIA_NATS_IP": "h"}) == []


@pytest.mark.parametrize("via_env", [False, True])
def test_an_entry_that_is_a_folder_is_one_clear_line(tmp_path: Path, via_env: bool, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from persia.launcher import main

    (tmp_path / "train.py").write_text("")
    argv = ["nn-worker"]
    if via_env:
        monkeypatch.setenv("PERSIA_NN_WORKER_ENTRY", str(tmp_path))
    else:
        argv.append(str(tmp_path))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    who = "PERSIA_NN_WORKER_ENTRY" if via_env else "the script"
    assert err[-1] == (f"persia-launcher: {who} {str(tmp_path)!r} is a folder (it holds train.py): give the "
                       f"script's own path, e.g. {tmp_path / 'train.py'}")


def test_persias_context_methods_not_here_say_what_to_use() -> None:
    from persia.ctx import TrainCtx, eval_ctx
    from persia.nn_contexts import REFUSED_METHODS

    model, emb, dense = _model_and_optimizers()
    for ctx in (TrainCtx(emb, dense, model=model), eval_ctx(model=model)):
        for name, instead in REFUSED_METHODS.items():
            with pytest.raises(NotImplementedError, match=re.escape(f".{name}() is PERSIA's and not supported here: "
                                                                    f"use {instead}")):
                getattr(ctx, name)("dir")


def test_data_loader_says_which_persia_arguments_do_nothing(caplog: pytest.LogCaptureFixture) -> None:
    from persia.data import DataLoader, StreamingDataset

    with caplog.at_level(logging.WARNING):
        DataLoader(StreamingDataset(10), reproducible=False)
        assert warnings_of(caplog) == []  # PERSIA's defaults say nothing
        loader = DataLoader(StreamingDataset(10), 4, 1000, 2, True, 3)
    assert (loader.forward_buffer_size, loader.timeout_s, loader.embedding_staleness) == (4, 1.0, 3)
    warned = warnings_of(caplog)
    assert warned[0].startswith("DataLoader(num_workers=2) has no effect here: ")
    assert warned[1].startswith("DataLoader(reproducible=True) has no effect here: batches train in the order")
