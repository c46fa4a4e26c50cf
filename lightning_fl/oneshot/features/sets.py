"""Frozen features for the one-shot methods: the feature sets and the base class of every feature pipeline.

The FMP paper does not work on raw images: "we first map each input image x to a frozen feature
representation h in R^{d_x}, obtained from a feature extractor trained offline with cross-entropy loss";
the server then refits linear softmax classifiers on ``h``. A pipeline (:class:`FeatureData`) returns a
train and a test :class:`FeatureSet`, optionally restricted to a class subset (relabelled ``0..k-1`` in the
order given) and standardised per dimension with train-split statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fl.data.sources import Split
from lightning_fl.errors import ConfigError

KEY = "data.features"  # where FMP configs put a feature pipeline: messages name this key


def check_classes(classes: Sequence[int] | None, num_classes: int, key: str = f"{KEY}.classes") -> list[int] | None:
    """Validate a class subset: at least two distinct ids in ``[0, num_classes)``."""
    if classes is None:
        return None
    classes = [int(c) for c in classes]
    dupes = sorted({c for c in classes if classes.count(c) > 1})
    bad = [c for c in classes if not 0 <= c < num_classes]
    if dupes or bad or len(classes) < 2:
        found = [f"duplicates {dupes}"] * bool(dupes) + [f"out-of-range ids {bad}"] * bool(bad)
        found += [f"only {len(classes)} class(es)"] * (len(classes) < 2)
        raise ConfigError(
            f"{key} must list at least two distinct class ids in [0, {num_classes}), got {' and '.join(found)}"
        )
    return classes


@dataclass
class FeatureSet:
    """Features ``h`` ``[N, D]`` float32 with integer labels ``y`` ``[N]`` in ``0..num_classes-1``."""

    h: Tensor
    y: Tensor
    num_classes: int

    def __post_init__(self) -> None:
        if self.h.ndim != 2 or self.y.shape != self.h.shape[:1]:
            raise ValueError(f"Expected h [N, D] and y [N], got {tuple(self.h.shape)} and {tuple(self.y.shape)}")
        if self.h.dtype != torch.float32 or self.y.dtype != torch.int64:
            raise ValueError(f"Expected float32 h and int64 y, got {self.h.dtype} and {self.y.dtype}")
        if len(self.y) and not 0 <= int(self.y.min()) <= int(self.y.max()) < self.num_classes:
            raise ValueError(f"Expected labels in [0, {self.num_classes}), got [{self.y.min()}, {self.y.max()}]")

    def __len__(self) -> int:
        return len(self.y)

    @property
    def feature_dim(self) -> int:
        return self.h.shape[1]

    def subset(self, indices: Tensor | np.ndarray | Sequence[int]) -> FeatureSet:
        """The samples at ``indices``, labels unchanged."""
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return FeatureSet(self.h[idx], self.y[idx], self.num_classes)

    def select_classes(self, classes: Sequence[int]) -> FeatureSet:
        """Only the samples of ``classes``, relabelled ``classes[i] -> i``."""
        classes = check_classes(classes, self.num_classes, key="classes")
        relabel = torch.full((self.num_classes,), -1, dtype=torch.long)
        relabel[torch.tensor(classes)] = torch.arange(len(classes))
        new = relabel[self.y]
        keep = new >= 0
        return FeatureSet(self.h[keep], new[keep], len(classes))

    def standardized(self, mean: Tensor, std: Tensor) -> FeatureSet:
        return FeatureSet((self.h - mean) / std, self.y, self.num_classes)


def standardize(train: FeatureSet, test: FeatureSet) -> tuple[FeatureSet, FeatureSet, Tensor, Tensor]:
    """Both sets standardised per dimension with the train set's mean and std (constant dimensions: std 1)."""
    mean, std = train.h.mean(0), train.h.std(0, unbiased=False)  # (D,), (D,)
    std = torch.where(std > 1e-6, std, torch.ones_like(std))
    return train.standardized(mean, std), test.standardized(mean, std), mean, std


class FeatureData:
    """Frozen features with a train and a test split; subclasses implement :meth:`compute`.

    Call :meth:`prepare` once (it may train and cache), then :meth:`load` each split.
    """

    _plugin_base = True  # not offered as a choice in CLI messages

    standardize: bool = False

    def __init__(self) -> None:
        self._sets: dict[str, FeatureSet] | None = None
        #: What was learnt while preparing (accuracies, timings, ``cached``); filled by :meth:`prepare`.
        self.info: dict[str, Any] = {}
        self.mean: Tensor | None = None
        self.std: Tensor | None = None

    @property
    def num_classes(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define num_classes")

    @property
    def feature_dim(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define feature_dim")

    def compute(self) -> tuple[FeatureSet, FeatureSet]:
        """The (train, test) features before standardisation."""
        raise NotImplementedError(f"{type(self).__name__} must define compute() -> (train, test) FeatureSets")

    def prepare(self) -> None:
        """Compute (or load) both splits once and keep them in memory."""
        if self._sets is not None:
            return
        train, test = self.compute()
        if self.standardize:
            train, test, self.mean, self.std = standardize(train, test)
        self._sets = {"train": train, "test": test}

    def load(self, split: Split) -> FeatureSet:
        if split not in ("train", "test"):
            raise ValueError(f"Expected split 'train' or 'test', got {split!r}")
        self.prepare()
        return self._sets[split]
