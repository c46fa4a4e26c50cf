"""ResNet-18/34 with GroupNorm (He et al. 2016; Wu & He 2018) for federated learning.

GroupNorm instead of BatchNorm: GN carries no running statistics, so averaging client weights
is well defined (Hsieh et al. 2020). Stems:

- ``cifar``: 3x3 conv, stride 1, no max-pool (32x32 inputs; the convention of kuangliu/pytorch-cifar).
- ``tinyimagenet``: the CIFAR stem followed by a 3x3/2 max-pool, so 64x64 inputs reach the
  residual stages at 32x32 with the same conv weights as the CIFAR variant.
- ``imagenet``: 7x7 conv, stride 2, then a 3x3/2 max-pool (torchvision's stem).

ResNet-18 with the CIFAR stem has 20 conv layers holding 11,159,232 weights.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from lightning_fl.models.backbone import Backbone, check_groups

Stem = Literal["cifar", "tinyimagenet", "imagenet"]


def conv3x3(in_planes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convs with GroupNorm and an identity (or 1x1 conv + GN) shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = conv3x3(in_planes, planes, stride)
        self.norm1 = nn.GroupNorm(groups, planes)
        self.conv2 = conv3x3(planes, planes)
        self.norm2 = nn.GroupNorm(groups, planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False), nn.GroupNorm(groups, planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNetGN(Backbone):
    """ResNet with BasicBlocks and GroupNorm; outputs the globally average-pooled features.

    Args:
        blocks: Blocks in each of the four stages, e.g. ``[2, 2, 2, 2]`` for ResNet-18.
        in_channels: Image channels.
        stem: ``cifar`` (32x32), ``tinyimagenet`` (64x64) or ``imagenet`` (224x224); see the module docstring.
        norm_groups: GroupNorm groups; must divide ``width``.
        width: Channels of the first stage (64 in He et al. 2016); stages use width x 1, 2, 4, 8.
        zero_init_residual: Start each block's last GroupNorm at zero so blocks begin as identities.
    """

    def __init__(
        self,
        blocks: list[int],
        in_channels: int = 3,
        stem: Stem = "cifar",
        norm_groups: int = 32,
        width: int = 64,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        if len(blocks) != 4 or min(blocks) < 1:
            raise ValueError(f"model.backbone.blocks must be four positive counts, got {blocks}")
        if stem not in ("cifar", "tinyimagenet", "imagenet"):
            raise ValueError(f"model.backbone.stem must be 'cifar', 'tinyimagenet' or 'imagenet', got {stem!r}")
        check_groups(width, norm_groups, "model.backbone")
        self.in_channels = in_channels
        self.out_features = 8 * width
        if stem == "imagenet":
            conv = nn.Conv2d(in_channels, width, kernel_size=7, stride=2, padding=3, bias=False)
        else:
            conv = conv3x3(in_channels, width)
        layers: list[nn.Module] = [conv, nn.GroupNorm(norm_groups, width), nn.ReLU(inplace=True)]
        if stem != "cifar":
            layers.append(nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        self.stem = nn.Sequential(*layers)
        stages = []
        in_planes = width
        for i, n in enumerate(blocks):
            planes, stride = width * 2**i, 1 if i == 0 else 2
            stage = [BasicBlock(in_planes, planes, stride, norm_groups)]
            stage += [BasicBlock(planes, planes, 1, norm_groups) for _ in range(n - 1)]
            stages.append(nn.Sequential(*stage))
            in_planes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, BasicBlock):
                    nn.init.zeros_(m.norm2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)  # (B, w, H, W)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))  # (B, 8w, H/8, W/8) for the cifar stem
        return torch.flatten(self.pool(x), 1)  # (B, 8w)


class ResNet18(ResNetGN):
    """ResNet-18 + GroupNorm (blocks 2-2-2-2). Arguments as :class:`ResNetGN`."""

    def __init__(
        self,
        in_channels: int = 3,
        stem: Stem = "cifar",
        norm_groups: int = 32,
        width: int = 64,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__([2, 2, 2, 2], in_channels, stem, norm_groups, width, zero_init_residual)


class ResNet34(ResNetGN):
    """ResNet-34 + GroupNorm (blocks 3-4-6-3). Arguments as :class:`ResNetGN`."""

    def __init__(
        self,
        in_channels: int = 3,
        stem: Stem = "cifar",
        norm_groups: int = 32,
        width: int = 64,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__([3, 4, 6, 3], in_channels, stem, norm_groups, width, zero_init_residual)
