"""The backbone contract: images in, a feature vector out; the classifier head lives elsewhere."""

from __future__ import annotations

import torch
from torch import nn


class Backbone(nn.Module):
    """Feature extractor ``(B, C, H, W) -> (B, out_features)``.

    Subclasses set ``in_channels`` and ``out_features`` in ``__init__``. Keeping the head outside
    the backbone lets methods freeze it, exclude it from the federated payload, or swap it.
    """

    _plugin_base = True  # not offered as a choice in CLI messages

    in_channels: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def check_groups(channels: int, groups: int, where: str) -> None:
    """GroupNorm needs ``groups`` to divide ``channels``; say which config key to change if not."""
    if groups < 1 or channels % groups:
        raise ValueError(f"{where}: norm_groups={groups} must divide the {channels} channels of every layer")
