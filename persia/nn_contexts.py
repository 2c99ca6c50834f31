"""PERSIA's NN-worker contexts as its scripts call them, over this project's (``persia.ctx`` loads this lazily).

PERSIA's arguments that tune its Rust engines (thread pools, backward buffers) or that its defects needed
(``grad_scalar_update_factor``, ``embedding_gradient_check_frequency``) have no counterpart here; they are
accepted, checked as PERSIA checked them, and logged once each with why they do nothing
(docs/migrating-from-persia.md). Anything else unknown is still a TypeError.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from persia_nats.common.env import read_env
from persia_nats.services.nn_worker import ctx as _ctx
from persia_nats.services.nn_worker.dense_sync import backend_for

from persia.distributed import DDPOption, DistributedBaseOption
from persia.no_effect import no_effect as _no_effect

#: TrainCtx.dump_checkpoint's positional arguments after dst_dir in PERSIA's final release, and in an earlier one
DUMP_ORDER = ("dense_filename", "jit_dense_filename", "blocking", "with_jit_model", "opt_filename")
DUMP_ORDER_EARLIER = ("dense_model_filename", "jit_dense_model_filename", "opt_filename", "blocking", "with_jit_model")

#: why each of PERSIA's engine arguments does nothing here
NO_EFFECT = {
    "grad_scalar_update_factor": "the loss scale is torch's GradScaler's alone; embedding gradients that are not "
                                 "finite are left out per slot on every step instead of shrinking the scale",
    "backward_buffer_size": "embedding gradients are sent from the training loop's I/O thread; their bound is "
                            "DataLoader(embedding_staleness=...)",
    "backward_workers_size": "embedding gradients are sent from the training loop's I/O thread (asyncio), not by "
                             "a pool of workers",
    "grad_update_buffer_size": "gradients are copied into their message when sent, so no buffer keeps them alive; "
                               "their bound is DataLoader(embedding_staleness=...)",
    "lookup_emb_directly": "every NN worker can always look batches up directly (IterableDataset); there is "
                           "no client to open",
    "threadpool_worker_size": "the NN worker's I/O runs on one asyncio loop, not on a thread pool",
    "embedding_gradient_check_frequency": "every step's embedding gradients are checked, per slot (PERSIA checked "
                                          "only the first step: a known defect)",
    "blocking": "a checkpoint is taken whole before this call returns (it never runs in the background)",
    "dense_model_filename": "the checkpoint's files are named by its manifest (docs/checkpoints.md)",
    "dense_filename": "the checkpoint's files are named by its manifest (docs/checkpoints.md)",
    "opt_filename": "the checkpoint's files are named by its manifest (docs/checkpoints.md)",
    "map_location": "the dense state loads onto this rank's device",
}
#: PERSIA's TrainCtx parameters after the two optimizers, in its positional order
TRAIN_POSITIONAL = ("grad_scalar_update_factor", "backward_buffer_size", "backward_workers_size",
                    "grad_update_buffer_size", "lookup_emb_directly", "mixed_precision", "distributed_option")


def no_effect(where: str, name: str, value: Any, why: str | None = None) -> None:
    _no_effect(where, name, value, why or NO_EFFECT[name])


def _persia_only(where: str, kwargs: dict[str, Any]) -> None:
    """Take PERSIA's engine arguments out of ``kwargs``, checked as PERSIA did, each logged once."""
    for name in [k for k in kwargs if k in NO_EFFECT]:
        value = kwargs.pop(name)
        if name == "grad_scalar_update_factor" and not value > 0:
            raise ValueError(f"{where}(grad_scalar_update_factor={value!r}): must be greater than zero")
        no_effect(where, name, value)


def _check_distributed(option: Any, device: torch.device) -> None:
    if not isinstance(option, DistributedBaseOption):
        raise TypeError(f"distributed_option must be a persia.distributed.DDPOption, got {type(option).__name__}")
    if isinstance(option, DDPOption):
        backend = backend_for(device, read_env().share_gpus)
        if option.backend != backend:
            no_effect("DDPOption", "backend", option.backend,
                      f"this rank trains on {device} and all-reduces with {backend}, the backend "
                      "every rank of the job shares")
        for name, why in option.no_effect().items():
            no_effect("DDPOption", name, getattr(option, name.split("=")[0], None), why)
    if option.master_addr:  # the address rank 0's store listens on and announces (dense_sync.default_master_addr)
        os.environ.setdefault("PERSIA_MASTER_ADDR", option.master_addr)


#: PERSIA's context methods with no counterpart here, and what to use instead
REFUSED_METHODS = {
    "dump_embedding": "TrainCtx.dump_checkpoint(dst_dir): the embeddings and the dense model, as one checkpoint",
    "load_embedding": "TrainCtx.load_checkpoint(src_dir), or `persia-launcher embedding-parameter-server "
                      "--checkpoint-dir` (each PS loads the newest valid checkpoint at start)",
    "wait_for_dump_embedding": "nothing: TrainCtx.dump_checkpoint returns once the checkpoint is whole",
    "wait_for_load_embedding": "nothing: TrainCtx.load_checkpoint returns once it is loaded",
    "dump_torch_state_dict": "torch.save(obj.state_dict(), path); checkpoints hold the dense state already",
    "load_torch_state_dict": "obj.load_state_dict(torch.load(path)); checkpoints hold the dense state already",
    "clear_embeddings": "a new job name (common_config.job_name) or fresh PS replicas",
    "get_embedding_from_bytes": "get_embedding_from_data(persia_batch): batches travel as msgpack, not as PERSIA's "
                                "speedy bytes (docs/protocol.md)",
    "configure_embedding_parameter_servers": "the contexts configure every PS on enter from embedding_config",
}


def _refused(name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.{name}() is PERSIA's and not supported here: use "
                                  f"{REFUSED_METHODS[name]}")

    method.__name__ = name
    method.__doc__ = f"PERSIA's; refused here: use {REFUSED_METHODS[name]}"
    return method


class _PersiaMethods:
    """PERSIA's context methods that have no counterpart here: each raises, naming what to use instead."""


for _name in REFUSED_METHODS:
    setattr(_PersiaMethods, _name, _refused(_name))


class EmbeddingCtx(_PersiaMethods, _ctx.EmbeddingCtx):
    __doc__ = _ctx.EmbeddingCtx.__doc__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _persia_only(type(self).__name__, kwargs)
        super().__init__(*args, **kwargs)


class TrainCtx(_PersiaMethods, _ctx.TrainCtx):
    __doc__ = _ctx.TrainCtx.__doc__

    def __init__(self, embedding_optimizer: Any, dense_optimizer: torch.optim.Optimizer, *args: Any,
                 **kwargs: Any) -> None:
        if len(args) > len(TRAIN_POSITIONAL):
            raise TypeError(f"TrainCtx takes at most {2 + len(TRAIN_POSITIONAL)} positional arguments "
                            f"({2 + len(args)} given)")
        for name, value in zip(TRAIN_POSITIONAL, args, strict=False):
            if name in kwargs:
                raise TypeError(f"TrainCtx got multiple values for argument {name!r}")
            kwargs[name] = value
        option = kwargs.pop("distributed_option", None)
        _persia_only("TrainCtx", kwargs)
        super().__init__(embedding_optimizer, dense_optimizer, **kwargs)
        if option is not None:
            _check_distributed(option, self.device)

    def backward(self, loss: torch.Tensor, embedding_gradient_check_frequency: int | None = None) -> torch.Tensor:
        if embedding_gradient_check_frequency is not None:
            no_effect("TrainCtx.backward", "embedding_gradient_check_frequency", embedding_gradient_check_frequency)
        return super().backward(loss)

    def dump_checkpoint(self, dst_dir: str | os.PathLike[str], *args: Any, final: bool = True,
                        with_jit_model: bool = False, jit_dense_model_filename: str = "jit_dense.pt",
                        **kwargs: Any) -> str | None:
        """As :meth:`persia_nats.services.nn_worker.ctx.TrainCtx.dump_checkpoint`; PERSIA's arguments too.

        ``with_jit_model=True`` also writes the model as TorchScript into the checkpoint's directory, as
        ``jit_dense_filename`` (or ``jit_dense_model_filename``), outside its checksummed manifest
        (``persia-launcher serve`` does not need it). Positional arguments follow PERSIA's final release
        (``dense_filename, jit_dense_filename, blocking, with_jit_model``) or its earlier one
        (``dense_model_filename, jit_dense_model_filename, opt_filename, blocking, with_jit_model``), told
        apart by the third. PERSIA's other file names and ``blocking`` do nothing here (logged once).
        """
        order = DUMP_ORDER_EARLIER if len(args) >= 3 and isinstance(args[2], str) else DUMP_ORDER
        if len(args) > len(order):
            raise TypeError(f"dump_checkpoint takes at most {1 + len(order)} positional arguments")
        given = dict(zip(order, args, strict=False))
        for name, value in kwargs.items():
            if name in given:
                raise TypeError(f"dump_checkpoint() got multiple values for argument {name!r}")
            given[name] = value
        with_jit_model = bool(given.pop("with_jit_model", with_jit_model))
        for name in ("jit_dense_filename", "jit_dense_model_filename"):
            jit_dense_model_filename = str(given.pop(name, jit_dense_model_filename))
        _persia_only("TrainCtx.dump_checkpoint", given)
        if given:
            raise TypeError(f"dump_checkpoint() got unexpected keyword arguments {sorted(given)}")
        path = super().dump_checkpoint(dst_dir, final=final)
        if with_jit_model and path is not None and self.model is not None:
            torch.jit.script(self.model).save(os.path.join(path, jit_dense_model_filename))
        return path

    def load_checkpoint(self, src_dir: str | os.PathLike[str], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """As :meth:`persia_nats.services.nn_worker.ctx.TrainCtx.load_checkpoint`; PERSIA's arguments (file
        names, ``map_location``, ``blocking``) are accepted and do nothing here (logged once)."""
        names = ("map_location", "dense_model_filename", "opt_filename", "blocking")
        if len(args) > len(names):
            raise TypeError(f"load_checkpoint takes at most {1 + len(names)} positional arguments")
        given = {**dict(zip(names, args, strict=False)), **kwargs}
        _persia_only("TrainCtx.load_checkpoint", given)
        if given:
            raise TypeError(f"load_checkpoint() got unexpected keyword arguments {sorted(given)}")
        return super().load_checkpoint(src_dir)


def eval_ctx(*args: Any, **kwargs: Any) -> EmbeddingCtx:
    """An evaluation context: no gradients, and the PS never inserts unseen ids."""
    return EmbeddingCtx(_ctx.PreprocessMode.EVAL, *args, **kwargs)


class InferCtx:
    """PERSIA's serving context (embedding workers by address, no NATS): refused, naming this project's serving."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "InferCtx is not supported: serving here goes through NATS like training. Run `persia-launcher serve` "
            "on a checkpoint (docs/operations.md, Serving), or, in a script, look batches up with "
            "eval_ctx(model=...).forward(persia_batch)")
