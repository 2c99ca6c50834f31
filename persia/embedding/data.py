"""Batch types (PERSIA's ``persia.embedding.data``)."""

from persia_nats.common.batch import IDTypeFeature, IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia_nats.common.messages import MAX_BATCH_SIZE

__all__ = ["MAX_BATCH_SIZE", "IDTypeFeature", "IDTypeFeatureWithSingleID", "Label", "NonIDTypeFeature",
           "PersiaBatch"]
