"""PERSIA's ``persia.distributed``: how the NN workers' dense step is made data-parallel.

Here the dense gradients are all-reduced with ``torch.distributed`` (NCCL on GPUs, gloo on CPUs), and
the ranks meet at a TCP store on rank 0 whose port the OS picks and whose address travels over NATS. So
a :class:`DDPOption` is accepted and checked; of its fields only ``master_addr`` has an effect (it is the
address rank 0's store listens on, as ``PERSIA_MASTER_ADDR``); the others are logged as having none,
with why (:func:`persia.ctx.TrainCtx` does that). Bagua is not supported: :class:`BaguaDistributedOption`
raises, naming what to use instead.
"""

from __future__ import annotations

import logging
from typing import Any

from persia_nats.common.env import read_env

log = logging.getLogger(__name__)

__all__ = ["BaguaDistributedOption", "DDPOption", "DistributedBaseOption", "get_default_distributed_option"]

_BACKENDS = ("nccl", "gloo")  # PERSIA allowed nccl only; gloo is what CPU ranks all-reduce with here
_INIT_METHODS = ("tcp", "file")


class DistributedBaseOption:
    """Where the ranks meet: ``master_addr`` (None: found by the job itself) and ``master_port``."""

    def __init__(self, master_port: int = 23456, master_addr: str | None = None) -> None:
        self.master_port = master_port
        self.master_addr = master_addr

    def init_with_env_file(self) -> bool:
        return False


class DDPOption(DistributedBaseOption):
    """PyTorch data-parallel training: ``init_method`` ``tcp`` or ``file``, ``backend`` ``nccl`` or ``gloo``;
    options ``master_port``, ``master_addr``, ``sync_file`` (file init)."""

    def __init__(self, init_method: str = "tcp", backend: str = "nccl", **options: Any) -> None:
        super().__init__(options.pop("master_port", 23456), options.pop("master_addr", None))
        if backend not in _BACKENDS:
            raise ValueError(f"DDPOption(backend={backend!r}): the backend must be one of {list(_BACKENDS)}")
        if init_method not in _INIT_METHODS:
            raise ValueError(f"DDPOption(init_method={init_method!r}): must be one of {list(_INIT_METHODS)}")
        self.init_method = init_method
        self.backend = backend
        self.sync_file: str | None = options.pop("sync_file", None)
        if options:
            raise TypeError(f"DDPOption got unexpected options {sorted(options)}; it takes master_port, "
                            "master_addr and sync_file")

    def init_with_env_file(self) -> bool:
        return self.init_method == "file"

    def no_effect(self) -> dict[str, str]:
        """The fields set away from their defaults that do nothing here, each with why."""
        why: dict[str, str] = {}
        if self.master_port != 23456:
            why["master_port"] = "rank 0's store listens on a port the OS picks and announces over NATS, so " \
                                 "concurrent jobs on one host never collide"
        if self.init_method == "file" or self.sync_file is not None:
            why["init_method='file'"] = "the ranks meet at rank 0's TCP store, found over NATS; no sync file is used"
        return why

    def __repr__(self) -> str:
        return (f"DDPOption(init_method={self.init_method!r}, backend={self.backend!r}, "
                f"master_addr={self.master_addr!r}, master_port={self.master_port})")


class BaguaDistributedOption(DistributedBaseOption):
    """Not supported: raises at once, so a job asking for Bagua does not train with something else unawares."""

    def __init__(self, algorithm: str, **options: Any) -> None:
        raise NotImplementedError(
            f"BaguaDistributedOption({algorithm!r}): Bagua is not supported here. The NN workers all-reduce the "
            "dense gradients with torch.distributed (NCCL on GPUs, gloo on CPUs): drop distributed_option, or "
            "pass persia.distributed.DDPOption()")


def get_default_distributed_option(device_id: int | None = None) -> DDPOption:
    """The option :class:`~persia.ctx.TrainCtx` uses when given none: NCCL on a GPU of the rank's own, gloo on
    the CPU or on GPUs the ranks share (``PERSIA_SHARE_GPUS=1``)."""
    return DDPOption(backend="nccl" if device_id is not None and not read_env().share_gpus else "gloo")
