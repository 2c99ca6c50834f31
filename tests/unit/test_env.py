"""Tests for persia_nats.common.env: defaults, parsing and the errors for each bad variable."""

from __future__ import annotations

import dataclasses

import pytest
from persia_nats.common.env import Env, read_env
from persia_nats.common.errors import ConfigError


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


# --- NATS credentials and TLS -------------------------------------------------------------------


def test_no_credentials_by_default() -> None:
    env = read_env({})
    assert (env.nats_user, env.nats_password, env.nats_token, env.nats_creds, env.nats_nkey_seed) == (None,) * 5
    assert (env.nats_tls_ca, env.nats_tls_cert, env.nats_tls_key, env.nats_tls_hostname) == (None,) * 4
    assert env.nats_options() == {}


def test_user_and_password_options_and_secrets_kept_out_of_repr() -> None:
    env = read_env({"PERSIA_NATS_USER": "ps", "PERSIA_NATS_PASSWORD": "hunter2-secret"})
    assert env.nats_options() == {"user": "ps", "password": "hunter2-secret", "inbox_prefix": "_INBOX.ps"}
    assert "hunter2-secret" not in repr(env) and "nats_user='ps'" in repr(env)
    token = read_env({"PERSIA_NATS_TOKEN": "tok-secret"})
    assert token.nats_options() == {"token": "tok-secret"}
    assert "tok-secret" not in repr(token)


def test_credential_files_must_exist(tmp_path) -> None:
    creds, seed = tmp_path / "user.creds", tmp_path / "user.nk"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    seed.write_text("SUAEXAMPLE\n")
    assert read_env({"PERSIA_NATS_CREDS": str(creds)}).nats_creds == str(creds)
    assert read_env({"PERSIA_NATS_NKEY_SEED": str(seed)}).nats_nkey_seed == str(seed)
    for var in ("PERSIA_NATS_CREDS", "PERSIA_NATS_NKEY_SEED", "PERSIA_NATS_TLS_CA"):
        with pytest.raises(ConfigError, match=f"{var}='{tmp_path}/missing': no such file"):
            read_env({var: str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="PERSIA_NATS_CREDS=.*no such file"):
        read_env({"PERSIA_NATS_CREDS": str(tmp_path)})  # a folder is not a file


def test_nkeys_options_need_the_nkeys_package(tmp_path) -> None:
    import importlib.util

    seed = tmp_path / "user.nk"
    seed.write_text("SUAEXAMPLE\n")
    env = read_env({"PERSIA_NATS_NKEY_SEED": str(seed)})
    if importlib.util.find_spec("nkeys") is None:
        with pytest.raises(ConfigError, match="PERSIA_NATS_NKEY_SEED needs the nkeys package"):
            env.nats_options()
    else:
        assert env.nats_options() == {"nkeys_seed": str(seed)}


@pytest.mark.parametrize("environ, fragment", [
    ({"PERSIA_NATS_USER": "ps"}, "PERSIA_NATS_USER is set but PERSIA_NATS_PASSWORD is not"),
    ({"PERSIA_NATS_PASSWORD": "pw"}, "PERSIA_NATS_PASSWORD is set but PERSIA_NATS_USER is not"),
    ({"PERSIA_NATS_USER": "ps", "PERSIA_NATS_PASSWORD": "pw", "PERSIA_NATS_TOKEN": "t"},
     "PERSIA_NATS_USER/PERSIA_NATS_PASSWORD and PERSIA_NATS_TOKEN cannot be combined"),
    ({"PERSIA_NATS_TOKEN": "t", "PERSIA_NATS_CREDS": "CREDS"}, "PERSIA_NATS_TOKEN and PERSIA_NATS_CREDS cannot"),
    ({"PERSIA_NATS_CREDS": "CREDS", "PERSIA_NATS_NKEY_SEED": "CREDS"},
     "PERSIA_NATS_CREDS and PERSIA_NATS_NKEY_SEED cannot be combined"),
    ({"PERSIA_NATS_TOKEN": "t", "PERSIA_NATS_URL": "nats://ps:pw@nats:4222"},
     "PERSIA_NATS_URL holds credentials and PERSIA_NATS_TOKEN is set"),
    ({"PERSIA_NATS_TLS_CERT": "CREDS"}, "PERSIA_NATS_TLS_CERT is set but PERSIA_NATS_TLS_KEY is not"),
    ({"PERSIA_NATS_TLS_KEY": "CREDS"}, "PERSIA_NATS_TLS_KEY is set but PERSIA_NATS_TLS_CERT is not"),
])
def test_contradictory_credentials_refused(tmp_path, environ: dict[str, str], fragment: str) -> None:
    some_file = tmp_path / "f"
    some_file.write_text("x")
    environ = {k: str(some_file) if v == "CREDS" else v for k, v in environ.items()}
    with pytest.raises(ConfigError) as info:
        read_env(environ)
    assert fragment in str(info.value)
    assert "pw" not in str(info.value).replace("PASSWORD", "")  # no secret in the message


def test_credentials_in_the_url_alone_are_accepted() -> None:
    assert read_env({"PERSIA_NATS_URL": "nats://ps:pw@nats:4222"}).nats_options() == {}


def test_tls_files_must_hold_pem(tmp_path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ConfigError, match="PERSIA_NATS_TLS_CA=.*not a PEM CA file"):
        read_env({"PERSIA_NATS_TLS_CA": str(junk)}).nats_options()
    with pytest.raises(ConfigError, match="PERSIA_NATS_TLS_CERT=.*not a PEM certificate and its key"):
        read_env({"PERSIA_NATS_TLS_CERT": str(junk), "PERSIA_NATS_TLS_KEY": str(junk)}).nats_options()


def test_tls_hostname_alone_verifies_with_the_system_cas() -> None:
    import ssl

    options = read_env({"PERSIA_NATS_TLS_HOSTNAME": "nats.example"}).nats_options()
    assert isinstance(options["tls"], ssl.SSLContext) and options["tls"].verify_mode == ssl.CERT_REQUIRED
    assert options["tls_hostname"] == "nats.example"


@pytest.mark.parametrize("url", ["nats://127.0.0.1:4222", "127.0.0.1:4222", "tls://u:p@nats:4443", "localhost",
                                 "wss://proxy.example/nats", "nats://a:1,nats://b:2"])
def test_nats_urls_nats_py_can_dial_pass(url):
    assert read_env({"PERSIA_NATS_URL": url}).nats_url == url


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:4222", "scheme 'http'"), ("nats//127.0.0.1:4222", r"is not \[nats://\]host"),
    ("nats://h:99999", "is not host:port"), ("nats://h:4222/path", r"is not \[nats://\]host"),
    ("nats://a:1,https://b:2", "scheme 'https'")])
def test_nats_urls_with_a_wrong_scheme_or_shape_are_refused(url, message):
    with pytest.raises(ConfigError, match=f"PERSIA_NATS_URL: server .*{message}"):
        read_env({"PERSIA_NATS_URL": url})


def test_connect_timeout_must_be_positive_seconds():
    assert read_env({"PERSIA_NATS_CONNECT_TIMEOUT": "2.5"}).nats_connect_timeout == 2.5
    for raw in ("0", "-1", "soon", "inf"):
        with pytest.raises(ConfigError, match=f"PERSIA_NATS_CONNECT_TIMEOUT={raw!r}"):
            read_env({"PERSIA_NATS_CONNECT_TIMEOUT": raw})


def test_metrics_port_turns_metrics_on_at_that_port() -> None:
    from persia_nats.common.config import GlobalConfig
    from persia_nats.common.settings import global_config_from_env, with_metrics_port

    assert read_env({}).metrics_port is None
    assert read_env({"PERSIA_METRICS_PORT": "9400"}).metrics_port == 9400
    for raw in ("http", "-1", "65536", "94.0"):
        with pytest.raises(ConfigError, match=f"PERSIA_METRICS_PORT={raw!r}: expected a port number"):
            read_env({"PERSIA_METRICS_PORT": raw})
    off = global_config_from_env(read_env({})).common_config.metrics_config
    assert not off.enable_metrics
    on = global_config_from_env(read_env({"PERSIA_METRICS_PORT": "9400"})).common_config.metrics_config
    assert on.enable_metrics and on.port == 9400
    assert dataclasses.replace(off, enable_metrics=True, port=9400) == on  # nothing else changes
    # a role's --port still wins, as on the command line
    cfg = with_metrics_port(global_config_from_env(read_env({"PERSIA_METRICS_PORT": "9400"})), 9500)
    assert isinstance(cfg, GlobalConfig) and cfg.common_config.metrics_config.port == 9500
