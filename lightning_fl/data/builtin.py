"""Data sets that need no files: scikit-learn's bundled digits and a synthetic generator."""

from __future__ import annotations

import numpy as np
import torch

from lightning_fl.data.sources import DataSource, LabeledImages, Split, TensorImages


class Digits(DataSource):
    """scikit-learn's bundled handwritten digits: 1,797 images, 8x8 grey, 10 classes.

    Pixel values 0..16 are stored as uint8 ``round(v * 255 / 16)``. The set has no official test
    split; a stratified split with a fixed seed keeps ``test_fraction`` of it aside, identical on
    every machine.

    Args:
        test_fraction: Share of the 1,797 images held out as the test split.
    """

    display_name = "digits (scikit-learn)"
    num_classes = 10
    input_shape = (1, 8, 8)
    mean = (0.3054,)
    std = (0.3760,)

    def __init__(self, test_fraction: float = 0.2) -> None:
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"data.source.test_fraction must be in (0, 1), got {test_fraction}")
        self.test_fraction = test_fraction
        self._splits: dict[str, TensorImages] | None = None

    def load(self, split: Split) -> LabeledImages:
        if self._splits is None:
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split

            bunch = load_digits()
            images = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None]  # (N, 1, 8, 8)
            idx_train, idx_test = train_test_split(
                np.arange(len(images)), test_size=self.test_fraction, random_state=0, stratify=bunch.target
            )
            self._splits = {
                name: TensorImages(torch.from_numpy(images[idx]), bunch.target[idx])
                for name, idx in (("train", np.sort(idx_train)), ("test", np.sort(idx_test)))
            }
        return self._splits[split]

    def __repr__(self) -> str:
        return f"Digits(test_fraction={self.test_fraction})"


class Synthetic(DataSource):
    """Class-conditional random images for tests and smoke runs.

    Each class has a random prototype image; a sample is its class prototype plus Gaussian pixel
    noise, clipped to uint8. ``noise`` controls difficulty (0.3 is easy, 1.0 is hard). Fully
    determined by ``seed``.

    Args:
        num_classes: Number of classes.
        image_size: Height and width of the square images.
        channels: Image channels.
        train_size: Images in the train split.
        test_size: Images in the test split.
        noise: Noise standard deviation relative to the prototypes' pixel spread.
        seed: Seed of the generator.
    """

    display_name = "synthetic"
    chunk = 1 << 16  # images generated at a time
    crop_padding = 0
    hflip = False

    def __init__(
        self,
        num_classes: int = 10,
        image_size: int = 8,
        channels: int = 1,
        train_size: int = 2000,
        test_size: int = 500,
        noise: float = 0.5,
        seed: int = 0,
    ) -> None:
        problems = []
        if num_classes < 2:
            problems.append(f"num_classes must be >= 2, got {num_classes}")
        if image_size < 1 or channels < 1:
            problems.append(f"image_size and channels must be >= 1, got {image_size} and {channels}")
        if train_size < num_classes or test_size < 1:
            problems.append(f"train_size must be >= num_classes and test_size >= 1, got {train_size}, {test_size}")
        if noise < 0:
            problems.append(f"noise must be >= 0, got {noise}")
        if problems:
            raise ValueError("data.source (Synthetic): " + "; ".join(problems))
        self.num_classes = num_classes
        self.input_shape = (channels, image_size, image_size)
        self.mean = (0.5,) * channels
        self.std = (0.25,) * channels
        self.train_size, self.test_size, self.noise, self.seed = train_size, test_size, noise, seed
        self._splits: dict[str, TensorImages] | None = None

    def load(self, split: Split) -> LabeledImages:
        if self._splits is None:
            rng = np.random.default_rng(self.seed)
            prototypes = rng.uniform(0.0, 1.0, size=(self.num_classes, *self.input_shape))
            self._splits = {}
            for name, n in (("train", self.train_size), ("test", self.test_size)):
                labels = np.arange(n) % self.num_classes  # balanced
                rng.shuffle(labels)
                images = np.empty((n, *self.input_shape), dtype=np.uint8)
                # a chunk at a time (the normal draws come in the same order as in one call): millions of images
                # for population-scale runs never hold their float64 noise all at once
                for start in range(0, n, self.chunk):
                    rows = labels[start : start + self.chunk]
                    x = prototypes[rows] + rng.normal(0.0, 0.29 * self.noise, size=(len(rows), *self.input_shape))
                    images[start : start + len(rows)] = np.clip(np.rint(x * 255.0), 0, 255)
                self._splits[name] = TensorImages(torch.from_numpy(images), labels)
        return self._splits[split]

    def __repr__(self) -> str:
        return (
            f"Synthetic(num_classes={self.num_classes}, input_shape={self.input_shape}, "
            f"train_size={self.train_size}, test_size={self.test_size}, noise={self.noise}, seed={self.seed})"
        )
