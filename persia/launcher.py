"""``persia-launcher``: start one role of a job (PERSIA's subcommands and flags).

    persia-launcher embedding-parameter-server --replica-index 0 --replica-size 2
    persia-launcher embedding-worker --replica-index 0 --replica-size 1
    persia-launcher nn-worker train.py --nproc-per-node 2
    persia-launcher data-loader data_loader.py --replica-index 0 --replica-size 1

Config paths come from the flags or ``PERSIA_GLOBAL_CONFIG`` / ``PERSIA_EMBEDDING_CONFIG``; entry
scripts from the argument or ``PERSIA_NN_WORKER_ENTRY`` / ``PERSIA_DATALOADER_ENTRY``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from common.bridge import new_event_loop
from common.config import load_embedding_config
from common.env import read_env
from common.settings import global_config_from_env
from common.errors import ConfigError
from common.logs import configure_logging


def _common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-config", default=None, help="global_config.yml (default: $PERSIA_GLOBAL_CONFIG)")
    p.add_argument("--replica-index", type=int, default=None, help="this replica's index (default: $REPLICA_INDEX)")
    p.add_argument("--replica-size", type=int, default=None, help="number of replicas (default: $REPLICA_SIZE)")
    p.add_argument("--port", type=int, default=None, help="accepted for PERSIA compatibility; traffic goes over NATS")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="persia-launcher", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role", required=True)
    ps = sub.add_parser("embedding-parameter-server", help="run one PS replica")
    _common_flags(ps)
    ew = sub.add_parser("embedding-worker", help="run one embedding worker")
    _common_flags(ew)
    ew.add_argument("--embedding-config", default=None, help="embedding_config.yml (default: $PERSIA_EMBEDDING_CONFIG)")
    nn = sub.add_parser("nn-worker", help="run the training script on NN-worker ranks")
    nn.add_argument("filepath", nargs="?", default=None, help="training script (default: $PERSIA_NN_WORKER_ENTRY)")
    nn.add_argument("--nproc-per-node", type=int, default=1)
    nn.add_argument("--node-rank", type=int, default=0)
    nn.add_argument("--nnodes", type=int, default=1)
    dl = sub.add_parser("data-loader", help="run a data-loader script")
    dl.add_argument("filepath", nargs="?", default=None, help="data loader script (default: $PERSIA_DATALOADER_ENTRY)")
    dl.add_argument("--replica-index", type=int, default=None)
    dl.add_argument("--replica-size", type=int, default=None)
    dl.add_argument("--stay-alive", action="store_true",
                    help="after the script succeeds, wait for SIGTERM instead of exiting (a Procfile runner "
                         "stops the whole job when any process exits)")
    return parser


def _replica(args: argparse.Namespace) -> tuple[int, int]:
    env = read_env()
    index = env.replica_index if args.replica_index is None else args.replica_index
    size = env.replica_size if args.replica_size is None else args.replica_size
    if size < 1 or not 0 <= index < size:
        raise ConfigError(f"--replica-index {index} must be in 0..{size - 1} (--replica-size {size})")
    return index, size


def _run_async(main: object) -> int:
    loop = new_event_loop()
    try:
        return loop.run_until_complete(main)  # type: ignore[arg-type]
    finally:
        loop.close()


def _serve_ps(args: argparse.Namespace) -> int:
    from common.service import run_service
    from services.embedding_ps.service import EmbeddingParameterServer

    env = read_env()
    gcfg = global_config_from_env(env, args.global_config)
    index, size = _replica(args)
    configure_logging(env.log_level, role="ps", replica=index)

    async def make(nc):  # noqa: ANN001, ANN202
        return EmbeddingParameterServer(nc, gcfg, index, size)

    return _run_async(run_service(make, env.nats_servers, f"ps-{index}"))


def _serve_ew(args: argparse.Namespace) -> int:
    from common.service import run_service
    from services.embedding_worker.service import EmbeddingWorkerService

    env = read_env()
    gcfg = global_config_from_env(env, args.global_config)
    path = args.embedding_config or env.embedding_config
    if not path:
        raise ConfigError("the embedding worker needs --embedding-config or PERSIA_EMBEDDING_CONFIG")
    ecfg = load_embedding_config(path)
    index, _ = _replica(args)
    configure_logging(env.log_level, role="embedding-worker", replica=index)

    async def make(nc):  # noqa: ANN001, ANN202
        return EmbeddingWorkerService(nc, gcfg, ecfg, index)

    return _run_async(run_service(make, env.nats_servers, f"embedding-worker-{index}"))


def _script(path: str | None, var: str) -> str:
    path = path or os.environ.get(var)
    if not path:
        raise ConfigError(f"no script given: pass a file path or set {var}")
    if not os.path.isfile(path):
        raise ConfigError(f"script {path!r} does not exist")
    return path


def _forward_signals(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    def handler(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _nn_worker(args: argparse.Namespace) -> int:
    script = _script(args.filepath, "PERSIA_NN_WORKER_ENTRY")
    world = args.nproc_per_node * args.nnodes
    procs = []
    for local in range(args.nproc_per_node):
        rank = args.node_rank * args.nproc_per_node + local
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(args.nproc_per_node))
        procs.append(subprocess.Popen([sys.executable, script], env=env))
    _forward_signals(procs)
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)


def _data_loader(args: argparse.Namespace) -> int:
    script = _script(args.filepath, "PERSIA_DATALOADER_ENTRY")
    index, size = _replica(args)
    env = dict(os.environ, REPLICA_INDEX=str(index), REPLICA_SIZE=str(size))
    proc = subprocess.Popen([sys.executable, script], env=env)
    _forward_signals([proc])
    code = proc.wait()
    if code != 0 or not args.stay_alive:
        return code
    stop = {"sig": False}

    def on_signal(_signum: int, _frame: object) -> None:
        stop["sig"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop["sig"]:
        signal.pause()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {"embedding-parameter-server": _serve_ps, "embedding-worker": _serve_ew,
                "nn-worker": _nn_worker, "data-loader": _data_loader}
    try:
        return handlers[args.role](args)
    except ConfigError as exc:
        print(f"persia-launcher: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
