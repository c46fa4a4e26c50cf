"""Our partitioners against flwr-datasets' (Flower's dataset library) where the algorithms are the same.

Both sides draw from NumPy generators, but in different orders (ours shuffles within a class before cutting, Flower
shuffles each partition after), so the random streams are aligned by hand: ours gets a generator whose
``permutation`` is the identity (Flower's partitioners take the dataset in its given order) and whose other draws
come from ``default_rng(seed)``, the generator Flower's partitioners build from the same seed. With the streams
aligned, the clients must hold the same indices:

- ``IID``: Flower's ``IidPartitioner`` cuts the (already shuffled) dataset into contiguous near-equal shards;
- ``Dirichlet``: Flower's ``DirichletPartitioner`` (per-class Dirichlet shares, NIID-Bench's self-balancing,
  redraws until ``min_partition_size``) on a dataset whose mean client size is not an integer (at an integer mean a
  client holding exactly the mean is stopped by ours and fed by Flower's ``>``). Flower renormalises the balanced
  shares with Python's left-to-right ``sum``, ours with NumPy's pairwise one: the last bit of a share can differ, and
  a cut that falls within that of an integer moves by one sample. So each class's cuts must agree to one sample,
  and at most one cut in the whole split may differ at all;
- ``Shards``: Flower's ``ShardPartitioner`` (label-sorted shards dealt by one permutation) when the shards divide
  the dataset (Flower drops the remainder, ours spreads it over the first shards).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from lightning_fl.data.partition import IID, Dirichlet, Shards

partitioner = pytest.importorskip("flwr_datasets.partitioner")
datasets = pytest.importorskip("datasets")


class Aligned:
    """A NumPy generator for our partitioners: the first ``keep`` calls of ``permutation`` (all, if None) keep the
    order; every other draw is ``default_rng(seed)``'s."""

    def __init__(self, seed: int, keep: int | None = None) -> None:
        self.rng, self.keep = np.random.default_rng(seed), keep

    def permutation(self, x):
        if self.keep is not None:
            if self.keep == 0:
                return self.rng.permutation(x)
            self.keep -= 1
        return np.arange(x) if isinstance(x, (int, np.integer)) else np.asarray(x)

    def __getattr__(self, name):
        return getattr(self.rng, name)


def flower_parts(flower, targets: np.ndarray) -> list[list[int]]:
    flower.dataset = datasets.Dataset.from_dict({"label": targets, "idx": np.arange(len(targets))})
    return [sorted(flower.load_partition(k)["idx"]) for k in range(flower.num_partitions)]


def ours(split, targets: np.ndarray, num_clients: int, rng) -> list[list[int]]:
    owner = split.assign(targets, num_clients, rng)
    return [sorted(np.flatnonzero(owner == k).tolist()) for k in range(num_clients)]


def labels(n: int, classes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(1000 + seed).integers(0, classes, n)


@pytest.mark.parametrize(("n", "clients"), [(100, 10), (1003, 7), (50, 50)])
def test_iid_equals_flowers_iid_partitioner(n, clients):
    targets = labels(n, 10, 0)
    assert ours(IID(), targets, clients, Aligned(0)) == flower_parts(partitioner.IidPartitioner(clients), targets)


def class_cuts(parts: list[list[int]], targets: np.ndarray) -> np.ndarray:
    """(classes, clients): how many samples of each class clients 0..k hold together."""
    counts = np.array([np.bincount(targets[part], minlength=targets.max() + 1) for part in parts]).T
    return counts.cumsum(axis=1)


def assert_same_cuts(got: list[list[int]], want: list[list[int]], targets: np.ndarray) -> None:
    diff = np.abs(class_cuts(got, targets) - class_cuts(want, targets))
    assert diff.max() <= 1 and np.count_nonzero(diff) <= 1, np.argwhere(diff)
    for part in got + want:  # each client's samples of a class are consecutive in the class's order (no shuffle)
        for c in np.unique(targets[part]):
            ranks = np.searchsorted(np.flatnonzero(targets == c), [i for i in part if targets[i] == c])
            assert np.array_equal(ranks, np.arange(ranks[0], ranks[0] + len(ranks)))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("alpha", "clients", "min_size"), [(0.1, 10, 10), (0.5, 13, 20), (5.0, 6, 10)])
def test_dirichlet_equals_flowers_dirichlet_partitioner(seed, alpha, clients, min_size):
    n = 2003  # the mean client size is not an integer for any of the client counts
    targets = labels(n, 10, seed)
    flower = partitioner.DirichletPartitioner(
        clients, "label", alpha, min_partition_size=min_size, self_balancing=True, shuffle=False, seed=seed
    )
    split = Dirichlet(alpha, min_partition_size=min_size, balance=True, max_retries=11)  # Flower tries 11 times
    with warnings.catch_warnings(action="ignore"):  # Flower warns on every redraw
        want = flower_parts(flower, targets)
    assert_same_cuts(ours(split, targets, clients, Aligned(seed)), want, targets)


def test_dirichlet_without_balancing_equals_flowers_too():
    targets = labels(1000, 10, 5)
    flower = partitioner.DirichletPartitioner(
        8, "label", 0.3, min_partition_size=0, self_balancing=False, shuffle=False, seed=5
    )
    split = Dirichlet(0.3, min_partition_size=1, balance=False)
    with warnings.catch_warnings(action="ignore"):
        want = flower_parts(flower, targets)
    assert ours(split, targets, 8, Aligned(5)) == want


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("n", "clients", "per_client"), [(1000, 10, 2), (600, 20, 3), (120, 6, 4)])
def test_shards_equal_flowers_shard_partitioner_when_the_shards_divide_the_data(seed, n, clients, per_client):
    targets = labels(n, 10, seed)
    flower = partitioner.ShardPartitioner(
        clients, "label", num_shards_per_partition=per_client, shuffle=False, seed=seed
    )
    # ours shuffles the samples (kept in order here), then deals the shards (Flower's one draw)
    assert ours(Shards(per_client), targets, clients, Aligned(seed, keep=1)) == flower_parts(flower, targets)
