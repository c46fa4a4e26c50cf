import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_fl.data import IID, Dirichlet, Shards, label_histograms
from lightning_fl.errors import ConfigError

labels = st.integers(2, 10).flatmap(lambda c: st.lists(st.integers(0, c - 1), min_size=60, max_size=400).map(np.array))
partitioners = st.one_of(
    st.just(IID()),
    st.builds(
        Dirichlet,
        alpha=st.sampled_from([0.05, 0.1, 0.5, 1.0, 100.0]),
        min_partition_size=st.just(1),
        balance=st.booleans(),
    ),
    st.builds(Shards, shards_per_client=st.integers(1, 3)),
)


@settings(max_examples=150, deadline=None)
@given(targets=labels, partitioner=partitioners, num_clients=st.integers(1, 12), seed=st.integers(0, 2**31))
def test_partitions_are_disjoint_covering_and_deterministic(targets, partitioner, num_clients, seed):
    try:
        parts = partitioner(targets, num_clients, seed)
    except ConfigError as err:  # a skewed draw that keeps leaving a client empty is refused, naming the fix
        refused = err
    else:
        refused = None
    if refused is not None:
        assert isinstance(partitioner, Dirichlet) and "min_partition_size" in str(refused)
        return
    assert len(parts) == num_clients and all(len(p) > 0 for p in parts)
    everything = np.concatenate(parts)
    assert np.array_equal(np.sort(everything), np.arange(len(targets)))  # disjoint and covering
    again = partitioner(targets, num_clients, seed)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


@settings(max_examples=50, deadline=None)
@given(targets=labels, num_clients=st.integers(1, 12), seed=st.integers(0, 2**31))
def test_iid_sizes_differ_by_at_most_one(targets, num_clients, seed):
    sizes = [len(p) for p in IID()(targets, num_clients, seed)]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=40, deadline=None)
@given(
    num_clients=st.integers(2, 10),
    min_size=st.integers(1, 30),
    seed=st.integers(0, 2**31),
    alpha=st.sampled_from([0.3, 1.0, 10.0]),
)
def test_dirichlet_honours_min_partition_size_or_raises_a_clear_error(num_clients, min_size, seed, alpha):
    targets = np.repeat(np.arange(5), 60)
    partitioner = Dirichlet(alpha=alpha, min_partition_size=min_size, max_retries=20)
    try:
        parts = partitioner(targets, num_clients, seed)
    except ConfigError as err:
        message = str(err)
        parts = None
    if parts is None:
        assert "min_partition_size" in message and "alpha" in message
    else:
        assert min(len(p) for p in parts) >= min_size


def test_dirichlet_impossible_minimum_names_the_keys():
    with pytest.raises(ConfigError, match=r"min_partition_size=50 x data.num_clients=10"):
        Dirichlet(alpha=0.5, min_partition_size=50)(np.zeros(100, dtype=int), 10, 0)
    with pytest.raises(ConfigError, match="Raise data.partition.alpha"):
        Dirichlet(alpha=0.001, min_partition_size=20, max_retries=5)(np.repeat(np.arange(10), 30), 10, 0)


def skew(parts, targets, num_classes):
    """Mean total-variation distance between client label distributions and the global one."""
    hist = label_histograms(parts, targets, num_classes).astype(float)
    local = hist / hist.sum(1, keepdims=True)
    glob = np.bincount(targets, minlength=num_classes) / len(targets)
    return 0.5 * np.abs(local - glob).sum(1).mean()


def test_smaller_alpha_gives_more_skew():
    targets = np.repeat(np.arange(10), 300)
    skews = {
        a: np.mean([skew(Dirichlet(alpha=a)(targets, 10, s), targets, 10) for s in range(5)])
        for a in (0.05, 0.5, 5.0, 500.0)
    }
    assert skews[0.05] > skews[0.5] > skews[5.0] > skews[500.0]
    assert skews[500.0] < 0.05 and skews[0.05] > 0.6


def test_shards_give_each_client_few_classes():
    targets = np.repeat(np.arange(10), 100)
    parts = Shards(shards_per_client=2)(targets, 10, 0)
    assert all(len(np.unique(targets[p])) <= 2 for p in parts)


def test_label_histograms_count_each_client():
    targets = np.array([0, 0, 1, 2, 2, 2])
    hist = label_histograms([np.array([0, 3]), np.array([1, 2, 4, 5])], targets, 3)
    assert hist.tolist() == [[1, 0, 1], [1, 1, 2]]


def test_bad_arguments_are_rejected():
    with pytest.raises(ConfigError, match="alpha must be > 0"):
        Dirichlet(alpha=0)
    with pytest.raises(ConfigError, match="num_clients"):
        IID()(np.zeros(5, dtype=int), 6, 0)
    with pytest.raises(ConfigError, match="shards"):
        Shards(3)(np.zeros(5, dtype=int), 2, 0)
