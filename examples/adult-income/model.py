"""The adult-income dense model, PERSIA's shape, shared by the reference and the distributed example.

::

    dense (bs, k)        -> Linear(k, 16)  -> BatchNorm1d(16)  --+
    8 embeddings (bs, 8) -> concat (bs, 64) -> Linear(64, 128) -> BatchNorm1d(128) --+--> concat (bs, 144)
    -> Linear(144, 256) [-> ReLU] -> Linear(256, 128) [-> ReLU] -> Linear(128, 1) -> sigmoid

PERSIA's example has no activation between the linear layers; that is ``relu=False`` here. The
default ``relu=True`` adds the two ReLUs: one shuffled pass of the reference trainer reaches test AUC
0.9065 with them against 0.9016 without (3 seeds, standardised dense features, Adam 1e-3).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DNN"]


class DNN(nn.Module):
    """PERSIA adult-income DNN. Outputs probabilities (bs, 1), float32."""

    def __init__(
        self,
        dense_dim: int = 5,
        num_slots: int = 8,
        embedding_dim: int = 8,
        dense_mlp_output_size: int = 16,
        sparse_mlp_output_size: int = 128,
        relu: bool = True,
    ):
        super().__init__()
        self.num_slots = num_slots
        self.embedding_dim = embedding_dim
        self.dense_mlp = nn.Linear(dense_dim, dense_mlp_output_size)
        self.dense_bn = nn.BatchNorm1d(dense_mlp_output_size)
        self.sparse_mlp = nn.Linear(num_slots * embedding_dim, sparse_mlp_output_size)
        self.sparse_bn = nn.BatchNorm1d(sparse_mlp_output_size)
        self.ln1 = nn.Linear(dense_mlp_output_size + sparse_mlp_output_size, 256)
        self.ln2 = nn.Linear(256, 128)
        self.ln3 = nn.Linear(128, 1)
        self.act = nn.ReLU() if relu else nn.Identity()

    def forward(self, non_id_tensors: list[torch.Tensor], embedding_tensors: list[torch.Tensor]) -> torch.Tensor:
        """``non_id_tensors[0]``: dense (bs, k); ``embedding_tensors``: ``num_slots`` x (bs, dim), any float dtype."""
        if len(embedding_tensors) != self.num_slots:
            raise ValueError(f"expected {self.num_slots} embedding tensors, got {len(embedding_tensors)}")
        dense_x = non_id_tensors[0].float()
        sparse = torch.cat([t.float() for t in embedding_tensors], dim=1)
        sparse = self.sparse_bn(self.sparse_mlp(sparse))
        dense_x = self.dense_bn(self.dense_mlp(dense_x))
        x = torch.cat([sparse, dense_x], dim=1)
        x = self.act(self.ln1(x))
        x = self.act(self.ln2(x))
        return torch.sigmoid(self.ln3(x))
