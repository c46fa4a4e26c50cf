"""Krum and Multi-Krum: Blanchard, El Mhamdi, Guerraoui and Stainer (2017), "Machine Learning with Adversaries:
Byzantine Tolerant Gradient Descent" (NeurIPS).

With ``n`` uploads of which at most ``f`` are Byzantine, each upload's score is the sum of its squared
Euclidean distances to its ``n - f - 2`` nearest other uploads; Krum returns the upload with the lowest score,
Multi-Krum the mean of the ``m`` lowest-scoring ones. Ties go to the lower client id. The scores need
``n >= f + 3``; the paper's guarantee needs ``n > 2f + 2``. A round with too few uploads for ``f`` keeps the
global state (no silent clamping of ``f``).

It needs every upload at once, so a round keeps them as an ``(n, D)`` float32 matrix (O(n D) memory) instead
of streaming them into a running sum as the mean-based strategies do.
"""

from __future__ import annotations

import torch

from lightning_fl.errors import ConfigError
from lightning_fl.federated.server.strategies.base import Strategy


def krum_scores(uploads: torch.Tensor, num_malicious: int) -> torch.Tensor:
    """Each row's sum of squared distances to its ``n - f - 2`` nearest other rows, float64 ``(n,)``."""
    x = uploads.to(torch.float64)
    n = len(x)
    # row by row (no |a|^2 + |b|^2 - 2ab cancellation): O(n) passes of an (n, D) difference
    dist = torch.stack([((x - x[i]) ** 2).sum(dim=1) for i in range(n)])  # (n, n) squared distances
    dist.fill_diagonal_(float("inf"))  # a row is not its own neighbour
    nearest = dist.sort(dim=1).values[:, : n - num_malicious - 2]
    return nearest.sum(dim=1)


class Krum(Strategy):
    """(Multi-)Krum selection of the uploads.

    Args:
        num_malicious: ``f``, the number of Byzantine uploads to tolerate.
        multi: ``m``, how many lowest-scoring uploads to average (1: Krum).
        min_clients: Fewest accepted uploads a round needs; with fewer the round keeps the global state.
    """

    def __init__(self, num_malicious: int = 1, multi: int = 1, min_clients: int = 1) -> None:
        super().__init__(min_clients)
        problems = []
        if num_malicious < 0:
            problems.append(f"trainer.strategy.num_malicious must be >= 0, got {num_malicious}")
        if multi < 1:
            problems.append(f"trainer.strategy.multi must be >= 1, got {multi}")
        if problems:
            raise ConfigError("; ".join(problems))
        self.num_malicious, self.multi = num_malicious, multi

    def problem(self, num_uploads: int) -> str | None:
        needed = max(self.num_malicious + 3, self.multi)
        if num_uploads < needed:
            return (
                f"{num_uploads} upload(s) accepted; Krum with num_malicious={self.num_malicious} and "
                f"multi={self.multi} needs at least {needed}"
            )
        return super().problem(num_uploads)

    def plan_warning(self, count: int) -> str | None:
        """Why a round of ``count`` uploads computes Krum's scores without its guarantee: Blanchard, El Mhamdi,
        Guerraoui, Stainer (2017), "Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent"
        (NeurIPS), prove it for ``n >= 2f + 3``."""
        if count < 2 * self.num_malicious + 3:
            return (
                f"Krum with num_malicious={self.num_malicious} is proven to tolerate them only with at least "
                f"{2 * self.num_malicious + 3} uploads per round (n >= 2f + 3); a round samples {count}: lower "
                "trainer.strategy.num_malicious or sample more clients"
            )
        return None

    def select(self, uploads: torch.Tensor) -> list[int]:
        """Row indices of the ``m`` lowest scores (ties to the lower index)."""
        scores = krum_scores(uploads, self.num_malicious)
        order = sorted(range(len(scores)), key=lambda i: (float(scores[i]), i))
        return sorted(order[: self.multi])

    def aggregate(self, round, current, uploads, num_samples, clients) -> tuple[torch.Tensor, dict[str, float]]:
        chosen = self.select(uploads)
        return uploads[chosen].to(torch.float64).mean(dim=0), {"selected": float(len(chosen))}

    def __repr__(self) -> str:
        return f"Krum(num_malicious={self.num_malicious}, multi={self.multi})"
