"""Small GroupNorm CNNs for 28x28 (MNIST, Fashion-MNIST) and 8x8 (digits) inputs, for CPU experiments."""

from __future__ import annotations

import torch
from torch import nn

from lightning_fl.models.backbone import Backbone, check_groups


class SmallCNN(Backbone):
    """Conv stages (3x3 conv -> GroupNorm -> ReLU, then 2x2 max-pool) and a linear feature layer.

    With the defaults on 28x28 inputs: 1->32->64 channels, 28->14->7 pixels, 3,136 -> 128 features.
    On 8x8 inputs the same stages give 8->4->2 pixels and 256 -> 128 features.

    Args:
        in_channels: Image channels.
        image_size: Input height and width (the flatten size depends on it).
        channels: Output channels of each conv stage.
        convs_per_stage: 3x3 convs in each stage before its pooling.
        feature_dim: Size of the feature vector (the head's input).
        norm_groups: GroupNorm groups; must divide every entry of ``channels``.
    """

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 28,
        channels: list[int] | None = None,
        convs_per_stage: int = 1,
        feature_dim: int = 128,
        norm_groups: int = 8,
    ) -> None:
        super().__init__()
        channels = [32, 64] if channels is None else list(channels)
        if not channels or min(channels) < 1:
            raise ValueError(f"model.backbone.channels must be a non-empty list of positive ints, got {channels}")
        if image_size < 2 ** len(channels):
            raise ValueError(
                f"model.backbone.image_size={image_size} is too small for {len(channels)} pooling stages; "
                f"use at most {max(1, image_size.bit_length() - 1)} entries in channels"
            )
        if convs_per_stage < 1 or feature_dim < 1:
            raise ValueError("model.backbone.convs_per_stage and feature_dim must be >= 1")
        for c in channels:
            check_groups(c, norm_groups, "model.backbone")
        self.in_channels = in_channels
        self.image_size = image_size
        self.out_features = feature_dim
        layers: list[nn.Module] = []
        prev, size = in_channels, image_size
        for c in channels:
            for _ in range(convs_per_stage):
                layers += [nn.Conv2d(prev, c, 3, padding=1, bias=False), nn.GroupNorm(norm_groups, c), nn.ReLU(True)]
                prev = c
            layers.append(nn.MaxPool2d(2))
            size //= 2
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(prev * size * size, feature_dim)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            raise ValueError(
                f"SmallCNN was built for {self.image_size}x{self.image_size} inputs, got {tuple(x.shape[-2:])}; "
                "set model.backbone.image_size"
            )
        x = self.features(x)  # (B, C_last, s, s)
        return torch.relu(self.fc(torch.flatten(x, 1)))  # (B, feature_dim)
