"""PERSIA's ``persia.prelude``: the classes of its Rust extension ``persia_core``, which this project has not.

Each name PERSIA exported here raises an AttributeError that says what to use instead; a script importing
one fails on that import line, with that message.
"""

from __future__ import annotations

from typing import Any

_USE = "persia.embedding.data.PersiaBatch(id_type_features, non_id_type_features=..., labels=...)"
#: PERSIA's exports (its last release and the earlier ones its tutorials import), and what replaces each
INSTEAD = {
    "PersiaBatch": _USE,
    "PyPersiaBatchData": _USE,
    "PersiaBatchDataSender": "an IterableDataset subclass whose __iter__ yields PersiaBatch (persia.data)",
    "PyPersiaBatchDataSender": "an IterableDataset subclass whose __iter__ yields PersiaBatch (persia.data)",
    "PyPersiaBatchDataChannel": "persia.data.DataLoader over a StreamingDataset or an IterableDataset",
    "PyPersiaBatchDataReceiver": "persia.data.DataLoader over a StreamingDataset or an IterableDataset",
    "PyPersiaRpcClient": "the contexts (persia.ctx); roles talk over NATS, not HTTP RPC",
    "PyPersiaReplicaInfo": "persia.env.get_replica_index() / get_replica_size()",
    "PyPersiaMessageQueueServer": "nothing: PERSIA exported this legacy queue but never used it",
    "PyPersiaMessageQueueClient": "nothing: PERSIA exported this legacy queue but never used it",
    "PyPersiaBatchFlowNatsStubPublisher": "persia.ctx.DataCtx().send_data(batch)",
    "PyPersiaBatchFlowNatsStubResponder": "persia.data.StreamingDataset",
    "PyOptimizerBase": "persia.embedding.optim.Optimizer",
    "PyBackward": "persia.ctx.TrainCtx.backward(loss)",
    "PyForward": "persia.data.DataLoader",
    "forward_directly_from_data": "persia.ctx.eval_ctx(model=...).get_embedding_from_data(batch)",
    "forward_directly_from_bytes": "persia.ctx.eval_ctx(model=...).get_embedding_from_data(batch)",
    "is_cuda_feature_available": "torch.cuda.is_available(): one package serves CPUs and GPUs",
}


def __getattr__(name: str) -> Any:
    if name in INSTEAD:
        raise AttributeError(f"persia.prelude.{name} is part of PERSIA's Rust extension, which this project has "
                             f"not: use {INSTEAD[name]}")
    raise AttributeError(f"module 'persia.prelude' has no attribute {name!r}")


__all__: list[str] = []
