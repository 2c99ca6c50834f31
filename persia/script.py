"""``python -m persia.script FILE [ARGS...]``: run a user's script as ``python FILE`` would, for the launcher.

The NN-worker and data-loader scripts are the user's own, so an uncaught error ends them with a
traceback. A :class:`~persia_nats.common.errors.StartupError` (NATS unreachable, peers missing) is not a bug
in the script: here it ends the process with its one-line message and exit status 1, as the
long-running roles do.
"""

from __future__ import annotations

import os
import runpy
import sys

from persia_nats.common import taskdump
from persia_nats.common.cpu_policy import apply_cpu_policy
from persia_nats.common.errors import ConfigError, StartupError
from persia_nats.common.malloc import tune_malloc


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: python -m persia.script FILE [ARGS...]", file=sys.stderr)
        return 2
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python FILE` puts first
    # the one signal handler of a user's rank or loader: SIGUSR1 lists the asyncio tasks of the
    # training API's loop (the launcher forwards it); the library itself installs none
    taskdump.install()
    try:
        tune_malloc()  # as the launcher's own roles (persia_nats.common.malloc)
        apply_cpu_policy()  # and their CPU policy (persia_nats.common.cpu_policy)
    except ConfigError as exc:
        print(f"persia-launcher: {exc}", file=sys.stderr)
        return 2
    try:
        runpy.run_path(script, run_name="__main__")
    except StartupError as exc:
        print(f"persia-launcher: {os.path.basename(script)}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
