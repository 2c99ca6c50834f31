"""Data loading on NN workers: ``DataLoader`` over ``StreamingDataset`` or ``IterableDataset``."""

from persia_nats.services.nn_worker.data import DataLoader, IterableDataset, StreamingDataset
from persia_nats.services.nn_worker.runtime import TrainingBatch as PersiaTrainingBatch

#: the spelling PERSIA's tutorials use (``from persia.data import Dataloader``)
Dataloader = DataLoader

__all__ = ["DataLoader", "Dataloader", "IterableDataset", "PersiaTrainingBatch", "StreamingDataset"]
