"""The server algorithm as a plug-in: which clients train, and how their uploads become the next global state.

A :class:`Strategy` works on flat vectors: the global state and each accepted upload concatenated in a fixed
name order. So one strategy serves every federated state: a FLITE latent of a few thousand floats or the full
weights of a network. It only ever sees uploads that passed the gate (decoded, right layout, finite), in
client-id order, and must be deterministic given its inputs and its own state: every process computes the
aggregate itself, and a resumed run must continue exactly.

Two kinds:

- Strategies that are a function of the round's **mean** upload (FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad)
  implement :meth:`Strategy.step` ``(round, current, mean)``; the round never builds an ``(n, D)`` matrix for
  them: it folds each upload into a running float64 sum as it arrives (O(D) memory) and hands the mean over.
  Under central DP that mean is the global state plus the noised mean of the clipped updates.
- **Robust** strategies (Median, TrimmedMean, Krum) need every upload at once: they implement
  :meth:`Strategy.aggregate` over the ``(n, D)`` float32 matrix of the round's uploads, which the round keeps
  for them (O(n D) memory).

Write your own by subclassing :class:`Strategy` and implementing one of the two; keep any state across rounds
in attributes and return it from ``state_dict`` (it is saved in every round checkpoint).
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import numpy as np
import torch

from lightning_fl.errors import ConfigError
from lightning_fl.privacy.base import SystemRandomness
from lightning_fl.seeding import STREAM_POISSON, STREAM_SAMPLING, derive_seed


class Strategy:
    """Base class of server strategies.

    Args:
        min_clients: Fewest accepted uploads a round needs; with fewer the round keeps the global state.
    """

    _plugin_base = True  # not offered as a choice in CLI messages
    #: The aggregate is an affine combination of the uploads (so averaging latents equals averaging the
    #: weights they map to, and the loop logs the averaging identity error). False for robust or adaptive rules.
    linear: ClassVar[bool] = False
    #: Weight each upload by its client's sample count in the mean (linear strategies).
    weighted: bool = False

    def __init__(self, min_clients: int = 1) -> None:
        if min_clients < 1:
            raise ConfigError(f"trainer.strategy.min_clients must be >= 1, got {min_clients}")
        self.min_clients = min_clients

    # ------------------------------------------------------------------------------------- sampling
    def sample(self, round: int, num_clients: int, count: int, seed: int | None) -> list[int]:
        """The ``count`` clients (sorted ids) that train in ``round``: uniform without replacement, seeded by
        ``(seed, round)``; ``seed`` ``None``: drawn from the operating system's secure generator (a cohort no seed
        can reveal, which amplification by sampling assumes)."""
        if count > num_clients:
            raise ConfigError(f"trainer.clients_per_round={count} exceeds data.num_clients={num_clients}")
        if seed is None:
            return sorted(random.SystemRandom().sample(range(num_clients), count))
        rng = np.random.default_rng(derive_seed(seed, round, STREAM_SAMPLING))
        return sorted(int(c) for c in rng.choice(num_clients, size=count, replace=False))

    def sample_poisson(self, round: int, num_clients: int, rate: float, seed: int | None) -> list[int]:
        """Poisson sampling: every client takes part independently with probability ``rate`` (seeded per round;
        ``seed`` ``None``: from the operating system's secure generator, as :meth:`sample`).

        The cohort's size varies from round to round (it may be empty); most DP analyses of federated learning
        assume this sampling (:mod:`lightning_fl.privacy.accountant`).
        """
        if not 0 < rate <= 1:
            raise ConfigError(f"Poisson sampling needs a rate in (0, 1], got {rate}")
        if seed is None:
            return [int(c) for c in np.flatnonzero(SystemRandomness.uniform(num_clients) < rate)]
        rng = np.random.default_rng(derive_seed(seed, round, STREAM_POISSON))
        return [int(c) for c in np.flatnonzero(rng.random(num_clients) < rate)]

    def plan_warning(self, count: int) -> str | None:
        """What to warn about, once before the first round, when every round samples ``count`` clients (``None``:
        nothing; Krum warns when its guarantee needs more uploads)."""
        return None

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
        """The next global state (flat, float64) and scalar metrics to log (under ``strategy/``), from every upload.

        Robust strategies implement this; for a linear one it is :meth:`step` of the uploads' mean.

        Args:
            round: The round (0-based).
            current: The global state the clients started from, flat float32 ``(D,)``.
            uploads: Accepted uploads, flat float32 ``(n, D)``, rows in ``clients`` order.
            num_samples: Each client's number of training samples, float64 ``(n,)``.
            clients: The uploading clients' ids.
        """
        if type(self).step is not Strategy.step:
            return self.step(round, current, mean_of_uploads(uploads, num_samples, self.weighted))
        raise NotImplementedError(f"{self.name} implements neither aggregate nor step")

    def step(self, round: int, current: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """A linear strategy's next global state (flat, float64) and metrics, from the round's mean upload.

        Args:
            round: The round (0-based).
            current: The global state the clients started from, flat float32 ``(D,)``.
            mean: The round's mean upload, float64 ``(D,)``: ``sum_k w_k x_k / sum_k w_k`` summed in client order
                (``w_k`` the sample count when :attr:`weighted`, else 1), or under central DP the global state
                plus the noised mean of the clipped updates.
        """
        raise NotImplementedError

    @property
    def streams(self) -> bool:
        """Whether the round may fold uploads into a running sum for this strategy (it implements :meth:`step`)."""
        return type(self).step is not Strategy.step

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
        return configured_name(self)

    def __repr__(self) -> str:
        return f"{self.name}()"


def configured_name(obj: object) -> str:
    """``obj``'s class name as the config names it, also for a default built lazily by jsonargparse (which wraps
    the class in a subclass of its own)."""
    lazy = ("LazyInstance_", "_LazyInit")  # jsonargparse's wrappers of a lazily built default
    return next(c.__name__ for c in type(obj).__mro__ if not c.__name__.startswith(lazy))


def mean_of_uploads(uploads: torch.Tensor, num_samples: torch.Tensor, weighted: bool) -> torch.Tensor:
    """``sum_k w_k x_k / sum_k w_k`` in float64, rows summed in order (so every process agrees bit for bit).

    ``w_k`` is the client's sample count when ``weighted``, else 1. The round's streaming sum
    (:class:`RunningSum`) performs exactly these operations, one upload at a time.
    """
    if len(uploads) == 0:
        raise ValueError("Expected at least one upload to aggregate")
    acc = RunningSum(uploads.shape[1])
    for x, w in zip(uploads, num_samples, strict=True):
        acc.add(x, float(w) if weighted else 1.0)
    return acc.mean()


#: Values a :class:`RunningSum` adds per step (its float64 temporaries: 512 KiB).
FOLD_CHUNK = 2**16


class RunningSum:
    """``sum_k w_k x_k`` and ``sum_k w_k`` in float64, one upload at a time, in the order they are added.

    Float64 addition is not associative: the result depends on the order, so the round adds uploads in
    client-id order, whichever process trained them, and a fold equals the old all-rows mean bit for bit
    (several processes: :class:`GroupedSums`).
    """

    def __init__(self, size: int) -> None:
        self.total = torch.zeros(size, dtype=torch.float64)
        self.weight = 0.0
        self.count = 0

    def add(self, x: torch.Tensor, w: float = 1.0) -> None:
        """``total += w * x`` in float64, :data:`FOLD_CHUNK` values at a time.

        Elementwise, so the chunks give the very additions of one ``total += w * x.double()``, bit for bit; but
        their float64 temporaries stay in cache instead of two fresh copies of the whole upload per client (0.5
        against 1.9 ms for a 421,738-value upload, one thread). A weight of 1 multiplies nothing (``1.0 * v == v``).
        """
        if x.shape != self.total.shape:
            raise ValueError(f"Expected an upload of shape {tuple(self.total.shape)}, got {tuple(x.shape)}")
        for start in range(0, len(self.total), FOLD_CHUNK):
            part = x[start : start + FOLD_CHUNK].to(torch.float64)
            self.total[start : start + FOLD_CHUNK] += part if w == 1.0 else w * part
        self.weight += w
        self.count += 1

    def merge(self, total: torch.Tensor, weight: float, count: int) -> None:
        """Add another sum's ``total``, ``weight`` and ``count`` (one group of :class:`GroupedSums`)."""
        self.total += total.to(torch.float64)
        self.weight += weight
        self.count += count

    def mean(self) -> torch.Tensor:
        if not self.weight > 0:
            raise ValueError(f"Expected positive aggregation weights, got a total of {self.weight}")
        return self.total / self.weight


class GroupedSums:
    """``groups`` running sums: client ``c`` is added to sum ``c % groups``, each sum in client-id order, and
    :meth:`combine` adds the sums together in group order.

    The result depends on ``groups`` alone: a group's clients all train on one process, so the same sums reach
    the same additions however many processes hold the groups. That lets several processes stream (each holds
    only its groups' sums, O(D) each) and still give the global state of one process, bit for bit. With one
    group, :meth:`combine` is the single sum itself: the order of a single running sum.
    """

    def __init__(self, size: int, groups: int = 1) -> None:
        if groups < 1:
            raise ValueError(f"Expected at least one group, got {groups}")
        self.size, self.groups = size, groups
        self.sums: dict[int, RunningSum] = {}  # only the groups that received an upload

    def add(self, client: int, x: torch.Tensor, w: float = 1.0) -> None:
        group = client % self.groups
        if group not in self.sums:
            self.sums[group] = RunningSum(self.size)
        self.sums[group].add(x, w)

    def combine(self) -> RunningSum:
        """Every group's sum added in group order (starting from zero) into one :class:`RunningSum`."""
        if self.groups == 1:
            return self.sums.get(0, RunningSum(self.size))
        out = RunningSum(self.size)
        for group in sorted(self.sums):
            part = self.sums[group]
            out.merge(part.total, part.weight, part.count)
        return out
