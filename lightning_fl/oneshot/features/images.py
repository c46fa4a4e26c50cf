"""Images as features: selecting a split's images, batching them for extraction, and :class:`PixelFeatures`."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_fl.data.builtin import Digits
from lightning_fl.data.sources import DataSource, ImageTransform, LabeledImages, TensorImages
from lightning_fl.oneshot.features.sets import KEY, FeatureData, FeatureSet, check_classes
from lightning_fl.trainer_api import lazy_instance

EVAL_BATCH = 512


def select_images(
    images: LabeledImages, classes: list[int] | None, cap: int | None, seed: int
) -> tuple[np.ndarray, Tensor]:
    """Indices into a split (sorted) and their labels after the class subset and the seeded sample cap."""
    targets = np.asarray(images.targets, dtype=np.int64)
    idx = np.arange(len(targets))
    labels = targets
    if classes is not None:
        relabel = np.full(max(max(classes), int(targets.max(initial=0))) + 1, -1, dtype=np.int64)
        relabel[classes] = np.arange(len(classes))
        labels = relabel[targets]
        idx = idx[labels >= 0]
    if cap is not None and cap < len(idx):
        idx = np.sort(np.random.default_rng(seed).permutation(idx)[:cap])
    return idx, torch.from_numpy(labels[idx].copy())


class RelabelledImages(Dataset):
    """``(transform(images[indices[i]]), labels[i])``."""

    def __init__(self, images: LabeledImages, indices: np.ndarray, labels: Tensor, transform: ImageTransform) -> None:
        self.images, self.indices, self.labels, self.transform = images, indices, labels, transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        image, _ = self.images[int(self.indices[i])]
        return self.transform(image), self.labels[i]


def eval_batches(images: LabeledImages, indices: np.ndarray, transform: ImageTransform) -> Iterator[Tensor]:
    """Normalised ``(B, C, H, W)`` batches without augmentation; in-memory splits are sliced, not iterated."""
    plain = isinstance(transform, ImageTransform) and transform.crop_padding == 0 and not transform.hflip
    if isinstance(images, TensorImages) and plain:
        for start in range(0, len(indices), EVAL_BATCH):
            yield transform.batch(images.images[torch.from_numpy(indices[start : start + EVAL_BATCH])])
    else:
        dummy = torch.zeros(len(indices), dtype=torch.long)
        loader = DataLoader(RelabelledImages(images, indices, dummy, transform), batch_size=EVAL_BATCH)
        for x, _ in loader:
            yield x


class PixelFeatures(FeatureData):
    """Flattened, normalised pixels used directly as features (digits: 64-d).

    Args:
        source: The image data set.
        standardize: Standardise each pixel with train-split statistics (else the source's own normalisation).
        classes: Keep only these classes, relabelled ``0..len-1`` in this order (``null``: all).
    """

    def __init__(
        self, source: DataSource = lazy_instance(Digits), standardize: bool = True, classes: list[int] | None = None
    ) -> None:
        super().__init__()
        self.source = source
        self.source.config_key = f"{KEY}.source"  # messages about the data name the key that works here
        self.standardize = standardize
        self.classes = check_classes(classes, self.source.num_classes)

    @property
    def num_classes(self) -> int:
        return len(self.classes) if self.classes is not None else self.source.num_classes

    @property
    def feature_dim(self) -> int:
        return math.prod(self.source.input_shape)

    def compute(self) -> tuple[FeatureSet, FeatureSet]:
        self.source.prepare()
        out = []
        for split in ("train", "test"):
            images = self.source.load(split)
            idx, y = select_images(images, self.classes, None, 0)
            parts = [x.flatten(1) for x in eval_batches(images, idx, self.source.transform(train=False))]
            h = torch.cat(parts) if parts else torch.zeros(0, self.feature_dim)
            out.append(FeatureSet(h.float(), y, self.num_classes))
        self.info = {"num_train": len(out[0]), "num_test": len(out[1]), "cached": False}
        return out[0], out[1]

    def __repr__(self) -> str:
        return f"PixelFeatures(source={self.source!r}, standardize={self.standardize}, classes={self.classes})"
