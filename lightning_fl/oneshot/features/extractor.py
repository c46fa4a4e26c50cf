"""Features learnt from images: an extractor trained with cross-entropy, run once over both splits, cached.

:class:`ExtractedFeatures` is the FMP paper's pipeline ("a feature extractor trained offline with
cross-entropy loss"; our reading: ``d_x = 128``): ``backbone -> Linear(out_features, feature_dim) -> ReLU``
(:class:`FeatureExtractor`) trained through a trainable linear head, the function class the server refits.
Features, extractor weights and its accuracy are cached in one file keyed by everything that determines them
(:mod:`lightning_fl.oneshot.features.cache`), so every run of an experiment shares them.

Kept as one file: it is one class, :class:`ExtractedFeatures` (with the small network it trains), whose steps (read
a checkpoint, key the cache, train, extract) share the cache key and the model they fill; the parts that stand alone
are already beside it: the cache file (``cache.py``), the choice of images (``images.py``) and the training loop
(:mod:`lightning_fl.methods.centralised`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch.utilities.seed import isolate_rng
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_fl.checkpoint import (
    cache_file,
    cache_key_text,
    compute_environment,
    digest_tensors,
    read_checkpoint,
    tensor_state,
)
from lightning_fl.data.sources import DataSource
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.methods import centralised
from lightning_fl.methods.centralised import resolve_device, train_classifier
from lightning_fl.methods.classifier import Classifier
from lightning_fl.methods.schedules import OptimizerName, Recipe, recipe_problems
from lightning_fl.models.backbone import Backbone
from lightning_fl.oneshot.features.cache import read_features_cache, write_features_cache
from lightning_fl.oneshot.features.images import EVAL_BATCH, RelabelledImages, eval_batches, select_images
from lightning_fl.oneshot.features.sets import KEY, FeatureData, FeatureSet, check_classes

log = logging.getLogger(__name__)
CACHE_FORMAT = "lightning_fl.oneshot.features/1"  # an identifier, not a module path: bump when extraction changes


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
        recipe = SimpleNamespace(optimizer=optimizer, lr=lr, weight_decay=weight_decay, warmup_epochs=warmup_epochs)
        problems += recipe_problems(recipe, k)  # the methods' own recipe checks, named under this key
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
            self.model = Classifier(net, self.num_classes, head="trainable", recipe=Recipe(**vars(recipe)))
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
        """Everything that determines the raw features, the torch threads and device included; its hash names the
        cache folder."""
        net = self.model.backbone
        key: dict[str, Any] = {
            "format": CACHE_FORMAT,
            "source": repr(self.source),
            "classes": self.classes,
            "max_train_samples": self.max_train_samples,
            "seed": self.seed,
            "extractor": f"{type(net).__module__}.{type(net).__qualname__}: {net!r}",
            "feature_dim": self.feature_dim,
            # the same extractor trained with another thread count gives other features (docs/results-fmp.md)
            "environment": compute_environment(resolve_device(self.accelerator)),
        }
        if checkpoint_state is not None:
            key["checkpoint"] = digest_tensors(checkpoint_state)
        else:
            key["initial_weights"] = self._init_digest
            key["recipe"] = {"loop": "lightning_fl.methods.centralised.train_classifier/1", **self.recipe}
        return key

    def cache_path(self, key: dict[str, Any]) -> Path:
        return cache_file("features", key, "features.pt", self.cache_dir)

    def prepare(self, allow_training: bool = True) -> None:
        """Load the features from the cache, or compute and cache them (training only if ``allow_training``).

        Under several processes, call it on one first, then on the others with ``allow_training=False``.
        """
        self._allow_training = allow_training
        super().prepare()

    def compute(self) -> tuple[FeatureSet, FeatureSet]:
        ckpt = self._checkpoint_state() if self.checkpoint is not None else None
        key = self.cache_key(ckpt)
        path = self.cache_path(key)
        if path.exists():
            own = {k: v for k, v in self.model.state_dict().items() if k.startswith(("backbone.", "head."))}
            data = read_features_cache(path, cache_key_text(key), own)
            if data is not None:
                self.model.load_state_dict(data["extractor"], strict=False)
                self.info = {**data["info"], "cached": True, "cache_path": str(path)}
                c = self.num_classes
                return FeatureSet(data["train_h"], data["train_y"], c), FeatureSet(data["test_h"], data["test_y"], c)
        self.source.prepare()
        splits = {s: self.source.load(s) for s in ("train", "test")}
        picks = {
            "train": select_images(splits["train"], self.classes, self.max_train_samples, self.seed),
            "test": select_images(splits["test"], self.classes, None, self.seed),
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
        write_features_cache(path, key, state, sets, info)
        self.info = {**info, "cached": False, "cache_path": str(path)}
        log.warning(
            "Feature extractor ready: train acc %s, test acc %s; features cached at %s",
            info.get("extractor_train_acc"),
            info.get("extractor_test_acc"),
            path,
        )
        return sets["train"], sets["test"]

    def _train(self, splits: dict, picks: dict, log_dir: Path) -> dict[str, float]:
        """Train the extractor and head with cross-entropy; return the last epoch's metrics."""
        r = self.recipe
        log.warning("Training the feature extractor for %d epochs (cached under %s)", r["epochs"], log_dir.parent)
        train_tf = self.source.transform(train=True, augment=r["augment"])
        train_set = RelabelledImages(splits["train"], *picks["train"], train_tf)
        val_set = RelabelledImages(splits["test"], *picks["test"], self.source.transform(train=False))
        generator = torch.Generator().manual_seed(self.seed)
        loaders = SimpleNamespace(  # what train_classifier needs of a data module
            train_dataloader=lambda: DataLoader(train_set, r["batch_size"], shuffle=True, generator=generator),
            val_dataloader=lambda: DataLoader(val_set, EVAL_BATCH),
        )
        with isolate_rng():
            torch.manual_seed(self.seed)  # augmentation draws
            metrics = train_classifier(
                self.model, loaders, r["epochs"], self.accelerator, r["precision"], log_dir, label="feature extractor"
            )
        self.model.cpu()
        return metrics

    @torch.no_grad()
    def _extract(self, images, idx, y, has_head: bool, info: dict, split: str) -> FeatureSet:
        """Map every selected image to its raw feature in eval mode; record the head's accuracy."""
        device = resolve_device(self.accelerator)
        model = self.model.to(device).eval()
        parts, correct = [], 0
        offset = 0
        last_line = time.monotonic()
        log.info("extracting %s features: %d images through %s", split, len(y), type(model.backbone).__name__)
        for x in eval_batches(images, idx, self.source.transform(train=False)):
            h = model.backbone(x.to(device, non_blocking=True)).float()  # (B, D)
            if has_head:
                correct += int((model.head(h).argmax(-1).cpu() == y[offset : offset + len(h)]).sum())
            parts.append(h.cpu())
            offset += len(h)
            if time.monotonic() - last_line >= centralised.HEARTBEAT_SECONDS:  # a line at most once a minute
                last_line = time.monotonic()
                log.info("extracting %s features: %d/%d images", split, offset, len(y))
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
