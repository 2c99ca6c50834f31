"""The embedding worker's entry point and composition root: its flags, its configs and identity, and
the :class:`~.service.EmbeddingWorkerService` it runs (``python -m persia_nats.services.embedding_worker``,
``persia-launcher embedding-worker``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from persia_nats.common import launch
from persia_nats.common.env import read_env
from persia_nats.common.logs import configure_logging


def add_arguments(ew: argparse.ArgumentParser) -> None:
    launch.common_flags(ew)


def run(args: argparse.Namespace) -> int:
    from persia_nats.services.embedding_worker.service import EmbeddingWorkerService

    env = read_env()
    index, _ = launch.replica(args)
    configure_logging(env.log_level, role="embedding-worker", replica=index)  # first: loading the configs may warn
    gcfg = launch.global_config(args, env)
    ecfg = launch.embedding_config(args, env, "the embedding worker")

    async def make(nc):  # noqa: ANN001, ANN202
        return EmbeddingWorkerService(nc, gcfg, ecfg, index)

    return launch.run_role(make, env, f"embedding-worker-{index}", gcfg)


#: ``persia-launcher embedding-worker``
COMMAND = launch.Command("embedding-worker", "run one embedding worker", add_arguments, run)


def main(argv: Sequence[str] | None = None) -> int:
    return launch.role_main(COMMAND, argv)
