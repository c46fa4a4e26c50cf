"""Models: GroupNorm backbones (ResNet-18/34, small CNNs), classifier heads, TinyGPT (a small causal LM) and pretrained
Hugging Face causal LMs (``HFCausalLM``, ``SmolLM2``; the ``llm`` extra)."""

from lightning_fl.models.backbone import Backbone
from lightning_fl.models.cnn import SmallCNN
from lightning_fl.models.gpt import TinyGPT
from lightning_fl.models.heads import ClassifierHead, HeadKind
from lightning_fl.models.hf import HFCausalLM, SmolLM2
from lightning_fl.models.resnet_gn import BasicBlock, ResNet18, ResNet34, ResNetGN

__all__ = [
    "Backbone",
    "BasicBlock",
    "ClassifierHead",
    "HFCausalLM",
    "HeadKind",
    "ResNet18",
    "ResNet34",
    "ResNetGN",
    "SmallCNN",
    "SmolLM2",
    "TinyGPT",
]
