"""The data loader's entry point and composition root: its flags, and either the user's data-loader
script as a child process or, with ``--from-stream``, the :class:`~.stream_service.StreamLoaderService`
(``python -m persia_nats.services.data_loader``, ``persia-launcher data-loader``)."""

from __future__ import annotations

import argparse
import os
import subprocess
from collections.abc import Sequence

from persia_nats.common import launch
from persia_nats.common.config import load_embedding_config
from persia_nats.common.env import read_env
from persia_nats.common.logs import configure_logging, say
from persia_nats.common.settings import global_config_from_env


def add_arguments(dl: argparse.ArgumentParser) -> None:
    dl.add_argument("filepath", nargs="?", default=None, help="data loader script (default: $PERSIA_DATALOADER_ENTRY)")
    dl.add_argument("--from-stream", action="store_true",
                    help="run no script: forward the batches any client publishes on the job's JetStream "
                         "stream (persia.<job>.batches) until its end marker")
    launch.config_flags(dl)
    dl.add_argument("--replica-index", type=int, default=None)
    dl.add_argument("--replica-size", type=int, default=None)
    dl.add_argument("--stay-alive", action="store_true",
                    help="after the script succeeds, wait for SIGTERM instead of exiting (a Procfile runner "
                         "stops the whole job when any process exits)")


def stream_loader(args: argparse.Namespace) -> int:
    from persia_nats.services.data_loader.stream import STATS_LOG_INTERVAL_S
    from persia_nats.services.data_loader.stream_service import StreamLoaderService

    env = read_env()
    gcfg = global_config_from_env(env, args.global_config)
    index, size = launch.replica(args)
    configure_logging(env.log_level, role="data-loader", replica=index)
    slots = load_embedding_config(env.embedding_config).slot_names if env.embedding_config else None

    made: list[StreamLoaderService] = []

    async def make(nc):  # noqa: ANN001, ANN202
        made.append(StreamLoaderService(nc, gcfg, replica_index=index, replica_size=size, slots=slots))
        return made[-1]

    from persia_nats.common.service import run_service

    # no metrics endpoint: the loader's figures are in its $SRV status (persia-launcher status)
    code = launch.run_async(run_service(make, env.nats_servers, f"data-loader-{index}",
                                        stats_interval=STATS_LOG_INTERVAL_S, connect_options=env.nats_options(),
                                        connect_timeout=env.nats_connect_timeout))
    if made:  # the summary scripts and tests read, whatever the log format
        say("persia-launcher", f"stream loader {index} stopped:", level="info", **dict(made[-1].loader.counters))
    return code


def run(args: argparse.Namespace) -> int:
    if args.from_stream:
        code = stream_loader(args)
    else:
        script = launch.script(args.filepath, "PERSIA_DATALOADER_ENTRY")
        index, size = launch.replica(args)
        env = dict(os.environ, **launch.config_env(args), REPLICA_INDEX=str(index), REPLICA_SIZE=str(size))
        proc = subprocess.Popen(launch.script_command(script), env=env)
        launch.forward_signals([proc])
        code = proc.wait()
    return launch.stay_alive_after(code, args.stay_alive)


#: ``persia-launcher data-loader``
COMMAND = launch.Command("data-loader", "run a data-loader script", add_arguments, run)


def main(argv: Sequence[str] | None = None) -> int:
    return launch.role_main(COMMAND, argv)
