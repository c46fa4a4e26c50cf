"""Server strategies against hand-computed values, their state across rounds, and finiteness on any finite input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lightning_fl.errors import ConfigError
from lightning_fl.federated.server.strategies import (
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedYogi,
    Krum,
    Median,
    TrimmedMean,
    krum_scores,
)


def agg(strategy, uploads, current=None, num_samples=None):
    uploads = torch.tensor(uploads, dtype=torch.float32)
    current = torch.zeros(uploads.shape[1]) if current is None else torch.tensor(current, dtype=torch.float32)
    n = torch.ones(len(uploads), dtype=torch.float64) if num_samples is None else torch.tensor(num_samples).double()
    new, _ = strategy.aggregate(0, current, uploads, n, list(range(len(uploads))))
    assert new.dtype == torch.float64 and new.shape == current.shape
    return new.tolist()


def test_fedavg_unweighted_and_weighted_by_hand():
    ups = [[1.0, 2.0], [3.0, 6.0], [8.0, -2.0]]
    assert agg(FedAvg(), ups) == pytest.approx([4.0, 2.0])
    # weights 1, 2, 1: (1 + 6 + 8) / 4 = 3.75, (2 + 12 - 2) / 4 = 3
    assert agg(FedAvg(weighted=True), ups, num_samples=[1, 2, 1]) == pytest.approx([3.75, 3.0])


def test_a_running_sum_in_chunks_is_the_one_step_fold_bit_for_bit():
    """RunningSum adds FOLD_CHUNK values at a time: the same float64 additions as ``total += w * x.double()``
    over the whole vector, for weights 1 (no multiplication) and others, float32 and float64 uploads."""
    from lightning_fl.federated.server.strategies.base import FOLD_CHUNK, RunningSum

    g = torch.Generator().manual_seed(0)
    size = 2 * FOLD_CHUNK + 5  # three chunks, the last a short one
    acc, want = RunningSum(size), torch.zeros(size, dtype=torch.float64)
    for w, dtype in ((1.0, torch.float32), (60.0, torch.float32), (0.37, torch.float64), (1.0, torch.float64)):
        x = (torch.randn(size, generator=g) * 1e3).to(dtype)
        acc.add(x, w)
        want += w * x.to(torch.float64)
    assert torch.equal(acc.total, want) and acc.weight == 62.37 and acc.count == 4
    with pytest.raises(ValueError, match="shape"):
        acc.add(torch.zeros(1, size))


def test_median_of_three_and_four_vectors_by_hand():
    assert agg(Median(), [[1.0, 5.0, 3.0], [2.0, 0.0, 9.0], [10.0, 4.0, -1.0]]) == [2.0, 4.0, 3.0]
    # even count: mean of the two middle values, as numpy.median
    assert agg(Median(), [[1.0], [2.0], [10.0], [4.0]]) == [3.0]


def test_trimmed_mean_by_hand():
    ups = [[0.0], [1.0], [2.0], [3.0], [100.0]]
    assert agg(TrimmedMean(beta=0.2), ups) == [2.0]  # drop 0 and 100: (1 + 2 + 3) / 3
    assert agg(TrimmedMean(beta=0.0), ups) == [pytest.approx(21.2)]  # nothing trimmed: the mean
    assert agg(TrimmedMean(beta=0.25), [[5.0], [-7.0], [1.0], [3.0]]) == [2.0]  # k=1: (1 + 3) / 2
    assert agg(TrimmedMean(beta=0.3), [[0.0], [1.0], [2.0], [4.0], [100.0]]) == [pytest.approx(7 / 3)]  # floor(1.5)
    with pytest.raises(ConfigError, match="beta"):
        TrimmedMean(beta=0.5)


def test_krum_scores_by_hand_and_honest_cluster_chosen():
    # n=4, f=1: each score is the squared distance to the n - f - 2 = 1 nearest other vector
    ups = torch.tensor([[0.0], [1.0], [3.0], [10.0]])
    assert krum_scores(ups, 1).tolist() == [1.0, 1.0, 4.0, 49.0]
    honest = [[1.0, 1.0], [1.1, 0.9], [0.9, 1.1], [1.0, 1.2], [1.2, 1.0]]
    hostile = [[-20.0, -20.0], [-21.0, -19.0]]  # a colluding pair, far away
    chosen = Krum(num_malicious=2).select(torch.tensor(hostile + honest))
    assert chosen == [2]  # [1, 1]: the most central honest vector
    assert agg(Krum(num_malicious=2), hostile + honest) == [1.0, 1.0]
    # Multi-Krum averages the m best: the honest vectors closest to the centre
    multi = agg(Krum(num_malicious=2, multi=3), hostile + honest)
    assert all(0.8 < v < 1.3 for v in multi)


def test_krum_refuses_too_few_uploads_instead_of_clamping():
    krum = Krum(num_malicious=2, multi=1)
    assert krum.problem(4) is not None and "at least 5" in krum.problem(4)
    assert krum.problem(5) is None
    assert Krum(num_malicious=0, multi=6).problem(5) is not None
    with pytest.raises(ConfigError, match="num_malicious"):
        Krum(num_malicious=-1)


def test_min_clients_is_a_problem_for_every_strategy():
    for strategy in (FedAvg(min_clients=3), Median(min_clients=3), FedAdam(min_clients=3)):
        assert "min_clients=3" in strategy.problem(2)
        assert strategy.problem(3) is None
    with pytest.raises(ConfigError, match="min_clients"):
        FedAvg(min_clients=0)


def test_fedadam_first_two_steps_by_hand():
    eta, tau, b1, b2 = 1.0, 0.1, 0.9, 0.99
    s = FedAdam(server_lr=eta, tau=tau, beta1=b1, beta2=b2)
    # round 1: x = 1, mean upload 2 -> Delta = 1; m = 0.1; v = 0.99 * 0.01 + 0.01 * 1 = 0.0199
    x1 = agg(s, [[1.5], [2.5]], current=[1.0])[0]
    m1, v1 = 0.1, 0.99 * tau**2 + 0.01 * 1.0
    assert x1 == pytest.approx(1.0 + eta * m1 / (math.sqrt(v1) + tau), rel=1e-12)
    # round 2: from x1, mean upload 1 -> Delta = 1 - x1
    x1_32 = float(torch.tensor(x1, dtype=torch.float32))  # the loop hands the strategy a float32 state
    x2 = agg(s, [[1.0], [1.0]], current=[x1_32])[0]
    d2 = 1.0 - x1_32
    m2 = b1 * m1 + (1 - b1) * d2
    v2 = b2 * v1 + (1 - b2) * d2**2
    assert x2 == pytest.approx(x1_32 + eta * m2 / (math.sqrt(v2) + tau), rel=1e-12)
    assert set(s.state_dict()) == {"m", "v"}


def test_fedyogi_and_fedadagrad_steps_by_hand():
    tau = 0.1
    # Yogi: v0 = tau^2 = 0.01 < Delta^2 = 4, so v1 = 0.01 + 0.01 * 4 = 0.05
    y = agg(FedYogi(server_lr=0.5, tau=tau, beta1=0.9, beta2=0.99), [[2.0]], current=[0.0])[0]
    assert y == pytest.approx(0.5 * 0.2 / (math.sqrt(0.05) + tau), rel=1e-12)
    # Adagrad (beta1 = 0): m = Delta = -3, v = 0.01 + 9
    a = agg(FedAdagrad(server_lr=0.5, tau=tau), [[-3.0]], current=[0.0])[0]
    assert a == pytest.approx(0.5 * -3.0 / (math.sqrt(9.01) + tau), rel=1e-12)


def test_fedavgm_momentum_by_hand_and_fedavg_without_it():
    s = FedAvgM(server_lr=0.5, momentum=0.9)
    # g1 = x - mean = 0 - 2 = -2; v1 = -2; x1 = 0 + 0.5 * 2 = 1
    assert agg(s, [[2.0]], current=[0.0]) == [1.0]
    # g2 = 1 - 1 = 0; v2 = 0.9 * -2 + 0 = -1.8; x2 = 1 + 0.9 = 1.9
    assert agg(s, [[1.0]], current=[1.0]) == [pytest.approx(1.9)]
    plain = agg(FedAvgM(server_lr=1.0, momentum=0.0), [[1.0, 3.0], [2.0, 5.0]], current=[7.0, -1.0])
    assert plain == pytest.approx(agg(FedAvg(), [[1.0, 3.0], [2.0, 5.0]]), abs=1e-12)


def test_fedavgm_three_rounds_of_different_pseudo_gradients_by_hand():
    """``v_t = beta v_{t-1} + g_t`` (undampened) over three rounds whose pseudo-gradients are all non-zero and
    different; eta = 1/2, beta = 3/4 and dyadic uploads keep every value exact in float32 and float64."""
    s = FedAvgM(server_lr=0.5, momentum=0.75)
    # round 1: mean [4, 2], g1 = [0, 4] - [4, 2] = [-4, 2] = v1; x1 = [0, 4] - v1 / 2 = [2, 3]
    assert agg(s, [[2.0, 0.0], [6.0, 4.0]], current=[0.0, 4.0]) == [2.0, 3.0]
    # round 2: mean [1, 5], g2 = [1, -2]; v2 = 0.75 [-4, 2] + g2 = [-2, -0.5]; x2 = [2, 3] - v2 / 2 = [3, 3.25]
    # (dampened momentum, v2 = 0.75 v1 + 0.25 g2 = [-2.75, 1], would give [3.375, 2.5])
    assert agg(s, [[0.0, 3.0], [2.0, 7.0]], current=[2.0, 3.0]) == [3.0, 3.25]
    # round 3: mean [4, 1.5], g3 = [-1, 1.75]; v3 = 0.75 [-2, -0.5] + g3 = [-2.5, 1.375]; x3 = [4.25, 2.5625]
    assert agg(s, [[5.0, 1.0], [3.0, 2.0]], current=[3.0, 3.25]) == [4.25, 2.5625]
    assert s.state_dict()["velocity"].tolist() == [-2.5, 1.375]


def test_fedavgm_agrees_with_sgd_momentum_and_flowers_fedavgm_over_five_rounds():
    """Random float64 states and round means: FedAvgM's step is torch's SGD with ``momentum=beta, dampening=0`` on
    the pseudo-gradient, and Flower 1.42's FedAvgM (``server_momentum``) fed the same mean as its one client."""
    eta, beta, rounds, size = 0.7, 0.9, 5, 6
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(size, generator=g, dtype=torch.float64)
    means = [x0 + torch.randn(size, generator=g, dtype=torch.float64) * (r + 1) for r in range(rounds)]
    ours, x = FedAvgM(server_lr=eta, momentum=beta), x0.clone()
    param = x0.clone().requires_grad_(True)
    sgd = torch.optim.SGD([param], lr=eta, momentum=beta, dampening=0.0)
    # by hand, in float64: v = beta v + g, x = x - eta v
    hand, v = x0.clone(), None
    for r, mean in enumerate(means):
        x = ours.step(r, x, mean)[0]
        param.grad = (param.detach() - mean).clone()
        sgd.step()
        grad = hand - mean
        v = grad if v is None else beta * v + grad
        hand = hand - eta * v
        assert torch.equal(x, hand), r
        torch.testing.assert_close(x, param.detach(), rtol=1e-14, atol=1e-14)
    flower = pytest.importorskip("flwr.server.strategy")
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    theirs = flower.FedAvgM(
        server_learning_rate=eta, server_momentum=beta, initial_parameters=ndarrays_to_parameters([x0.numpy()])
    )
    for r, mean in enumerate(means):
        reply = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([mean.numpy()]), num_examples=1, metrics={})
        new, _ = theirs.aggregate_fit(r + 1, [(None, reply)], [])
    assert torch.equal(torch.from_numpy(parameters_to_ndarrays(new)[0]), x)


@pytest.mark.parametrize(
    "make",
    [
        lambda: FedAdam(server_lr=0.3),
        lambda: FedYogi(server_lr=0.3),
        lambda: FedAdagrad(server_lr=0.3),
        lambda: FedAvgM(server_lr=0.7, momentum=0.8),
    ],
)
def test_server_optimiser_state_round_trips(make):
    torch.manual_seed(0)
    rounds = [torch.randn(3, 5) for _ in range(3)]
    current = torch.zeros(5)
    straight = make()
    for r, ups in enumerate(rounds):
        current = straight.aggregate(r, current, ups, torch.ones(3, dtype=torch.float64), [0, 1, 2])[0].float()
    resumed = make()
    current2 = torch.zeros(5)
    for r, ups in enumerate(rounds[:2]):
        current2 = resumed.aggregate(r, current2, ups, torch.ones(3, dtype=torch.float64), [0, 1, 2])[0].float()
    saved = {k: v.clone() for k, v in resumed.state_dict().items()}
    fresh = make()
    fresh.load_state_dict(saved)
    current2 = fresh.aggregate(2, current2, rounds[2], torch.ones(3, dtype=torch.float64), [0, 1, 2])[0].float()
    assert torch.equal(current, current2)


def test_bad_server_optimiser_settings_name_the_key():
    with pytest.raises(ConfigError, match=r"trainer\.strategy\.tau"):
        FedAdam(tau=0.0)
    with pytest.raises(ConfigError, match=r"trainer\.strategy\.beta2"):
        FedYogi(beta2=1.0)
    with pytest.raises(ConfigError, match=r"trainer\.strategy\.momentum"):
        FedAvgM(momentum=1.5)
    with pytest.raises(ValueError, match="stateless"):
        Median().load_state_dict({"m": torch.zeros(1)})


FINITE32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
STRATEGIES = [
    FedAvg,
    lambda: FedAvg(weighted=True),
    FedAvgM,
    FedAdagrad,
    FedAdam,
    FedYogi,
    Median,
    TrimmedMean,
    lambda: Krum(num_malicious=1),
    lambda: Krum(num_malicious=1, multi=2),
]


@settings(max_examples=60, deadline=None)
@given(
    ups=arrays(
        "float32",
        st.tuples(st.integers(4, 7), st.integers(1, 6)),
        elements=st.floats(allow_nan=False, allow_infinity=False, width=32),
    ),
    seed=st.integers(0, 2**16),
)
def test_every_strategy_stays_finite_on_finite_input(ups, seed):
    uploads = torch.from_numpy(ups)
    num_samples = torch.arange(1, len(uploads) + 1, dtype=torch.float64)
    current = torch.from_numpy(ups[seed % len(ups)].copy())
    for make in STRATEGIES:
        strategy = make()
        for r in range(2):  # the second round exercises server optimiser state
            new, _ = strategy.aggregate(r, current, uploads, num_samples, list(range(len(uploads))))
            assert torch.isfinite(new).all(), type(strategy).__name__


@settings(max_examples=40, deadline=None)
@given(ups=arrays("float32", st.tuples(st.integers(3, 6), st.integers(1, 4)), elements=st.floats(-100, 100, width=32)))
def test_robust_aggregates_do_not_depend_on_client_order(ups):
    uploads = torch.from_numpy(ups)
    flipped = uploads.flip(0)
    ones = torch.ones(len(uploads), dtype=torch.float64)
    for strategy in (Median(), TrimmedMean(beta=0.25)):
        a = strategy.aggregate(0, uploads[0], uploads, ones, [])[0]
        b = strategy.aggregate(0, uploads[0], flipped, ones, [])[0]
        assert torch.equal(a, b)


def test_krum_warns_when_a_round_is_too_small_for_its_guarantee():
    """Krum is proven for n >= 2f + 3: a plan below it is warned about (it still runs: its scores are defined for
    n >= f + 3), a plan at it is not."""
    import warnings

    from lightning_fl.federated.trainer.setup import check_plan

    with pytest.warns(UserWarning, match=r"num_malicious=3 is proven to tolerate them only with at least 9 uploads"):
        check_plan(Krum(num_malicious=3), None, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_plan(Krum(num_malicious=3), None, 9, 9)


def _flower_results(uploads: torch.Tensor, num_samples: list[int]):
    """Our ``(n, D)`` uploads as Flower's ``results``: per client two layers (a split of the flat vector), float64."""
    import numpy as np

    split = uploads.shape[1] // 3
    rows = uploads.to(torch.float64).numpy()
    return [([np.array(r[:split]), np.array(r[split:])], int(k)) for r, k in zip(rows, num_samples, strict=True)]


def _flat(layers) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.concatenate([np.ravel(layer) for layer in layers]))


@pytest.mark.parametrize("n", [5, 8, 11])
def test_strategies_agree_with_flowers_aggregation_functions(n):
    """FedAvg (sample-weighted), Median, TrimmedMean and (Multi-)Krum against Flower 1.42's own aggregate,
    aggregate_median, aggregate_trimmed_avg and aggregate_krum on the same random uploads (float64 inside both)."""
    flower = pytest.importorskip("flwr.server.strategy.aggregate")
    g = torch.Generator().manual_seed(n)
    uploads = torch.randn(n, 13, generator=g) * torch.linspace(0.1, 10, 13)
    uploads[: n // 4] += 30.0  # a few outliers, so that trimming and Krum's choice matter
    samples = torch.randint(1, 50, (n,), generator=g).tolist()
    equal = [1] * n
    current = torch.zeros(13)

    def ours(strategy, weights):
        n_samples = torch.tensor(weights, dtype=torch.float64)
        return strategy.aggregate(0, current, uploads, n_samples, list(range(n)))[0]

    torch.testing.assert_close(
        ours(FedAvg(weighted=True), samples),
        _flat(flower.aggregate(_flower_results(uploads, samples))),
        rtol=1e-12,
        atol=1e-12,
    )
    assert torch.equal(ours(Median(), samples), _flat(flower.aggregate_median(_flower_results(uploads, samples))))
    for beta in (0.1, 0.2, 0.3):
        theirs = flower.aggregate_trimmed_avg(_flower_results(uploads, samples), proportiontocut=beta)
        torch.testing.assert_close(ours(TrimmedMean(beta=beta), samples), _flat(theirs), rtol=1e-12, atol=1e-12)
    for f in (1, 2):
        theirs = flower.aggregate_krum(_flower_results(uploads, equal), num_malicious=f, to_keep=0)
        assert torch.equal(ours(Krum(num_malicious=f), equal), _flat(theirs))
        theirs = flower.aggregate_krum(_flower_results(uploads, equal), num_malicious=f, to_keep=3)
        torch.testing.assert_close(ours(Krum(num_malicious=f, multi=3), equal), _flat(theirs), rtol=1e-12, atol=1e-12)
