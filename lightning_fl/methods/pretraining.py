"""How a base is pretrained when no checkpoint is given."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_fl.errors import ConfigError
from lightning_fl.methods.schedules import OptimizerName, Recipe, recipe_problems


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
        precision: ``null``/``32-true``, ``bf16-mixed`` or ``16-mixed`` (autocast, with a grad scaler on GPU; on a
            CPU ``16-mixed`` runs as ``bf16-mixed``, as Fabric runs it).
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

    def __post_init__(self) -> None:
        problems = recipe_problems(self, "model.pretraining")
        if not self.epochs >= 1:
            problems.insert(0, f"model.pretraining.epochs must be >= 1, got {self.epochs}")
        if problems:
            raise ConfigError("; ".join(problems))

    def recipe(self, **changes: object) -> Recipe:
        """The optimiser recipe a base trains with: these values, a cosine schedule and no clipping (or ``changes``)."""
        fields = {"optimizer": self.optimizer, "lr": self.lr, "momentum": self.momentum}
        return Recipe(
            **fields, weight_decay=self.weight_decay, warmup_epochs=self.warmup_epochs, schedule="cosine", **changes
        )


PAPER_PRETRAINING = Pretraining()
