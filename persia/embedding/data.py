"""Batch types (PERSIA's ``persia.embedding.data``)."""

from common.batch import IDTypeFeature, IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from common.messages import MAX_BATCH_SIZE

__all__ = ["MAX_BATCH_SIZE", "IDTypeFeature", "IDTypeFeatureWithSingleID", "Label", "NonIDTypeFeature",
           "PersiaBatch"]
