"""Data: offline-first data sources, client partitioners and the federated data module."""

from lightning_fl.data.builtin import Digits, Synthetic
from lightning_fl.data.datamodule import FederatedDataModule, TransformedSubset
from lightning_fl.data.features import ExtractedFeatures, FeatureData, FeatureExtractor, FeatureSet, PixelFeatures
from lightning_fl.data.partition import IID, Dirichlet, Partitioner, Shards, label_histograms
from lightning_fl.data.sources import (
    DataSource,
    FileDataSource,
    ImageTransform,
    LabeledImages,
    TensorImages,
    default_data_dir,
)
from lightning_fl.data.vision import CIFAR10, CIFAR100, MNIST, FashionMNIST, ImageFiles, TinyImageNet, read_idx

__all__ = [
    "CIFAR10",
    "CIFAR100",
    "IID",
    "MNIST",
    "DataSource",
    "Digits",
    "Dirichlet",
    "ExtractedFeatures",
    "FashionMNIST",
    "FeatureData",
    "FeatureExtractor",
    "FeatureSet",
    "FederatedDataModule",
    "FileDataSource",
    "ImageFiles",
    "ImageTransform",
    "LabeledImages",
    "Partitioner",
    "PixelFeatures",
    "Shards",
    "Synthetic",
    "TensorImages",
    "TinyImageNet",
    "TransformedSubset",
    "default_data_dir",
    "label_histograms",
    "read_idx",
]
