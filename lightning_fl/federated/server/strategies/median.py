"""Coordinate-wise median: Yin, Chen, Ramchandran and Bartlett (2018), "Byzantine-Robust Distributed Learning:
Towards Optimal Statistical Rates" (ICML).

Each coordinate of the next global state is the median of that coordinate over the uploads (the mean of
the two middle values for an even count, as ``numpy.median``). It tolerates fewer than half of the uploads
being arbitrary; every upload counts once, whatever its client's sample count.

It needs every upload at once, so a round keeps them as an ``(n, D)`` float32 matrix (O(n D) memory) instead
of streaming them into a running sum as the mean-based strategies do.
"""

from __future__ import annotations

import torch

from lightning_fl.federated.server.strategies.base import Strategy


def coordinate_median(uploads: torch.Tensor) -> torch.Tensor:
    """Median of each column of ``uploads`` ``(n, D)``, float64."""
    ordered = uploads.to(torch.float64).sort(dim=0).values
    n = len(ordered)
    if n % 2:
        return ordered[n // 2]
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


class Median(Strategy):
    """Coordinate-wise median of the uploads.

    Args:
        min_clients: Fewest accepted uploads a round needs; with fewer the round keeps the global state.
    """

    def aggregate(self, round, current, uploads, num_samples, clients) -> tuple[torch.Tensor, dict[str, float]]:
        return coordinate_median(uploads), {}
