"""The PS replica's entry point and composition root: its flags, its configs and identity, and the
:class:`~.service.EmbeddingParameterServer` it runs (``python -m persia_nats.services.embedding_ps``,
``persia-launcher embedding-parameter-server``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from persia_nats.common import launch
from persia_nats.common.env import read_env
from persia_nats.common.logs import configure_logging


def add_arguments(ps: argparse.ArgumentParser) -> None:
    launch.common_flags(ps)
    ps.add_argument("--checkpoint-dir", default=None,
                    help="checkpoint root: load the newest valid checkpoint at start, accept checkpoint paths only "
                         "inside it (default: $PERSIA_CHECKPOINT_DIR, then checkpointing_config.checkpoint_dir)")


def run(args: argparse.Namespace) -> int:
    from persia_nats.services.embedding_ps.service import EmbeddingParameterServer

    env = read_env()
    index, size = launch.replica(args)
    configure_logging(env.log_level, role="ps", replica=index)  # first: loading the configs may warn
    gcfg = launch.global_config(args, env)
    if args.embedding_config or env.embedding_config:  # PERSIA passes it; checked here, the NN worker sends it
        launch.embedding_config(args, env, "the PS")

    async def make(nc):  # noqa: ANN001, ANN202
        return EmbeddingParameterServer(nc, gcfg, index, size, checkpoint_dir=args.checkpoint_dir)

    return launch.run_role(make, env, f"ps-{index}", gcfg)


#: ``persia-launcher embedding-parameter-server``
COMMAND = launch.Command("embedding-parameter-server", "run one PS replica", add_arguments, run)


def main(argv: Sequence[str] | None = None) -> int:
    return launch.role_main(COMMAND, argv)
