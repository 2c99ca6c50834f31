"""Contexts: ``DataCtx`` (data loaders), ``TrainCtx`` / ``eval_ctx`` / ``EmbeddingCtx`` (NN workers).

The NN-worker contexts import torch; they load on first use, so a data loader importing
``DataCtx`` from here starts without paying for torch.
"""

from typing import Any

from persia_nats.services.data_loader.ctx import DataCtx

_NN_NAMES = {"BatchError", "EmbeddingCtx", "PreprocessMode", "TrainCtx", "current_ctx", "eval_ctx", "cnt_ctx"}


def __getattr__(name: str) -> Any:
    if name in _NN_NAMES:
        from persia_nats.services.nn_worker import ctx

        return getattr(ctx, "current_ctx" if name == "cnt_ctx" else name)
    raise AttributeError(f"module 'persia.ctx' has no attribute {name!r}")


__all__ = ["BatchError", "DataCtx", "EmbeddingCtx", "PreprocessMode", "TrainCtx", "cnt_ctx", "current_ctx", "eval_ctx"]
