"""FLITE: Federated Lightweight Fine-Tuning (flite.md), the latent classifier.

A frozen pretrained backbone is steered by a small latent through the delta low-rank map
``theta_l = theta_pre_l + U_l V_l^T z_l`` (:class:`~lightning_fl.mapping.LatentMapping`); only ``z``
trains and only ``z`` is communicated. The module trains centrally under ``lightning.Trainer`` and,
unchanged, per client under :class:`~lightning_fl.federated.FederatedTrainer`.

The base comes from ``base_checkpoint``, or, when none is given, is pretrained with the
foundation's :class:`~lightning_fl.methods.Classifier` recipe on the data module's centralised
split and cached under a key made of everything that determines it, so one command runs the whole
pipeline and later runs reuse the base. ``base: scratch`` keeps the random (Kaiming) initialisation
instead: the paper's negative result (section 5.7).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.utilities.seed import isolate_rng
from torch.func import functional_call

from lightning_fl.checkpoint import atomic_save, default_cache_dir
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.mapping.lowrank import FactorMode, LatentMapping, LayerSelection, memory_report
from lightning_fl.methods.centralised import train_classifier
from lightning_fl.methods.classifier import Classifier, OptimizerName
from lightning_fl.methods.schedules import Schedule
from lightning_fl.models.backbone import Backbone
from lightning_fl.models.heads import HeadKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pretraining:
    """How the base is pretrained when no ``base_checkpoint`` is given (the FLITE paper's appendix C recipe).

    Args:
        epochs: Training epochs (100 in the paper on CIFAR).
        optimizer: ``sgd``, ``adam`` or ``adamw``.
        lr: Peak learning rate.
        momentum: SGD momentum.
        weight_decay: Weight decay.
        warmup_epochs: Linear warm-up before the cosine decay.
        seed: Seed of the pretraining run (isolated from the run's own randomness).
        accelerator: Device for pretraining: ``auto`` (a GPU if there is one), ``cpu`` or ``gpu``.
        precision: ``null``/``32-true``, ``bf16-mixed`` or ``16-mixed`` (autocast, with a grad scaler on GPU).
        cache_dir: Where bases are cached (default ``$LIGHTNING_FL_CACHE`` or ``~/.cache/lightning_fl``).
    """

    epochs: int = 100
    optimizer: OptimizerName = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_epochs: float = 3.0
    seed: int = 0
    accelerator: str = "auto"
    precision: str | None = None
    cache_dir: str | None = None


PAPER_PRETRAINING = Pretraining()


def _digest_tensors(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


class LatentClassifier(Classifier):
    """FLITE: a frozen (pretrained) backbone and head, steered by per-layer latents.

    Args:
        backbone: The backbone architecture (weights come from the base).
        num_classes: Number of classes.
        head: Classifier head kind; ``orthogonal`` (frozen) is the paper's default. A ``trainable`` head
            trains and is communicated too.
        base: ``pretrained`` (delta mode on a pretrained base) or ``scratch`` (random Kaiming base).
        base_checkpoint: Checkpoint with the base's ``backbone.*`` and ``head.*`` weights (e.g. the
            ``last.ckpt`` of a ``pretrain_*.yaml`` run). ``null``: pretrain per ``pretraining`` and cache.
        pretraining: Recipe for pretraining the base when no checkpoint is given.
        latent_dim: ``d`` per mapped layer: one value, or one per layer.
        rank: ``r`` of the factors.
        layers: Which backbone weights are mapped: ``conv`` (every conv weight), ``linear``, ``conv+linear``,
            or a list of name patterns.
        factors: ``stored``, ``regenerate``, ``streamed`` or ``dense`` (see :mod:`lightning_fl.mapping.lowrank`).
        factor_seed: The 64-bit seed of the factors, shared by every client.
        max_dense_bytes: Largest dense projection ``factors: dense`` may allocate.
        optimizer: Latent optimiser (paper: Adam).
        lr: Learning rate (paper: 1e-2).
        momentum: SGD momentum, if ``optimizer`` is ``sgd``.
        weight_decay: Weight decay on the latent (paper: 1e-4).
        warmup_epochs: Linear warm-up epochs (under ``lightning.Trainer``).
        schedule: Learning-rate schedule after warm-up (under ``lightning.Trainer``).
        label_smoothing: Cross-entropy label smoothing.
        grad_clip: Gradient-norm clipping (paper: 1.0).
    """

    def __init__(
        self,
        backbone: Backbone,
        num_classes: int,
        head: HeadKind = "orthogonal",
        base: Literal["pretrained", "scratch"] = "pretrained",
        base_checkpoint: str | None = None,
        pretraining: Pretraining = PAPER_PRETRAINING,
        latent_dim: int | list[int] = 64,
        rank: int = 32,
        layers: LayerSelection | list[str] = "conv",
        factors: FactorMode = "stored",
        factor_seed: int = 0,
        max_dense_bytes: int = 2**31,
        optimizer: OptimizerName = "adam",
        lr: float = 1e-2,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        warmup_epochs: float = 0.0,
        schedule: Schedule = "constant",
        label_smoothing: float = 0.0,
        grad_clip: float | None = 1.0,
    ) -> None:
        if base not in ("pretrained", "scratch"):
            raise ConfigError(f"model.base must be 'pretrained' or 'scratch', got {base!r}")
        if base == "scratch" and base_checkpoint is not None:
            raise ConfigError("model.base is 'scratch' but model.base_checkpoint is set; drop one of them")
        if pretraining.epochs < 1:
            raise ConfigError(f"model.pretraining.epochs must be >= 1, got {pretraining.epochs}")
        super().__init__(
            backbone=backbone,
            num_classes=num_classes,
            head=head,
            optimizer=optimizer,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            warmup_epochs=warmup_epochs,
            schedule=schedule,
            label_smoothing=label_smoothing,
            grad_clip=grad_clip,
        )
        self.pretraining = pretraining
        self.backbone.requires_grad_(False)
        # Digest of the initial weights: part of the base cache key (the random head must match).
        self._init_digest = _digest_tensors({**self.backbone.state_dict(), **self.head.state_dict()})
        self.mapping = LatentMapping(
            self.backbone,
            latent_dim=latent_dim,
            rank=rank,
            layers=layers,
            mode=factors,
            seed=factor_seed,
            max_dense_bytes=max_dense_bytes,
        )
        self._base_ready = base == "scratch"
        if base_checkpoint is not None:
            self.load_weights(base_checkpoint)
            self._base_ready = True

    def _hparams_ignore(self) -> list[str]:
        return [*super()._hparams_ignore(), "pretraining"]

    # ----------------------------------------------------------------------------------- forward
    def mapped_base(self) -> dict[str, torch.Tensor]:
        """The frozen base weights of the mapped layers."""
        return {name: self.backbone.get_parameter(name) for name in self.mapping.names}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.mapping.weights(self.mapped_base())  # theta_pre + U V^T z, differentiable in z
        features = functional_call(self.backbone, weights, (x,), strict=False)  # (B, F)
        return self.head(features)

    # ----------------------------------------------------------------------------------- federated
    def factor_fingerprint(self) -> str:
        """Fingerprint of the factors and of the base; clients refuse to train when theirs differs."""
        base = _digest_tensors({**self.backbone.state_dict(), **self.head.state_dict()})
        return f"factors:{self.mapping.fingerprint()} base:{base}"

    @torch.no_grad()
    def averaging_identity_error(self, states: list[dict[str, torch.Tensor]]) -> float:
        """``max |mean_k theta(z_k) - theta(mean_k z_k)|`` over the mapped weights (flite.md eq. 4)."""
        zs = torch.stack([s["mapping.latent"].to(self.mapping.latent) for s in states])  # (K, D)
        per_client = [self.mapping.split(z) for z in zs]  # K lists of per-layer latents
        averaged = self.mapping.split(zs.mean(0))
        base = self.mapped_base()
        worst = 0.0
        for i, lay in enumerate(self.mapping.layers):  # one layer at a time bounds the memory
            b = base[lay.name]
            mean_theta = sum(self.mapping.mapped(lay, b, z[i]) for z in per_client) / len(per_client)
            theta_of_mean = self.mapping.mapped(lay, b, averaged[i])
            worst = max(worst, (mean_theta - theta_of_mean).abs().max().item())
        return worst

    def memory_report(self):
        """Analytic bytes of each factor mode for this model (see :func:`lightning_fl.mapping.memory_report`)."""
        hp = self.hparams
        return memory_report(self.backbone, hp.latent_dim, hp.rank, hp.layers)

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
        super().setup(stage)
        trainer = self._trainer
        if trainer is not None and getattr(trainer, "ckpt_path", None) is None and trainer.datamodule is not None:
            self.prepare_base(trainer.datamodule, allow_training=False)
