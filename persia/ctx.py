"""Contexts: ``DataCtx`` (data loaders), ``TrainCtx`` / ``eval_ctx`` / ``EmbeddingCtx`` (NN workers).

The NN-worker contexts import torch; they load on first use, so a data loader importing
``DataCtx`` from here starts without paying for torch.
"""

from types import TracebackType
from typing import Any

from persia_nats.services.data_loader import ctx as _loader

from persia.stay import stay_if_cat_follows


class DataCtx(_loader.DataCtx):
    __doc__ = _loader.DataCtx.__doc__

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        super().__exit__(exc_type, exc, tb)
        if exc_type is None:  # every batch delivered: PERSIA's `&& cat` Procfile line may now keep us (persia.stay)
            stay_if_cat_follows()


_NN_NAMES = {"BatchError", "EmbeddingCtx", "PreprocessMode", "TrainCtx", "current_ctx", "eval_ctx", "cnt_ctx"}


def __getattr__(name: str) -> Any:
    if name in _NN_NAMES:
        from persia_nats.services.nn_worker import ctx

        return getattr(ctx, "current_ctx" if name == "cnt_ctx" else name)
    raise AttributeError(f"module 'persia.ctx' has no attribute {name!r}")


__all__ = ["BatchError", "DataCtx", "EmbeddingCtx", "PreprocessMode", "TrainCtx", "cnt_ctx", "current_ctx", "eval_ctx"]
