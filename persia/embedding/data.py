"""Batch types (PERSIA's ``persia.embedding.data``)."""

from persia_nats.common.batch import IDTypeFeature, IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia_nats.common.messages import MAX_BATCH_SIZE

#: PERSIA's name for IDTypeFeature before its last release (its adult-income data_generator.py used it)
IDTypeFeatureSparse = IDTypeFeature

__all__ = ["MAX_BATCH_SIZE", "IDTypeFeature", "IDTypeFeatureSparse", "IDTypeFeatureWithSingleID", "Label",
           "NonIDTypeFeature", "PersiaBatch"]
