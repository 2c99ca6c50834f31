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
import asyncio
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from persia_nats.common.bridge import new_event_loop
from persia_nats.common.config import EmbeddingConfig, load_embedding_config
from persia_nats.common.cpu_policy import NATS_SERVER_GO_ENV, apply_cpu_policy, choice_from_env, openmp_env
from persia_nats.common.discovery import project_version
from persia_nats.common.env import Env, read_env
from persia_nats.common.errors import ConfigError, StartupError
from persia_nats.common.logs import configure_logging, say
from persia_nats.common.malloc import tune_malloc
from persia_nats.common.settings import global_config_from_env, with_metrics_port

from persia.env import persia_only_vars

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from persia_nats.common.config import GlobalConfig
    from persia_nats.common.service import Service


def _config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-config", default=None, help="global_config.yml (default: $PERSIA_GLOBAL_CONFIG)")
    p.add_argument("--embedding-config", default=None, help="embedding_config.yml (default: $PERSIA_EMBEDDING_CONFIG)")


def _common_flags(p: argparse.ArgumentParser) -> None:
    _config_flags(p)
    p.add_argument("--replica-index", type=int, default=None, help="this replica's index (default: $REPLICA_INDEX)")
    p.add_argument("--replica-size", type=int, default=None, help="number of replicas (default: $REPLICA_SIZE)")
    _port_flag(p)


def _port_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=None,
                   help="the port of this role's /metrics endpoint (default: metrics_config.port); traffic goes "
                        "over NATS, so without metrics_config.enable_metrics it is unused")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="persia-launcher", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {project_version()}")
    sub = parser.add_subparsers(dest="role", required=True)
    ps = sub.add_parser("embedding-parameter-server", help="run one PS replica")
    _common_flags(ps)
    ps.add_argument("--checkpoint-dir", default=None,
                    help="checkpoint root: load the newest valid checkpoint at start, accept checkpoint paths only "
                         "inside it (default: $PERSIA_CHECKPOINT_DIR, then checkpointing_config.checkpoint_dir)")
    ew = sub.add_parser("embedding-worker", help="run one embedding worker")
    _common_flags(ew)
    nn = sub.add_parser("nn-worker", help="run the training script on NN-worker ranks")
    nn.add_argument("filepath", nargs="?", default=None, help="training script (default: $PERSIA_NN_WORKER_ENTRY)")
    nn.add_argument("--nproc-per-node", type=int, default=1)
    nn.add_argument("--node-rank", type=int, default=0)
    nn.add_argument("--nnodes", type=int, default=1)
    _config_flags(nn)
    nn.add_argument("--stay-alive", action="store_true",
                    help="after every rank succeeds, wait for SIGTERM instead of exiting (compose's "
                         "--exit-code-from stops the job when any container exits: a rank other than 0 "
                         "finishes before rank 0 has evaluated)")
    dl = sub.add_parser("data-loader", help="run a data-loader script")
    dl.add_argument("filepath", nargs="?", default=None, help="data loader script (default: $PERSIA_DATALOADER_ENTRY)")
    dl.add_argument("--from-stream", action="store_true",
                    help="run no script: forward the batches any client publishes on the job's JetStream "
                         "stream (persia.<job>.batches) until its end marker")
    _config_flags(dl)
    dl.add_argument("--replica-index", type=int, default=None)
    dl.add_argument("--replica-size", type=int, default=None)
    dl.add_argument("--stay-alive", action="store_true",
                    help="after the script succeeds, wait for SIGTERM instead of exiting (a Procfile runner "
                         "stops the whole job when any process exits)")
    sv = sub.add_parser("serve", help="serve predictions over NATS from the newest valid checkpoint, "
                                       "reloading newer ones")
    sv.add_argument("--checkpoint-dir", default=None,
                    help="checkpoint root (default: $PERSIA_CHECKPOINT_DIR, then checkpointing_config.checkpoint_dir)")
    sv.add_argument("--model", required=True, help="the dense model: FILE.py:CALLABLE or MODULE:CALLABLE, "
                                                  "e.g. examples/adult-income/model.py:DNN")
    sv.add_argument("--model-kwargs", default="", help="JSON object of keyword arguments for the model callable")
    _config_flags(sv)
    sv.add_argument("--reload-interval", type=float, default=10.0,
                    help="seconds between looks for a newer checkpoint (0: never reload)")
    sv.add_argument("--replica-index", type=int, default=None, help="this server's index (default: $REPLICA_INDEX)")
    _port_flag(sv)
    sv.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (1: run more servers to use more cores; see benchmarks/RESULTS.md)")
    hc = sub.add_parser("health", help="exit 0 if a role is ready to do its job now (with --live: if it answers "
                                        "at all), 1 otherwise; for health checks and probes")
    hc.add_argument("target", choices=["embedding-parameter-server", "embedding-worker", "nn-worker", "serve"])
    hc.add_argument("--replica-index", type=int, default=None)
    hc.add_argument("--global-config", default=None)
    hc.add_argument("--timeout", type=float, default=3.0)
    hc.add_argument("--live", action="store_true",
                    help="liveness only: the role answers, even while it loads a checkpoint or waits for its peers "
                         "(a liveness probe; without it, readiness: a PS has loaded its shard, an NN worker has "
                         "joined its ranks, a server has a checkpoint loaded)")
    st = sub.add_parser("status", help="print every live instance of the job (PS, embedding workers, NN ranks)")
    st.add_argument("--global-config", default=None)
    st.add_argument("--wait", type=float, default=1.0, help="seconds to collect answers")
    st.add_argument("--json", action="store_true", help="one JSON line instead of a table")
    cp = sub.add_parser("checkpoint", help="have the training job write a checkpoint at its next step; "
                                             "prints the checkpoint's directory")
    cp.add_argument("--global-config", default=None)
    cp.add_argument("--timeout", type=float, default=600.0)
    pf = sub.add_parser("procfile", help="print a Procfile for N NN workers x M PS replicas x W embedding "
                                          "workers x L data loaders (for honcho)")
    pf.add_argument("--nn-workers", type=int, default=1, help="NN ranks (one process group)")
    pf.add_argument("--ps-replicas", type=int, default=1)
    pf.add_argument("--embedding-workers", type=int, default=1)
    pf.add_argument("--data-loaders", type=int, default=1)
    pf.add_argument("--nn-worker-entry", default="examples/adult-income/train.py")
    pf.add_argument("--data-loader-entry", default="examples/adult-income/data_loader.py")
    pf.add_argument("--nats-conf", default=None,
                    help="nats-server's configuration (default: the nats.conf installed with persia-nats)")
    sub.add_parser("compile-kernels",
                   help="compile every role's numba kernels into numba's cache now (an image build step), so "
                        "that no role compiles them at start")
    return parser


def nats_server_exec() -> str:
    """A Procfile's start of the nats-server line: the Go runtime's settings of
    :data:`~persia_nats.common.cpu_policy.NATS_SERVER_GO_ENV`, each unless the environment (.env) sets it."""
    settings = " ".join(f'{k}="${{{k}:-{v}}}"' for k, v in NATS_SERVER_GO_ENV.items())
    return f"exec env {settings} nats-server"


def procfile(nn_workers: int, ps_replicas: int, embedding_workers: int, data_loaders: int,
             nn_worker_entry: str, data_loader_entry: str, nats_conf: str | None = None) -> str:
    """A Procfile running one nats-server and every role with the given replica counts.

    ``nats_conf`` defaults to the nats.conf installed with the package, so the Procfile runs from a
    wheel as well as from a checkout.
    """
    if nats_conf is None:
        from persia_nats import data_file

        nats_conf = str(data_file("nats.conf"))
    for name, n in (("nn-workers", nn_workers), ("ps-replicas", ps_replicas),
                    ("embedding-workers", embedding_workers), ("data-loaders", data_loaders)):
        if n < 1:
            raise ConfigError(f"--{name} must be at least 1, got {n}")
    # the sparse roles yield the shared cores to the NN workers' dense step (persia_nats.common.cpu_policy)
    sparse = 'exec env PERSIA_CPU_POLICY="${PERSIA_CPU_POLICY:-idle}" persia-launcher'
    lines = [
        "# Generated by `persia-launcher procfile`; run with `honcho start`. The job ends when the NN workers exit.",
        "# PS, embedding workers and data loaders run with PERSIA_CPU_POLICY=idle unless .env sets it;",
        "# nats-server with GOGC and GOMEMLIMIT as below unless .env sets them.",
        f"nats: {nats_server_exec()} -c {shlex.quote(nats_conf)} -js -sd runs/nats -a 127.0.0.1 "
        "-p \"${PERSIA_NATS_URL##*:}\"",
    ]
    lines += [f"ps{i}: {sparse} embedding-parameter-server --replica-index {i} --replica-size {ps_replicas}"
              for i in range(ps_replicas)]
    lines += [f"embedding_worker{i}: {sparse} embedding-worker --replica-index {i} "
              f"--replica-size {embedding_workers}" for i in range(embedding_workers)]
    lines.append(f"nn_worker: exec persia-launcher nn-worker {nn_worker_entry} --nproc-per-node {nn_workers}")
    lines += [f"data_loader{i}: {sparse} data-loader {data_loader_entry} --replica-index {i} "
              f"--replica-size {data_loaders} --stay-alive" for i in range(data_loaders)]
    return "\n".join(lines) + "\n"


def _procfile(args: argparse.Namespace) -> int:
    sys.stdout.write(procfile(args.nn_workers, args.ps_replicas, args.embedding_workers, args.data_loaders,
                              args.nn_worker_entry, args.data_loader_entry, args.nats_conf))
    return 0


def health_subject(job: str, target: str, index: int) -> str:
    """The info subject that answers ``persia-launcher health <target>`` (common/health.py says what each
    answer means)."""
    from persia_nats.common.subjects import Subjects

    subjects = Subjects(job)
    # an inference server answers serve.info in its queue group: any one of them, whatever the index
    return {"embedding-parameter-server": subjects.ps(index, "info"),
            "embedding-worker": subjects.ew_replica_info(index), "nn-worker": subjects.nn_info(),
            "serve": subjects.serve_info()}[target]


def _health(args: argparse.Namespace) -> int:
    import json

    from persia_nats.common.errors import NatsUnreachable
    from persia_nats.common.health import check
    from persia_nats.common.service import connect

    env = read_env()
    job = global_config_from_env(env, args.global_config).common_config.job_name
    options = env.nats_options()  # credentials and TLS (PERSIA_NATS_*)
    index = env.replica_index if args.replica_index is None else args.replica_index
    subject = health_subject(job, args.target, index)

    async def probe() -> int:
        try:
            nc = await connect(env.nats_servers, "persia-launcher-health", args.timeout, **options)
        except NatsUnreachable as exc:
            print(f"unhealthy: {exc}", file=sys.stderr)
            return 1
        try:
            health = await check(nc, subject, args.target, args.timeout)
        finally:
            await nc.close()
        if not health.live:
            print(f"unhealthy: {args.target} {index} ({subject}): {health.why}", file=sys.stderr)
            return 1
        print(json.dumps({"live": True, "ready": health.ready, **dict(health.info)}, default=str))
        if health.ready or args.live:
            return 0
        print(f"not ready: {args.target} {index} ({subject}): {health.why}", file=sys.stderr)
        return 1

    return _run_async(probe())


_STATUS_COLUMNS = ("rows", "memory_bytes", "evictions", "staleness", "max_staleness", "buffered", "looked_up",
                   "grads_applied", "received", "requests", "refused")


def _status(args: argparse.Namespace) -> int:
    """The live cluster from ``$SRV.INFO`` + ``$SRV.STATS``."""
    import json

    from persia_nats.common.discovery import cluster_status, format_uptime
    from persia_nats.common.errors import NatsUnreachable
    from persia_nats.common.service import connect
    from persia_nats.common.subjects import Subjects

    env = read_env()
    subjects = Subjects(global_config_from_env(env, args.global_config).common_config.job_name)
    options = env.nats_options()  # credentials and TLS (PERSIA_NATS_*)

    async def collect() -> list:
        try:
            nc = await connect(env.nats_servers, "persia-launcher-status", 5, **options)
        except NatsUnreachable as exc:
            print(f"persia-launcher: {exc}", file=sys.stderr)
            return []
        try:
            return await cluster_status(nc, subjects.job, args.wait)
        finally:
            await nc.close()

    replies = _run_async(collect())
    if args.json:
        print(json.dumps([dict(r) for r in replies], default=str))
        return 0 if replies else 1
    if not replies:
        print(f"no instance of job {subjects.job!r} answered on {env.nats_url}")
        return 1
    cols = [c for c in _STATUS_COLUMNS if any(c in r.get("stats", {}) for r in replies)]
    rows = [[str(r.get("role")), str(r.get("replica")), str(r.get("instance")), str(r.get("version") or "-"),
             format_uptime(r.get("uptime_s")), str(r.get("metrics_port") or "-")]
            + [str(r.get("stats", {}).get(c, "")) for c in cols] for r in replies]
    header = ["role", "replica", "instance", "version", "uptime", "metrics", *cols]
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    for line in (header, *rows):
        print("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())
    return 0


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
        # as asyncio.run does: a client closed while its server was already gone leaves cancelled
        # subscription tasks that still need a turn of the loop to finish
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _serve_ps(args: argparse.Namespace) -> int:
    from persia_nats.services.embedding_ps.service import EmbeddingParameterServer

    env = read_env()
    index, size = _replica(args)
    configure_logging(env.log_level, role="ps", replica=index)  # first: loading the configs may warn
    gcfg = _global_config(args, env)
    if args.embedding_config or env.embedding_config:  # PERSIA passes it; checked here, the NN worker sends it
        _embedding_config(args, env, "the PS")

    async def make(nc):  # noqa: ANN001, ANN202
        return EmbeddingParameterServer(nc, gcfg, index, size, checkpoint_dir=args.checkpoint_dir)

    return _run_role(make, env, f"ps-{index}", gcfg)


def _global_config(args: argparse.Namespace, env: Env) -> GlobalConfig:
    """The role's global config, with ``--port`` (where the role has it) as its metrics port."""
    return with_metrics_port(global_config_from_env(env, args.global_config), getattr(args, "port", None))


def _run_role(make: Callable[[NATS], Awaitable[Service]], env: Env, name: str, gcfg: GlobalConfig) -> int:
    from persia_nats.common.service import run_service

    return _run_async(run_service(make, env.nats_servers, name, connect_options=env.nats_options(),
                                  connect_timeout=env.nats_connect_timeout,
                                  metrics=gcfg.common_config.metrics_config))


def _embedding_config(args: argparse.Namespace, env: Env, who: str) -> EmbeddingConfig:
    path = args.embedding_config or env.embedding_config
    if not path:
        raise ConfigError(f"{who} needs --embedding-config or PERSIA_EMBEDDING_CONFIG")
    return load_embedding_config(path)


def _serve_ew(args: argparse.Namespace) -> int:
    from persia_nats.services.embedding_worker.service import EmbeddingWorkerService

    env = read_env()
    index, _ = _replica(args)
    configure_logging(env.log_level, role="embedding-worker", replica=index)  # first: loading the configs may warn
    gcfg = _global_config(args, env)
    ecfg = _embedding_config(args, env, "the embedding worker")

    async def make(nc):  # noqa: ANN001, ANN202
        return EmbeddingWorkerService(nc, gcfg, ecfg, index)

    return _run_role(make, env, f"embedding-worker-{index}", gcfg)


def _serve(args: argparse.Namespace) -> int:
    from persia_nats.services.serving.model import model_factory, parse_model_kwargs
    from persia_nats.services.serving.service import InferenceService

    env = read_env()
    gcfg = _global_config(args, env)
    ecfg = _embedding_config(args, env, "serve")
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

    return _run_role(make, env, f"serving-{index}", gcfg)


def _script(path: str | None, var: str) -> str:
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


def _config_env(args: argparse.Namespace) -> dict[str, str]:
    """``--global-config`` / ``--embedding-config`` for a user's script, which reads them from the environment."""
    pairs = (("PERSIA_GLOBAL_CONFIG", args.global_config), ("PERSIA_EMBEDDING_CONFIG", args.embedding_config))
    return {name: path for name, path in pairs if path}


def _script_command(script: str) -> list[str]:
    # through persia.script: a StartupError ends the script with one line, not a traceback
    return [sys.executable, "-m", "persia.script", script]


def _forward_signals(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    def handler(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    if hasattr(signal, "SIGUSR1"):
        # the ranks write their asyncio tasks (persia_nats.common.taskdump); the launcher itself must not die of it
        signal.signal(signal.SIGUSR1, handler)


def _nn_worker(args: argparse.Namespace) -> int:
    script = _script(args.filepath, "PERSIA_NN_WORKER_ENTRY")
    if choice_from_env() == "idle":  # allowed, but rarely what was meant: say so once
        say("persia-launcher", "nn-worker: PERSIA_CPU_POLICY=idle gives the NN worker, the job's critical path, "
            "only the CPU every other thread leaves; it is meant for the PS, embedding workers and data loaders",
            level="warning")
    world = args.nproc_per_node * args.nnodes
    procs = []
    for local in range(args.nproc_per_node):
        rank = args.node_rank * args.nproc_per_node + local
        # torch's OpenMP workers sleep when idle instead of spinning on the cores the rank's I/O thread
        # and the sparse roles need (persia_nats.common.cpu_policy.openmp_env)
        env = dict(os.environ, **openmp_env(os.environ), **_config_env(args), RANK=str(rank), LOCAL_RANK=str(local),
                   WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(args.nproc_per_node))
        procs.append(subprocess.Popen(_script_command(script), env=env))
    _forward_signals(procs)
    return _stay_alive_after(_wait_ranks(procs), args.stay_alive)


def _wait_ranks(procs: Sequence[subprocess.Popen[bytes]], poll_s: float = 0.2) -> int:
    """Wait for every rank; when one fails, stop the rest (they would block in a collective forever)."""
    import time

    while True:
        codes = [p.poll() for p in procs]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is not None:
            running = [p for p in procs if p.poll() is None]
            for p in running:
                p.terminate()
            for p in running:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            if running:  # the failed rank has said why; this says what became of the rest
                say("persia-launcher", f"an NN rank exited with {failed}; stopped the others")
            return failed
        if all(c == 0 for c in codes):
            return 0
        time.sleep(poll_s)


def _stream_loader(args: argparse.Namespace) -> int:
    from persia_nats.services.data_loader.stream import STATS_LOG_INTERVAL_S
    from persia_nats.services.data_loader.stream_service import StreamLoaderService

    env = read_env()
    gcfg = global_config_from_env(env, args.global_config)
    index, size = _replica(args)
    configure_logging(env.log_level, role="data-loader", replica=index)
    slots = load_embedding_config(env.embedding_config).slot_names if env.embedding_config else None

    made: list[StreamLoaderService] = []

    async def make(nc):  # noqa: ANN001, ANN202
        made.append(StreamLoaderService(nc, gcfg, replica_index=index, replica_size=size, slots=slots))
        return made[-1]

    from persia_nats.common.service import run_service

    # no metrics endpoint: the loader's figures are in its $SRV status (persia-launcher status)
    code = _run_async(run_service(make, env.nats_servers, f"data-loader-{index}", stats_interval=STATS_LOG_INTERVAL_S,
                                  connect_options=env.nats_options(), connect_timeout=env.nats_connect_timeout))
    if made:  # the summary scripts and tests read, whatever the log format
        say("persia-launcher", f"stream loader {index} stopped:", level="info", **dict(made[-1].loader.counters))
    return code


def _data_loader(args: argparse.Namespace) -> int:
    if args.from_stream:
        code = _stream_loader(args)
    else:
        script = _script(args.filepath, "PERSIA_DATALOADER_ENTRY")
        index, size = _replica(args)
        env = dict(os.environ, **_config_env(args), REPLICA_INDEX=str(index), REPLICA_SIZE=str(size))
        proc = subprocess.Popen(_script_command(script), env=env)
        _forward_signals([proc])
        code = proc.wait()
    return _stay_alive_after(code, args.stay_alive)


def _stay_alive_after(code: int, stay_alive: bool) -> int:
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


#: an answer slower than this means NN rank 0 is in a step (or not training): the command says what it waits for
CHECKPOINT_NOTICE_S = 5.0


def _checkpoint(args: argparse.Namespace) -> int:
    from persia_nats.common.errors import NoResponders, PersiaError, RequestTimeout
    from persia_nats.common.messages import Empty, NNCheckpointReply
    from persia_nats.common.rpc import request_with_retry
    from persia_nats.common.service import close_connection, connect_from_env
    from persia_nats.common.subjects import Subjects

    env = read_env()
    subjects = Subjects(global_config_from_env(env, args.global_config).common_config.job_name)
    waits_for = (f"NN rank 0 of job {subjects.job!r} takes it at its next training step, or at once while it "
                 "waits for batches")

    async def ask() -> int:
        nc = await connect_from_env(env, "persia-launcher-checkpoint", connect_timeout=10)
        try:
            # NN rank 0 may still be starting: wait for it within the same time budget
            asking = asyncio.ensure_future(request_with_retry(
                nc, subjects.nn_checkpoint(), Empty(), args.timeout, args.timeout, retry_on=(NoResponders,)))
            if not (await asyncio.wait({asking}, timeout=min(CHECKPOINT_NOTICE_S, args.timeout)))[0]:
                print(f"persia-launcher: waiting up to {args.timeout:g} s for the checkpoint: {waits_for}",
                      file=sys.stderr)
            reply = NNCheckpointReply.from_wire(await asking)
        except RequestTimeout as exc:
            print(f"persia-launcher: checkpoint failed: no checkpoint within {args.timeout:g} s ({exc}): {waits_for}, "
                  "so a step took longer than that, or the training script is not iterating its DataLoader",
                  file=sys.stderr)
            return 1
        except PersiaError as exc:
            print(f"persia-launcher: checkpoint failed: {exc}", file=sys.stderr)
            return 1
        finally:
            await close_connection(nc)
        print(reply.checkpoint)
        return 0

    return _run_async(ask())


def _compile_kernels(args: argparse.Namespace) -> int:
    """Each role's kernels, as its start-up loads them, into ``NUMBA_CACHE_DIR`` (else next to the
    sources). numba keys its cache on the source files and the CPU, so a host with another CPU compiles
    its own at start: the cache directory must stay writable."""
    import numba
    from persia_nats.core.plan import warm_up as pooling_kernels
    from persia_nats.core.store import warm_up as store_kernels
    from persia_nats.services.nn_worker.hot_rows import RowMirror

    for name, warm_up in (("PS store", store_kernels), ("pooling and float16", pooling_kernels),
                          ("NN hot rows", RowMirror.warm_up)):
        print(f"{name}: {warm_up():.1f} s")
    print(f"cache: {numba.config.CACHE_DIR or 'next to the sources (__pycache__)'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # a reader gone (`| head -1`) fails here, inside the handler, not at exit
    except BrokenPipeError:
        # the reader of our output has gone, as after `status | head -1`: exit as a command killed by
        # SIGPIPE does, quietly; what is still buffered would fail again at exit, so it goes to /dev/null
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    return code


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    handlers = {"embedding-parameter-server": _serve_ps, "embedding-worker": _serve_ew,
                "nn-worker": _nn_worker, "data-loader": _data_loader, "procfile": _procfile,
                "health": _health, "status": _status, "checkpoint": _checkpoint, "serve": _serve,
                "compile-kernels": _compile_kernels}
    for line in persia_only_vars():  # PERSIA's variables that nothing reads here: said once per process, not ignored
        say("persia-launcher", f"warning: {line}", level="warning")
    try:
        tune_malloc()  # every role handles a batch's megabytes at a time (persia_nats.common.malloc)
        apply_cpu_policy()  # PERSIA_CPU_POLICY: yield shared cores to the NN worker (persia_nats.common.cpu_policy)
        return handlers[args.role](args)
    except ConfigError as exc:
        say("persia-launcher", str(exc))
        return 2
    except StartupError as exc:  # what it waited for did not come: one line, not a traceback
        say("persia-launcher", f"{args.role}: {exc}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
