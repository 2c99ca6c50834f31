"""Data loading on NN workers: ``DataLoader`` over ``StreamingDataset`` or ``IterableDataset``."""

from persia_nats.services.nn_worker.data import DataLoader, IterableDataset, StreamingDataset
from persia_nats.services.nn_worker.runtime import TrainingBatch as PersiaTrainingBatch

__all__ = ["DataLoader", "IterableDataset", "PersiaTrainingBatch", "StreamingDataset"]
