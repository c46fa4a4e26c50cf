"""Coordinate-wise trimmed mean: Yin, Chen, Ramchandran and Bartlett (2018), "Byzantine-Robust Distributed
Learning: Towards Optimal Statistical Rates" (ICML).

For each coordinate, the ``k = floor(beta n)`` largest and ``k`` smallest values over the ``n`` uploads are
removed and the remaining ``n - 2k`` averaged. It tolerates up to ``k`` arbitrary uploads per coordinate.

It needs every upload at once, so a round keeps them as an ``(n, D)`` float32 matrix (O(n D) memory) instead
of streaming them into a running sum as the mean-based strategies do.
"""

from __future__ import annotations

import math

import torch

from lightning_fl.errors import ConfigError
from lightning_fl.federated.server.strategies.base import Strategy


class TrimmedMean(Strategy):
    """Coordinate-wise beta-trimmed mean of the uploads.

    Args:
        beta: Fraction trimmed from each end, in [0, 0.5).
        min_clients: Fewest accepted uploads a round needs; with fewer the round keeps the global state.
    """

    def __init__(self, beta: float = 0.2, min_clients: int = 1) -> None:
        super().__init__(min_clients)
        if not 0 <= beta < 0.5:
            raise ConfigError(f"trainer.strategy.beta must be in [0, 0.5), got {beta}")
        self.beta = beta

    def trimmed(self, n: int) -> int:
        """Values removed from each end of a coordinate over ``n`` uploads."""
        return math.floor(self.beta * n)

    def aggregate(self, round, current, uploads, num_samples, clients) -> tuple[torch.Tensor, dict[str, float]]:
        n = len(uploads)
        k = self.trimmed(n)
        ordered = uploads.to(torch.float64).sort(dim=0).values
        return ordered[k : n - k].mean(dim=0), {"trimmed_per_side": float(k)}

    def __repr__(self) -> str:
        return f"TrimmedMean(beta={self.beta})"
