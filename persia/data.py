"""Data loading on NN workers: ``DataLoader`` over ``StreamingDataset`` or ``IterableDataset``."""

from typing import Any

from persia_nats.services.nn_worker import data as _data
from persia_nats.services.nn_worker.data import IterableDataset, StreamingDataset
from persia_nats.services.nn_worker.runtime import TrainingBatch as PersiaTrainingBatch

from persia.no_effect import no_effect


class DataLoader(_data.DataLoader):
    __doc__ = _data.DataLoader.__doc__

    def __init__(self, dataset: StreamingDataset | IterableDataset, forward_buffer_size: int = 10,
                 timeout_ms: int = 600_000, num_workers: int | None = None, reproducible: bool = False,
                 embedding_staleness: int | None = None, **kwargs: Any) -> None:
        # PERSIA's two arguments that tuned or ordered its Rust forward engine: said, not silently dropped
        if num_workers is not None:
            no_effect("DataLoader", "num_workers", num_workers, "batches are looked up by the NN worker's asyncio "
                      "loop, forward_buffer_size of them ahead of the training loop")
        if reproducible:
            no_effect("DataLoader", "reproducible", reproducible, "batches train in the order they arrive (there is "
                      "no reorder buffer); for the same order on every run, use one data loader and one NN worker")
        super().__init__(dataset, forward_buffer_size, timeout_ms, 10, False, embedding_staleness, **kwargs)

#: the spellings PERSIA's tutorials use (``from persia.data import Dataloader``, and ``Dataloder``)
Dataloader = DataLoader
Dataloder = DataLoader

#: PERSIA's earlier names that no longer fit, and what replaces each
_INSTEAD = {
    "PersiaDataset": "subclass persia.data.IterableDataset and yield PersiaBatch from __iter__ (PERSIA's later "
                     "API; fetch_data(sender) with a sender channel is gone)",
    "IterableDatasetBase": "persia.data.IterableDataset or StreamingDataset",
}


def __getattr__(name: str) -> Any:
    if name in _INSTEAD:
        raise AttributeError(f"persia.data.{name} is not supported: {_INSTEAD[name]}")
    raise AttributeError(f"module 'persia.data' has no attribute {name!r}")


__all__ = ["DataLoader", "Dataloader", "Dataloder", "IterableDataset", "PersiaTrainingBatch", "StreamingDataset"]
