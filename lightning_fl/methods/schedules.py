"""The optimiser recipe's checks, and learning-rate schedules as multiplicative factors of the base learning rate,
per optimiser step."""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["cosine", "constant"]


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


def recipe_problems(
    optimizer: str,
    lr: float,
    momentum: float,
    weight_decay: float,
    nesterov: bool,
    warmup_epochs: float,
    schedule: str,
    grad_clip: float | None,
) -> list[str]:
    """What is wrong with an optimiser recipe, one message per key (``model.<key>``)."""
    problems = []
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
    return problems
