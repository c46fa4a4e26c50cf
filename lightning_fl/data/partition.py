"""Client partitioners: split a labelled training set among ``num_clients`` clients.

Every partitioner is seeded and deterministic, and returns disjoint, non-empty index arrays that
together cover every sample exactly once (a split that leaves a client empty is refused). Add your own
by subclassing :class:`Partitioner` and implementing :meth:`Partitioner.split`; select it with
``data.partition.class_path``.
"""

from __future__ import annotations

import numpy as np

from lightning_fl.errors import ConfigError


class Partitioner:
    """Base class: ``partitioner(targets, num_clients, seed)`` -> one sorted index array per client."""

    _plugin_base = True  # not offered as a choice in CLI messages

    def split(self, targets: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        """Assign every index of ``targets`` to exactly one client."""
        raise NotImplementedError

    def __call__(self, targets: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
        targets = np.asarray(targets)
        if targets.ndim != 1:
            raise ValueError(f"Expected 1-D targets, got shape {targets.shape}")
        if not 1 <= num_clients <= len(targets):
            raise ConfigError(
                f"data.num_clients must be between 1 and the number of client samples ({len(targets)}), "
                f"got {num_clients}"
            )
        parts = [
            np.sort(np.asarray(p, dtype=np.int64))
            for p in self.split(targets, num_clients, np.random.default_rng(seed))
        ]
        if empty := [k for k, p in enumerate(parts) if len(p) == 0]:
            shown = ", ".join(map(str, empty[:10])) + (", ..." if len(empty) > 10 else "")
            raise ConfigError(
                f"data.partition ({self!r}) left {len(empty)} of {num_clients} clients with no samples (client "
                f"{shown}); an empty client cannot train: lower data.num_clients or make the split less skewed"
            )
        return parts

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class IID(Partitioner):
    """Uniformly random split into near-equal parts (sizes differ by at most one)."""

    def split(self, targets: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        return np.array_split(rng.permutation(len(targets)), num_clients)


class Dirichlet(Partitioner):
    """Label-skewed split: for each class, client shares are drawn from Dirichlet(alpha).

    This is the per-class scheme of Yurochkin et al. (2019) as used by NIID-Bench (Li et al.
    2022) and most FL papers with "Dirichlet alpha" splits, including FLITE and FMP. Smaller
    ``alpha`` gives more skew; large ``alpha`` approaches IID.

    With ``balance`` (NIID-Bench's rule) a client that already holds at least ``N / num_clients``
    samples gets no more of the next class, which keeps client sizes comparable. If any client ends
    with fewer than ``min_partition_size`` samples the whole draw is repeated (new randomness from
    the same seed), up to ``max_retries`` times, then a :class:`~lightning_fl.errors.ConfigError`
    says what to change.

    Args:
        alpha: Dirichlet concentration (> 0).
        min_partition_size: Smallest allowed number of samples per client.
        balance: Stop giving samples to clients above the average size.
        max_retries: Draws to try before giving up.
    """

    def __init__(
        self, alpha: float = 0.5, min_partition_size: int = 10, balance: bool = True, max_retries: int = 100
    ) -> None:
        problems = []
        if not alpha > 0:
            problems.append(f"alpha must be > 0, got {alpha}")
        if min_partition_size < 1:
            problems.append(f"min_partition_size must be >= 1 (an empty client cannot train), got {min_partition_size}")
        if max_retries < 1:
            problems.append(f"max_retries must be >= 1, got {max_retries}")
        if problems:
            raise ConfigError("data.partition (Dirichlet): " + "; ".join(problems))
        self.alpha = float(alpha)
        self.min_partition_size = min_partition_size
        self.balance = balance
        self.max_retries = max_retries

    def split(self, targets: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        n = len(targets)
        if self.min_partition_size * num_clients > n:
            raise ConfigError(
                f"data.partition.min_partition_size={self.min_partition_size} x data.num_clients={num_clients} "
                f"exceeds the {n} client samples; lower one of them"
            )
        classes = np.unique(targets)
        smallest = 0
        for _ in range(self.max_retries):
            parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
            sizes = np.zeros(num_clients, dtype=np.int64)
            for c in classes:
                idx = rng.permutation(np.flatnonzero(targets == c))
                p = rng.dirichlet(np.full(num_clients, self.alpha))
                if self.balance:
                    p = p * (sizes < n / num_clients)
                    total = p.sum()
                    p = p / total if total > 0 else np.full(num_clients, 1.0 / num_clients)
                cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
                for k, chunk in enumerate(np.split(idx, cuts)):
                    parts[k].append(chunk)
                    sizes[k] += len(chunk)
            smallest = int(sizes.min())
            if smallest >= self.min_partition_size:
                return [np.concatenate(p) for p in parts]
        raise ConfigError(
            f"Dirichlet(alpha={self.alpha}) could not give each of {num_clients} clients at least "
            f"{self.min_partition_size} samples in {self.max_retries} draws (the last draw's smallest client had "
            f"{smallest}). Raise data.partition.alpha, lower data.num_clients, or lower "
            "data.partition.min_partition_size."
        )


class Shards(Partitioner):
    """Pathological non-IID split of McMahan et al. (2017): sort by label, cut into shards, deal shards out.

    Each client receives ``shards_per_client`` shards of consecutive (label-sorted) samples, so it
    sees only a few classes.

    Args:
        shards_per_client: Shards given to each client.
    """

    def __init__(self, shards_per_client: int = 2) -> None:
        if shards_per_client < 1:
            raise ConfigError(f"data.partition.shards_per_client must be >= 1, got {shards_per_client}")
        self.shards_per_client = shards_per_client

    def split(self, targets: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        num_shards = num_clients * self.shards_per_client
        if num_shards > len(targets):
            raise ConfigError(
                f"{num_clients} clients x {self.shards_per_client} shards need at least {num_shards} samples, "
                f"got {len(targets)}"
            )
        # Shuffle first so ties within a class are broken randomly, then stable-sort by label.
        perm = rng.permutation(len(targets))
        order = perm[np.argsort(targets[perm], kind="stable")]
        shards = np.array_split(order, num_shards)
        owner = rng.permutation(num_shards)
        return [
            np.concatenate([shards[s] for s in owner[k * self.shards_per_client : (k + 1) * self.shards_per_client]])
            for k in range(num_clients)
        ]


def label_histograms(partitions: list[np.ndarray], targets: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts per client and class: array ``(num_clients, num_classes)``."""
    targets = np.asarray(targets)
    return np.stack([np.bincount(targets[p], minlength=num_classes) for p in partitions]).astype(np.int64)
