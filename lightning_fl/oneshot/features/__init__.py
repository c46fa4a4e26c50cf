"""Frozen features for the one-shot methods: feature sets, pixels as features, and a trained, cached extractor."""

from lightning_fl.oneshot.features.extractor import ExtractedFeatures, FeatureExtractor
from lightning_fl.oneshot.features.images import PixelFeatures
from lightning_fl.oneshot.features.sets import FeatureData, FeatureSet, check_classes, standardize

__all__ = [
    "ExtractedFeatures",
    "FeatureData",
    "FeatureExtractor",
    "FeatureSet",
    "PixelFeatures",
    "check_classes",
    "standardize",
]
