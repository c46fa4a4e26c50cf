"""Models: GroupNorm backbones (ResNet-18/34, small CNNs), classifier heads and TinyGPT (a small causal LM)."""

from lightning_fl.models.backbone import Backbone
from lightning_fl.models.cnn import SmallCNN
from lightning_fl.models.gpt import TinyGPT
from lightning_fl.models.heads import ClassifierHead, HeadKind
from lightning_fl.models.resnet_gn import BasicBlock, ResNet18, ResNet34, ResNetGN

__all__ = [
    "Backbone",
    "BasicBlock",
    "ClassifierHead",
    "HeadKind",
    "ResNet18",
    "ResNet34",
    "ResNetGN",
    "SmallCNN",
    "TinyGPT",
]
