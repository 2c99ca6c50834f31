"""Tests for common.env: defaults, parsing and the errors for each bad variable."""

from __future__ import annotations

import dataclasses

import pytest

from common.env import Env, read_env
from common.errors import ConfigError


def test_defaults() -> None:
    env = read_env({})
    assert env == Env()
    assert env.nats_url == "nats://127.0.0.1:4222"
    assert env.nats_servers == ["nats://127.0.0.1:4222"]
    assert (env.global_config, env.embedding_config, env.nn_worker_entry, env.dataloader_entry) == (
        None, None, None, None)
    assert env.log_level == "info"
    assert (env.replica_index, env.replica_size, env.rank, env.local_rank, env.world_size) == (0, 1, 0, 0, 1)
    assert env.job_name is None


def test_every_variable_read() -> None:
    env = read_env({
        "PERSIA_NATS_URL": "nats://n1:4222",
        "PERSIA_GLOBAL_CONFIG": "/cfg/global_config.yml",
        "PERSIA_EMBEDDING_CONFIG": "/cfg/embedding_config.yml",
        "PERSIA_NN_WORKER_ENTRY": "train.py",
        "PERSIA_DATALOADER_ENTRY": "data_loader.py",
        "LOG_LEVEL": "WARNING",
        "REPLICA_INDEX": "2",
        "REPLICA_SIZE": "3",
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "PERSIA_JOB_NAME": "adult-1",
    })
    assert env == Env(
        nats_url="nats://n1:4222", global_config="/cfg/global_config.yml",
        embedding_config="/cfg/embedding_config.yml", nn_worker_entry="train.py",
        dataloader_entry="data_loader.py", log_level="warning", replica_index=2, replica_size=3,
        rank=5, local_rank=1, world_size=8, job_name="adult-1")


def test_unrelated_and_empty_variables_ignored() -> None:
    env = read_env({"HOME": "/root", "RANK": "", "PERSIA_GLOBAL_CONFIG": "  ", "LOG_LEVEL": ""})
    assert env == Env()


def test_nats_url_list() -> None:
    env = read_env({"PERSIA_NATS_URL": " nats://a:4222, nats://b:4223 ,,nats://c:4224,"})
    assert env.nats_servers == ["nats://a:4222", "nats://b:4223", "nats://c:4224"]
    assert env.nats_url == "nats://a:4222,nats://b:4223,nats://c:4224"


@pytest.mark.parametrize("level", ["debug", "INFO", "Warning", "error", "CRITICAL"])
def test_log_levels_case_insensitive(level: str) -> None:
    assert read_env({"LOG_LEVEL": level}).log_level == level.lower()


@pytest.mark.parametrize("environ, fragment", [
    ({"REPLICA_INDEX": "one"}, "REPLICA_INDEX='one' is not an integer"),
    ({"REPLICA_INDEX": "1.0"}, "REPLICA_INDEX='1.0' is not an integer"),
    ({"REPLICA_INDEX": "-1"}, "REPLICA_INDEX='-1' must be >= 0"),
    ({"REPLICA_SIZE": "0"}, "REPLICA_SIZE='0' must be >= 1"),
    ({"REPLICA_SIZE": "x"}, "REPLICA_SIZE='x' is not an integer"),
    ({"REPLICA_INDEX": "2", "REPLICA_SIZE": "2"}, "REPLICA_INDEX=2 must be less than REPLICA_SIZE=2"),
    ({"REPLICA_INDEX": "1"}, "REPLICA_INDEX=1 must be less than REPLICA_SIZE=1"),
    ({"RANK": "-3"}, "RANK='-3' must be >= 0"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 must be less than WORLD_SIZE=4"),
    ({"LOCAL_RANK": "gpu0"}, "LOCAL_RANK='gpu0' is not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be >= 1"),
    ({"LOG_LEVEL": "verbose"}, "LOG_LEVEL='verbose' is not a log level"),
    ({"LOG_LEVEL": "warn"}, "LOG_LEVEL='warn' is not a log level"),
    ({"PERSIA_JOB_NAME": "a.b"}, "PERSIA_JOB_NAME='a.b' must match"),
    ({"PERSIA_JOB_NAME": "a*"}, "PERSIA_JOB_NAME='a*' must match"),
    ({"PERSIA_NATS_URL": ", ,"}, "PERSIA_NATS_URL=', ,' names no server"),
    ({"PERSIA_NATS_URL": "nats://a b:4222"}, "contains whitespace"),
])
def test_bad_values(environ: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        read_env(environ)
    assert fragment in str(info.value)


def test_frozen_and_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    env = read_env({"RANK": "0"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.rank = 1  # type: ignore[misc]
    # Two environments in one process give two answers: nothing is cached.
    assert read_env({"WORLD_SIZE": "2", "RANK": "1"}).rank == 1
    assert read_env({}).rank == 0
    monkeypatch.setenv("PERSIA_JOB_NAME", "from-os-environ")
    assert read_env().job_name == "from-os-environ"
