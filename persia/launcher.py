"""``persia-launcher``: start one role of a job (PERSIA's subcommands and flags).

    persia-launcher embedding-parameter-server --replica-index 0 --replica-size 2
    persia-launcher embedding-worker --replica-index 0 --replica-size 1
    persia-launcher nn-worker train.py --nproc-per-node 2
    persia-launcher data-loader data_loader.py --replica-index 0 --replica-size 1
    persia-launcher serve --model examples/adult-income/model.py:DNN --model-kwargs '{"dense_dim": 5}'
    persia-launcher compile-kernels

Config paths come from the flags or ``PERSIA_GLOBAL_CONFIG`` / ``PERSIA_EMBEDDING_CONFIG``; entry
scripts from the argument or ``PERSIA_NN_WORKER_ENTRY`` / ``PERSIA_DATALOADER_ENTRY``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from persia_nats.common.discovery import project_version
from persia_nats.common.launch import guarded, quiet_on_broken_pipe
from persia_nats.common.logs import say
from persia_nats.services.data_loader import main as data_loader
from persia_nats.services.embedding_ps import main as embedding_ps
from persia_nats.services.embedding_worker import main as embedding_worker
from persia_nats.services.nn_worker import main as nn_worker
from persia_nats.services.serving import main as serving

from persia.commands import COMMANDS, health_subject, nats_server_exec, procfile
from persia.env import persia_only_vars

# the commands' helpers that tests and tools import from here
__all__ = ["health_subject", "main", "nats_server_exec", "procfile"]

#: every subcommand, in the order ``--help`` lists them: the roles (each its package's ``main``), then the rest
SUBCOMMANDS = {c.name: c for c in (embedding_ps.COMMAND, embedding_worker.COMMAND, nn_worker.COMMAND,
                                   data_loader.COMMAND, serving.COMMAND, *COMMANDS)}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="persia-launcher", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {project_version()}")
    sub = parser.add_subparsers(dest="role", required=True)
    for command in SUBCOMMANDS.values():
        command.add_arguments(sub.add_parser(command.name, help=command.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return quiet_on_broken_pipe(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    for line in persia_only_vars():  # PERSIA's variables that nothing reads here: said once per process, not ignored
        say("persia-launcher", f"warning: {line}", level="warning")
    return guarded(args.role, SUBCOMMANDS[args.role].run, args)


if __name__ == "__main__":
    sys.exit(main())
