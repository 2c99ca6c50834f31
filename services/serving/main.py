"""The inference server's entry point and composition root: its flags, its configs, the user's model
and the :class:`~.service.InferenceService` it runs (``python -m persia_nats.services.serving``,
``persia-launcher serve``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from persia_nats.common import launch
from persia_nats.common.env import read_env
from persia_nats.common.errors import ConfigError
from persia_nats.common.logs import configure_logging


def add_arguments(sv: argparse.ArgumentParser) -> None:
    sv.add_argument("--checkpoint-dir", default=None,
                    help="checkpoint root (default: $PERSIA_CHECKPOINT_DIR, then checkpointing_config.checkpoint_dir)")
    sv.add_argument("--model", required=True, help="the dense model: FILE.py:CALLABLE or MODULE:CALLABLE, "
                                                  "e.g. examples/adult-income/model.py:DNN")
    sv.add_argument("--model-kwargs", default="", help="JSON object of keyword arguments for the model callable")
    launch.config_flags(sv)
    sv.add_argument("--reload-interval", type=float, default=10.0,
                    help="seconds between looks for a newer checkpoint (0: never reload)")
    sv.add_argument("--replica-index", type=int, default=None, help="this server's index (default: $REPLICA_INDEX)")
    launch.port_flag(sv)
    sv.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (1: run more servers to use more cores; see benchmarks/RESULTS.md)")


def run(args: argparse.Namespace) -> int:
    from persia_nats.services.serving.model import model_factory, parse_model_kwargs
    from persia_nats.services.serving.service import InferenceService

    env = read_env()
    gcfg = launch.global_config(args, env)
    ecfg = launch.embedding_config(args, env, "serve")
    root = args.checkpoint_dir or gcfg.common_config.checkpointing_config.checkpoint_dir
    if not root:
        raise ConfigError("serve needs --checkpoint-dir, PERSIA_CHECKPOINT_DIR or checkpointing_config.checkpoint_dir")
    if not args.reload_interval >= 0:
        raise ConfigError(f"--reload-interval must be >= 0, got {args.reload_interval}")
    if args.torch_threads < 1:
        raise ConfigError(f"--torch-threads must be >= 1, got {args.torch_threads}")
    index = env.replica_index if args.replica_index is None else args.replica_index
    make_model = model_factory(args.model, parse_model_kwargs(args.model_kwargs))
    configure_logging(env.log_level, role="serving", replica=index)
    import torch

    torch.set_num_threads(args.torch_threads)

    async def make(nc):  # noqa: ANN001, ANN202
        return InferenceService(nc, gcfg, ecfg, make_model, root, reload_interval=args.reload_interval,
                                replica_index=index)

    return launch.run_role(make, env, f"serving-{index}", gcfg)


#: ``persia-launcher serve``
COMMAND = launch.Command("serve", "serve predictions over NATS from the newest valid checkpoint, "
                                  "reloading newer ones", add_arguments, run)


def main(argv: Sequence[str] | None = None) -> int:
    return launch.role_main(COMMAND, argv)
