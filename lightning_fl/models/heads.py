"""Classifier heads: frozen orthogonal (default), frozen Kaiming, or trainable.

A frozen orthogonal head gives the backbone a fixed, well-conditioned set of class prototypes
to align to (Hoffer et al. 2018, "Fix your classifier"); the FLITE paper freezes it from the
first pretraining step, which also keeps it out of every federated payload.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

HeadKind = Literal["orthogonal", "kaiming", "trainable"]


class ClassifierHead(nn.Module):
    """Linear map ``(B, in_features) -> (B, num_classes)``.

    - ``orthogonal``: orthonormal rows (or columns when ``num_classes > in_features``), frozen, no bias.
    - ``kaiming``: ``nn.Linear``'s default Kaiming-uniform init, frozen, no bias.
    - ``trainable``: ``nn.Linear`` with bias, trained (the textbook head).

    Frozen weights are parameters with ``requires_grad=False`` so they travel in checkpoints.
    """

    def __init__(self, in_features: int, num_classes: int, kind: HeadKind = "orthogonal") -> None:
        super().__init__()
        if kind not in ("orthogonal", "kaiming", "trainable"):
            raise ValueError(f"model.head must be 'orthogonal', 'kaiming' or 'trainable', got {kind!r}")
        self.kind = kind
        self.in_features, self.num_classes = in_features, num_classes
        weight = torch.empty(num_classes, in_features)
        if kind == "orthogonal":
            nn.init.orthogonal_(weight)
        else:
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # as nn.Linear.reset_parameters
        trainable = kind == "trainable"
        self.weight = nn.Parameter(weight, requires_grad=trainable)
        self.bias: nn.Parameter | None = None
        if trainable:
            bound = 1.0 / math.sqrt(in_features)
            self.bias = nn.Parameter(torch.empty(num_classes).uniform_(-bound, bound))

    @property
    def frozen(self) -> bool:
        return self.kind != "trainable"

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(features, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, kind={self.kind!r}"
