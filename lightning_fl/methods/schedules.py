"""Learning-rate schedules as multiplicative factors of the base learning rate, per optimiser step."""

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
