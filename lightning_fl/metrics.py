"""Metrics shared by every method: accuracy and expected calibration error (ECE).

ECE follows Guo et al. (2017): 15 equal-width confidence bins, L1 gap between accuracy and
confidence weighted by bin mass (torchmetrics ``MulticlassCalibrationError(norm="l1")``).
Accuracy is plain (micro) accuracy, not torchmetrics' default macro average.
"""

from __future__ import annotations

from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassCalibrationError

ECE_BINS = 15


def classification_metrics(num_classes: int, prefix: str) -> MetricCollection:
    """``{prefix}acc`` and ``{prefix}ece``; update with ``(probs or logits (B, C) float32, targets (B,))``."""
    return MetricCollection(
        {
            "acc": MulticlassAccuracy(num_classes=num_classes, average="micro"),
            "ece": MulticlassCalibrationError(num_classes=num_classes, n_bins=ECE_BINS, norm="l1"),
        },
        prefix=prefix,
    )
