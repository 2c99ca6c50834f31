"""PERSIA's ``persia.service``: refused, because embedding workers are found over NATS, not by address."""

from __future__ import annotations


def get_embedding_worker_services() -> list[str]:
    """PERSIA read ``EMBEDDING_WORKER_SERVICE`` (``host:port``) for its HTTP RPC; here there is none to give."""
    raise NotImplementedError(
        "get_embedding_worker_services(): embedding workers are found over NATS here (queue groups under the "
        "job's subject prefix), so there are no addresses and EMBEDDING_WORKER_SERVICE is not read; set "
        "PERSIA_NATS_URL and use persia.ctx.eval_ctx / TrainCtx")


__all__ = ["get_embedding_worker_services"]
