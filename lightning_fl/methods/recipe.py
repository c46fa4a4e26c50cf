"""What every trainable method here shares: the optimiser recipe, the cached pretrained base, the federated contract.

:class:`~lightning_fl.methods.Classifier` and :class:`~lightning_fl.methods.LanguageModel` are siblings on this
base. A subclass says which state-dict entries make up its weights (``weight_prefixes``), what determines
its pretrained base (``base_cache_key``) and how to build the module that pretrains it
(``pretraining_module``); the rest is here:

- ``training_step`` (the subclass's ``compute_loss``, logged with next-label accuracy) and the evaluation steps
  (the subclass's ``_eval_step`` updating its ``val_metrics``/``test_metrics``);
- ``make_optimizer`` / ``configure_optimizers``: the method's :class:`~lightning_fl.methods.schedules.Recipe`
  (``self.recipe``, config key ``model.recipe``): SGD (momentum, Nesterov), Adam or AdamW with a linear warm-up
  then cosine or constant schedule, and ``grad_clip`` applied by ``lightning.Trainer`` and federated clients alike;
- ``prepare_base``: load the base from the cache, pretraining and caching it first (one process trains, the
  others read), keyed by the hash of everything that determines it (:mod:`lightning_fl.methods.bases`);
- ``federated_state`` / ``load_federated_state``: every trainable parameter is what a client sends.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_fl.checkpoint import DEFAULT_FIX, checkpoint_name, read_checkpoint, tensor_state
from lightning_fl.errors import CheckpointError, ConfigError, UserError
from lightning_fl.methods import bases
from lightning_fl.methods.pretraining import Pretraining
from lightning_fl.methods.schedules import OptimizerName, Recipe, warmup_cosine_factor
from lightning_fl.metrics import IGNORE_INDEX

__all__ = ["OptimizerName", "Recipe", "TrainingDivergedError", "TrainingRecipe", "load_state_dict_file"]


class TrainingDivergedError(UserError, FloatingPointError):
    """The training loss became NaN or infinite."""


def load_state_dict_file(path: str | Path, what: str = "checkpoint", fix: str = DEFAULT_FIX) -> dict[str, torch.Tensor]:
    """Read a Lightning checkpoint (its ``state_dict``) or a plain state dict, without unpickling code.

    Raises :class:`CheckpointError` naming ``what`` (the config key or cache), the file and ``fix``.
    """
    obj = read_checkpoint(path, what, fix=fix)
    return tensor_state(obj, checkpoint_name(what, path), keys=("state_dict",), fix=fix)


class TrainingRecipe(L.LightningModule):
    """Base of the methods: optimiser recipe, cached pretrained base and the federated contract (module docstring).

    Subclasses call ``save_hyperparameters`` (leaving out ``recipe``) and :meth:`use_recipe`, set
    ``self.pretraining`` (a :class:`Pretraining` or ``None``), ``self._base_ready``, ``self.val_metrics`` and
    ``self.test_metrics``, and define ``weight_prefixes``, ``compute_loss``, ``_eval_step``, ``base_cache_key`` and
    ``pretraining_module``.
    """

    _plugin_base = True  # not offered as a choice in CLI messages

    #: State-dict entries (by prefix) that make up the weights a base or ``init_from`` checkpoint provides.
    weight_prefixes: tuple[str, ...] = ()
    #: Config keys to name when a checkpoint does not fit the model.
    weights_hint: str = "the model's architecture"
    #: The config key ``init_from`` comes from (named in errors about the file).
    init_from_key: str = "model.init_from="
    recipe: Recipe
    pretraining: Pretraining | None
    _base_ready: bool
    _init_digest: str

    def use_recipe(self, recipe: Recipe) -> None:
        """Train with ``recipe``; it is saved in ``hparams`` (under ``recipe``) as a plain dictionary."""
        if not isinstance(recipe, Recipe):
            raise ConfigError(f"model.recipe must be a lightning_fl.Recipe, got {type(recipe).__name__}")
        self.recipe = recipe
        self.hparams["recipe"] = asdict(recipe)

    # ----------------------------------------------------------------------------------- weights
    def own_weights(self) -> dict[str, torch.Tensor]:
        """The state-dict entries a base provides (those under ``weight_prefixes``)."""
        return {k: v for k, v in self.state_dict().items() if k.startswith(self.weight_prefixes)}

    def load_weights(self, path: str | Path, what: str = "model.init_from=", fix: str | None = None) -> None:
        """Load the weights from ``path``; every weight must be present with the right shape.

        Errors name ``what`` (the config key, or the cache) and the file, and end with ``fix``."""
        if not Path(path).expanduser().exists():
            raise CheckpointError(
                f"{checkpoint_name(what, path)} does not exist; pass the path of a checkpoint file "
                "(e.g. <run>/checkpoints/last.ckpt)"
            )
        fix = fix or f"check that {self.weights_hint} are those the checkpoint was trained with"
        state = load_state_dict_file(path, what, fix)
        own = self.own_weights()
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
                f"{checkpoint_name(what, path)} does not match this model: {'; '.join(details)}; {fix}"
            )
        self.load_own_weights({k: state[k] for k in own})

    def load_own_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Put ``weights`` (keys as :meth:`own_weights` names them, every one of them) into the module."""
        self.load_state_dict(weights, strict=False)

    # ----------------------------------------------------------------------------------- base
    def base_cache_key(self, datamodule: object) -> dict[str, object]:
        """Everything that determines the pretrained base; its hash names the cache folder.

        Subclasses add their architecture's entries to :meth:`shared_base_key`'s."""
        raise NotImplementedError(f"{type(self).__name__} must define base_cache_key to pretrain a base")

    def shared_base_key(self, datamodule: object) -> dict[str, object]:
        """The base key's entries every method has: loop, initial weights (``self._init_digest``), data, recipe."""
        describe = getattr(datamodule, "describe", None)
        recipe = {k: v for k, v in asdict(self.pretraining).items() if k not in ("cache_dir", "accelerator")}
        return {
            "loop": "lightning_fl.methods.centralised.train_classifier/1",  # bump when the pretraining loop changes
            "initial_weights": self._init_digest,
            "data": describe() if callable(describe) else repr(datamodule),
            "pretraining": recipe,
        }

    def pretraining_module(self) -> TrainingRecipe:
        """A fresh module, starting from this one's initial weights, that trains with ``self.pretraining``'s recipe."""
        raise NotImplementedError(f"{type(self).__name__} must define pretraining_module to pretrain a base")

    def base_cache_path(self, datamodule: object) -> Path:
        return bases.cache_path(self, datamodule)

    def prepare_base(self, datamodule: object, allow_training: bool = True) -> None:
        """Load the base from the cache, pretraining and caching it first if needed and allowed
        (:func:`~lightning_fl.methods.bases.prepare`). Call it on one process first (it may train), then on the
        others with the same data module."""
        bases.prepare(self, datamodule, allow_training)

    def build_base(self, datamodule: object, folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """The base's weights (the keys of :meth:`own_weights`) and what to record of how they were made.

        Here: train :meth:`pretraining_module` with ``self.pretraining``'s recipe (logs under ``folder``);
        subclasses that make their base another way override it (and say so in :meth:`base_cache_key`)."""
        return bases.pretrain(self, datamodule, folder)

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
        """Refuse data that does not fit the model, naming the keys to change (subclasses)."""

    # ----------------------------------------------------------------------------------- steps
    def compute_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean training loss of one batch (subclasses: cross-entropy over classes or over tokens)."""
        raise NotImplementedError(f"{type(self).__name__} must define compute_loss")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # inputs and targets: labels (B,) or the next tokens (B, T)
        logits = self(x)
        loss = self.compute_loss(logits, y)
        self.check_loss(loss)
        # Plain tensors (not Metric objects) so the same step logs under lightning.Trainer and federated loops.
        acc = self.train_accuracy(logits.detach(), y)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=len(y), sync_dist=True)
        self.log("train/acc", acc, on_step=False, on_epoch=True, batch_size=len(y), sync_dist=True)
        return loss

    @staticmethod
    def train_accuracy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The share of targets whose logit is the largest (what ``training_step`` logs as ``train/acc``); targets
        equal to ``IGNORE_INDEX`` (-100: an instruction's prompt and padding, which the loss leaves out too) are not
        counted. Written without boolean indexing, so it runs under ``vmap`` (vectorised cohorts)."""
        counted = y != IGNORE_INDEX
        return ((logits.argmax(-1) == y) & counted).float().sum() / counted.float().sum().clamp(min=1.0)

    def check_loss(self, loss: torch.Tensor) -> None:
        """Raise :class:`TrainingDivergedError` if the training loss is NaN or infinite (not under DP-SGD, whose
        step context turns the check off: a record's non-finite gradient is zeroed there instead)."""
        if not torch.isfinite(loss) and getattr(self.fabric, "check_finite", True):
            raise TrainingDivergedError(
                f"train/loss became {loss.item()} at epoch {self.current_epoch}, step {self.global_step}. "
                "Lower model.recipe.lr, raise model.recipe.warmup_epochs, or check the data for NaNs."
            )

    # ----------------------------------------------------------------------------------- evaluation
    def _eval_step(self, batch: Any, stage: str) -> None:
        """Update ``self.val_metrics`` (``stage == 'val'``) or ``self.test_metrics`` with one batch (subclasses)."""
        raise NotImplementedError(f"{type(self).__name__} must define _eval_step")

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
    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Every trainable parameter by name, listed once: the federated state and the optimiser use it per client.

        Walking the module tree costs more than a small client's step, so the list is kept. It is listed again
        when one of its parameters stops training; a subclass that makes a frozen parameter train after the
        list was first used calls :meth:`forget_trainable_parameters`.
        """
        listed = self.__dict__.get("_trainable")
        if listed is None or not all(p.requires_grad for p in listed.values()):
            listed = {name: p for name, p in self.named_parameters() if p.requires_grad}
            self.__dict__["_trainable"] = listed  # not an nn.Module attribute: no registration, no state dict
        return listed

    def forget_trainable_parameters(self) -> None:
        """List the trainable parameters again at the next use (see :meth:`trainable_parameters`)."""
        self.__dict__.pop("_trainable", None)

    def federated_state(self) -> dict[str, torch.Tensor]:
        """What a client uploads and the server averages: every trainable parameter, detached."""
        return {name: p.detach().clone() for name, p in self.trainable_parameters().items()}

    def load_federated_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the trainable parameters from a (global) federated state."""
        params = self.trainable_parameters()
        if state.keys() != params.keys():
            raise ValueError(f"Expected federated state keys {sorted(params)}, got {sorted(state)}")
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)

    # ----------------------------------------------------------------------------------- optimiser
    def make_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        r = self.recipe
        if r.optimizer == "sgd":
            return torch.optim.SGD(
                params, lr=r.lr, momentum=r.momentum, weight_decay=r.weight_decay, nesterov=r.nesterov
            )
        cls = torch.optim.Adam if r.optimizer == "adam" else torch.optim.AdamW
        return cls(params, lr=r.lr, weight_decay=r.weight_decay)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        clip = gradient_clip_val if gradient_clip_val is not None else self.recipe.grad_clip
        if clip is not None:
            self.clip_gradients(
                optimizer, gradient_clip_val=clip, gradient_clip_algorithm=gradient_clip_algorithm or "norm"
            )

    def configure_optimizers(self) -> Any:
        params = list(self.trainable_parameters().values())
        if not params:
            raise ConfigError("the model has no trainable parameters; check which of its parts are frozen")
        optimizer = self.make_optimizer(params)
        if self._trainer is None:  # a federated client: one round of local steps from the server's state
            if self.recipe.warmup_epochs > 0 or self.recipe.schedule != "constant":
                # Never ignored in silence: a client has no epochs to warm up over or decay across.
                raise ConfigError(
                    f"model.recipe.warmup_epochs={self.recipe.warmup_epochs} and model.recipe.schedule="
                    f"{self.recipe.schedule!r} set a centralised schedule, which federated clients do not "
                    "follow (each trains a round of local steps at model.recipe.lr); set model.recipe.warmup_epochs "
                    "0 and model.recipe.schedule constant (the base's pretraining has its own, under model.pretraining)"
                )
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)
        max_epochs = self.trainer.max_epochs
        steps_per_epoch = total / max_epochs if max_epochs and max_epochs > 0 else total
        warmup = round(self.recipe.warmup_epochs * steps_per_epoch)
        schedule = self.recipe.schedule
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine_factor(step, warmup, total, schedule)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
