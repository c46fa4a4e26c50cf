import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_fl.data import IID, Dirichlet, Partitioner, Shards, label_histograms
from lightning_fl.data.partition import ClientPartition
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


# ---------------------------------------------------------------- the flat partition against the list-based textbook
def reference_split(partitioner, targets, num_clients, seed):
    """The textbook list-of-chunks algorithms (np.array_split / np.split), which the vectorised ``assign`` of every
    built-in must reproduce sample for sample (it draws the same random numbers in the same order)."""
    rng = np.random.default_rng(seed)
    if isinstance(partitioner, IID):
        parts = np.array_split(rng.permutation(len(targets)), num_clients)
    elif isinstance(partitioner, Shards):
        num_shards = num_clients * partitioner.shards_per_client
        perm = rng.permutation(len(targets))
        shards = np.array_split(perm[np.argsort(targets[perm], kind="stable")], num_shards)
        dealt, spc = rng.permutation(num_shards), partitioner.shards_per_client
        parts = [np.concatenate([shards[s] for s in dealt[k * spc : (k + 1) * spc]]) for k in range(num_clients)]
    else:
        n = len(targets)
        for _ in range(partitioner.max_retries):
            parts, sizes = [[] for _ in range(num_clients)], np.zeros(num_clients, dtype=np.int64)
            for c in np.unique(targets):
                idx = rng.permutation(np.flatnonzero(targets == c))
                p = rng.dirichlet(np.full(num_clients, partitioner.alpha))
                if partitioner.balance:
                    p = p * (sizes < n / num_clients)
                    p = p / p.sum() if p.sum() > 0 else np.full(num_clients, 1.0 / num_clients)
                for k, chunk in enumerate(np.split(idx, (np.cumsum(p) * len(idx)).astype(np.int64)[:-1])):
                    parts[k].append(chunk)
                    sizes[k] += len(chunk)
            if sizes.min() >= partitioner.min_partition_size:
                break
        else:
            return None
        parts = [np.concatenate(p) for p in parts]
    return [np.sort(p) for p in parts]


@settings(max_examples=150, deadline=None)
@given(targets=labels, partitioner=partitioners, num_clients=st.integers(1, 12), seed=st.integers(0, 2**31))
def test_the_flat_partitions_equal_the_list_based_textbook_splits(targets, partitioner, num_clients, seed):
    try:
        reference = reference_split(partitioner, targets, num_clients, seed)
    except ValueError:  # e.g. more shards than samples: the partitioner refuses it by name (tested above)
        return
    if reference is None or any(len(p) == 0 for p in reference):
        with pytest.raises(ConfigError):
            partitioner(targets, num_clients, seed)
        return
    parts = partitioner(targets, num_clients, seed)
    assert isinstance(parts, ClientPartition) and len(parts) == num_clients
    assert all(np.array_equal(a, b) for a, b in zip(parts, reference, strict=True))
    assert label_histograms(parts, targets, 10).tolist() == label_histograms(reference, targets, 10).tolist()


def test_client_partition_is_two_read_only_arrays_indexed_like_a_list():
    parts = ClientPartition.from_owner(np.array([2, 0, 2, 1, 0, 2]), 4)
    assert parts.indices.tolist() == [1, 4, 3, 0, 2, 5] and parts.offsets.tolist() == [0, 2, 3, 6, 6]
    assert [p.tolist() for p in parts] == [[1, 4], [3], [0, 2, 5], []] and parts[-2].tolist() == [0, 2, 5]
    assert [p.tolist() for p in parts[1:3]] == [[3], [0, 2, 5]] and parts.sizes().tolist() == [2, 1, 3, 0]
    assert parts.owners().tolist() == [0, 0, 1, 2, 2, 2]
    assert parts.take(np.array([10, 11, 12, 13, 14, 15]))[0].tolist() == [11, 14]
    with pytest.raises(ValueError, match="read-only"):
        parts[0][0] = 7  # a view: writing to it would move a sample between clients
    with pytest.raises(IndexError, match="client 4"):
        parts[4]
    with pytest.raises(ValueError, match="offsets"):
        ClientPartition(np.arange(3), np.array([0, 2]))


class _ByParity(Partitioner):
    """A user's plug-in written the old way: one index array per client."""

    def __init__(self, broken: str = "") -> None:
        self.broken = broken

    def split(self, targets, num_clients, rng):
        parts = [np.arange(k, len(targets), num_clients) for k in range(num_clients)]
        if self.broken == "overlap":
            parts[1] = np.concatenate([parts[1], parts[0][:1]])
        elif self.broken == "missing":
            parts[0] = parts[0][1:]
        return parts


def test_a_user_partitioner_with_split_only_works_and_a_wrong_one_is_named():
    targets = np.zeros(10, dtype=int)
    assert [p.tolist() for p in _ByParity()(targets, 2, 0)] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert [p.tolist() for p in IID().split(targets, 2, np.random.default_rng(0))] == [
        p.tolist() for p in IID()(targets, 2, 0)
    ]
    with pytest.raises(ConfigError, match="gave a sample to two clients"):
        _ByParity("overlap")(targets, 2, 0)
    with pytest.raises(ConfigError, match=r"did not give each of the 10 samples one client .*\(1 without one\)"):
        _ByParity("missing")(targets, 2, 0)
    with pytest.raises(NotImplementedError, match="must define assign\\(\\) or split\\(\\)"):
        Partitioner()(targets, 2, 0)
