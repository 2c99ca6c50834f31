"""Process identity from the environment (PERSIA's ``persia.env``), read fresh on every call."""

import logging
import os

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
    """This NN worker's CUDA device: ``LOCAL_RANK`` when CUDA is present and every rank on this host has a GPU
    of its own (``LOCAL_WORLD_SIZE``, set by ``persia-launcher nn-worker``, at most the visible GPUs); else None,
    the CPU, where the ranks all-reduce with gloo. NCCL refuses two ranks on one GPU, and a job whose ranks
    mix devices would have no backend they all share."""
    import torch

    if not torch.cuda.is_available():
        return None
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    if local_ranks > gpus:
        log.warning("%d NN ranks on this host and %d GPU(s): every rank trains on the CPU", local_ranks, gpus)
        return None
    return get_local_rank()
