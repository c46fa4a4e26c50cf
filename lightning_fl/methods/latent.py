"""FLITE: "Federated Lightweight Fine-Tuning" (arXiv 2607.18343), the latent classifier.

A frozen pretrained backbone is steered by a small latent through the delta low-rank map
``theta_l = theta_pre_l + U_l V_l^T z_l`` (:class:`~lightning_fl.mapping.LatentMapping`); only ``z``
trains and only ``z`` is communicated. The module trains centrally under ``lightning.Trainer`` and,
unchanged, per client under :class:`~lightning_fl.federated.FederatedTrainer`.

The base comes from ``base_checkpoint``, or, when none is given, is pretrained with the
foundation's :class:`~lightning_fl.methods.Classifier` recipe on the data module's centralised
split and cached under a key made of everything that determines it, so one command runs the whole
pipeline and later runs reuse the base. ``base: scratch`` keeps the random (Kaiming) initialisation
instead: the paper's negative result (section 5.7). ``base: scratch`` with ``latent_init: teacher`` is the paper's
least-squares warm start (appendix E): the base stays random, and ``z`` starts at the least-squares fit of a converged
teacher's weights (``base_checkpoint``, or the base the recipe pretrains and caches).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.utilities.seed import isolate_rng

from lightning_fl.checkpoint import digest_tensors
from lightning_fl.errors import ConfigError
from lightning_fl.mapping.lowrank import FactorMode, LayerSelection
from lightning_fl.methods.centralised import resolve_device
from lightning_fl.methods.classifier import Classifier
from lightning_fl.methods.pretraining import PAPER_PRETRAINING, Pretraining
from lightning_fl.methods.schedules import Recipe
from lightning_fl.methods.steering import (
    LatentSteering as LatentSteering,
)
from lightning_fl.models import pcanet
from lightning_fl.models.backbone import Backbone
from lightning_fl.models.heads import HeadKind

#: Images of the centralised split whose patches make a ``base: pcanet`` base.
PCANET_IMAGES = 1024
log = logging.getLogger(__name__)


#: How FLITE's latent trains (the FLITE paper's recipe), on images and text alike: Adam at 1e-2, weight decay 1e-4,
#: a constant rate, gradient norms clipped at 1.0.
LATENT_RECIPE = Recipe(
    optimizer="adam", lr=1e-2, weight_decay=1e-4, warmup_epochs=0.0, schedule="constant", grad_clip=1.0
)


class LatentClassifier(LatentSteering, Classifier):
    """FLITE: a frozen (pretrained) backbone and head, steered by per-layer latents.

    Args:
        backbone: The backbone architecture (weights come from the base).
        num_classes: Number of classes.
        head: Classifier head kind; ``orthogonal`` (frozen) is the paper's default. A ``trainable`` head
            trains and is communicated too.
        base: ``pretrained`` (delta mode on a pretrained base), ``scratch`` (random Kaiming base) or ``pcanet``
            (appendix E's PCANet-initialised base: every convolution's filters are the principal components of its
            input patches on up to ``PCANET_IMAGES`` images of the centralised split, no labels or training, see
            :func:`~lightning_fl.models.pcanet.pcanet_init_`; made once and cached like a pretrained base, with
            ``pretraining``'s ``seed`` and ``cache_dir``; the linear layers and head keep their initialisation).
        base_checkpoint: Checkpoint with the base's ``backbone.*`` and ``head.*`` weights (e.g. the
            ``last.ckpt`` of a ``pretrain_*.yaml`` run). ``null``: pretrain per ``pretraining`` and cache.
            With ``latent_init: teacher``, the teacher's weights.
        latent_init: ``zero`` (the paper's default: the model starts exactly at the base) or ``teacher``
            (with ``base: scratch``; appendix E's least-squares warm start): the backbone keeps its random
            initialisation and ``z`` starts at :meth:`fit_latent` of a converged teacher, the base that
            ``base_checkpoint`` holds or that ``pretraining`` trains (and caches) from the same initial weights.
            The head is the teacher's (a frozen head is the same as the random one).
        pretraining: Recipe for pretraining the base when no checkpoint is given.
        latent_dim: ``d`` per mapped layer: one value, or one per layer.
        rank: ``r`` of the factors.
        layers: Which backbone weights are mapped: ``conv`` (every conv weight), ``linear``, ``conv+linear``,
            or a list of name patterns.
        factors: ``stored``, ``regenerate``, ``streamed``, ``dense``, ``kronecker`` or ``two_sided`` (see
            :mod:`lightning_fl.mapping.lowrank`).
        factor_seed: The 64-bit seed of the factors, shared by every client.
        max_dense_bytes: Largest dense projection ``factors: dense`` may allocate.
        recipe: The latent's optimiser recipe; default ``LATENT_RECIPE``, the paper's: Adam at 1e-2, weight decay
            1e-4, constant, gradient norms clipped at 1.0.
        label_smoothing: Cross-entropy label smoothing.
    """

    def __init__(
        self,
        backbone: Backbone,
        num_classes: int,
        head: HeadKind = "orthogonal",
        base: Literal["pretrained", "scratch", "pcanet"] = "pretrained",
        base_checkpoint: str | None = None,
        pretraining: Pretraining = PAPER_PRETRAINING,
        latent_init: Literal["zero", "teacher"] = "zero",
        latent_dim: int | list[int] = 64,
        rank: int = 32,
        layers: LayerSelection | list[str] = "conv",
        factors: FactorMode = "stored",
        factor_seed: int = 0,
        max_dense_bytes: int = 2**31,
        recipe: Recipe = LATENT_RECIPE,
        label_smoothing: float = 0.0,
    ) -> None:
        if latent_init not in ("zero", "teacher"):
            raise ConfigError(f"model.latent_init must be 'zero' or 'teacher', got {latent_init!r}")
        source = self.base_source(
            base,
            base_checkpoint,
            pretraining,
            teacher=latent_init == "teacher",
            choices=("pretrained", "scratch", "pcanet"),
        )
        # the random initialisation the teacher's fit starts from (before a teacher checkpoint is loaded into it)
        initial = None
        if latent_init == "teacher":
            initial = {k: v.detach().clone() for k, v in backbone.state_dict().items()}
        super().__init__(
            backbone=backbone,
            num_classes=num_classes,
            head=head,
            recipe=recipe,
            label_smoothing=label_smoothing,
            **source,
        )
        self.steer(latent_dim, rank, layers, factors, factor_seed, max_dense_bytes)
        self._random_backbone = initial
        if initial is not None and self._base_ready:  # the teacher came from base_checkpoint
            self._start_from_teacher()

    def _start_from_teacher(self) -> None:
        """The teacher's weights are in the backbone: fit ``z`` to them, then put the random backbone back."""
        teacher = {name: w.detach().clone() for name, w in self.mapped_base().items()}
        self.backbone.load_state_dict(self._random_backbone)
        self.fit_latent(teacher)
        self._random_backbone = None

    def prepare_base(self, datamodule: object, allow_training: bool = True) -> None:
        super().prepare_base(datamodule, allow_training)
        if self._random_backbone is not None:
            self._start_from_teacher()

    def base_cache_key(self, datamodule: object) -> dict[str, object]:
        key = super().base_cache_key(datamodule)
        if self.hparams.base == "pcanet":  # made by PCA, not by the training recipe: only its seed matters
            key |= {"loop": pcanet.VERSION, "pretraining": {"images": PCANET_IMAGES, "seed": self.pretraining.seed}}
        return key

    def build_base(self, datamodule: object, folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        if self.hparams.base != "pcanet":
            return super().build_base(datamodule, folder)
        with isolate_rng():
            torch.manual_seed(self.pretraining.seed)
            batches = []
            for x, _ in datamodule.train_dataloader():
                batches.append(x)
                if sum(map(len, batches)) >= PCANET_IMAGES:
                    break
        if not batches:
            raise ConfigError("model.base is 'pcanet' but the data module's centralised split is empty; give it data")
        device = resolve_device(self.pretraining.accelerator)
        images = torch.cat(batches)[:PCANET_IMAGES].float().to(device)
        log.warning("Making the PCANet base from %d images on %s (cached in %s)", len(images), device, folder)
        net = copy.deepcopy(self.backbone).to(device)
        try:
            layers = pcanet.pcanet_init_(net, images)
        except ValueError as err:
            raise ConfigError(f"model.base is 'pcanet': {err}; use model.base pretrained or scratch") from err
        for lay in layers:
            log.info(
                "PCANet base: %s: %d of %d filters are principal components (%.1f%% of the patch variance)",
                lay.name,
                lay.pca_filters,
                lay.filters,
                100 * lay.variance_kept,
            )
        state = self.own_weights() | {f"backbone.{k}": v for k, v in net.state_dict().items()}
        return state, {"images": len(images), "layers": [asdict(lay) for lay in layers]}

    # ----------------------------------------------------------------------------------- forward
    @property
    def steered(self) -> torch.nn.Module:
        return self.backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.steered_forward(x))  # features (B, F) from the mapped backbone, then the head

    # ----------------------------------------------------------------------------------- federated
    def factor_fingerprint(self) -> str:
        """Fingerprint of the factors and of the base; clients refuse to train when theirs differs."""
        base = digest_tensors({**self.backbone.state_dict(), **self.head.state_dict()})
        return f"factors:{self.mapping.fingerprint()} base:{base}"
