"""Centralised image classification: the pretraining recipe shared by FLITE and its baselines.

Defaults are the FLITE paper's centralised pretraining (appendix C): SGD with momentum 0.9,
learning rate 0.05 with a 3-epoch linear warm-up then cosine decay to zero, weight decay 5e-4,
and the orthogonal classifier head frozen from the first step.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.utilities.seed import isolate_rng
from torch import nn

from lightning_fl.checkpoint import atomic_save, default_cache_dir, digest_tensors, read_checkpoint
from lightning_fl.errors import CheckpointError, ConfigError, UserError
from lightning_fl.methods.centralised import train_classifier
from lightning_fl.methods.pretraining import Pretraining
from lightning_fl.methods.schedules import Schedule, warmup_cosine_factor
from lightning_fl.metrics import classification_metrics
from lightning_fl.models.backbone import Backbone
from lightning_fl.models.heads import ClassifierHead, HeadKind

OptimizerName = Literal["sgd", "adam", "adamw"]
log = logging.getLogger(__name__)


class TrainingDivergedError(UserError, FloatingPointError):
    """The training loss became NaN or infinite."""


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a Lightning checkpoint (its ``state_dict``) or a plain state dict, without unpickling code."""
    obj = read_checkpoint(path)
    state = obj.get("state_dict", obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"checkpoint {path} holds no state dict of tensors")
    return state


class Classifier(L.LightningModule):
    """Backbone + classifier head trained with cross-entropy.

    Args:
        backbone: Feature extractor (``ResNet18``, ``ResNet34``, ``SmallCNN``, or your own ``Backbone``).
        num_classes: Number of classes; must match the data set.
        head: ``orthogonal`` (frozen, default), ``kaiming`` (frozen) or ``trainable``.
        optimizer: ``sgd`` (momentum, optional Nesterov), ``adam`` or ``adamw``. For another optimiser,
            subclass and override ``configure_optimizers``.
        lr: Peak learning rate.
        momentum: SGD momentum (ignored by Adam/AdamW).
        weight_decay: Weight decay on every trainable parameter.
        nesterov: Nesterov momentum for SGD.
        warmup_epochs: Linear warm-up length in epochs (fractions allowed); 0 disables it.
        schedule: ``cosine`` decays to zero at the end of training; ``constant`` keeps ``lr`` after warm-up.
        label_smoothing: Cross-entropy label smoothing.
        grad_clip: Clip the gradient norm to this value every step (``null``: no clipping). Applied by
            ``lightning.Trainer`` (unless its own ``gradient_clip_val`` is set) and by federated trainers alike.
        init_from: Checkpoint (Lightning ``.ckpt`` or a state dict) whose backbone and head weights to
            start from, e.g. a pretrained base for fine-tuning. Loaded with ``weights_only=True``.
        pretraining: Without ``init_from``: pretrain the backbone and head with this recipe before training
            (on the data module's centralised split) and cache the result, so a run starts from the same
            base as every other run with the same architecture, seed, data and recipe (FLITE and its
            full-weight baselines share it). ``null``: start from the random initialisation.
    """

    def __init__(
        self,
        backbone: Backbone,
        num_classes: int,
        head: HeadKind = "orthogonal",
        optimizer: OptimizerName = "sgd",
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        nesterov: bool = False,
        warmup_epochs: float = 3.0,
        schedule: Schedule = "cosine",
        label_smoothing: float = 0.0,
        grad_clip: float | None = None,
        init_from: str | None = None,
        pretraining: Pretraining | None = None,
    ) -> None:
        super().__init__()
        problems = []
        if num_classes < 2:
            problems.append(f"model.num_classes must be >= 2, got {num_classes}")
        if optimizer not in ("sgd", "adam", "adamw"):
            problems.append(f"model.optimizer must be 'sgd', 'adam' or 'adamw', got {optimizer!r}")
        if not lr > 0:
            problems.append(f"model.lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            problems.append(f"model.momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            problems.append(f"model.weight_decay must be >= 0, got {weight_decay}")
        if nesterov and (optimizer != "sgd" or momentum == 0):
            problems.append("model.nesterov needs optimizer 'sgd' and momentum > 0")
        if warmup_epochs < 0:
            problems.append(f"model.warmup_epochs must be >= 0, got {warmup_epochs}")
        if schedule not in ("cosine", "constant"):
            problems.append(f"model.schedule must be 'cosine' or 'constant', got {schedule!r}")
        if grad_clip is not None and not grad_clip > 0:
            problems.append(f"model.grad_clip must be > 0 or null, got {grad_clip}")
        if not 0 <= label_smoothing < 1:
            problems.append(f"model.label_smoothing must be in [0, 1), got {label_smoothing}")
        if not isinstance(backbone, nn.Module) or not hasattr(backbone, "out_features"):
            problems.append("model.backbone must be a Backbone (an nn.Module with an out_features attribute)")
        if problems:
            raise ConfigError("; ".join(problems))
        if pretraining is not None and pretraining.epochs < 1:
            raise ConfigError(f"model.pretraining.epochs must be >= 1, got {pretraining.epochs}")
        self.save_hyperparameters(ignore=self._hparams_ignore())
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
            self.load_weights(init_from)
            self._base_ready = True

    def _hparams_ignore(self) -> list[str]:
        """Constructor arguments kept out of ``hparams`` (modules and objects that are not plain values)."""
        return ["backbone", "pretraining"]

    # ----------------------------------------------------------------------------------- weights
    def load_weights(self, path: str | Path) -> None:
        """Load backbone and head weights from ``path``; every weight must be present with the right shape."""
        state = load_state_dict_file(path)
        own = {k: v for k, v in self.state_dict().items() if k.startswith(("backbone.", "head."))}
        missing = sorted(set(own) - set(state))
        wrong = sorted(k for k in own if k in state and state[k].shape != own[k].shape)
        if missing or wrong:
            details = []
            if missing:
                details.append(f"missing {len(missing)} weights (first: {missing[:3]})")
            if wrong:
                details.append(
                    f"{len(wrong)} shape mismatches (first: {wrong[0]} is {tuple(state[wrong[0]].shape)} in the "
                    f"checkpoint, {tuple(own[wrong[0]].shape)} here)"
                )
            raise CheckpointError(
                f"model.init_from={path} does not match this model: {'; '.join(details)}. Check that "
                "model.backbone and model.num_classes are those the checkpoint was trained with."
            )
        self.load_state_dict({k: state[k] for k in own}, strict=False)

    # ----------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))  # (B, num_classes)

    # ----------------------------------------------------------------------------------- base
    def base_cache_key(self, datamodule: object) -> dict[str, object]:
        """Everything that determines the pretrained base; its hash names the cache folder."""
        describe = getattr(datamodule, "describe", None)
        recipe = {k: v for k, v in asdict(self.pretraining).items() if k not in ("cache_dir", "accelerator")}
        return {
            "loop": "lightning_fl.methods.centralised.train_classifier/1",  # bump when the pretraining loop changes
            "backbone": f"{type(self.backbone).__module__}.{type(self.backbone).__qualname__}",
            "initial_weights": self._init_digest,
            "num_classes": self.num_classes,
            "head": self.hparams.head,
            "data": describe() if callable(describe) else repr(datamodule),
            "pretraining": recipe,
        }

    def base_cache_path(self, datamodule: object) -> Path:
        key = json.dumps(self.base_cache_key(datamodule), sort_keys=True, default=str)
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        root = Path(self.pretraining.cache_dir).expanduser() if self.pretraining.cache_dir else default_cache_dir()
        return root / "bases" / digest / "base.pt"

    def prepare_base(self, datamodule: object, allow_training: bool = True) -> None:
        """Load the base from the cache, pretraining and caching it first if needed (and allowed).

        Call it on one process first (it may train), then on the others with the same data module.
        """
        if self._base_ready:
            return
        path = self.base_cache_path(datamodule)
        if not path.is_file():
            if not allow_training:
                raise CheckpointError(f"the pretrained base {path} is missing; it should have been prepared first")
            self._pretrain_base(datamodule, path)
        self.load_weights(path)
        self._base_ready = True

    def _pretrain_base(self, datamodule: object, path: Path) -> None:
        p = self.pretraining
        log.warning("Pretraining the base for %d epochs (cached at %s)", p.epochs, path)
        pre = Classifier(
            backbone=copy.deepcopy(self.backbone).requires_grad_(True),
            num_classes=self.num_classes,
            head=self.hparams.head,
            optimizer=p.optimizer,
            lr=p.lr,
            momentum=p.momentum,
            weight_decay=p.weight_decay,
            warmup_epochs=p.warmup_epochs,
        )
        pre.head.load_state_dict(self.head.state_dict())  # the same frozen class prototypes
        with isolate_rng():
            torch.manual_seed(p.seed)
            metrics = train_classifier(
                pre, datamodule, p.epochs, p.accelerator, p.precision, log_dir=path.parent / "pretraining"
            )
        state = {k: v.detach().cpu() for k, v in pre.state_dict().items() if k.startswith(("backbone.", "head."))}
        atomic_save({"state_dict": state}, path)
        meta = {"key": self.base_cache_key(datamodule), "final_epoch": metrics}
        (path.parent / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))

    # ----------------------------------------------------------------------------------- Lightning hooks
    def prepare_data(self) -> None:
        trainer = self._trainer
        if trainer is not None and getattr(trainer, "ckpt_path", None) is None and trainer.datamodule is not None:
            self.prepare_base(trainer.datamodule)

    def setup(self, stage: str) -> None:
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None:
            self.check_data(datamodule)
            if getattr(self._trainer, "ckpt_path", None) is None:
                self.prepare_base(datamodule, allow_training=False)

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

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.compute_loss(logits, y)
        if not torch.isfinite(loss):
            raise TrainingDivergedError(
                f"train/loss became {loss.item()} at epoch {self.current_epoch}, step {self.global_step}. "
                "Lower model.lr, raise model.warmup_epochs, or check the data for NaNs."
            )
        # Plain tensors (not Metric objects) so the same step logs under lightning.Trainer and federated loops.
        acc = (logits.detach().argmax(-1) == y).float().mean()
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=len(y), sync_dist=True)
        self.log("train/acc", acc, on_step=False, on_epoch=True, batch_size=len(y), sync_dist=True)
        return loss

    def _eval_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        x, y = batch
        logits = self(x)
        metrics = self.val_metrics if stage == "val" else self.test_metrics
        metrics.update(logits.float().softmax(-1), y)
        loss = self.compute_loss(logits, y)
        self.log(f"{stage}/loss", loss, on_epoch=True, prog_bar=stage == "val", batch_size=len(y), sync_dist=True)

    def _eval_epoch_end(self, stage: str) -> None:
        metrics = self.val_metrics if stage == "val" else self.test_metrics
        values = metrics.compute()  # synchronised across processes by torchmetrics
        metrics.reset()
        self.log_dict(values, prog_bar=stage == "val", sync_dist=True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    # ----------------------------------------------------------------------------------- federated
    def federated_state(self) -> dict[str, torch.Tensor]:
        """What a client uploads and the server averages: every trainable parameter, detached."""
        return {name: p.detach().clone() for name, p in self.named_parameters() if p.requires_grad}

    def load_federated_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the trainable parameters from a (global) federated state."""
        params = dict(self.named_parameters())
        expected = {n for n, p in params.items() if p.requires_grad}
        if set(state) != expected:
            raise ValueError(f"Expected federated state keys {sorted(expected)}, got {sorted(state)}")
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)

    # ----------------------------------------------------------------------------------- optimiser
    def make_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        hp = self.hparams
        if hp.optimizer == "sgd":
            return torch.optim.SGD(
                params, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay, nesterov=hp.nesterov
            )
        cls = torch.optim.Adam if hp.optimizer == "adam" else torch.optim.AdamW
        return cls(params, lr=hp.lr, weight_decay=hp.weight_decay)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        clip = gradient_clip_val if gradient_clip_val is not None else self.hparams.grad_clip
        if clip is not None:
            self.clip_gradients(
                optimizer, gradient_clip_val=clip, gradient_clip_algorithm=gradient_clip_algorithm or "norm"
            )

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the model has no trainable parameters; check model.head and the backbone")
        optimizer = self.make_optimizer(params)
        if self._trainer is None:  # driven by a loop without epochs: plain optimiser
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)
        max_epochs = self.trainer.max_epochs
        steps_per_epoch = total / max_epochs if max_epochs and max_epochs > 0 else total
        warmup = round(self.hparams.warmup_epochs * steps_per_epoch)
        schedule = self.hparams.schedule
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine_factor(step, warmup, total, schedule)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
