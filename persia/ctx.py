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


#: from the NN-worker package as they are
_NN_NAMES = {"BatchError", "PreprocessMode", "current_ctx"}
#: in PERSIA's shape (its arguments accepted): persia.nn_contexts
_PERSIA_SHAPED = {"EmbeddingCtx", "InferCtx", "TrainCtx", "eval_ctx"}
#: PERSIA names with no counterpart here, and what to use instead
_NOT_HERE = {
    "BaseCtx": "use DataCtx in data loaders, TrainCtx or eval_ctx in NN workers",
    "PersiaCommonContext": "the contexts hold their NATS connection themselves: use DataCtx, TrainCtx or eval_ctx",
}


def persia_names() -> dict[str, str | None]:
    """PERSIA's context names that are not served as they are: None for those persia.nn_contexts gives PERSIA's
    shape (InferCtx there refuses), else what to use instead; docs/migrating-from-persia.md is checked against it."""
    return {**dict.fromkeys(sorted(_PERSIA_SHAPED)), **_NOT_HERE}


def __getattr__(name: str) -> Any:
    if name in _NN_NAMES or name == "cnt_ctx":
        from persia_nats.services.nn_worker import ctx

        return getattr(ctx, "current_ctx" if name == "cnt_ctx" else name)
    if name in _PERSIA_SHAPED:
        from persia import nn_contexts

        return getattr(nn_contexts, name)
    if name in _NOT_HERE:
        raise AttributeError(f"persia.ctx.{name} is PERSIA's and has no counterpart here: {_NOT_HERE[name]}")
    raise AttributeError(f"module 'persia.ctx' has no attribute {name!r}")


__all__ = ["BatchError", "DataCtx", "EmbeddingCtx", "InferCtx", "PreprocessMode", "TrainCtx", "cnt_ctx", "current_ctx",
           "eval_ctx"]
