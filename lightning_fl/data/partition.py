"""Client partitioners: split a labelled training set among ``num_clients`` clients.

Every partitioner is seeded and deterministic, and returns a :class:`ClientPartition`: disjoint, non-empty,
sorted index arrays that together cover every sample exactly once (a split that leaves a client empty, gives
a sample to two clients or to none is refused). The partition is held as two flat arrays (every client's
indices one after the other, and where each client starts), so a million clients cost a few arrays, not a
million Python objects.

Add your own by subclassing :class:`Partitioner` and implementing either :meth:`Partitioner.assign` (the
client of every sample, one array: what scales) or :meth:`Partitioner.split` (one index array per client);
select it with ``data.partition.class_path``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from lightning_fl.errors import ConfigError


class ClientPartition(Sequence):
    """Clients' sample indices, held flat: client ``k`` holds ``indices[offsets[k]:offsets[k + 1]]``.

    A sequence of index arrays (``partition[k]`` is a read-only view, ``len(partition)`` the number of
    clients), so code written for a list of arrays keeps working.
    """

    def __init__(self, indices: np.ndarray, offsets: np.ndarray) -> None:
        indices, offsets = np.asarray(indices, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
        if offsets.ndim != 1 or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != len(indices):
            raise ValueError(f"offsets must run from 0 to {len(indices)} (the number of indices)")
        if np.any(np.diff(offsets) < 0):
            raise ValueError("offsets must not decrease")
        self.indices, self.offsets = indices, offsets
        self.indices.flags.writeable = self.offsets.flags.writeable = False

    @classmethod
    def from_owner(cls, owner: np.ndarray, num_clients: int) -> ClientPartition:
        """The partition in which sample ``i`` belongs to client ``owner[i]`` (each client's indices sorted)."""
        owner = np.asarray(owner)
        sizes = np.bincount(owner, minlength=num_clients)
        order = np.argsort(owner, kind="stable")  # stable: each client's indices stay in increasing order
        return cls(order, np.concatenate([[0], np.cumsum(sizes)]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        k = int(k)
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(f"client {k} is not in 0..{len(self) - 1}")
        return self.indices[self.offsets[k] : self.offsets[k + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[k] for k in range(len(self)))

    def sizes(self) -> np.ndarray:
        """Samples per client."""
        return np.diff(self.offsets)

    def owners(self) -> np.ndarray:
        """The client of each entry of ``indices`` (``int64``, aligned with it)."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.sizes())

    def take(self, pool: np.ndarray) -> ClientPartition:
        """The same clients with each index ``i`` replaced by ``pool[i]`` (positions in a pool -> data set indices)."""
        return ClientPartition(np.asarray(pool)[self.indices], self.offsets)

    def __repr__(self) -> str:
        return f"ClientPartition({len(self)} clients, {len(self.indices)} samples)"


class Partitioner:
    """Base class: ``partitioner(targets, num_clients, seed)`` -> a :class:`ClientPartition`.

    Subclasses define :meth:`assign` (the client of every sample) or :meth:`split` (the samples of every
    client); either is enough.
    """

    _plugin_base = True  # not offered as a choice in CLI messages

    def assign(self, targets: np.ndarray, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        """The client (``0..num_clients - 1``) of every index of ``targets``. By default from :meth:`split`."""
        if type(self).split is Partitioner.split:
            raise NotImplementedError(f"{type(self).__name__} must define assign() or split()")
        owner = np.full(len(targets), -1, dtype=np.int64)
        for k, part in enumerate(self.split(targets, num_clients, rng)):
            part = np.asarray(part, dtype=np.int64)
            if len(part) and (part.min() < 0 or part.max() >= len(targets)):
                raise ConfigError(f"data.partition ({self!r}) gave client {k} indices outside 0..{len(targets) - 1}")
            if np.any(owner[part] != -1) or len(np.unique(part)) != len(part):
                raise ConfigError(f"data.partition ({self!r}) gave a sample to two clients (client {k} among them)")
            owner[part] = k
        return owner

    def split(self, targets: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        """The indices of ``targets`` each client holds (every index exactly once). By default from :meth:`assign`."""
        if type(self).assign is Partitioner.assign:
            raise NotImplementedError(f"{type(self).__name__} must define assign() or split()")
        return list(ClientPartition.from_owner(self.assign(targets, num_clients, rng), num_clients))

    def __call__(self, targets: np.ndarray, num_clients: int, seed: int) -> ClientPartition:
        targets = np.asarray(targets)
        if targets.ndim != 1:
            raise ValueError(f"Expected 1-D targets, got shape {targets.shape}")
        if not 1 <= num_clients <= len(targets):
            raise ConfigError(
                f"data.num_clients must be between 1 and the number of client samples ({len(targets)}), "
                f"got {num_clients}"
            )
        owner = np.asarray(self.assign(targets, num_clients, np.random.default_rng(seed)))
        if owner.shape != targets.shape or (len(owner) and (owner.min() < 0 or owner.max() >= num_clients)):
            unassigned = int(np.sum(owner < 0)) if owner.shape == targets.shape else len(targets)
            raise ConfigError(
                f"data.partition ({self!r}) did not give each of the {len(targets)} samples one client in "
                f"0..{num_clients - 1} ({unassigned} without one)"
            )
        parts = ClientPartition.from_owner(owner, num_clients)
        if len(empty := np.flatnonzero(parts.sizes() == 0)):
            shown = ", ".join(map(str, empty[:10])) + (", ..." if len(empty) > 10 else "")
            raise ConfigError(
                f"data.partition ({self!r}) left {len(empty)} of {num_clients} clients with no samples (client "
                f"{shown}); an empty client cannot train: lower data.num_clients or make the split less skewed"
            )
        return parts

    def __repr__(self) -> str:
        # a default made by jsonargparse's lazy_instance keeps its class and bookkeeping under _lazy* names
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_lazy"))
        return f"{getattr(self, '_lazy_class_type', type(self)).__name__}({args})"


class IID(Partitioner):
    """Uniformly random split into near-equal parts (sizes differ by at most one)."""

    def assign(self, targets: np.ndarray, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        # the split of np.array_split(permutation, num_clients): the first n % K clients hold one more
        n = len(targets)
        sizes = np.full(num_clients, n // num_clients, dtype=np.int64)
        sizes[: n % num_clients] += 1
        owner = np.empty(n, dtype=np.int64)
        owner[rng.permutation(n)] = np.repeat(np.arange(num_clients, dtype=np.int64), sizes)
        return owner


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

    def assign(self, targets: np.ndarray, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        n = len(targets)
        if self.min_partition_size * num_clients > n:
            raise ConfigError(
                f"data.partition.min_partition_size={self.min_partition_size} x data.num_clients={num_clients} "
                f"exceeds the {n} client samples; lower one of them"
            )
        classes = np.unique(targets)
        smallest = 0
        owner = np.empty(n, dtype=np.int64)
        for _ in range(self.max_retries):
            sizes = np.zeros(num_clients, dtype=np.int64)
            for c in classes:
                idx = rng.permutation(np.flatnonzero(targets == c))
                p = rng.dirichlet(np.full(num_clients, self.alpha))
                if self.balance:
                    p = p * (sizes < n / num_clients)
                    total = p.sum()
                    p = p / total if total > 0 else np.full(num_clients, 1.0 / num_clients)
                cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
                # np.split(idx, cuts)'s chunk k goes to client k: position j lies in the chunk of the cuts <= j
                clients = np.searchsorted(cuts, np.arange(len(idx)), side="right")
                owner[idx] = clients
                sizes += np.bincount(clients, minlength=num_clients)
            smallest = int(sizes.min())
            if smallest >= self.min_partition_size:
                return owner
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

    def assign(self, targets: np.ndarray, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        num_shards = num_clients * self.shards_per_client
        if num_shards > len(targets):
            raise ConfigError(
                f"{num_clients} clients x {self.shards_per_client} shards need at least {num_shards} samples, "
                f"got {len(targets)}"
            )
        # Shuffle first so ties within a class are broken randomly, then stable-sort by label.
        perm = rng.permutation(len(targets))
        order = perm[np.argsort(targets[perm], kind="stable")]
        # np.array_split(order, num_shards); client k is dealt shards dealt[k * spc : (k + 1) * spc]
        n = len(targets)
        shard_sizes = np.full(num_shards, n // num_shards, dtype=np.int64)
        shard_sizes[: n % num_shards] += 1
        dealt = rng.permutation(num_shards)
        client_of_shard = np.empty(num_shards, dtype=np.int64)
        client_of_shard[dealt] = np.arange(num_shards) // self.shards_per_client
        owner = np.empty(n, dtype=np.int64)
        owner[order] = np.repeat(client_of_shard, shard_sizes)
        return owner


def label_histograms(
    partitions: ClientPartition | Sequence[np.ndarray], targets: np.ndarray, num_classes: int
) -> np.ndarray:
    """Counts per client and class: array ``(num_clients, num_classes)`` (one pass over a :class:`ClientPartition`)."""
    targets = np.asarray(targets)
    if not isinstance(partitions, ClientPartition):
        partitions = ClientPartition(
            np.concatenate([np.asarray(p, dtype=np.int64) for p in partitions] or [np.zeros(0, np.int64)]),
            np.concatenate([[0], np.cumsum([len(p) for p in partitions])]),
        )
    cells = partitions.owners() * num_classes + targets[partitions.indices]
    return np.bincount(cells, minlength=len(partitions) * num_classes).reshape(len(partitions), num_classes)
