"""The NN worker's entry point: its flags, and the training script started once per local rank with
that rank's identity (``python -m persia_nats.services.nn_worker``, ``persia-launcher nn-worker``).
The ranks are child processes; each builds its own runtime when the script enters its context."""

from __future__ import annotations

import argparse
import os
import subprocess
from collections.abc import Sequence

from persia_nats.common import launch
from persia_nats.common.cpu_policy import choice_from_env, openmp_env
from persia_nats.common.logs import say


def add_arguments(nn: argparse.ArgumentParser) -> None:
    nn.add_argument("filepath", nargs="?", default=None, help="training script (default: $PERSIA_NN_WORKER_ENTRY)")
    nn.add_argument("--nproc-per-node", type=int, default=1)
    nn.add_argument("--node-rank", type=int, default=0)
    nn.add_argument("--nnodes", type=int, default=1)
    launch.config_flags(nn)
    nn.add_argument("--share-gpus", action="store_true",
                    help="more ranks than GPUs on a host share them round robin, every rank all-reducing with "
                         "gloo (sets PERSIA_SHARE_GPUS=1; give it on every host of the job); without it such "
                         "ranks train on the CPU")
    nn.add_argument("--stay-alive", action="store_true",
                    help="after every rank succeeds, wait for SIGTERM instead of exiting (compose's "
                         "--exit-code-from stops the job when any container exits: a rank other than 0 "
                         "finishes before rank 0 has evaluated)")


def run(args: argparse.Namespace) -> int:
    script = launch.script(args.filepath, "PERSIA_NN_WORKER_ENTRY")
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
        env = dict(os.environ, **openmp_env(os.environ), **launch.config_env(args), RANK=str(rank),
                   LOCAL_RANK=str(local), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(args.nproc_per_node),
                   **({"PERSIA_SHARE_GPUS": "1"} if args.share_gpus else {}))
        procs.append(subprocess.Popen(launch.script_command(script), env=env))
    launch.forward_signals(procs)
    return launch.stay_alive_after(wait_ranks(procs), args.stay_alive)


def wait_ranks(procs: Sequence[subprocess.Popen[bytes]], poll_s: float = 0.2) -> int:
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


#: ``persia-launcher nn-worker``
COMMAND = launch.Command("nn-worker", "run the training script on NN-worker ranks", add_arguments, run)


def main(argv: Sequence[str] | None = None) -> int:
    return launch.role_main(COMMAND, argv)
