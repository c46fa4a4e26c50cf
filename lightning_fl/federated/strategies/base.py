"""The server algorithm as a plug-in: which clients train, and how their uploads become the next global state.

A :class:`Strategy` works on flat vectors: the global state and each accepted upload concatenated in a fixed
name order (float32 rows of ``uploads``). So one strategy serves every federated state: a FLITE latent of a
few thousand floats or the full weights of a network. It only ever sees uploads that passed the gate
(decoded, right layout, finite), in client-id order, and must be deterministic given its inputs and its own
state: every process computes the aggregate itself, and a resumed run must continue exactly.

Write your own by subclassing :class:`Strategy` and implementing :meth:`Strategy.aggregate`; keep any state
across rounds in attributes and return it from ``state_dict`` (it is saved in every round checkpoint).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from lightning_fl.errors import ConfigError
from lightning_fl.seeding import derive_seed

STREAM_SAMPLING = 11


class Strategy:
    """Base class of server strategies.

    Args:
        min_clients: Fewest accepted uploads a round needs; with fewer the round keeps the global state.
    """

    _plugin_base = True  # not offered as a choice in CLI messages
    #: The aggregate is an affine combination of the uploads (so averaging latents equals averaging the
    #: weights they map to, and the loop logs the averaging identity error). False for robust or adaptive rules.
    linear: ClassVar[bool] = False

    def __init__(self, min_clients: int = 1) -> None:
        if min_clients < 1:
            raise ConfigError(f"trainer.strategy.min_clients must be >= 1, got {min_clients}")
        self.min_clients = min_clients

    # ------------------------------------------------------------------------------------- sampling
    def sample(self, round: int, num_clients: int, count: int, seed: int) -> list[int]:
        """The ``count`` clients (sorted ids) that train in ``round``: uniform without replacement, seeded."""
        if count > num_clients:
            raise ConfigError(f"trainer.clients_per_round={count} exceeds data.num_clients={num_clients}")
        rng = np.random.default_rng(derive_seed(seed, round, STREAM_SAMPLING))
        return sorted(int(c) for c in rng.choice(num_clients, size=count, replace=False))

    # ------------------------------------------------------------------------------------- aggregation
    def problem(self, num_uploads: int) -> str | None:
        """Why ``num_uploads`` accepted uploads cannot be aggregated (``None``: they can)."""
        if num_uploads < self.min_clients:
            return f"{num_uploads} upload(s) accepted, fewer than trainer.strategy.min_clients={self.min_clients}"
        return None

    def aggregate(
        self,
        round: int,
        current: torch.Tensor,
        uploads: torch.Tensor,
        num_samples: torch.Tensor,
        clients: list[int],
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The next global state (flat, float64) and scalar metrics to log (under ``strategy/``).

        Args:
            round: The round (0-based).
            current: The global state the clients started from, flat float32 ``(D,)``.
            uploads: Accepted uploads, flat float32 ``(n, D)``, rows in ``clients`` order.
            num_samples: Each client's number of training samples, float64 ``(n,)``.
            clients: The uploading clients' ids.
        """
        raise NotImplementedError

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """State carried across rounds (server optimiser moments, ...); saved in every round checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but got state keys {sorted(state)}")

    @property
    def name(self) -> str:
        """The class name (of the configured class, also for a config default built lazily by jsonargparse)."""
        lazy = ("LazyInstance_", "_LazyInit")  # jsonargparse's wrappers of a lazily built default
        return next(c.__name__ for c in type(self).__mro__ if not c.__name__.startswith(lazy))

    def __repr__(self) -> str:
        return f"{self.name}()"


def mean_of_uploads(uploads: torch.Tensor, num_samples: torch.Tensor, weighted: bool) -> torch.Tensor:
    """``sum_k w_k x_k / sum_k w_k`` in float64, rows summed in order (so every process agrees bit for bit).

    ``w_k`` is the client's sample count when ``weighted``, else 1.
    """
    if len(uploads) == 0:
        raise ValueError("Expected at least one upload to aggregate")
    weights = [float(w) for w in num_samples] if weighted else [1.0] * len(uploads)
    total = sum(weights)
    if not total > 0:
        raise ValueError(f"Expected positive aggregation weights, got {weights}")
    acc = torch.zeros(uploads.shape[1], dtype=torch.float64)
    for x, w in zip(uploads, weights, strict=True):
        acc += w * x.to(torch.float64)
    return acc / total
