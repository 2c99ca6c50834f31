"""Process identity from the environment (PERSIA's ``persia.env``), read fresh on every call."""

import logging
import os
from collections.abc import Mapping

from persia_nats.common.env import read_env

log = logging.getLogger(__name__)


def get_rank() -> int:
    return read_env().rank


def get_local_rank() -> int:
    return read_env().local_rank


def get_world_size() -> int:
    return read_env().world_size


def get_replica_index() -> int:
    return read_env().replica_index


def get_replica_size() -> int:
    return read_env().replica_size


def get_device_id() -> int | None:
    """This NN worker's CUDA device, or None for the CPU (where the ranks all-reduce with gloo): ``LOCAL_RANK``
    when CUDA is present and every rank on this host has a GPU of its own (``LOCAL_WORLD_SIZE``, set by
    ``persia-launcher nn-worker``, at most the visible GPUs). Where the host has fewer GPUs than ranks, NCCL
    refuses two ranks on one GPU: the ranks train on the CPU, or, with ``PERSIA_SHARE_GPUS=1`` set for the
    whole job, share the GPUs round robin and all-reduce with gloo."""
    import torch
    from persia_nats.services.nn_worker.dense_sync import device_for_rank

    if not torch.cuda.is_available():
        return None
    env = read_env()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    device = device_for_rank(env.local_rank, local_ranks, gpus, env.share_gpus)
    if device is None:
        log.warning("%d NN ranks on this host and %d GPU(s): every rank trains on the CPU "
                    "(PERSIA_SHARE_GPUS=1 shares the GPUs)", local_ranks, gpus)
    elif local_ranks > gpus:
        log.info("%d NN ranks share %d GPU(s): rank %d trains on GPU %d, all-reducing with gloo",
                 local_ranks, gpus, env.local_rank, device)
    return device


def reload_env() -> None:
    """PERSIA cached the environment until this was called; here every getter reads it afresh, so nothing to do."""


def set_env(**values: int) -> None:
    """Set this process's identity, as PERSIA's ``set_env``: ``rank``, ``local_rank``, ``world_size``,
    ``replica_index``, ``replica_size`` (each written to its environment variable, read by the getters)."""
    names = {"rank": "RANK", "local_rank": "LOCAL_RANK", "world_size": "WORLD_SIZE",
             "replica_index": "REPLICA_INDEX", "replica_size": "REPLICA_SIZE"}
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise TypeError(f"set_env() got unknown names {unknown}; it takes {sorted(names)}")
    for name, value in values.items():
        os.environ[names[name]] = str(int(value))


#: variables PERSIA's processes read that nothing reads here, and why (warned by persia-launcher at start)
PERSIA_ONLY_VARS = {
    "PERSIA_METRICS_GATEWAY_ADDR": "nothing pushes to a Prometheus pushgateway: each role serves its metrics for "
                                   "scraping (common_config.metrics_config, PERSIA_METRICS_PORT)",
    "PERSIA_SOCKET_IFNAME": "roles reach each other over NATS, never by an advertised interface address",
    "PERSIA_SCHEDULED_THREAD_POOL_SIZE": "the roles run on asyncio, not on a Rust thread pool",
    "PERSIA_DEADLOCK_DETECTION": "there are no Rust locks to watch; SIGUSR1 lists a script's asyncio tasks",
    "PERSIA_LAUNCHER_VERBOSE": "persia-launcher runs each role itself; it has no command lines to print",
    "EMBEDDING_WORKER_SERVICE": "embedding workers are found over NATS, not at a host:port",
}


def persia_only_vars(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line for each variable of :data:`PERSIA_ONLY_VARS` set in ``environ`` (default: this process's), and
    one for ``PERSIA_CKPT_DIR`` without a checkpoint root."""
    env = os.environ if environ is None else environ
    lines = [f"{name}={env[name]!r} has no effect here: {why}" for name, why in PERSIA_ONLY_VARS.items()
             if env.get(name)]
    if env.get("PERSIA_CKPT_DIR") and not env.get("PERSIA_CHECKPOINT_DIR"):
        # PERSIA's example dumps there; the PS replicas refuse paths outside their checkpoint root
        lines.append(f"PERSIA_CKPT_DIR={env['PERSIA_CKPT_DIR']!r} is read by PERSIA's example scripts only: the PS "
                     "replicas write checkpoints only under their checkpoint root, so set PERSIA_CHECKPOINT_DIR to it "
                     "too (unless checkpointing_config.checkpoint_dir holds it)")
    return lines
