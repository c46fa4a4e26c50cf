"""The optimiser recipe (:class:`Recipe`, a method's ``model.recipe``), and learning-rate schedules as
multiplicative factors of the base learning rate, per optimiser step."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Literal

from lightning_fl.errors import ConfigError

Schedule = Literal["cosine", "constant"]
OptimizerName = Literal["sgd", "adam", "adamw"]


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, schedule: Schedule = "cosine") -> float:
    """Linear warm-up over ``warmup_steps`` (from 1/warmup to 1), then cosine to zero at ``total_steps``.

    ``constant`` keeps the factor at 1 after warm-up. Steps past ``total_steps`` stay at the final value.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Recipe:
    """How a method's trainable parameters train: the optimiser and its schedule (config key ``model.recipe``).

    Every method takes one (:class:`~lightning_fl.methods.Classifier` defaults to the FLITE paper's centralised
    recipe, the FLITE, LoRA and language-model methods to their own, named in their docstrings); override a key with
    ``--model.recipe.lr 0.1`` or a ``recipe:`` block under ``model.init_args`` holding only the keys that change.
    The values are checked when the recipe is made, from a config or from Python alike.

    Args:
        optimizer: ``sgd`` (momentum, optional Nesterov), ``adam`` or ``adamw``. For another optimiser, subclass
            the method and override ``make_optimizer``.
        lr: Peak learning rate (federated clients train at it: they have no schedule).
        momentum: SGD momentum (ignored by Adam/AdamW).
        weight_decay: Weight decay on every trainable parameter.
        nesterov: Nesterov momentum for SGD.
        warmup_epochs: Linear warm-up length in epochs (fractions allowed); 0 disables it. ``lightning.Trainer``
            only: federated runs refuse a non-zero value.
        schedule: ``cosine`` decays to zero at the end of training; ``constant`` keeps ``lr`` after the warm-up
            (federated runs need ``constant``).
        grad_clip: Clip the gradient norm to this value every step (``null``: no clipping). Applied by
            ``lightning.Trainer`` (unless its own ``gradient_clip_val`` is set) and by federated clients alike.
    """

    optimizer: OptimizerName = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = False
    warmup_epochs: float = 3.0
    schedule: Schedule = "cosine"
    grad_clip: float | None = None

    def __post_init__(self) -> None:
        problems = recipe_problems(self)
        if problems:
            raise ConfigError("; ".join(problems))


def recipe_problems(recipe: object, key: str = "model.recipe") -> list[str]:
    """What is wrong with ``recipe`` (a :class:`Recipe`, or a pretraining recipe with some of its fields), one
    message per field (named ``<key>.<field>``)."""
    # the fields ``recipe`` lacks (a pretraining recipe has no schedule or clipping) take Recipe's defaults
    r = SimpleNamespace(**{f.name: getattr(recipe, f.name, f.default) for f in fields(Recipe)})
    problems: list[str] = []
    if r.optimizer not in ("sgd", "adam", "adamw"):
        problems.append(f"{key}.optimizer must be 'sgd', 'adam' or 'adamw', got {r.optimizer!r}")
    if not r.lr > 0:
        problems.append(f"{key}.lr must be > 0, got {r.lr}")
    if not 0 <= r.momentum < 1:
        problems.append(f"{key}.momentum must be in [0, 1), got {r.momentum}")
    if not r.weight_decay >= 0:
        problems.append(f"{key}.weight_decay must be >= 0, got {r.weight_decay}")
    if r.nesterov and (r.optimizer != "sgd" or r.momentum == 0):
        problems.append(f"{key}.nesterov needs optimizer 'sgd' and momentum > 0")
    if not r.warmup_epochs >= 0:
        problems.append(f"{key}.warmup_epochs must be >= 0, got {r.warmup_epochs}")
    if r.schedule not in ("cosine", "constant"):
        problems.append(f"{key}.schedule must be 'cosine' or 'constant', got {r.schedule!r}")
    if r.grad_clip is not None and not r.grad_clip > 0:
        problems.append(f"{key}.grad_clip must be > 0 or null, got {r.grad_clip}")
    return problems
