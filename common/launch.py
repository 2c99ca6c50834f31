"""What every role's entry point shares: its config flags, its replica identity and configs from the
flags and the environment, the guard that turns a bad setup into exit status 2 and a failed start into
1, the event loop a role runs in, and the plumbing of the roles that run a user's script as child
processes (signal forwarding, ``--stay-alive``).

Each role's own ``main`` (``services/<role>/main.py``) parses its flags and builds its service with
these; ``persia-launcher`` (:mod:`persia.launcher`) puts the roles' flags under its subcommands and
dispatches to the same functions. Messages on stderr name ``persia-launcher``, the command line every
role is documented under.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from persia_nats.common.bridge import new_event_loop
from persia_nats.common.config import EmbeddingConfig, load_embedding_config
from persia_nats.common.cpu_policy import apply_cpu_policy
from persia_nats.common.env import Env, read_env
from persia_nats.common.errors import ConfigError, StartupError
from persia_nats.common.logs import say
from persia_nats.common.malloc import tune_malloc
from persia_nats.common.settings import global_config_from_env, with_metrics_port

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from persia_nats.common.config import GlobalConfig
    from persia_nats.common.service import Service

#: the program every role's messages name (its entry points are ``persia-launcher <subcommand>``)
PROG = "persia-launcher"


class Command(NamedTuple):
    """A subcommand of ``persia-launcher``: its name and one-line help, what adds its flags to a
    parser, and what runs it on the parsed flags (returning the exit status)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-config", default=None, help="global_config.yml (default: $PERSIA_GLOBAL_CONFIG)")
    p.add_argument("--embedding-config", default=None, help="embedding_config.yml (default: $PERSIA_EMBEDDING_CONFIG)")


def common_flags(p: argparse.ArgumentParser) -> None:
    config_flags(p)
    p.add_argument("--replica-index", type=int, default=None, help="this replica's index (default: $REPLICA_INDEX)")
    p.add_argument("--replica-size", type=int, default=None, help="number of replicas (default: $REPLICA_SIZE)")
    port_flag(p)


def port_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=None,
                   help="the port of this role's /metrics endpoint (default: metrics_config.port); traffic goes "
                        "over NATS, so without metrics_config.enable_metrics it is unused")


def replica(args: argparse.Namespace) -> tuple[int, int]:
    env = read_env()
    index = env.replica_index if args.replica_index is None else args.replica_index
    size = env.replica_size if args.replica_size is None else args.replica_size
    if size < 1 or not 0 <= index < size:
        raise ConfigError(f"--replica-index {index} must be in 0..{size - 1} (--replica-size {size})")
    return index, size


def run_async(main: Coroutine[Any, Any, int]) -> int:
    loop = new_event_loop()
    try:
        return loop.run_until_complete(main)
    finally:
        # as asyncio.run does: a client closed while its server was already gone leaves cancelled
        # subscription tasks that still need a turn of the loop to finish
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def global_config(args: argparse.Namespace, env: Env) -> GlobalConfig:
    """The role's global config, with ``--port`` (where the role has it) as its metrics port."""
    return with_metrics_port(global_config_from_env(env, args.global_config), getattr(args, "port", None))


def run_role(make: Callable[[NATS], Awaitable[Service]], env: Env, name: str, gcfg: GlobalConfig) -> int:
    from persia_nats.common.service import run_service

    return run_async(run_service(make, env.nats_servers, name, connect_options=env.nats_options(),
                                 connect_timeout=env.nats_connect_timeout,
                                 metrics=gcfg.common_config.metrics_config))


def embedding_config(args: argparse.Namespace, env: Env, who: str) -> EmbeddingConfig:
    path = args.embedding_config or env.embedding_config
    if not path:
        raise ConfigError(f"{who} needs --embedding-config or PERSIA_EMBEDDING_CONFIG")
    return load_embedding_config(path)


def script(path: str | None, var: str) -> str:
    source = "the script" if path else var
    path = path or os.environ.get(var)
    if not path:
        raise ConfigError(f"no script given: pass a file path or set {var}")
    if os.path.isdir(path):
        scripts = sorted(name for name in os.listdir(path) if name.endswith(".py"))[:5]
        hint = f" (it holds {', '.join(scripts)})" if scripts else ""
        raise ConfigError(f"{source} {path!r} is a folder{hint}: give the script's own path, "
                          f"e.g. {os.path.join(path, scripts[0] if scripts else 'train.py')}")
    if not os.path.isfile(path):
        raise ConfigError(f"script {path!r} does not exist")
    return path


def config_env(args: argparse.Namespace) -> dict[str, str]:
    """``--global-config`` / ``--embedding-config`` for a user's script, which reads them from the environment."""
    pairs = (("PERSIA_GLOBAL_CONFIG", args.global_config), ("PERSIA_EMBEDDING_CONFIG", args.embedding_config))
    return {name: path for name, path in pairs if path}


def script_command(script: str) -> list[str]:
    # through persia.script (the user API's runner, started as a program, not imported): a StartupError
    # ends the script with one line, not a traceback
    return [sys.executable, "-m", "persia.script", script]


def forward_signals(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    def handler(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    if hasattr(signal, "SIGUSR1"):
        # the ranks write their asyncio tasks (persia_nats.common.taskdump); the launcher itself must not die of it
        signal.signal(signal.SIGUSR1, handler)


def stay_alive_after(code: int, stay_alive: bool) -> int:
    """``code`` at once, or after SIGTERM / SIGINT when it is 0 and ``stay_alive`` is set."""
    if code != 0 or not stay_alive:
        return code
    stop = {"sig": False}

    def on_signal(_signum: int, _frame: object) -> None:
        stop["sig"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop["sig"]:
        signal.pause()
    return 0


def guarded(command: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``run(args)`` after the process-wide settings, with a bad setup as exit status 2 and a start
    that did not come about as 1, each said in one line instead of a traceback."""
    try:
        tune_malloc()  # every role handles a batch's megabytes at a time (persia_nats.common.malloc)
        apply_cpu_policy()  # PERSIA_CPU_POLICY: yield shared cores to the NN worker (persia_nats.common.cpu_policy)
        return run(args)
    except ConfigError as exc:
        say(PROG, str(exc))
        return 2
    except StartupError as exc:  # what it waited for did not come: one line, not a traceback
        say(PROG, f"{command}: {exc}")
        return 1
    except KeyboardInterrupt:
        return 130


def quiet_on_broken_pipe(main: Callable[[], int]) -> int:
    """``main()``, with its output flushed; a reader of that output that has gone ends it as SIGPIPE would."""
    try:
        code = main()
        sys.stdout.flush()  # a reader gone (`| head -1`) fails here, inside the handler, not at exit
    except BrokenPipeError:
        # the reader of our output has gone, as after `status | head -1`: exit as a command killed by
        # SIGPIPE does, quietly; what is still buffered would fail again at exit, so it goes to /dev/null
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    return code


def role_main(command: Command, argv: Sequence[str] | None = None) -> int:
    """A role's ``main``: its flags as ``persia-launcher <command>`` has them, then its ``run`` under
    :func:`guarded` (argparse's own errors exit 2, as there)."""
    parser = argparse.ArgumentParser(prog=f"{PROG} {command.name}")
    command.add_arguments(parser)
    return quiet_on_broken_pipe(lambda: guarded(command.name, command.run, parser.parse_args(argv)))
