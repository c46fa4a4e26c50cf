"""Models: GroupNorm backbones (ResNet-18/34, small CNNs) and classifier heads."""

from lightning_fl.models.backbone import Backbone
from lightning_fl.models.cnn import SmallCNN
from lightning_fl.models.heads import ClassifierHead, HeadKind
from lightning_fl.models.resnet_gn import BasicBlock, ResNet18, ResNet34, ResNetGN

__all__ = ["Backbone", "BasicBlock", "ClassifierHead", "HeadKind", "ResNet18", "ResNet34", "ResNetGN", "SmallCNN"]
