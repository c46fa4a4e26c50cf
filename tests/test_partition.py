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


TARGETS_5X60 = np.repeat(np.arange(5), 60)  # 300 samples, 5 classes


@pytest.mark.parametrize("setting", ["feasible", "unreachable", "too_large"])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), balance=st.booleans(), data=st.data())
def test_dirichlet_honours_min_partition_size_or_raises_a_clear_error(setting, seed, balance, data):
    """Each setting has one right outcome, and each is run.

    - feasible: alpha >= 10 gives each of <= 10 clients about 300 / num_clients >= 30 samples (over 1,000
      seeds, with and without balance, the smallest of 10 clients never held fewer than 17 in one draw), so
      with min size <= 10 it must succeed and honour it;
    - unreachable: alpha = 0.001 hands each of the 5 classes to about one client, yet every one of >= 6
      clients must hold a full equal share (no single draw of 15,000 tried, with or without balance, did):
      it must refuse after its draws, saying what to change;
    - too_large: min size x clients exceeds the samples: refused up front, naming both keys.
    """
    num_clients = data.draw(st.integers(2 if setting == "feasible" else 6, 10), label="num_clients")
    if setting == "feasible":
        alpha = data.draw(st.sampled_from([10.0, 100.0]), label="alpha")
        min_size = data.draw(st.integers(1, 10), label="min_size")
        partitioner = Dirichlet(alpha=alpha, min_partition_size=min_size, balance=balance, max_retries=20)
        parts = partitioner(TARGETS_5X60, num_clients, seed)
        assert len(parts) == num_clients
        assert min(len(p) for p in parts) >= min_size
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(TARGETS_5X60)))
    elif setting == "unreachable":
        min_size = len(TARGETS_5X60) // num_clients  # the total fits, so the up-front check passes
        partitioner = Dirichlet(alpha=0.001, min_partition_size=min_size, balance=balance, max_retries=5)
        with pytest.raises(ConfigError) as err:
            partitioner(TARGETS_5X60, num_clients, seed)
        assert f"{num_clients} clients at least {min_size} samples in 5 draws" in str(err.value)
        fix = "Raise data.partition.alpha, lower data.num_clients, or lower data.partition.min_partition_size."
        assert fix in str(err.value)
    else:
        min_size = len(TARGETS_5X60) // num_clients + 1
        partitioner = Dirichlet(alpha=100.0, min_partition_size=min_size, balance=balance)
        key = rf"data.partition.min_partition_size={min_size} x data.num_clients={num_clients} exceeds"
        with pytest.raises(ConfigError, match=key + r" the 300 client samples; lower one of them"):
            partitioner(TARGETS_5X60, num_clients, seed)


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
