"""Frozen features for FMP: every image mapped once to a vector ``h``, then cached.

FMP ("Federated Martingale Posterior Sampling", section V-2) does not work on raw images: "we first map each input image
x to a frozen feature representation h in R^{d_x}, obtained from a feature extractor trained
offline with cross-entropy loss". Our reading: ``d_x = 128``, and the server
refits linear softmax classifiers on ``h``.

- :class:`PixelFeatures`: the flattened pixels themselves (digits: 64-d), for quick CPU runs.
- :class:`ExtractedFeatures`: ``backbone -> Linear(out_features, feature_dim) -> ReLU`` trained with
  cross-entropy through a trainable linear head (the function class the server refits), then run
  once in eval mode over both splits. Features, extractor weights and its accuracy are cached in
  one file keyed by everything that determines them, so every run of an experiment shares them.

Both return :class:`FeatureSet` pairs, optionally restricted to a class subset (relabelled
``0..k-1`` in the order given) and standardised per dimension with train-split statistics.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from jsonargparse import lazy_instance
from lightning.pytorch.utilities.seed import isolate_rng
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_fl.checkpoint import (
    atomic_save,
    atomic_write_text,
    default_cache_dir,
    digest_tensors,
    read_checkpoint,
    state_mismatch,
    tensor_state,
)
from lightning_fl.data.builtin import Digits
from lightning_fl.data.sources import DataSource, ImageTransform, LabeledImages, Split, TensorImages
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.methods.classifier import Classifier, OptimizerName
from lightning_fl.models.backbone import Backbone

log = logging.getLogger(__name__)
KEY = "data.features"  # config path used in messages
CACHE_FORMAT = "lightning_fl.data.features/1"  # bump when extraction or the file layout changes
_EVAL_BATCH = 512


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


# --------------------------------------------------------------------------------------------- images


def _select(images: LabeledImages, classes: list[int] | None, cap: int | None, seed: int) -> tuple[np.ndarray, Tensor]:
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


class _Relabelled(Dataset):
    """``(transform(images[indices[i]]), labels[i])``."""

    def __init__(self, images: LabeledImages, indices: np.ndarray, labels: Tensor, transform: ImageTransform) -> None:
        self.images, self.indices, self.labels, self.transform = images, indices, labels, transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        image, _ = self.images[int(self.indices[i])]
        return self.transform(image), self.labels[i]


def _eval_batches(images: LabeledImages, indices: np.ndarray, transform: ImageTransform) -> Iterator[Tensor]:
    """Normalised ``(B, C, H, W)`` batches without augmentation; in-memory splits are sliced, not iterated."""
    plain = isinstance(transform, ImageTransform) and transform.crop_padding == 0 and not transform.hflip
    if isinstance(images, TensorImages) and plain:
        for start in range(0, len(indices), _EVAL_BATCH):
            yield transform(images.images[torch.from_numpy(indices[start : start + _EVAL_BATCH])])
    else:
        dummy = torch.zeros(len(indices), dtype=torch.long)
        loader = DataLoader(_Relabelled(images, indices, dummy, transform), batch_size=_EVAL_BATCH)
        for x, _ in loader:
            yield x


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
        raise NotImplementedError

    @property
    def feature_dim(self) -> int:
        raise NotImplementedError

    def compute(self) -> tuple[FeatureSet, FeatureSet]:
        """The (train, test) features before standardisation."""
        raise NotImplementedError

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
        self.source.config_key = "data.features.source"  # where FMP configs put it: messages name this key
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
            idx, y = _select(images, self.classes, None, 0)
            parts = [x.flatten(1) for x in _eval_batches(images, idx, self.source.transform(train=False))]
            h = torch.cat(parts) if parts else torch.zeros(0, self.feature_dim)
            out.append(FeatureSet(h.float(), y, self.num_classes))
        self.info = {"num_train": len(out[0]), "num_test": len(out[1]), "cached": False}
        return out[0], out[1]

    def __repr__(self) -> str:
        return f"PixelFeatures(source={self.source!r}, standardize={self.standardize}, classes={self.classes})"


class FeatureExtractor(Backbone):
    """``backbone -> Linear(out_features, feature_dim) -> ReLU``: the 128-d representation FMP works on.

    The ReLU makes ``h`` the usual penultimate-layer representation of a CE-trained network, so the
    linear softmax classifier trained on top of it is exactly the model FMP's server refits.
    """

    def __init__(self, backbone: Backbone, feature_dim: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.proj = nn.Sequential(nn.Linear(backbone.out_features, feature_dim), nn.ReLU())
        self.in_channels = getattr(backbone, "in_channels", None)
        self.out_features = feature_dim

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.backbone(x))  # (B, feature_dim)


class ExtractedFeatures(FeatureData):
    """Features from an extractor trained with cross-entropy on the train split (or loaded), cached on disk.

    The extractor is ``backbone -> Linear -> ReLU`` (:class:`FeatureExtractor`) with a trainable linear
    head, trained by the centralised loop of ``Classifier`` pretraining (SGD/Adam, warm-up then cosine).
    Every train and test image is then mapped once, in eval mode and without augmentation. The cache
    file holds the raw features, the extractor's weights and ``info`` (``extractor_train_acc``,
    ``extractor_test_acc``, timings); standardisation is applied after loading. The backbone given is
    trained (or loaded) in place.

    Args:
        source: The image data set.
        backbone: Feature trunk (``SmallCNN``, ``ResNet18``...), randomly initialised; its initial weights
            are part of the cache key.
        feature_dim: Size of ``h``. ``null``: no projection, ``h`` is the backbone's own output (then a
            ``Classifier`` checkpoint of the same backbone, e.g. from ``pretrain_*.yaml``, fits ``checkpoint``).
        epochs: Training epochs of the extractor.
        optimizer: ``sgd`` (momentum 0.9), ``adam`` or ``adamw``.
        lr: Peak learning rate.
        weight_decay: Weight decay.
        warmup_epochs: Linear warm-up before the cosine decay (fractions allowed).
        batch_size: Training batch size.
        augment: Train with the source's standard augmentation (crop + flip on CIFAR).
        classes: Keep only these classes, relabelled ``0..len-1`` in this order (``null``: all); the
            extractor is trained on them only.
        max_train_samples: Use a seeded random subset of this many training images (after ``classes``).
        standardize: Standardise each feature with train-split statistics.
        checkpoint: Extractor weights to use instead of training: a features cache file, a Lightning
            checkpoint or a state dict with keys ``backbone.*`` (with a projection: ``backbone.backbone.*`` and
            ``backbone.proj.*``), and optionally ``head.weight``/``head.bias`` for the accuracy in ``info``.
        cache_dir: Cache folder (default ``$LIGHTNING_FL_CACHE`` or ``~/.cache/lightning_fl``); files go
            to ``features/<digest>/``.
        accelerator: ``auto`` (a GPU if there is one), ``cpu`` or ``gpu``.
        precision: Training precision: ``null``/``32-true``, ``bf16-mixed`` or ``16-mixed``; extraction is float32.
        seed: Seed of the projection and head initialisation, the shuffling and the sample cap.
    """

    def __init__(
        self,
        source: DataSource,
        backbone: Backbone,
        feature_dim: int | None = 128,
        epochs: int = 10,
        optimizer: OptimizerName = "sgd",
        lr: float = 0.05,
        weight_decay: float = 5e-4,
        warmup_epochs: float = 1.0,
        batch_size: int = 128,
        augment: bool = True,
        classes: list[int] | None = None,
        max_train_samples: int | None = None,
        standardize: bool = True,
        checkpoint: str | None = None,
        cache_dir: str | None = None,
        accelerator: str = "auto",
        precision: str | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        k = KEY
        source.config_key = f"{k}.source"  # messages about the data name the key that works in this config
        problems = []
        if not isinstance(backbone, nn.Module) or not hasattr(backbone, "out_features"):
            problems.append(f"{k}.backbone must be a Backbone (an nn.Module with out_features)")
        else:
            channels, size = getattr(backbone, "in_channels", None), getattr(backbone, "image_size", None)
            shape = tuple(source.input_shape)
            if channels is not None and channels != shape[0]:
                problems.append(f"{k}.backbone.in_channels={channels} but {source.display_name} has {shape[0]}")
            if size is not None and (size, size) != shape[1:]:
                problems.append(f"{k}.backbone.image_size={size} but {source.display_name} is {shape[1]}x{shape[2]}")
        if feature_dim is not None and feature_dim < 1:
            problems.append(f"{k}.feature_dim must be >= 1 or null, got {feature_dim}")
        if epochs < 1 or batch_size < 1:
            problems.append(f"{k}.epochs and {k}.batch_size must be >= 1, got {epochs} and {batch_size}")
        if optimizer not in ("sgd", "adam", "adamw"):
            problems.append(f"{k}.optimizer must be 'sgd', 'adam' or 'adamw', got {optimizer!r}")
        if not lr > 0 or weight_decay < 0 or warmup_epochs < 0:
            got = f"{lr}, {weight_decay}, {warmup_epochs}"
            problems.append(f"{k}.lr must be > 0 and weight_decay, warmup_epochs >= 0, got {got}")
        if max_train_samples is not None and max_train_samples < 1:
            problems.append(f"{k}.max_train_samples must be >= 1 or null, got {max_train_samples}")
        if accelerator not in ("auto", "cpu", "gpu", "cuda"):
            problems.append(f"{k}.accelerator must be 'auto', 'cpu' or 'gpu', got {accelerator!r}")
        if precision not in (None, "32", "32-true", "bf16-mixed", "16-mixed"):
            problems.append(f"{k}.precision must be null, '32-true', 'bf16-mixed' or '16-mixed', got {precision!r}")
        if problems:
            raise ConfigError("; ".join(problems))
        self.classes = check_classes(classes, source.num_classes)
        if checkpoint is not None and not Path(checkpoint).expanduser().is_file():
            raise CheckpointError(f"{k}.checkpoint={checkpoint} does not exist")
        self.source, self.feature_dim_arg = source, feature_dim
        self.recipe = {
            "epochs": epochs,
            "optimizer": optimizer,
            "lr": lr,
            "weight_decay": weight_decay,
            "warmup_epochs": warmup_epochs,
            "batch_size": batch_size,
            "augment": augment,
            "precision": precision,
        }
        self.max_train_samples, self.standardize, self.checkpoint = max_train_samples, standardize, checkpoint
        self.cache_dir, self.accelerator, self.seed = cache_dir, accelerator, seed
        self._allow_training = True
        with isolate_rng():  # projection and head drawn from `seed`, whatever the run's global seed
            torch.manual_seed(seed)
            net = backbone if feature_dim is None else FeatureExtractor(backbone, feature_dim)
            # The trained module; state keys backbone.* (the net) and head.* (trainable linear head).
            self.model = Classifier(
                net, self.num_classes, head="trainable", optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                warmup_epochs=warmup_epochs,
            )  # fmt: skip
        self._init_digest = self.model._init_digest

    @property
    def num_classes(self) -> int:
        return len(self.classes) if self.classes is not None else self.source.num_classes

    @property
    def feature_dim(self) -> int:
        return self.model.backbone.out_features

    @property
    def extractor(self) -> nn.Module:
        """Images ``(B, C, H, W)`` -> raw features ``(B, feature_dim)`` (trained or loaded after :meth:`prepare`)."""
        return self.model.backbone

    # ------------------------------------------------------------------------------- cache
    def _checkpoint_state(self) -> dict[str, Tensor]:
        """The checkpoint's weights for this extractor; raise naming the keys that do not fit."""
        path = Path(self.checkpoint).expanduser()
        fix = "pass a Lightning checkpoint of a pretrain_*.yaml run or a features cache file written by this package"
        obj = read_checkpoint(path, f"{KEY}.checkpoint=", fix=fix)
        obj = tensor_state(obj, f"{KEY}.checkpoint={path}", keys=("extractor", "state_dict"), fix=fix)
        own = {k: v for k, v in self.model.state_dict().items() if k.startswith("backbone.")}
        missing = sorted(set(own) - set(obj))
        unexpected = sorted(k for k in obj if k.startswith("backbone.") and k not in own)
        wrong = [
            f"{k} {tuple(obj[k].shape)} vs {tuple(v.shape)}" for k, v in own.items() if obj.get(k, v).shape != v.shape
        ]
        if missing or unexpected or wrong:
            found = [f"missing {missing[:4]}"] * bool(missing) + [f"unexpected {unexpected[:4]}"] * bool(unexpected)
            found += [f"shape (checkpoint vs extractor) {wrong[:4]}"] * bool(wrong)
            raise CheckpointError(
                f"{KEY}.checkpoint={path} does not fit this extractor: {'; '.join(found)}. Check {KEY}.backbone and "
                f"{KEY}.feature_dim (null = no projection layer)"
            )
        state = {k: obj[k] for k in own}
        head = {k: obj[k] for k in ("head.weight", "head.bias") if k in obj}
        if head.get("head.weight") is not None and head["head.weight"].shape == self.model.head.weight.shape:
            state["head.weight"] = head["head.weight"]
            state["head.bias"] = head.get("head.bias", torch.zeros(self.num_classes))
        return state

    def cache_key(self, checkpoint_state: dict[str, Tensor] | None = None) -> dict[str, Any]:
        """Everything that determines the raw features; its hash names the cache folder."""
        net = self.model.backbone
        key: dict[str, Any] = {
            "format": CACHE_FORMAT,
            "source": repr(self.source),
            "classes": self.classes,
            "max_train_samples": self.max_train_samples,
            "seed": self.seed,
            "extractor": f"{type(net).__module__}.{type(net).__qualname__}: {net!r}",
            "feature_dim": self.feature_dim,
        }
        if checkpoint_state is not None:
            key["checkpoint"] = digest_tensors(checkpoint_state)
        else:
            key["initial_weights"] = self._init_digest
            key["recipe"] = {"loop": "lightning_fl.methods.centralised.train_classifier/1", **self.recipe}
        return key

    def cache_path(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        root = Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()
        return root / "features" / digest / "features.pt"

    def prepare(self, allow_training: bool = True) -> None:
        """Load the features from the cache, or compute and cache them (training only if ``allow_training``).

        Under several processes, call it on one first, then on the others with ``allow_training=False``.
        """
        self._allow_training = allow_training
        super().prepare()

    def _read_cache(self, path: Path, text: str) -> dict[str, Any] | None:
        """The cache file's contents if it is a usable cache for key ``text``, else ``None``.

        A derived file: one that cannot be read safely (truncated, foreign, needs Python objects), is for another
        key or is malformed is a cache miss; it is warned about, recomputed and overwritten. A folder in its
        place is an error (it cannot be overwritten).
        """
        if path.is_dir():
            raise CheckpointError(f"the features cache {path} is a folder, not a file; delete it")
        miss = "treated as a cache miss: the features are recomputed and the file overwritten"
        try:
            data = read_checkpoint(path, "features cache", fix=miss)
        except CheckpointError as err:
            log.warning("%s", err)
            return None
        own = {k: v for k, v in self.model.state_dict().items() if k.startswith(("backbone.", "head."))}
        problem = None
        if not isinstance(data, dict) or data.get("key") != text:
            problem = "it was written for another key or format"
        elif not isinstance(data.get("info"), dict) or not isinstance(data.get("extractor"), dict):
            problem = "it lacks 'info' or 'extractor'"
        elif not all(isinstance(data.get(f"{s}_{f}"), Tensor) for s in ("train", "test") for f in ("h", "y")):
            problem = "it lacks the feature tensors"
        elif any(data[f"{s}_h"].ndim != 2 or len(data[f"{s}_h"]) != len(data[f"{s}_y"]) for s in ("train", "test")):
            problem = "its feature tensors have inconsistent shapes"
        elif not all(isinstance(v, Tensor) for v in data["extractor"].values()):
            problem = "its 'extractor' is not a state dict of tensors"
        elif mismatch := state_mismatch(data["extractor"], own):
            problem = f"its extractor does not fit: {mismatch}"
        if problem is not None:
            log.warning("features cache %s is unusable (%s); %s", path, problem, miss)
            return None
        return data

    def compute(self) -> tuple[FeatureSet, FeatureSet]:
        ckpt = self._checkpoint_state() if self.checkpoint is not None else None
        key = self.cache_key(ckpt)
        path = self.cache_path(key)
        text = json.dumps(key, sort_keys=True, default=str)
        if path.exists():
            data = self._read_cache(path, text)
            if data is not None:
                self.model.load_state_dict(data["extractor"], strict=False)
                self.info = {**data["info"], "cached": True, "cache_path": str(path)}
                c = self.num_classes
                return FeatureSet(data["train_h"], data["train_y"], c), FeatureSet(data["test_h"], data["test_y"], c)
        self.source.prepare()
        splits = {s: self.source.load(s) for s in ("train", "test")}
        picks = {
            "train": _select(splits["train"], self.classes, self.max_train_samples, self.seed),
            "test": _select(splits["test"], self.classes, None, self.seed),
        }
        info: dict[str, Any] = {"extractor": f"checkpoint {self.checkpoint}" if ckpt else "trained"}
        if ckpt is not None:
            self.model.load_state_dict(ckpt, strict=False)
            has_head = "head.weight" in ckpt
        else:
            if not self._allow_training:
                raise CheckpointError(f"the features cache {path} is missing; it should have been prepared first")
            start = time.perf_counter()
            info["final_epoch"] = self._train(splits, picks, path.parent / "extractor")
            info["train_seconds"] = round(time.perf_counter() - start, 1)
            has_head = True
        start = time.perf_counter()
        sets = {s: self._extract(splits[s], *picks[s], has_head, info, s) for s in ("train", "test")}
        info.update(extract_seconds=round(time.perf_counter() - start, 1), num_train=len(sets["train"]))
        info.update(num_test=len(sets["test"]), feature_dim=self.feature_dim)
        state = {
            k: v.detach().cpu() for k, v in self.model.state_dict().items() if k.startswith(("backbone.", "head."))
        }
        payload = {"key": text, "extractor": state, "info": info}
        payload.update({f"{s}_{f}": getattr(sets[s], f) for s in sets for f in ("h", "y")})
        atomic_save(payload, path)
        atomic_write_text(path.parent / "meta.json", json.dumps({"key": key, "info": info}, indent=2, default=str))
        self.info = {**info, "cached": False, "cache_path": str(path)}
        log.warning(
            "Feature extractor ready: train acc %s, test acc %s; features cached at %s",
            info.get("extractor_train_acc"), info.get("extractor_test_acc"), path,
        )  # fmt: skip
        return sets["train"], sets["test"]

    def _train(self, splits: dict, picks: dict, log_dir: Path) -> dict[str, float]:
        """Train the extractor and head with cross-entropy; return the last epoch's metrics."""
        from lightning_fl.methods.centralised import train_classifier

        r = self.recipe
        log.warning("Training the feature extractor for %d epochs (cached under %s)", r["epochs"], log_dir.parent)
        train_tf = self.source.transform(train=True, augment=r["augment"])
        train_set = _Relabelled(splits["train"], *picks["train"], train_tf)
        val_set = _Relabelled(splits["test"], *picks["test"], self.source.transform(train=False))
        generator = torch.Generator().manual_seed(self.seed)
        loaders = SimpleNamespace(  # what train_classifier needs of a data module
            train_dataloader=lambda: DataLoader(train_set, r["batch_size"], shuffle=True, generator=generator),
            val_dataloader=lambda: DataLoader(val_set, _EVAL_BATCH),
        )
        with isolate_rng():
            torch.manual_seed(self.seed)  # augmentation draws
            metrics = train_classifier(self.model, loaders, r["epochs"], self.accelerator, r["precision"], log_dir)
        self.model.cpu()
        return metrics

    @torch.no_grad()
    def _extract(self, images, idx, y, has_head: bool, info: dict, split: str) -> FeatureSet:
        """Map every selected image to its raw feature in eval mode; record the head's accuracy."""
        from lightning_fl.methods.centralised import resolve_device

        device = resolve_device(self.accelerator)
        model = self.model.to(device).eval()
        parts, correct = [], 0
        offset = 0
        for x in _eval_batches(images, idx, self.source.transform(train=False)):
            h = model.backbone(x.to(device, non_blocking=True)).float()  # (B, D)
            if has_head:
                correct += int((model.head(h).argmax(-1).cpu() == y[offset : offset + len(h)]).sum())
            parts.append(h.cpu())
            offset += len(h)
        model.cpu().train()
        h = torch.cat(parts) if parts else torch.zeros(0, self.feature_dim)
        info[f"extractor_{split}_acc"] = round(correct / max(len(y), 1), 4) if has_head else None
        return FeatureSet(h, y, self.num_classes)

    def __repr__(self) -> str:
        recipe = ", ".join(f"{k}={v!r}" for k, v in self.recipe.items())
        return (
            f"ExtractedFeatures(source={self.source!r}, backbone={type(self.model.backbone).__name__} "
            f"[init {self._init_digest[:12]}], feature_dim={self.feature_dim_arg}, {recipe}, classes={self.classes}, "
            f"max_train_samples={self.max_train_samples}, standardize={self.standardize}, "
            f"checkpoint={self.checkpoint!r}, seed={self.seed})"
        )
