"""Counter-based seeds: every random stream of a run is a pure function of ``(seed, round, client, ...)``.

Deriving seeds instead of advancing one global generator is what makes a resumed run continue exactly, and
makes the result independent of how clients are placed on processes or machines.
"""

from __future__ import annotations

import random

import numpy as np
import torch

MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele et al. 2014): a bijective 64-bit mixer."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """A 64-bit seed determined by a tuple of non-negative integers (counter-based, order-sensitive)."""
    h = 0x6A09E667F3BCC909
    for p in parts:
        h = splitmix64(h ^ (int(p) & MASK64))
    return h


def seed_everything_quietly(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (no log line, unlike Lightning's helper).

    The same seeds as ``torch.manual_seed``, without its cost on CUDA builds: there, every call made before
    CUDA is initialised queues a lazy seeding together with a formatted stack trace (milliseconds inside a
    deep stack, once per client). CUDA's generators are seeded here only once CUDA is initialised, which it
    is whenever a model or batch is on a GPU; CPU runs draw exactly what ``torch.manual_seed`` would give.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
