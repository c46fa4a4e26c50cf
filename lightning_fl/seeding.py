"""Counter-based seeds: every random stream of a run is a pure function of ``(seed, round, client, ...)``.

Deriving seeds instead of advancing one global generator is what makes a resumed run continue exactly, and
makes the result independent of how clients are placed on processes or machines.
"""

from __future__ import annotations

import random

import numpy as np
import torch

MASK64 = (1 << 64) - 1

# Random-stream ids: the last part of every ``derive_seed`` tuple, one per use, so that no two uses of a seed draw
# the same numbers. They are part of every run's results: changing one changes what a seed draws.
STREAM_U, STREAM_V, STREAM_DENSE = 1, 2, 3  # a mapped layer's factors: (seed, layer, stream, chunk)
STREAM_KRON_A, STREAM_KRON_B, STREAM_KRON_SIGNS = 4, 5, 6  # kronecker factors' parts, the same tuple
STREAM_TWO_SIDED_A, STREAM_TWO_SIDED_B = 7, 8  # two-sided factors' output and input sides, the same tuple
STREAM_SAMPLING = 11  # a round's clients, fixed count: (seed, round, stream)
STREAM_CLIENT, STREAM_LOADER = 12, 13  # a client's torch seed and its loader's order: (seed, round, client, stream)
STREAM_ATTACK = 14  # a hostile client's draws: (seed, round, client, stream)
STREAM_DROPOUT = 15  # whether a client drops out: (seed, round, client, stream)
STREAM_CENTRAL_NOISE, STREAM_COUNT_NOISE = 16, 17  # central DP: (noise_seed, seed, round, stream)
STREAM_LOCAL_NOISE = 18  # local DP: (noise_seed, seed, round, client, stream)
STREAM_POISSON = 19  # a round's clients, Poisson: (seed, round, stream)
# DP-SGD's sampling shares 19 with Poisson sampling in a five-part tuple (noise_seed, seed, round, client, stream),
# which never equals Poisson's three-part one; kept so that recorded DP-SGD runs rerun bit for bit.
STREAM_DPSGD_SAMPLING, STREAM_DPSGD_NOISE = 19, 20
STREAM_DISTRIBUTED_NOISE = 21  # distributed DP: (noise_seed, seed, round, client, stream)
STREAM_SECURE_ROUNDING = 22  # secure aggregation's rounding: (rounding_seed, seed, round, client, stream)
STREAM_CLOCK = 23  # a client's device speed and link (the simulated clock): (seed, client, stream)
STREAM_FEDBUFF = 24  # FedBuff: the client that fills a free slot, by the count of starts: (seed, starts, stream)
STREAM_AVAILABILITY = 25  # when a client is available (trainer.clock.availability): (seed, client, stream)


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
