"""Centralised image classification: the pretraining recipe shared by FLITE and its baselines.

Defaults are the FLITE paper's centralised pretraining (appendix C): SGD with momentum 0.9,
learning rate 0.05 with a 3-epoch linear warm-up then cosine decay to zero, weight decay 5e-4,
and the orthogonal classifier head frozen from the first step.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_fl.checkpoint import digest_tensors
from lightning_fl.errors import ConfigError
from lightning_fl.methods.pretraining import Pretraining
from lightning_fl.methods.recipe import TrainingDivergedError, TrainingRecipe, load_state_dict_file
from lightning_fl.methods.schedules import Recipe
from lightning_fl.metrics import classification_metrics
from lightning_fl.models.backbone import Backbone
from lightning_fl.models.heads import ClassifierHead, HeadKind

__all__ = ["CLASSIFIER_RECIPE", "Classifier", "TrainingDivergedError", "load_state_dict_file"]

#: How a :class:`Classifier` trains by default: the FLITE paper's centralised recipe (SGD, momentum 0.9, lr 0.05,
#: weight decay 5e-4, a 3-epoch warm-up, then cosine to zero).
CLASSIFIER_RECIPE = Recipe()


class Classifier(TrainingRecipe):
    """Backbone + classifier head trained with cross-entropy.

    Args:
        backbone: Feature extractor (``ResNet18``, ``ResNet34``, ``SmallCNN``, or your own ``Backbone``).
        num_classes: Number of classes; must match the data set.
        head: ``orthogonal`` (frozen, default), ``kaiming`` (frozen) or ``trainable``.
        recipe: The optimiser recipe (:class:`~lightning_fl.methods.schedules.Recipe`); the default is the FLITE
            paper's centralised one (``CLASSIFIER_RECIPE``).
        label_smoothing: Cross-entropy label smoothing.
        init_from: Checkpoint (Lightning ``.ckpt`` or a state dict) whose backbone and head weights to
            start from, e.g. a pretrained base for fine-tuning. Loaded with ``weights_only=True``.
        pretraining: Without ``init_from``: pretrain the backbone and head with this recipe before training
            (on the data module's centralised split) and cache the result, so a run starts from the same
            base as every other run with the same architecture, seed, data and recipe (FLITE and its
            full-weight baselines share it). ``null``: start from the random initialisation.
    """

    weight_prefixes = ("backbone.", "head.")
    weights_hint = "model.backbone and model.num_classes"

    def __init__(
        self,
        backbone: Backbone,
        num_classes: int,
        head: HeadKind = "orthogonal",
        recipe: Recipe = CLASSIFIER_RECIPE,
        label_smoothing: float = 0.0,
        init_from: str | None = None,
        pretraining: Pretraining | None = None,
    ) -> None:
        super().__init__()
        problems = []
        if num_classes < 2:
            problems.append(f"model.num_classes must be >= 2, got {num_classes}")
        if not 0 <= label_smoothing < 1:
            problems.append(f"model.label_smoothing must be in [0, 1), got {label_smoothing}")
        if not isinstance(backbone, nn.Module) or not hasattr(backbone, "out_features"):
            problems.append("model.backbone must be a Backbone (an nn.Module with an out_features attribute)")
        if problems:
            raise ConfigError("; ".join(problems))
        self.save_hyperparameters(ignore=self._hparams_ignore())
        self.use_recipe(recipe)
        self.backbone = backbone
        self.head = ClassifierHead(backbone.out_features, num_classes, head)
        self.num_classes = num_classes
        self.val_metrics = classification_metrics(num_classes, "val/")
        self.test_metrics = classification_metrics(num_classes, "test/")
        self.pretraining = pretraining
        # Digest of the initial weights: part of the base cache key (the random frozen head must match).
        self._init_digest = digest_tensors({**self.backbone.state_dict(), **self.head.state_dict()})
        self._base_ready = pretraining is None  # nothing to prepare: train from the initialisation
        if init_from is not None:
            self.load_weights(init_from, self.init_from_key)
            self._base_ready = True

    def _hparams_ignore(self) -> list[str]:
        """Constructor arguments kept out of ``hparams`` (modules and objects that are not plain values)."""
        return ["backbone", "pretraining", "recipe"]

    # ----------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))  # (B, num_classes)

    # ----------------------------------------------------------------------------------- base
    def base_cache_key(self, datamodule: object) -> dict[str, object]:
        """Everything that determines the pretrained base; its hash names the cache folder."""
        return self.shared_base_key(datamodule) | {
            "backbone": f"{type(self.backbone).__module__}.{type(self.backbone).__qualname__}",
            "num_classes": self.num_classes,
            "head": self.hparams.head,
        }

    def base_backbone(self) -> nn.Module:
        """The backbone as a base is trained (here the backbone itself; a method that wraps it says otherwise)."""
        return self.backbone

    def pretraining_module(self) -> Classifier:
        """A classifier with a copy of this backbone and the same frozen head that trains with the recipe."""
        p = self.pretraining
        pre = Classifier(
            backbone=copy.deepcopy(self.base_backbone()).requires_grad_(True),
            num_classes=self.num_classes,
            head=self.hparams.head,
            recipe=p.recipe(),
        )
        pre.head.load_state_dict(self.head.state_dict())  # the same frozen class prototypes
        return pre

    # ----------------------------------------------------------------------------------- Lightning hooks
    def check_data(self, datamodule: object) -> None:
        """Refuse data whose classes or channels do not match the model, naming the keys to change."""
        problems = []
        num_classes = getattr(datamodule, "num_classes", None)
        if num_classes is not None and num_classes != self.num_classes:
            problems.append(f"model.num_classes={self.num_classes} but the data has {num_classes} classes")
        shape = getattr(datamodule, "input_shape", None)
        channels = getattr(self.backbone, "in_channels", None)
        if shape is not None and channels is not None and shape[0] != channels:
            problems.append(f"model.backbone.in_channels={channels} but the data has {shape[0]} channels")
        size = getattr(self.backbone, "image_size", None)
        if shape is not None and size is not None and tuple(shape[1:]) != (size, size):
            problems.append(f"model.backbone.image_size={size} but the data is {shape[1]}x{shape[2]}")
        if problems:
            raise ConfigError("; ".join(problems))

    def compute_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (with ``label_smoothing``) computed in float32."""
        return nn.functional.cross_entropy(logits.float(), y, label_smoothing=self.hparams.label_smoothing)

    def _eval_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        x, y = batch
        logits = self(x)
        metrics = self.val_metrics if stage == "val" else self.test_metrics
        metrics.update(logits.float().softmax(-1), y)
        loss = self.compute_loss(logits, y)
        self.log(f"{stage}/loss", loss, on_epoch=True, prog_bar=stage == "val", batch_size=len(y), sync_dist=True)
