"""The one place where the environment and the YAML files combine into a process's settings."""

from __future__ import annotations

import dataclasses

from persia_nats.common.config import GlobalConfig, load_global_config
from persia_nats.common.env import Env


def global_config_from_env(env: Env, path: str | None = None) -> GlobalConfig:
    """Load global_config.yml (``path`` or ``PERSIA_GLOBAL_CONFIG``).

    ``PERSIA_JOB_NAME`` overrides its job name, ``PERSIA_CHECKPOINT_DIR`` its checkpoint root, and
    ``PERSIA_METRICS_PORT`` turns metrics on at that port.
    """
    cfg = load_global_config(path or env.global_config)
    if env.job_name:
        cfg = dataclasses.replace(cfg, common_config=dataclasses.replace(cfg.common_config, job_name=env.job_name))
    if env.checkpoint_dir:
        common = cfg.common_config
        checkpointing = dataclasses.replace(common.checkpointing_config, checkpoint_dir=env.checkpoint_dir)
        cfg = dataclasses.replace(cfg, common_config=dataclasses.replace(common, checkpointing_config=checkpointing))
    if env.metrics_port is not None:
        common = cfg.common_config
        metrics = dataclasses.replace(common.metrics_config, enable_metrics=True, port=env.metrics_port)
        cfg = dataclasses.replace(cfg, common_config=dataclasses.replace(common, metrics_config=metrics))
    return cfg


def with_metrics_port(cfg: GlobalConfig, port: int | None) -> GlobalConfig:
    """``cfg`` with ``metrics_config.port`` set to ``port`` (a launcher's ``--port``); None keeps it."""
    if port is None:
        return cfg
    common = cfg.common_config
    metrics = dataclasses.replace(common.metrics_config, port=port)  # MetricsConfig checks the range
    return dataclasses.replace(cfg, common_config=dataclasses.replace(common, metrics_config=metrics))
