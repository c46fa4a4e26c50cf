"""Data: offline-first data sources, client partitioners and the federated data module."""

from lightning_fl.data.builtin import Digits, Synthetic
from lightning_fl.data.datamodule import FederatedDataModule, TransformedSubset
from lightning_fl.data.instruct import FederatedInstructionDataModule
from lightning_fl.data.instruction_tasks import InstructionTasks
from lightning_fl.data.instructions import InstructionFiles, InstructionRecord, InstructionSource
from lightning_fl.data.partition import IID, Dirichlet, Partitioner, Shards, label_histograms
from lightning_fl.data.roles import ByPlay, ByRole, Role, TextPartition, TextSource
from lightning_fl.data.shakespeare import Shakespeare, parse_play
from lightning_fl.data.sources import (
    DataSource,
    FileDataSource,
    ImageTransform,
    LabeledImages,
    TensorImages,
    default_data_dir,
)
from lightning_fl.data.text import FederatedTextDataModule, TextWindows
from lightning_fl.data.vision import CIFAR10, CIFAR100, MNIST, FashionMNIST, ImageFiles, TinyImageNet, read_idx

__all__ = [
    "CIFAR10",
    "CIFAR100",
    "IID",
    "MNIST",
    "ByPlay",
    "ByRole",
    "DataSource",
    "Digits",
    "Dirichlet",
    "FashionMNIST",
    "FederatedDataModule",
    "FederatedInstructionDataModule",
    "FederatedTextDataModule",
    "FileDataSource",
    "ImageFiles",
    "ImageTransform",
    "InstructionFiles",
    "InstructionRecord",
    "InstructionSource",
    "InstructionTasks",
    "LabeledImages",
    "Partitioner",
    "Role",
    "Shakespeare",
    "Shards",
    "Synthetic",
    "TensorImages",
    "TextPartition",
    "TextSource",
    "TextWindows",
    "TinyImageNet",
    "TransformedSubset",
    "default_data_dir",
    "label_histograms",
    "parse_play",
    "read_idx",
]
