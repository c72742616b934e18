"""Two-layer GCN (Kipf & Welling) baseline for the chains example, on the same normalized operator as IGNN.

Its receptive field is two hops, so on chains it can only label nodes within two hops of a chain's first
node; the rest is a guess. Not part of the package: a baseline lives with its experiment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GCN(nn.Module):
    """logits = Â · dropout(ReLU(Â X W₁ + b₁)) W₂ + b₂ with the sparse operator Â (rows = targets)."""

    def __init__(self, in_features: int, hidden: int, num_classes: int, dropout: float = 0.5):
        super().__init__()
        self.lin1 = nn.Linear(in_features, hidden)
        self.lin2 = nn.Linear(hidden, num_classes)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, operator: torch.Tensor) -> torch.Tensor:
        h = F.relu(operator @ self.lin1(F.dropout(x, self.dropout, self.training)))
        h = F.dropout(h, self.dropout, self.training)
        return operator @ self.lin2(h)
