"""Metrics shared by every method: accuracy and expected calibration error (ECE).

ECE follows Guo et al. (2017): 15 equal-width confidence bins, L1 gap between accuracy and
confidence weighted by bin mass (torchmetrics ``MulticlassCalibrationError(norm="l1")``).
Accuracy is plain (micro) accuracy, not torchmetrics' default macro average.

Language models (:class:`NextTokenMetrics`) report the mean token cross-entropy, its exponential
(perplexity) and next-token accuracy (LEAF's Shakespeare metric), every token weighted alike.
"""

from __future__ import annotations

import math

import torch
from torchmetrics import Metric, MetricCollection
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


class NextTokenMetrics(Metric):
    """``{prefix}loss`` (mean token cross-entropy, nats), ``{prefix}ppl`` (its exp) and ``{prefix}acc``.

    Update with ``(logits (B, T, V), targets (B, T))``; sums are kept in float64 and summed over processes.
    """

    full_state_update = False

    def __init__(self, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix
        self.add_state("loss_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("correct", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        flat = logits.reshape(-1, logits.shape[-1]).float()
        target = targets.reshape(-1)
        self.loss_sum += torch.nn.functional.cross_entropy(flat, target, reduction="sum").double()
        self.correct += (flat.argmax(-1) == target).sum()
        self.tokens += target.numel()

    def compute(self) -> dict[str, torch.Tensor]:
        if self.tokens == 0:
            raise ValueError("NextTokenMetrics.compute() called before any update")
        loss = self.loss_sum / self.tokens
        ppl = torch.exp(loss) if loss < math.log(torch.finfo(torch.float64).max) else torch.tensor(math.inf)
        acc = self.correct.double() / self.tokens
        return {f"{self.prefix}loss": loss.float(), f"{self.prefix}ppl": ppl.float(), f"{self.prefix}acc": acc.float()}
