"""The round as a pipeline: streaming sums, and central DP's clipping, denominator, noise and adaptive bound,
each checked against values computed by hand from uploads the clients are made to send."""

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from helpers import crafted_runner
from lightning_fl.compress import FP32
from lightning_fl.errors import ConfigError
from lightning_fl.federated import FedAdam, FedAvg, FedAvgM, Median, NaNUpload, SignFlip
from lightning_fl.federated.clients.client import LocalTraining
from lightning_fl.federated.clients.transport import InProcess
from lightning_fl.federated.persistence.ledger import ByteLedger
from lightning_fl.federated.server.collect import Uploads
from lightning_fl.federated.server.round import RoundRunner
from lightning_fl.privacy import AdaptiveClipping, CentralDP, Plan

D = 6


def updates(scale=1.0, seed=0):
    """Client ``c``'s update in round ``r``: fixed random vectors of very different sizes (a wide float range)."""

    def update(c, r):
        g = torch.Generator().manual_seed(1000 * seed + 100 * r + c)
        return torch.randn(D, generator=g) * scale * 10.0 ** ((c % 7) - 3)

    return update


def run_rounds(runner, population, rounds=1, state=None, seed=0):
    state = state if state is not None else {"a": torch.zeros(2, 2), "b": torch.ones(2)}  # D = 6
    history = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for r in range(rounds):
            state, metrics = runner.run(None, population, state, r, seed, runner.count)
            history.append(metrics)
    return state, history


def make(update, n, count=None, **kwargs):
    runner, population = crafted_runner(update, n, count=count, **kwargs)
    runner.count = count if count is not None else n
    return runner, population


def flat(state):
    return torch.cat([state[n].reshape(-1) for n in sorted(state)])


def textbook_mean(rows, weights):
    """Today's reference: ``sum_k w_k x_k / sum_k w_k``, float64, rows added one after another in client order."""
    acc, total = torch.zeros(rows.shape[1], dtype=torch.float64), 0.0
    for x, w in zip(rows, weights, strict=True):
        acc += w * x.to(torch.float64)
        total += w
    return acc / total


@pytest.mark.parametrize("weighted", [False, True])
def test_a_streamed_fedavg_round_equals_the_all_rows_mean_bit_for_bit_and_keeps_no_rows(weighted):
    samples = lambda c: 7 + 3 * c
    update = updates()
    streamed, population = make(update, 12, strategy=FedAvg(weighted=weighted), num_samples=samples)
    state, _ = run_rounds(streamed, population, rounds=2)
    assert streamed.kept_rows == 0  # never an (n, D) matrix
    kept, population = make(
        update, 12, strategy=FedAvg(weighted=weighted), num_samples=samples, max_update_norm_ratio=1e30
    )  # a relative gate that refuses nothing
    again, _ = run_rounds(kept, population, rounds=2)
    assert kept.kept_rows == 12
    assert torch.equal(flat(state), flat(again))
    # and both are the reference arithmetic, round by round
    current = flat({"a": torch.zeros(2, 2), "b": torch.ones(2)})
    for r in range(2):
        rows = torch.stack([current + update(c, r) for c in range(12)])
        current = textbook_mean(rows, [float(samples(c)) if weighted else 1.0 for c in range(12)]).float()
    assert torch.equal(flat(state), current)


def test_a_streamed_round_folds_in_client_order_whatever_order_replies_arrive():
    big = torch.tensor([1e20, 0, 0, 0, 0, 0])  # float64 addition is not associative: (1e20 - 1e20) + 1 = 1,
    given = {0: big, 1: -big, 2: big / 1e20}  # but (1 - 1e20) + 1e20 = 0
    update = lambda c, r: given[c]
    ordered, population = make(update, 3)
    shuffled, _ = make(update, 3)
    transport = shuffled.collection.transport
    inner = transport.replies
    transport.replies = lambda *a, **k: reversed(list(inner(*a, **k)))  # the last client answers first
    first = flat(run_rounds(ordered, population)[0])
    assert first[0] == pytest.approx(1 / 3) and torch.equal(first, flat(run_rounds(shuffled, population)[0]))


def grouped_reference(rows, weights, groups):
    """Fold groups by hand: client ``c`` into sum ``c % groups`` in client order, then the sums in group order."""
    parts = {}
    for c, (x, w) in enumerate(zip(rows, weights, strict=True)):
        acc, total = parts.setdefault(c % groups, [torch.zeros(rows.shape[1], dtype=torch.float64), 0.0])
        parts[c % groups] = [acc + w * x.to(torch.float64), total + w]
    acc, total = torch.zeros(rows.shape[1], dtype=torch.float64), 0.0
    for g in sorted(parts):
        acc, total = acc + parts[g][0], total + parts[g][1]
    return acc / total


def test_fold_groups_add_each_group_in_client_order_then_the_groups_in_group_order():
    big = torch.tensor([1e20, 0, 0, 0, 0, 0])
    given = {0: big, 1: -big, 2: big / 1e20}
    one, population = make(lambda c, r: given[c], 3)
    two, _ = make(lambda c, r: given[c], 3, fold_groups=2)
    assert flat(run_rounds(one, population)[0])[0] == pytest.approx(1 / 3)  # ((1e20 - 1e20) + 1) / 3
    assert flat(run_rounds(two, population)[0])[0] == 0.0  # ((1e20 + 1) + -1e20) / 3: group 0, then group 1
    three, _ = make(lambda c, r: given[c], 3, fold_groups=3)
    assert flat(run_rounds(three, population)[0])[0] == pytest.approx(1 / 3)  # groups 0, 1, 2 in that order
    # wide-ranging updates, weighted, 3 groups of 11 clients: the hand fold, streamed and with rows kept
    update, samples = updates(), lambda c: 5 + 2 * c
    streamed, population = make(update, 11, strategy=FedAvg(weighted=True), num_samples=samples, fold_groups=3)
    kept, _ = make(
        update, 11, strategy=FedAvg(weighted=True), num_samples=samples, fold_groups=3, max_update_norm_ratio=1e30
    )
    s_streamed, history = run_rounds(streamed, population)
    s_kept, _ = run_rounds(kept, population)
    current = flat({"a": torch.zeros(2, 2), "b": torch.ones(2)})
    rows = torch.stack([current + update(c, 0) for c in range(11)])
    want = grouped_reference(rows, [float(samples(c)) for c in range(11)], 3).float()
    assert torch.equal(flat(s_streamed), want) and torch.equal(flat(s_kept), want)
    assert history[0]["fed/kept_rows"] == 0 and kept.kept_rows == 11


def test_with_fold_groups_a_process_trains_the_clients_of_its_groups():
    runner, _ = make(updates(), 4, fold_groups=4)
    assert [runner.process_of(c, 2) for c in range(8)] == [c % 2 for c in range(8)]  # 2 divides 4: as before
    runner.collection.fold_groups = 3
    assert [runner.process_of(c, 2) for c in range(6)] == [0, 1, 0, 0, 1, 0]  # group c % 3 on process g % 2
    with pytest.warns(UserWarning, match="fold_groups is 2 but the run has 4 processes"):
        RoundRunner(
            SimpleNamespace(world_size=4), FedAvg(), Uploads(InProcess(), FP32(), LocalTraining(), 2), [], ByteLedger(4)
        )
    from lightning_fl import FederatedTrainer

    for bad in (0, 2.5):
        with pytest.raises(ConfigError, match=f"trainer.fold_groups must be a whole number >= 1, got {bad}"):
            FederatedTrainer(fold_groups=bad)


@pytest.mark.parametrize("strategy", [FedAvgM(momentum=0.5), FedAdam(server_lr=0.1)], ids=["FedAvgM", "FedAdam"])
def test_server_optimisers_stream_and_equal_their_all_rows_result(strategy):
    import copy

    update = updates()
    a, population = make(update, 8, strategy=copy.deepcopy(strategy))
    b, _ = make(update, 8, strategy=copy.deepcopy(strategy), max_update_norm_ratio=1e30)
    sa, _ = run_rounds(a, population, rounds=3)
    sb, _ = run_rounds(b, population, rounds=3)
    assert a.kept_rows == 0 and b.kept_rows == 8 and torch.equal(flat(sa), flat(sb))


def test_a_linear_strategy_reuses_one_rows_buffer_and_a_robust_one_gets_a_new_one_each_round():
    """Rows a linear strategy keeps (here for the relative gate) are folded and never leave the round: one buffer
    serves every round. A robust strategy may return a view of a row as the global state: its rows are new."""
    update = updates()
    kept, population = make(update, 6, max_update_norm_ratio=1e30)
    run_rounds(kept, population)
    buffer = kept.collection._buffer
    run_rounds(kept, population, rounds=3)
    assert buffer is not None and kept.collection._buffer is buffer and kept.kept_rows == 6
    median, population = make(update, 5, strategy=Median())
    one, _ = run_rounds(median, population)
    before = flat(one).clone()
    run_rounds(median, population, state=one)
    assert median.collection._buffer is None and torch.equal(flat(one), before)


def test_robust_strategies_and_per_client_attacks_keep_what_they_need():
    update = updates()
    median, population = make(update, 5, strategy=Median())
    run_rounds(median, population)
    assert median.kept_rows == 5  # the median needs every upload
    attacked, population = make(update, 5, attack=SignFlip([2], scale=3.0))
    clean, _ = make(update, 5)
    s_attacked, history = run_rounds(attacked, population)
    s_clean, _ = run_rounds(clean, population)
    assert attacked.kept_rows == 0 and history[0]["fed/attacked_clients"] == 1  # forged per client, streamed
    current = flat({"a": torch.zeros(2, 2), "b": torch.ones(2)})
    # SignFlip sends current - 3 (x - current): the mean moves by -4/5 of client 2's update
    want = flat(s_clean).double() - 4 / 5 * update(2, 0).float().double()
    assert torch.allclose(flat(s_attacked).double(), want, atol=1e-6) and not torch.equal(current, flat(s_attacked))


def test_a_streamed_round_gates_each_upload_before_folding_it():
    given = {c: torch.full((D,), 0.05 * (c + 1)) for c in range(5)}  # norms 0.12 to 0.61
    given[1] = torch.full((D,), 5.0)  # norm 12.2: above the absolute bound
    runner, population = make(lambda c, r: given[c], 5, max_update_norm=1.0, attack=NaNUpload([3]))
    with pytest.warns(UserWarning, match="upload rejected") as caught:
        state, metrics = runner.run(None, population, {"a": torch.zeros(2, 2), "b": torch.ones(2)}, 0, 0, 5)
    messages = [str(w.message) for w in caught]
    assert any("client 1: upload rejected: update norm 12.25 exceeds trainer.max_update_norm=1" in m for m in messages)
    assert any("client 3: upload rejected: non-finite values" in m for m in messages)
    assert runner.kept_rows == 0 and runner.dropped == [1, 3] and metrics["fed/attacked_clients"] == 1
    want = torch.tensor([0.0, 0, 0, 0, 1, 1]) + (given[0] + given[2] + given[4]) / 3
    assert torch.allclose(flat(state), want, atol=1e-7)


# ------------------------------------------------------------------------------------------ central DP
def test_central_dp_clips_each_update_and_divides_by_the_expected_cohort_not_the_arrivals():
    given = {
        0: torch.tensor([3.0, 4.0, 0, 0, 0, 0]),  # norm 5: scaled to 1 -> (0.6, 0.8)
        1: torch.tensor([0.3, 0.0, 0.4, 0, 0, 0]),  # norm 0.5: kept as it is
        2: torch.tensor([0, 0, 0, 0, 2.0, 0]),  # norm 2: halved
        3: torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),  # fails: uploads nothing
    }
    privacy = CentralDP(clip_norm=1.0, noise_multiplier=0.0)
    runner, population = make(lambda c, r: given[c], 4, privacy=privacy, failing=[3])
    state, (metrics,) = run_rounds(runner, population)
    summed = torch.tensor([0.6 + 0.3, 0.8, 0.4, 0.0, 1.0, 0.0])
    start = torch.tensor([0.0, 0, 0, 0, 1, 1])  # the state's flat layout: a (4 zeros) then b (2 ones)
    assert torch.allclose(flat(state), start + summed / 4, atol=1e-7)  # divided by m = 4, though 3 arrived
    assert runner.kept_rows == 0 and metrics["privacy/clip_norm"] == 1.0


def test_per_layer_clipping_gives_each_tensor_its_share_of_the_bound():
    given = torch.tensor([3.0, 0.0, 0.0, 4.0, 0.1, 0.0])  # tensor a: norm 5; tensor b: norm 0.1
    privacy = CentralDP(clip_norm=1.0, noise_multiplier=0.0, per_layer=True)
    runner, population = make(lambda c, r: given, 1, privacy=privacy)
    state, _ = run_rounds(runner, population)
    each = 1 / math.sqrt(2)  # two tensors share S = 1
    want = torch.tensor([0.6 * each, 0, 0, 0.8 * each, 1.1, 1.0])
    assert torch.allclose(flat(state), want, atol=1e-7)


def test_central_noise_has_the_promised_scale_is_seeded_per_round_and_can_come_from_the_os():
    m, z, bound, size = 50, 1.3, 0.7, 200_000
    privacy = CentralDP(clip_norm=bound, noise_multiplier=z, noise_seed=0)
    privacy.setup(Plan(1000, float(m), "poisson", 10, 0, FedAvg()))
    zero = torch.zeros(size, dtype=torch.float64)
    draws = torch.stack([privacy.release(zero, 0, 0, r)[0] for r in range(3)])
    std = z * bound / m
    for d in draws:  # N(0, (z S / m)^2) per coordinate
        assert abs(float(d.mean())) < 5 * std / math.sqrt(size)
        assert float(d.std()) == pytest.approx(std, rel=0.01)
    assert float(torch.corrcoef(draws)[0, 1]).__abs__() < 0.01  # rounds draw independent noise
    again = CentralDP(clip_norm=bound, noise_multiplier=z, noise_seed=0)
    again.setup(Plan(1000, float(m), "poisson", 10, 0, FedAvg()))
    assert torch.equal(again.release(zero, 0, 0, 1)[0], draws[1])  # reproducible: a resumed run draws the same
    other_run = CentralDP(clip_norm=bound, noise_multiplier=z, noise_seed=0)
    other_run.setup(Plan(1000, float(m), "poisson", 10, 1, FedAvg()))  # another run seed: other noise
    assert not torch.equal(other_run.release(zero, 0, 0, 1)[0], draws[1])
    system = CentralDP(clip_norm=bound, noise_multiplier=z)  # the default: the OS's secure generator
    system.setup(Plan(1000, float(m), "poisson", 10, 0, FedAvg()))
    a, b = system.release(zero, 0, 0, 1)[0], system.release(zero, 0, 0, 1)[0]
    assert not torch.equal(a, b) and float(a.std()) == pytest.approx(std, rel=0.01)


def test_adaptive_clipping_takes_the_papers_geometric_step():
    privacy = CentralDP(clip_norm=1.0, noise_multiplier=0.0, adaptive=AdaptiveClipping(0.5, 0.2, count_std=1.0))
    privacy.setup(Plan(1000, 100.0, "poisson", 10, 0, FedAvg()))
    privacy.release(torch.zeros(3, dtype=torch.float64), unclipped=30, participants=100, round=0)
    # b = (30 - 100/2) / 100 + 1/2 = 0.3;  S <- 1 * exp(-0.2 (0.3 - 0.5))
    assert privacy.bound == pytest.approx(math.exp(0.04), rel=1e-12)
    # 80 of the m = 100 expected clients arrived (Poisson sampling, dropouts): the count is of sum_k (b_k - 1/2), so
    # b = (30 - 80/2) / 100 + 1/2 = 0.4 (as TF Privacy's quantile estimator centres it)
    privacy.release(torch.zeros(3, dtype=torch.float64), unclipped=30, participants=80, round=1)
    assert privacy.bound == pytest.approx(math.exp(0.04) * math.exp(0.02), rel=1e-12)


@pytest.mark.parametrize("quantile", [0.5, 0.9])
def test_adaptive_clipping_tracks_the_target_quantile_of_crafted_norms(quantile):
    n = 50  # client c's update has norm (c + 1) / 50: quantile q of the norms is about q
    norm_of = lambda c: (c + 1) / n
    update = lambda c, r: torch.tensor([norm_of(c), 0, 0, 0, 0, 0])
    privacy = CentralDP(clip_norm=0.05, noise_multiplier=0.0, adaptive=AdaptiveClipping(quantile, 0.2, count_std=1.0))
    runner, population = make(update, n, privacy=privacy, rounds=100)
    state = {"a": torch.zeros(2, 2), "b": torch.ones(2)}
    _, history = run_rounds(runner, population, rounds=100, state=state)
    bounds = [h["privacy/clip_norm"] for h in history]
    assert bounds[0] == 0.05 and bounds[-1] == pytest.approx(quantile, abs=0.03)
    fraction = history[-1]["privacy/unclipped_fraction"]  # measured, not assumed: the share actually kept
    assert fraction == pytest.approx(sum(norm_of(c) <= bounds[-1] for c in range(n)) / n, abs=1e-9)


def test_central_dp_noise_reaches_the_global_state_with_zero_updates():
    privacy = CentralDP(clip_norm=2.0, noise_multiplier=1.0)
    runner, population = make(lambda c, r: torch.zeros(D), 10, count=10, privacy=privacy)
    state, (metrics,) = run_rounds(runner, population)
    moved = flat(state) - torch.tensor([0.0, 0, 0, 0, 1, 1])
    assert metrics["privacy/noise_std"] == pytest.approx(1.0 * 2.0 / 10)
    assert 0 < float(moved.abs().max()) < 6 * metrics["privacy/noise_std"]
    assert metrics["privacy/epsilon"] > 0 and math.isfinite(metrics["privacy/epsilon"])


def test_a_private_round_with_no_upload_still_releases_its_noise():
    privacy = CentralDP(clip_norm=1.0, noise_multiplier=1.0)
    runner, population = make(lambda c, r: torch.zeros(D), 3, privacy=privacy, failing=[0, 1, 2])
    state, (metrics,) = run_rounds(runner, population)
    assert metrics["fed/round_skipped"] == 0 and not torch.equal(flat(state), torch.tensor([0.0, 0, 0, 0, 1, 1]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": FedAvg(weighted=True)}, "trainer.strategy.weighted true"),
        ({"strategy": Median()}, "needs a strategy that steps from the round's mean"),
        ({"max_update_norm_ratio": 100.0}, "set trainer.max_update_norm_ratio null with trainer.privacy CentralDP"),
        ({"strategy": FedAvg(min_clients=3)}, "set trainer.strategy.min_clients 1"),
    ],
    ids=["weighted", "robust", "relative-gate", "min-clients"],
)
def test_combinations_that_void_the_guarantee_are_refused_naming_the_keys(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make(updates(), 4, privacy=CentralDP(noise_multiplier=1.0), **kwargs)


def test_poisson_sampling_draws_each_client_with_the_rate_and_the_accountant_expects_m():
    runner, _ = make(lambda c, r: torch.zeros(D), 400, count=20, sampling="poisson")
    sizes = [len(runner.sample(r, 400, 20, 0)) for r in range(300)]
    assert sum(sizes) / len(sizes) == pytest.approx(20, rel=0.05) and len(set(sizes)) > 5
    assert runner.sample(7, 400, 20, 0) == runner.sample(7, 400, 20, 0) != runner.sample(8, 400, 20, 0)
    privacy = CentralDP(noise_multiplier=1.0)
    make(lambda c, r: torch.zeros(D), 400, count=20, sampling="poisson", privacy=privacy)
    assert privacy.accountant.expected_clients == 20 and privacy.accountant.sampling == "poisson"
