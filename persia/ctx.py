"""Contexts: ``DataCtx`` (data loaders), ``TrainCtx`` / ``eval_ctx`` / ``EmbeddingCtx`` (NN workers)."""

from services.data_loader.ctx import DataCtx
from services.nn_worker.ctx import EmbeddingCtx, PreprocessMode, TrainCtx, current_ctx, eval_ctx

cnt_ctx = current_ctx

__all__ = ["DataCtx", "EmbeddingCtx", "PreprocessMode", "TrainCtx", "cnt_ctx", "current_ctx", "eval_ctx"]
