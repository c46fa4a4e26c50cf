"""Differential privacy: the accountant against independent implementations and closed forms, local DP, and
private runs end to end (calibration, the budget stop, resuming the budget, refusals)."""

import math
import re
import sys
import warnings

import numpy as np
import pytest
import torch

from conftest import CONFIGS, make_dm, make_model, make_trainer, run_cli
from lightning_fl.errors import ConfigError
from lightning_fl.privacy import (
    Accountant,
    AdaptiveClipping,
    CentralDP,
    LocalDP,
    RoundEvent,
    clip,
    gaussian_epsilon_closed_form,
    update_noise_multiplier,
)

DELTA = 1e-5


# ------------------------------------------------------------------------------------------ the accountant
@pytest.mark.parametrize("z", [0.8, 2.0, 5.0])
def test_one_unsampled_gaussian_matches_the_exact_curve_of_balle_and_wang(z):
    """q = 1 and one round: PLD accounting is tight, so it meets the analytic Gaussian mechanism's epsilon; RDP
    is an upper bound above it."""
    pld = Accountant(100, 100, "poisson", "pld").epsilon(DELTA, (RoundEvent(z), 1))
    rdp = Accountant(100, 100, "poisson", "rdp").epsilon(DELTA, (RoundEvent(z), 1))
    exact = gaussian_epsilon_closed_form(z, DELTA)
    assert pld == pytest.approx(exact, rel=0.01)
    assert rdp > exact


@pytest.mark.parametrize(("z", "rounds"), [(1.0, 1), (2.0, 300)])
def test_unsampled_rdp_equals_the_closed_form_renyi_curve(z, rounds):
    """RDP of a Gaussian with sensitivity 1 is alpha / (2 z^2) per round; epsilon is its best conversion over the
    orders (Balle et al. 2020, Proposition 12, as dp-accounting converts)."""
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

    a = np.array(DEFAULT_RDP_ORDERS, dtype=float)
    rdp = rounds * a / (2 * z**2)
    eps = rdp + np.log1p(-1 / a) - (np.log(DELTA) + np.log(a)) / (a - 1)
    ours = Accountant(10, 10, "poisson", "rdp").epsilon(DELTA, (RoundEvent(z), rounds))
    assert ours == pytest.approx(float(eps.min()), rel=1e-9)


@pytest.mark.parametrize(("q", "z", "rounds"), [(0.05, 1.0, 200), (0.01, 0.8, 1000), (0.1, 2.0, 50)])
def test_poisson_sampling_matches_opacus_rdp_and_prv_accountants(q, z, rounds):
    from opacus.accountants import PRVAccountant, RDPAccountant

    n = 10_000
    rdp = Accountant(n, q * n, "poisson", "rdp").epsilon(DELTA, (RoundEvent(z), rounds))
    pld = Accountant(n, q * n, "poisson", "pld").epsilon(DELTA, (RoundEvent(z), rounds))
    opacus_rdp, opacus_prv = RDPAccountant(), PRVAccountant()
    opacus_rdp.history = [(z, q, rounds)]
    opacus_prv.history = [(z, q, rounds)]
    assert rdp == pytest.approx(opacus_rdp.get_epsilon(DELTA), rel=0.01)
    assert pld == pytest.approx(opacus_prv.get_epsilon(DELTA), rel=0.01)
    assert pld < rdp  # the tight accountant spends less


@pytest.mark.parametrize("z", [1.0, 2.0, 4.0])
def test_fixed_size_sampling_matches_autodp_and_pays_for_replace_one(z):
    """Sampling m of N without replacement, replace-one neighbours: the clipped sum moves by 2 S, so the
    accountant sees z / 2. Reference: autodp's RDP of the subsampled Gaussian (Wang, Balle, Kasiviswanathan
    2019, Theorem 27, by the paper's authors), converted to epsilon here."""
    from autodp import rdp_acct, rdp_bank

    n, m, rounds = 2000, 100, 100
    ours = Accountant(n, m, "fixed", "rdp").epsilon(DELTA, (RoundEvent(z), rounds))
    acct = rdp_acct.anaRDPacct()
    acct.compose_subsampled_mechanism(lambda a: rdp_bank.RDP_gaussian({"sigma": z / 2}, a), m / n,
                                      improved_bound_flag=True)  # fmt: skip
    acct.build_zeroth_oracle()
    orders = np.arange(2, 257)
    rdp = rounds * np.array([acct.evalRDP(int(a)) for a in orders])
    eps = rdp + np.log1p(-1 / orders) - (np.log(DELTA) + np.log(orders)) / (orders - 1)
    assert ours == pytest.approx(float(eps.min()), rel=0.01)
    poisson = Accountant(n, m, "poisson", "rdp").epsilon(DELTA, (RoundEvent(z), rounds))
    assert ours > poisson  # the stronger neighbouring relation costs more at equal noise


def test_flowers_rdp_accountant_agrees_where_both_apply():
    """Flower 1.42's RdpAccountant takes the multiplier in the accountant's units: ours divides by 2 for
    fixed-size sampling (replace-one), so Flower at z/2 equals ours at z."""
    from flwr.serverapp import GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod

    n, m, z, rounds = 1000, 50, 1.2, 40
    for sampling, method, relation, flower_z in (
        ("poisson", SamplingMethod.POISSON, NeighboringRelation.ADD_OR_REMOVE_ONE, z),
        ("fixed", SamplingMethod.WITHOUT_REPLACEMENT, NeighboringRelation.REPLACE_ONE, z / 2),
    ):
        flower = RdpAccountant(PrivacyConfig(target_delta=DELTA, population_size=n, neighboring_relation=relation,
                                             sampling_method=method))  # fmt: skip
        flower.compose(GaussianPrivacyEvent(noise_multiplier=flower_z, sample_size=m, population_size=n), rounds)
        ours = Accountant(n, m, sampling, "rdp").epsilon(DELTA, (RoundEvent(z), rounds))
        assert ours == pytest.approx(flower.get_epsilon(DELTA), rel=1e-9)


def test_calibration_meets_the_target_and_a_little_less_noise_would_not():
    accountant = Accountant(2000, 100, "poisson", "rdp")
    z = accountant.calibrate(4.0, DELTA, 150)
    assert accountant.epsilon(DELTA, (RoundEvent(z), 150)) == pytest.approx(4.0, rel=1e-3)
    assert accountant.epsilon(DELTA, (RoundEvent(z), 150)) <= 4.0
    assert accountant.epsilon(DELTA, (RoundEvent(0.99 * z), 150)) > 4.0


def test_adaptive_clippings_two_queries_cost_what_one_query_with_z_costs():
    z, count_std = 1.1, 5.0
    z_update = update_noise_multiplier(z, count_std)
    assert z_update**-2 + (2 * count_std) ** -2 == pytest.approx(z**-2, rel=1e-12)  # Andrew et al., Theorem 1
    for sampling, method in (("poisson", "rdp"), ("fixed", "rdp"), ("poisson", "pld")):
        accountant = Accountant(1000, 50, sampling, method)
        both = accountant.epsilon(DELTA, (RoundEvent(z_update, count_std), 30))
        one = accountant.epsilon(DELTA, (RoundEvent(z), 30))
        assert both == pytest.approx(one, rel=1e-9)
    with pytest.raises(ConfigError, match="count_std=0.5 is too small"):
        update_noise_multiplier(1.0, 0.5)


def test_the_accountant_state_round_trips_and_refuses_another_population():
    accountant = Accountant(500, 20, "fixed", "rdp")
    accountant.compose(RoundEvent(1.0), 3)
    accountant.compose(RoundEvent(1.0))
    accountant.compose(RoundEvent(2.0, 1.5))
    copy = Accountant(500, 20, "fixed", "rdp")
    copy.load_state_dict(accountant.state_dict())
    assert copy.num_rounds == 5 and copy.epsilon(DELTA) == accountant.epsilon(DELTA)
    with pytest.raises(ConfigError, match="resume with the same data.num_clients"):
        Accountant(600, 20, "fixed", "rdp").load_state_dict(accountant.state_dict())
    with pytest.raises(ConfigError, match="no event for fixed-size sampling"):
        Accountant(500, 20, "fixed", "pld")


# ------------------------------------------------------------------------------------------ clipping, local DP
def test_clip_scales_to_the_bound_and_says_whether_the_update_was_within():
    out, norm, within = clip(torch.tensor([3.0, 4.0], dtype=torch.float64), 1.0)
    assert out.tolist() == pytest.approx([0.6, 0.8]) and norm == 5.0 and not within
    out, norm, within = clip(torch.tensor([0.3, 0.4], dtype=torch.float64), 1.0)
    assert out.tolist() == [0.3, 0.4] and within
    layers = [slice(0, 2), slice(2, 3)]
    out, _, within = clip(torch.tensor([3.0, 4.0, 0.5], dtype=torch.float64), 2.0, layers)
    each = 2 / math.sqrt(2)
    assert out.tolist() == pytest.approx([0.6 * each, 0.8 * each, 0.5]) and not within


def test_local_dp_clips_then_adds_noise_of_the_calibrated_scale_on_the_client():
    import dp_accounting as dpa

    privacy = LocalDP(clip_norm=0.5, epsilon=2.0, delta=DELTA, noise_seed=0)

    def pld_epsilon(uploads):  # the reference: dp-accounting's tight accountant, sensitivity 2 S, std z S
        accountant = dpa.pld.PLDAccountant()
        accountant.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(privacy.z / 2), uploads))
        return accountant.get_epsilon(DELTA)

    assert pld_epsilon(1) == pytest.approx(2.0, rel=0.01)
    size = 100_000
    global_state = {"w": torch.zeros(size)}
    trained = {"w": torch.zeros(size)}
    trained["w"][0] = 10.0  # norm 10: clipped to 0.5
    sent = privacy.privatize(trained, global_state, client=3, round=1, seed=0)["w"].double()
    noise = sent.clone()
    noise[0] -= 0.5
    std = privacy.z * 0.5
    assert float(noise.std()) == pytest.approx(std, rel=0.01) and abs(float(noise.mean())) < 5 * std / size**0.5
    again = privacy.privatize(trained, global_state, client=3, round=1, seed=0)["w"]
    other = privacy.privatize(trained, global_state, client=4, round=1, seed=0)["w"]
    assert torch.equal(again.double(), sent) and not torch.equal(other.double(), sent)
    assert privacy.end_round(0, [3, 4])["privacy/epsilon"] == pytest.approx(2.0, rel=1e-6)
    two = privacy.end_round(1, [3])["privacy/epsilon"]  # client 3 has uploaded twice: the worst client counts
    assert two == pytest.approx(pld_epsilon(2), rel=0.01) and 2.0 < two < 4.0


def test_a_local_dp_run_uploads_noised_states_and_reports_the_worst_clients_budget(tmp_path):
    trainer = make_trainer(tmp_path, rounds=2, logger=False, privacy=LocalDP(clip_norm=0.1, epsilon=8.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(make_model(), datamodule=make_dm())
    eps = [h["privacy/epsilon"] for h in trainer.history[1:]]
    assert eps[0] == pytest.approx(8.0, rel=0.01) and 8.0 < eps[1] < 16.0  # every client uploaded twice
    assert trainer.local.upload_stage is trainer.privacy


# ------------------------------------------------------------------------------------------ private runs
def fit(trainer, model=None, dm=None, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(model or make_model(), datamodule=dm or make_dm(num_clients=8), **kwargs)
    return trainer


DP_ARGS = {"max_update_norm_ratio": None, "clients_per_round": 4}


@pytest.mark.parametrize("codec", ["int4", "topk_error_feedback"])
def test_central_dp_bounds_the_step_whatever_the_codec_did_and_local_dp_encodes_the_noised_update(tmp_path, codec):
    from lightning_fl.compress import Quantize, TopK

    make_codec = {"int4": lambda: Quantize(bits=4), "topk_error_feedback": lambda: TopK(density=0.5)}[codec]
    bound = 1e-3  # far below the clients' update norms: every update is clipped
    central = fit(make_trainer(tmp_path / "c", rounds=2, logger=False, codec=make_codec(),
                               privacy=CentralDP(clip_norm=bound, noise_multiplier=0.0), **DP_ARGS))  # fmt: skip
    states = [make_model().federated_state()["mapping.latent"], central.global_state["mapping.latent"].cpu()]
    # two rounds, each a mean of at most m = 4 clipped updates over m: the state moved by at most 2 S
    assert 0 < float((states[1] - states[0]).double().norm()) <= 2 * bound * (1 + 1e-6)
    local = fit(make_trainer(tmp_path / "l", rounds=1, logger=False, codec=make_codec(),
                             privacy=LocalDP(clip_norm=0.1, epsilon=4.0), population="local", **DP_ARGS))  # fmt: skip
    assert torch.isfinite(local.global_state["mapping.latent"]).all()
    assert local.history[-1]["privacy/epsilon"] == pytest.approx(4.0, rel=1e-6)


#: What the server computes from the clients' un-noised updates, or the clients log: never a private run's export.
UNPROTECTED = {"train/loss", "train/acc", "fed/update_norm_median", "fed/update_norm_max_ratio", "fed/identity_error"}
UNPROTECTED |= {"fed/dropped_clients", "comm/rejected_bytes", "comm/cum_rejected_bytes"}


def test_a_private_run_keeps_statistics_of_raw_updates_out_of_what_it_exports_unless_asked(tmp_path, capsys):
    """Under CentralDP the server sees the clients' updates in the clear: their logged loss, update norms, the
    averaging identity error and the uploads it refused are computed from them, outside the mechanism. A private
    run keeps them out of its metrics, TensorBoard and checkpoint history (they were in every DP study's CSV);
    trainer.unprotected_statistics logs them as unprotected/<key>, and a run without privacy as before."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def run(name, **kwargs):
        trainer = fit(make_trainer(tmp_path, rounds=2, name=name, **DP_ARGS, **kwargs))
        events = EventAccumulator(str(trainer.log_dir), size_guidance={"scalars": 0})
        events.Reload()
        ckpt = torch.load(trainer.log_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        return trainer.history[-1].keys() | ckpt["history"][-1].keys() | set(events.Tags()["scalars"])

    capsys.readouterr()
    plain = run("plain")
    assert {"train/loss", "fed/update_norm_median", "fed/identity_error", "fed/dropped_clients"} <= plain
    private = run("private", privacy=CentralDP(clip_norm=0.5, noise_multiplier=1.0))
    assert "privacy/epsilon" in private and not private & UNPROTECTED
    assert not any(k.startswith("unprotected/") for k in private) and "unprotected/*" not in capsys.readouterr().out
    labelled = run("labelled", privacy=CentralDP(clip_norm=0.5, noise_multiplier=1.0), unprotected_statistics=True)
    assert not labelled & UNPROTECTED
    assert {f"unprotected/{k}" for k in ("train/loss", "fed/update_norm_median", "fed/identity_error")} <= labelled
    out = capsys.readouterr().out
    assert "unprotected/* holds statistics of the clients' updates outside the privacy guarantee" in out
    with pytest.raises(ConfigError, match=r"trainer.unprotected_statistics labels .* has no trainer.privacy"):
        make_trainer(tmp_path, unprotected_statistics=True)


def test_target_epsilon_is_calibrated_before_round_1_and_spent_by_the_last(tmp_path):
    privacy = CentralDP(clip_norm=0.5, target_epsilon=6.0, delta=1e-4)
    trainer = fit(make_trainer(tmp_path, rounds=3, logger=False, privacy=privacy, **DP_ARGS))
    eps = [h["privacy/epsilon"] for h in trainer.history[1:]]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(6.0, rel=1e-3) and eps[-1] <= 6.0
    other = make_trainer(tmp_path, rounds=4, logger=False, privacy=CentralDP(clip_norm=0.5, target_epsilon=8.0),
                         **DP_ARGS)  # fmt: skip
    with pytest.raises(ConfigError, match="calibrated to trainer.privacy.target_epsilon=6.0, this run asks for 8.0"):
        fit(other, ckpt_path=str(trainer.log_dir / "checkpoints" / "last.ckpt"))


def test_central_dp_accounts_every_round_even_one_without_an_accepted_upload(tmp_path):
    """Every client sends NaN, so the gate drops every upload of every round; each round still releases its noised
    sum, so after round r the run has spent what a fresh accountant says r such rounds spend (4 of 8 clients, z = 1)."""
    from lightning_fl.federated import NaNUpload

    privacy = CentralDP(clip_norm=0.5, noise_multiplier=1.0)
    args = {"rounds": 2, "logger": False, "privacy": privacy, "attack": NaNUpload(list(range(8)))}
    trainer = fit(make_trainer(tmp_path, **args, unprotected_statistics=True, **DP_ARGS))
    rounds = trainer.history[1:]
    assert [(h["fed/clients"], h["unprotected/fed/dropped_clients"]) for h in rounds] == [(4, 4)] * 2  # none in
    fresh = Accountant(num_clients=8, expected_clients=4, sampling="fixed", method="rdp")
    spent = []
    for _ in rounds:
        fresh.compose(RoundEvent(1.0, 0.0))
        spent.append(fresh.epsilon(DELTA))
    assert [h["privacy/epsilon"] for h in rounds] == spent
    assert 0 < spent[0] < spent[1] < math.inf and privacy.accountant.num_rounds == 2


def test_max_epsilon_stops_before_the_round_that_would_exceed_it_and_a_resume_keeps_the_budget(tmp_path, capsys):
    def private(max_epsilon=None):
        return CentralDP(
            clip_norm=0.5,
            noise_multiplier=1.0,
            max_epsilon=max_epsilon,
            adaptive=AdaptiveClipping(count_std=2.0),
            noise_seed=0,
        )

    # (the reference run draws on a population of its own: the runs below are charged for theirs alone)
    full = fit(make_trainer(tmp_path / "a", rounds=4, name="dp", privacy=private(), population="full", **DP_ARGS))
    eps = [h["privacy/epsilon"] for h in full.history[1:]]
    capsys.readouterr()
    limit = (eps[1] + eps[2]) / 2  # allows 2 rounds, not 3
    stopped = fit(make_trainer(tmp_path / "b", rounds=4, name="dp", privacy=private(limit), **DP_ARGS))
    out = capsys.readouterr().out
    assert [h["round"] for h in stopped.history] == [0, 1, 2]
    said = "stopped before round 3: the population's round 3 (counting every run that drew on it) would spend epsilon"
    assert f"{said} {eps[2]:.4g}" in out and "max_epsilon" in out
    ckpt = stopped.log_dir / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["round"] == 2
    again = fit(make_trainer(tmp_path / "b", rounds=4, name="dp", privacy=private(limit), **DP_ARGS),
                ckpt_path=str(ckpt))  # fmt: skip
    assert [h["round"] for h in again.history] == [0, 1, 2]  # the budget carried over: still no round 3
    resumed = fit(make_trainer(tmp_path / "b", rounds=4, name="dp", privacy=private(), **DP_ARGS), ckpt_path=str(ckpt))
    assert [h["privacy/epsilon"] for h in resumed.history[1:]] == eps  # the same budget, continued
    assert [h["privacy/clip_norm"] for h in resumed.history[1:]] == [h["privacy/clip_norm"] for h in full.history[1:]]
    assert torch.equal(resumed.global_state["mapping.latent"], full.global_state["mapping.latent"])  # and noise


def test_a_non_private_checkpoint_does_not_resume_into_a_private_run_nor_the_reverse(tmp_path):
    plain = fit(make_trainer(tmp_path, rounds=1, name="p", **DP_ARGS))
    ckpt = str(plain.log_dir / "checkpoints" / "last.ckpt")
    private = make_trainer(tmp_path, rounds=2, name="p", privacy=CentralDP(noise_multiplier=1.0), **DP_ARGS)
    with pytest.raises(ConfigError, match="a private run cannot continue a non-private one"):
        fit(private, ckpt_path=ckpt)
    dp = fit(make_trainer(tmp_path, rounds=1, name="q", privacy=CentralDP(noise_multiplier=1.0), **DP_ARGS))
    with pytest.raises(Exception, match="written by a private run"):
        fit(
            make_trainer(tmp_path, rounds=2, name="q", **DP_ARGS),
            ckpt_path=str(dp.log_dir / "checkpoints" / "last.ckpt"),
        )


def test_private_runs_from_the_command_line_and_their_refusals(in_tmp, capsys, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    base = ["--config", str(CONFIGS / "quickstart.yaml"), "--trainer.rounds", "1", "--model.pretraining.epochs", "1"]
    dp = ["--trainer.privacy", "CentralDP", "--trainer.privacy.noise_multiplier", "1.0"]
    assert run_cli("fit", *base, *dp, "--trainer.max_update_norm_ratio", "10") == 2  # a ratio the user asked for
    err = capsys.readouterr().err
    assert "set trainer.max_update_norm_ratio null with trainer.privacy CentralDP" in err and len(err.splitlines()) == 2
    assert run_cli("fit", *base, *dp, "--trainer.privacy.target_epsilon", "2") == 2
    assert "exactly one of noise_multiplier and target_epsilon" in capsys.readouterr().err
    # One key turns DP on: the default gate (max_update_norm_ratio auto) is off under CentralDP, and says so.
    adaptive = ["--trainer.privacy.adaptive", "AdaptiveClipping", "--trainer.privacy.adaptive.count_std", "2"]
    ok = [*base, *dp, "--trainer.sampling", "poisson", *adaptive]
    assert run_cli("fit", *ok) == 0
    out = capsys.readouterr().out
    assert "privacy: user-level epsilon" in out and "at delta" in out
    assert "    trust: central, the server clips and noises the sum; neighbours: one client's data added or removed " \
           "(poisson sampling)\n" in out  # fmt: skip
    note = "relative norm gate off (trainer.max_update_norm_ratio auto under trainer.privacy CentralDP)"
    assert f"  {note}: the clip bound bounds every upload instead\n" in out
    config = (in_tmp / "runs" / "quickstart" / "version_0" / "config.yaml").read_text()
    assert "class_path: lightning_fl.privacy.CentralDP" in config and "sampling: poisson" in config


def test_the_default_norm_gate_is_off_under_a_mechanism_that_clips_every_upload(tmp_path, capsys):
    """``max_update_norm_ratio: auto`` (the default) is 10, and off under CentralDP, DistributedDP or secure
    aggregation, whose clip bound bounds every upload: the run equals one with the gate off (null), bit for bit, and
    its summary says why; a ratio the user gives is still refused under CentralDP."""
    from lightning_fl.federated import FederatedTrainer
    from lightning_fl.privacy import DistributedDP
    from lightning_fl.privacy.secure import SecureAggregation

    assert FederatedTrainer().norm_gate_ratio == 10.0 and FederatedTrainer().max_update_norm_ratio == "auto"
    assert FederatedTrainer(max_update_norm_ratio=3.0).norm_gate_ratio == 3.0
    assert FederatedTrainer(privacy=LocalDP(clip_norm=0.1, epsilon=4.0)).norm_gate_ratio == 10.0  # clipped, noised
    assert FederatedTrainer(privacy=CentralDP(noise_multiplier=1.0)).norm_gate_ratio is None
    sum_only = FederatedTrainer(privacy=DistributedDP(noise_multiplier=1.0), secure_aggregation=SecureAggregation())
    assert sum_only.norm_gate_ratio is None
    assert FederatedTrainer(secure_aggregation=SecureAggregation()).norm_gate_ratio is None
    runs = {}
    for ratio in ("auto", None):
        capsys.readouterr()
        privacy = CentralDP(noise_multiplier=1.0, noise_seed=0)
        args = {"rounds": 2, "logger": False, "clients_per_round": 4, "max_update_norm_ratio": ratio}
        runs[ratio] = (
            fit(make_trainer(tmp_path / str(ratio), privacy=privacy, **args)).global_state,
            capsys.readouterr().out,
        )
    assert all(torch.equal(runs["auto"][0][k], runs[None][0][k]) for k in runs[None][0])
    note = "relative norm gate off (trainer.max_update_norm_ratio auto under trainer.privacy CentralDP)"
    assert note in runs["auto"][1] and "relative norm gate" not in runs[None][1]
    ten = make_trainer(
        tmp_path / "ten", privacy=CentralDP(noise_multiplier=1.0), **{**args, "max_update_norm_ratio": 10}
    )
    with pytest.raises(ConfigError, match="set trainer.max_update_norm_ratio null with trainer.privacy CentralDP"):
        fit(ten)


def test_a_mechanism_whose_extra_is_missing_is_refused_when_it_is_made(in_tmp, capsys, monkeypatch):
    """Without the ``privacy`` extra, CentralDP and DP-SGD are refused in one line as they are made: before the CLI
    loads data or pretrains a base (DistributedDP and LocalDP need neither package)."""
    from lightning_fl.privacy import DPSGD, DistributedDP

    monkeypatch.setitem(sys.modules, "opacus", None)  # (importing it raises ImportError; find_spec gives None)
    fix = "pip install 'lightning-fl[privacy]'"
    with pytest.raises(ConfigError, match=re.escape(f"trainer.dp_sgd needs Opacus, which is not installed: {fix}")):
        DPSGD(noise_multiplier=1.0)
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))  # no base cached: it would pretrain first
    base = ["--config", str(CONFIGS / "quickstart.yaml"), "--trainer.rounds", "1", "--model.pretraining.epochs", "1"]
    assert run_cli("fit", *base, "--trainer.dp_sgd", "DPSGD", "--trainer.dp_sgd.noise_multiplier", "1.0") == 2
    out, err = capsys.readouterr()
    assert f"trainer.dp_sgd needs Opacus, which is not installed: {fix}\n" in err
    assert "pretraining" not in (out + err).lower() and not (in_tmp / "cache").exists()
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    message = f"trainer.privacy CentralDP needs Google's dp-accounting, which is not installed: {fix}"
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        CentralDP(target_epsilon=8.0)
    with pytest.raises(ConfigError, match="trainer.dp_sgd needs Google's dp-accounting and Opacus, which are not"):
        DPSGD(noise_multiplier=1.0)
    DistributedDP(noise_multiplier=1.0), LocalDP(clip_norm=0.1, epsilon=4.0)


def test_the_summary_says_what_the_epsilon_protects_and_the_bytes_of_the_clients_that_took_part(tmp_path, capsys):
    """Cross-device runs average the bytes over every client, most never sampled: the summary adds the mean over the
    clients that took part, and under the epsilon the trust model and the accountant's neighbouring relation."""
    from lightning_fl.federated import FedAvg
    from lightning_fl.privacy import DistributedDP, Plan

    capsys.readouterr()
    args = {**DP_ARGS, "clients_per_round": 2}  # of 8 clients
    trainer = fit(make_trainer(tmp_path, rounds=1, logger=False, privacy=LocalDP(clip_norm=0.1, epsilon=4.0), **args))
    out = capsys.readouterr().out.splitlines()
    ledger = torch.load(trainer.log_dir / "checkpoints" / "last.ckpt", weights_only=True)["ledger"]
    sent = (ledger["up"] + ledger["down"])[ledger["down"] > 0]
    assert len(sent) == 2 and sent.double().mean() > trainer.history[-1]["comm/cum_client_bytes"]
    mean = float(sent.double().mean())
    bytes_line = out.index(next(line for line in out if line.startswith("  bytes per client (")))
    assert out[bytes_line + 1] == f"  bytes per client that took part (2 of 8 clients): {mean:,.0f} " \
                                  f"({mean / 2**20:.3f} MiB)"  # fmt: skip
    epsilon = out.index(next(line for line in out if line.startswith("  privacy: user-level epsilon 4 at delta")))
    local = "    trust: local, each client noises its own upload (the server is not trusted); epsilon of the client "
    assert out[epsilon + 1] == local + "that uploaded most; neighbours: one client's data replaced"
    assert out[epsilon + 2] == "    noise from the operating system's secure generator"  # noise_seed null
    every = fit(make_trainer(tmp_path, rounds=1, logger=False, **DP_ARGS, name="every"), dm=make_dm(num_clients=4))
    assert "took part" not in capsys.readouterr().out and every.ledger.took_part()[0] == 4  # every client took part
    for sampling, relation in [("fixed", "one client's data replaced (fixed-size sampling)"),
                               ("poisson", "one client's data added or removed (poisson sampling)")]:  # fmt: skip
        central, shares = CentralDP(noise_multiplier=1.0, noise_seed=2), DistributedDP(noise_multiplier=1.0)
        for privacy in (central, shares):
            privacy.setup(Plan(100, 10.0, sampling, 5, 0, FedAvg()))
        assert central.guarantee() == (
            f"trust: central, the server clips and noises the sum; neighbours: {relation}\nnoise and cohorts seeded "
            "by noise_seed 2 and the run's seed: the guarantee assumes the seeds stay secret (noise_seed null for a "
            "deployment)")  # fmt: skip
        assert shares.guarantee(secure_sum=True) == (
            "trust: distributed, each client adds a share of the noise and the server sees only their sum (secure "
            "aggregation); epsilon of the client whose shares reached most sums, not amplified by sampling (the "
            "server sees who takes part); neighbours: one client's data replaced\nnoise from the operating system's "
            "secure generator")  # whatever the sampling  # fmt: skip
        assert "without secure aggregation the server sees each upload, with 1/sqrt(m) of the noise" in \
               shares.guarantee(secure_sum=False)  # fmt: skip


def test_plan_refusals_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="clip_norm must be a finite number > 0"):
        CentralDP(clip_norm=0, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="target_quantile must be in"):
        AdaptiveClipping(target_quantile=1.5)
    with pytest.raises(ConfigError, match="noise_seed must be an integer"):
        CentralDP(noise_multiplier=1.0, noise_seed=-1)
    with pytest.raises(ConfigError, match="trainer.privacy.delta must be in"):
        LocalDP(epsilon=1.0, delta=0)
    with pytest.raises(ConfigError, match="exactly one of epsilon and noise_multiplier"):
        LocalDP()


# ------------------------------------------------------------------------------------------ distributed DP
def distributed(m=50, sampling="fixed", **kwargs):
    from lightning_fl.federated import FedAvg
    from lightning_fl.privacy import DistributedDP, Plan

    privacy = DistributedDP(**{"clip_norm": 0.7, "noise_multiplier": 1.3, **kwargs})
    privacy.setup(Plan(1000, float(m), sampling, 10, 0, FedAvg()))
    return privacy


def test_distributed_shares_add_up_to_the_central_mechanisms_noise():
    m, size = 50, 20_000
    privacy = distributed(m)
    zero = {"w": torch.zeros(size)}
    shares = torch.stack([privacy.privatize(zero, zero, client=c, round=2, seed=0)["w"].double() for c in range(m)])
    assert float(shares[0].std()) == pytest.approx(1.3 * 0.7 / math.sqrt(m), rel=0.02)  # one share: z S / sqrt(m)
    mean, metrics = privacy.release(shares.sum(0), 0, m, round=2)  # the server: sum / m, no noise of its own
    central = 1.3 * 0.7 / m  # central DP's noise on the mean: N(0, (z S / m)^2)
    assert float(mean.std()) == pytest.approx(central, rel=0.02) and abs(float(mean.mean())) < 5 * central / size**0.5
    assert metrics["privacy/noise_std"] == pytest.approx(central)
    assert float(torch.corrcoef(shares[:2])[0, 1]).__abs__() < 0.05  # clients draw independent shares
    big = {"w": torch.zeros(size)}
    big["w"][:2] = torch.tensor([30.0, 40.0])  # norm 50: clipped to S on the client, before its share is added
    clipped = distributed(m, noise_multiplier=0.0).privatize(big, zero, client=1, round=0, seed=0)["w"].double()
    assert float(clipped.norm()) == pytest.approx(0.7, rel=1e-6)


def test_a_share_for_a_checked_cohort_is_never_smaller_than_the_plans():
    """A client that checked its round's cohort (a Flower node: the nodes of its SecAgg+ round) draws its share for
    ``min(m, cohort)``: more noise for a smaller cohort, never less for a larger one; the plan's share and its
    accounting are left as they were (the copy is the client's own)."""
    privacy = distributed(50)
    plan_std = 1.3 * 0.7 / math.sqrt(50)
    assert privacy.share_std() == pytest.approx(plan_std)
    assert privacy.for_cohort(8).share_std() == pytest.approx(1.3 * 0.7 / math.sqrt(8))
    assert privacy.for_cohort(10**8).share_std() == pytest.approx(plan_std)  # a larger cohort: the plan's share
    assert privacy.share_std() == pytest.approx(plan_std) and privacy.share_cohort is None
    with pytest.raises(ValueError, match="a noise share is for a cohort of at least 1 client, got 0"):
        privacy.for_cohort(0)


def replace_one_gaussians(*multipliers: float, delta: float = 1e-5) -> float:
    """dp-accounting's epsilon of Gaussian mechanisms composed, replace-one neighbours (sensitivity 2: one
    client's clipped update replaced by another), one per multiplier (std / S): the independent reference."""
    import dp_accounting as dpa

    accountant = dpa.pld.PLDAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    for z in multipliers:
        accountant.compose(dpa.GaussianDpEvent(z))
    return accountant.get_epsilon(delta)


def test_distributed_dp_accounts_each_clients_rounds_unamplified_and_reports_the_worst():
    """The server sees who takes part: each round a client's share reaches the sum is an unamplified Gaussian on
    its data, with the noise of the n shares that arrived, ``z sqrt(n / m)``; a client's rounds compose."""
    m, z = 20, 1.3
    privacy = distributed(m, noise_multiplier=z)
    privacy.end_round(0, list(range(m)))  # every share arrived
    privacy.end_round(1, list(range(m // 2)))  # half dropped: clients 0-9 took part with half the noise variance
    metrics = privacy.end_round(2, [])  # nobody: nothing released, nobody spends
    once, twice = replace_one_gaussians(z), replace_one_gaussians(z, z * math.sqrt(0.5))
    assert privacy.client_epsilon(privacy.precision[15]) == pytest.approx(once, rel=2e-3)  # in round 1 only
    assert metrics["privacy/epsilon"] == pytest.approx(twice, rel=2e-3) and twice > once  # clients 0-9: the worst
    assert 99 not in privacy.precision and metrics["privacy/round_noise_multiplier"] == 0.0
    central = CentralDP(clip_norm=0.7, noise_multiplier=z)
    from lightning_fl.federated import FedAvg
    from lightning_fl.privacy import Plan

    central.setup(Plan(1000, float(m), "fixed", 10, 0, FedAvg()))
    for r in range(2):
        central.end_round(r, list(range(m)))
    assert central.epsilon() < once  # amplification by sampling, which a server that sees the cohort defeats


def test_distributed_target_epsilon_is_spent_by_a_client_in_the_expected_number_of_rounds():
    privacy = distributed(m=10, noise_multiplier=None, target_epsilon=3.0)  # N = 1000, 10 rounds: 1 expected
    assert privacy.expected_rounds(privacy.plan) == 1
    metrics = privacy.end_round(0, list(range(10)))
    assert metrics["privacy/epsilon"] == pytest.approx(3.0, rel=1e-6)
    assert replace_one_gaussians(privacy.z) == pytest.approx(3.0, rel=2e-3)
    from lightning_fl.federated import FedAvg
    from lightning_fl.privacy import DistributedDP, Plan

    often = DistributedDP(clip_norm=0.7, target_epsilon=3.0, max_epsilon=5.0)
    often.setup(Plan(40, 10.0, "fixed", 12, 0, FedAvg()))  # 12 rounds x 10 / 40 clients: 3 rounds expected
    for r in range(3):
        metrics = often.end_round(r, list(range(10)))  # client 0 in 3 full rounds: the target
    assert metrics["privacy/epsilon"] == pytest.approx(3.0, rel=1e-6)
    assert replace_one_gaussians(often.z, often.z, often.z) == pytest.approx(3.0, rel=2e-3)
    assert "could spend epsilon 7.03" in often.stop_reason()  # a fourth round with client 0's share alone
    often.min_shares = 10  # a round with any share missing is refused: the stop assumes all 10 arrive
    assert often.stop_reason() is None  # a fourth round: 3.53
    for r in range(3, 7):
        often.end_round(r, [0])  # client 0 alone: one share of 10, far less noise, a large epsilon
    assert often.epsilon() == pytest.approx(replace_one_gaussians(*[often.z] * 3, *[often.z / 10**0.5] * 4), rel=2e-3)
    assert "could spend epsilon" in often.stop_reason() and "max_epsilon=5" in often.stop_reason()


def test_distributed_dp_max_epsilon_holds_when_fewer_shares_arrive_than_expected():
    """The issue's numbers: z = 4, m = 4, cap 5. After three rounds with all four shares a client has spent 3.71;
    the stop used to predict a fourth round with four shares (4.38) and let it run, and one where the client's share
    arrived alone took it to 6.07. Predicting with one share (min_shares 1, the default) stops before it (already
    before the third round: 5.55); with min_shares 4 the stop may assume four shares, and a round with fewer is
    refused, nobody charged."""
    from lightning_fl.federated import FedAvg
    from lightning_fl.privacy import DistributedDP, Plan

    def mechanism(**kwargs):
        privacy = DistributedDP(clip_norm=1.0, noise_multiplier=4.0, max_epsilon=5.0, delta=1e-5, **kwargs)
        privacy.setup(Plan(40, 4.0, "poisson", 100, 0, FedAvg()))
        return privacy

    alone = replace_one_gaussians(4.0, 4.0, 4.0, 4.0 * 0.5)  # three full sums, then one with the share alone
    assert alone == pytest.approx(6.07, abs=0.01)
    privacy = mechanism()
    for r in range(3):
        assert (privacy.stop_reason() is None) == (r < 2), r
        privacy.end_round(r, [0, 1, 2, 3])
    assert privacy.epsilon() == pytest.approx(3.71, abs=0.01)
    why = privacy.stop_reason()
    assert why is not None and "could spend epsilon 6.07" in why and "if the sum carries its share alone" in why
    for arrivals in ([[0]] * 20, [[0, 1, 2, 3], [0], [0, 1], [0]] * 5):  # whatever arrives, the cap holds
        privacy = mechanism()
        for r, participants in enumerate(arrivals):
            if privacy.stop_reason() is not None:
                break
            privacy.end_round(r, participants)
        assert 0 < privacy.epsilon() <= 5.0
    full = mechanism(min_shares=4)
    for r in range(3):
        full.end_round(r, [0, 1, 2, 3])
    assert full.stop_reason() is None  # a fourth full round: 4.38
    assert "carries 1 noise share(s), fewer than trainer.privacy.min_shares=4" in full.refusal(1)
    assert full.refusal(4) is None and full.refusal(0) is None  # (nobody's share: nothing of anyone released)
    with pytest.raises(ConfigError, match=r"trainer.privacy.min_shares=5 is above the 4 clients a round"):
        mechanism(min_shares=5)
    with pytest.raises(ConfigError, match=r"trainer.privacy.min_shares must be an integer >= 1, got 0"):
        DistributedDP(noise_multiplier=1.0, min_shares=0)


def test_a_distributed_dp_run_with_dropouts_stays_within_max_epsilon(tmp_path):
    """Four clients a round, each away with probability 1/2 (seeded): the first rounds' sums carry one share. The
    stop used to assume four shares and let a client reach 6.57 against a cap of 5; now it stops at or below the
    cap, and with min_shares 4 every short round is refused: the state kept, nobody charged."""
    from lightning_fl.privacy import DistributedDP

    def run(name, **kwargs):
        privacy = DistributedDP(clip_norm=0.1, noise_multiplier=4.0, max_epsilon=5.0, **kwargs)
        args = {"rounds": 6, "logger": False, "name": name, "dropout": 0.5, "clients_per_round": 4}
        return fit(make_trainer(tmp_path, max_update_norm_ratio=None, privacy=privacy, **args))

    default = run("default")
    assert 0 < default.privacy.epsilon() <= 5.0 and "its share alone" in default.stopped
    refusing = run("refusing", min_shares=4)
    rounds = refusing.history[1:]
    short = [h for h in rounds if h["privacy/noise_shares"] < 4]
    assert short and all(h["fed/round_skipped"] == 1.0 and h["privacy/round_noise_multiplier"] == 0 for h in short)
    assert refusing.privacy.epsilon() <= 5.0
    released = sum(h["privacy/noise_shares"] for h in rounds if h["fed/round_skipped"] == 0.0)
    assert sum(p / 4.0 for p in refusing.privacy.precision.values()) == pytest.approx(released)  # (mu = 2: 1/4)


def test_a_distributed_dp_run_reports_its_worst_clients_unamplified_epsilon(tmp_path):
    from lightning_fl.privacy import DistributedDP

    args = {
        "rounds": 2,
        "logger": False,
        "clients_per_round": 8,
        **{k: v for k, v in DP_ARGS.items() if k != "clients_per_round"},
    }
    # central DP's budget and the per-client ones do not add up in one ledger: a population each (a comparison)
    dist = fit(make_trainer(tmp_path / "d", privacy=DistributedDP(clip_norm=0.05, noise_multiplier=1.0), **args))
    central = CentralDP(clip_norm=0.05, noise_multiplier=1.0)
    cent = fit(make_trainer(tmp_path / "c", privacy=central, population="c", **args))
    rounds_taken = {c: p / (1.0 / 2) ** -2 for c, p in dist.privacy.precision.items()}  # every share arrived: mu 1/2
    assert sum(rounds_taken.values()) == pytest.approx(2 * 8)  # 8 clients a round, 2 rounds
    most = round(max(rounds_taken.values()))
    assert dist.history[-1]["privacy/epsilon"] == pytest.approx(replace_one_gaussians(*[1.0] * most), rel=2e-3)
    assert cent.history[-1]["privacy/epsilon"] != dist.history[-1]["privacy/epsilon"]  # another accounting
    assert dist.local.upload_stage is dist.privacy
    clean = [fit(make_trainer(tmp_path / name, privacy=kind(clip_norm=0.05, noise_multiplier=0.0), population=name,
                              **args))
             for name, kind in (("d0", DistributedDP), ("c0", CentralDP))]  # fmt: skip
    a, b = (t.global_state["mapping.latent"] for t in clean)  # without noise: clipped on the client or the server
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not torch.equal(dist.global_state["mapping.latent"], a)


def test_a_distributed_dp_checkpoint_of_the_amplified_accounting_does_not_resume():
    privacy = distributed(20)
    with pytest.raises(ConfigError, match="accounted with amplification by sampling"):
        privacy.load_state_dict({"distributed": True, "noise_multiplier": 1.3, "accountant": {}})
    privacy.end_round(0, [1, 2])
    again = distributed(20)
    again.load_state_dict(privacy.state_dict())
    assert again.precision == privacy.precision and again.epsilon() == privacy.epsilon()


# ------------------------------------------------------------------------------------------ the secure source
def test_the_secure_source_draws_standard_gaussians_and_uniforms_from_the_os_not_from_torch():
    from scipy import stats

    from lightning_fl.privacy.base import SeededRandomness, SystemRandomness, randomness

    assert isinstance(randomness(None, 0, 1), SystemRandomness) and isinstance(randomness(7, 0, 1), SeededRandomness)
    source, n = randomness(None, 0, 1), 200_000
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    z, u = source.randn((n,)), source.rand(n, dtype=torch.float64)
    assert torch.equal(torch.random.get_rng_state(), before)  # torch's own generator untouched
    assert z.dtype == torch.float64 and abs(float(z.mean())) < 6 / math.sqrt(n) and abs(float(z.std()) - 1) < 0.01
    assert stats.kstest(z.numpy(), "norm").statistic < 0.01  # (at n = 2e5, 0.01 is far beyond p = 1e-9)
    assert float(u.min()) > 0 and float(u.max()) < 1 and stats.kstest(u.numpy(), "uniform").statistic < 0.01
    assert not torch.equal(source.randn((8,)), source.randn((8,)))  # nothing seeded, nothing repeats
    assert source.normal(2.0, (3, 4), torch.float32).shape == (3, 4) and source.randn(()).shape == ()


@pytest.mark.parametrize("mechanism", ["central", "local", "distributed", "dp_sgd"])
def test_without_a_noise_seed_every_mechanism_draws_its_noise_from_the_os(mechanism, monkeypatch):
    """``noise_seed: null``: the noise (and DP-SGD's record sampling) comes from ``os.urandom``; with a seed it
    does not touch it."""
    import os

    from lightning_fl.federated import FedAvg
    from lightning_fl.privacy import DPSGD, DistributedDP, LocalDP, Plan

    used = []
    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: used.append(n) or real(n))
    for seed in (0, None):
        used.clear()
        zero = {"w": torch.zeros(100)}
        if mechanism == "central":
            privacy = CentralDP(noise_multiplier=1.0, noise_seed=seed)
            privacy.setup(Plan(100, 10.0, "poisson", 5, 0, FedAvg()))
            privacy.release(torch.zeros(100, dtype=torch.float64), 0, 10, 0)
        elif mechanism in ("local", "distributed"):
            privacy = LocalDP(noise_multiplier=1.0, noise_seed=seed) if mechanism == "local" else \
                DistributedDP(noise_multiplier=1.0, noise_seed=seed)  # fmt: skip
            privacy.setup(Plan(100, 10.0, "poisson", 5, 0, FedAvg()))
            privacy.privatize(zero, zero, client=1, round=0, seed=0)
        else:
            sampling, noise = DPSGD(max_grad_norm=1.0, noise_multiplier=1.0, noise_seed=seed).generators(0, 0, 1)
            sampling.rand(50), noise.normal(1.0, (10,), torch.float32)
        assert bool(used) == (seed is None), (mechanism, seed)


def test_dp_sgd_with_the_secure_source_steps_through_opacus_with_noise_of_scale_z_c_over_b():
    """No record drawn: the step is the noise alone, ``N(0, (z C)^2) / B`` per coordinate, from the OS."""
    from lightning_fl.federated.dp_client import dp_optimizer_for
    from lightning_fl.privacy.base import SystemRandomness
    from lightning_fl.privacy.dpsgd import ClientPlan

    p = torch.nn.Parameter(torch.zeros(100_000))
    plan = ClientPlan(records=100, batch_size=4, q=0.04, steps=1, z=1.5)
    optimizer = dp_optimizer_for(torch.optim.SGD([p], lr=1.0), plan, max_grad_norm=2.0, noise=SystemRandomness())
    assert type(optimizer).__name__ == "SecureNoiseDPOptimizer"
    p.grad_sample = torch.zeros((0, *p.shape))
    optimizer.step()
    assert float(p.detach().std()) == pytest.approx(1.5 * 2.0 / 4, rel=0.02) and abs(float(p.mean())) < 0.01


def test_the_planner_assumes_the_trainers_sampling_and_says_so(capsys):
    """``python -m lightning_fl.privacy``: fixed-size sampling by default, as ``trainer.sampling``; its epsilon is the
    trainer's accountant's for the same run; PLD asks for Poisson sampling in one line."""
    from lightning_fl.federated import FedAvg
    from lightning_fl.privacy import Plan
    from lightning_fl.privacy.__main__ import main

    assert main(["--clients", "2000", "--per-round", "100", "--rounds", "5", "--noise-multiplier", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "fixed-size sampling without replacement, replace-one neighbours" in out
    privacy = CentralDP(noise_multiplier=1.0)
    privacy.setup(Plan(2000, 100.0, "fixed", 5, 0, FedAvg()))  # the trainer's default sampling
    for _ in range(5):
        privacy.accountant.compose(privacy.event())  # what end_round composes
    assert f"| 1.0000 | {privacy.epsilon():.4f} |" in out
    assert main(["--clients", "2000", "--per-round", "100", "--rounds", "5", "--epsilon", "4", "--accountant",
                 "pld"]) == 2  # fmt: skip
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["--clients", "2000", "--per-round", "100", "--rounds", "5", "--noise-multiplier", "1.0",
                 "--accountant", "pld", "--sampling", "poisson"]) == 0  # fmt: skip
    assert "Poisson sampling, add/remove-one neighbours" in capsys.readouterr().out


def test_a_run_says_when_it_calibrates_its_noise_and_what_it_found(caplog):
    """Calibrating ``target_epsilon`` searches through the accountant (tens of seconds for 2,000 clients under PLD):
    a private run says so in a line before its first round, and the multiplier it found after."""
    import logging

    from lightning_fl.federated import FedAvg
    from lightning_fl.privacy import DistributedDP, Plan

    caplog.set_level(logging.INFO, logger="lightning_fl")
    privacy = CentralDP(target_epsilon=8.0)
    privacy.setup(Plan(8, 8.0, "fixed", 30, 0, FedAvg()))
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_fl.privacy.central"]
    assert lines[0] == (
        "calibrating the noise multiplier to trainer.privacy.target_epsilon 8 at delta 1e-05 (RDP accounting over 30 "
        "rounds) ..."
    )
    assert re.fullmatch(rf"noise multiplier {privacy.z:.4g}, calibrated in \d+ s", lines[1]) and len(lines) == 2
    caplog.clear()
    DistributedDP(target_epsilon=8.0).setup(Plan(8, 8.0, "fixed", 30, 0, FedAvg()))  # a closed form: no search
    assert not [r for r in caplog.records if r.name == "lightning_fl.privacy.central"]


def test_the_planner_says_on_stderr_which_setting_it_computes_and_that_it_still_is(capsys, monkeypatch):
    """A setting can take a minute: each says when it starts (its place among the settings), then every ``TICK``
    seconds that it is still being computed, and the planner how long they took; the table alone is on stdout."""
    from lightning_fl.privacy import __main__ as planner

    monkeypatch.setattr(planner, "TICK", 1e-4)  # every setting outlasts it
    argv = ["--clients", "200", "--per-round", "20", "--rounds", "5", "--epsilon", "1", "8", "--sampling", "poisson"]
    assert planner.main(argv) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0] == "1/2: computing the noise multiplier for epsilon 1 (RDP accounting over 5 rounds) ..."
    assert "2/2: computing the noise multiplier for epsilon 8 (RDP accounting over 5 rounds) ..." in lines
    assert lines[1].startswith("1/2: still computing the noise multiplier for epsilon 1 (RDP accounting over 5 ")
    assert lines[1].endswith(" s so far") and re.fullmatch(r"planned 2 setting\(s\) in \d+ s", lines[-1])
    assert out.count("\n| ") == 3 and "still" not in out  # the header and two rows
    argv = ["dp-sgd", "--records", "100", "--batch", "10", "--steps", "2", "--rounds", "1", "--noise-multiplier", "1"]
    assert planner.main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith("1/1: computing the epsilon of z = 1 (PLD accounting over 2 steps) ...\n")


@pytest.mark.parametrize("mechanism", ["CentralDP", "DistributedDP", "LocalDP"])
def test_a_delta_not_below_one_over_the_population_is_refused_naming_the_key(mechanism):
    from lightning_fl import privacy as dp
    from lightning_fl.federated import FedAvg
    from lightning_fl.privacy import Plan

    kind = getattr(dp, mechanism)
    with pytest.raises(
        ConfigError, match=r"trainer.privacy.delta=0.001 is not below 1 / 1,000 \(clients\).*below 0.001"
    ):
        kind(noise_multiplier=1.0, delta=1e-3).setup(Plan(1000, 10.0, "fixed", 5, 0, FedAvg()))
    kind(noise_multiplier=1.0, delta=9.9e-4).setup(Plan(1000, 10.0, "fixed", 5, 0, FedAvg()))  # below: fine


def test_a_dp_sgd_delta_not_below_one_over_a_clients_records_is_refused():
    from lightning_fl.federated import LocalTraining
    from lightning_fl.privacy import DPSGD

    dp = DPSGD(max_grad_norm=1.0, noise_multiplier=1.0, delta=1e-2)
    with pytest.raises(ConfigError, match=r"trainer.dp_sgd.delta=0.01 is not below 1 / 100 \(the client's records\)"):
        dp.plan(100, 10, LocalTraining())
    assert dp.plan(99, 10, LocalTraining()).q == pytest.approx(10 / 99)  # 1 / 99 is above delta: fine


def test_upload_policy_raise_is_refused_where_the_server_sees_updates_it_must_protect():
    from lightning_fl.federated import FederatedTrainer
    from lightning_fl.privacy import DistributedDP, LocalDP

    for kind in (CentralDP, DistributedDP):
        with pytest.raises(ConfigError, match=rf"trainer.upload_policy 'raise' with trainer.privacy {kind.__name__}"):
            FederatedTrainer(privacy=kind(noise_multiplier=1.0), upload_policy="raise")
    FederatedTrainer(privacy=LocalDP(noise_multiplier=1.0), upload_policy="raise")  # every upload already private


@pytest.mark.parametrize("mechanism", ["local", "distributed", "dp_sgd", "central"])
def test_under_a_mechanism_that_does_not_trust_the_server_only_the_noised_upload_leaves_a_client(
    tmp_path, monkeypatch, mechanism
):
    """Local DP, distributed DP's shares and DP-SGD: no sample count, no logged loss or accuracy reach the server
    (uploads weigh alike); central DP trusts the server, which gets them as without DP."""
    from lightning_fl.federated import FedAvg, FederatedTrainer, LocalTraining
    from lightning_fl.federated.local import ClientResult
    from lightning_fl.federated.transport import InProcess
    from lightning_fl.privacy import DPSGD, DistributedDP, LocalDP

    kinds = {"local": {"privacy": LocalDP(noise_multiplier=1.0)},
             "central": {"privacy": CentralDP(noise_multiplier=1.0)},
             "distributed": {"privacy": DistributedDP(noise_multiplier=1.0)},
             "dp_sgd": {"dp_sgd": DPSGD(max_grad_norm=1.0, noise_multiplier=1.0)}}  # fmt: skip
    trainer = make_trainer(tmp_path, rounds=1, logger=False, **DP_ARGS, **kinds[mechanism])
    seen = []
    inner = InProcess.replies

    def spy(self, *args, **kwargs):
        for reply in inner(self, *args, **kwargs):
            seen.append(reply)
            yield reply

    monkeypatch.setattr(InProcess, "replies", spy)
    fit(trainer)
    trusted = mechanism == "central"
    assert seen and all((r.num_samples > 0 and bool(r.logged)) == trusted for r in seen)
    assert "train/loss" not in trainer.history[-1]  # (central DP's server gets it, and keeps it out of its logs)
    failed = ClientResult(0, 10, None, {"train/loss": (1e9, 1.0)}, "local training failed: train/loss became inf")
    assert failed.released(LocalTraining(upload_stage=LocalDP(noise_multiplier=1.0)))[2] == (
        "local training failed (details withheld under local privacy)")  # fmt: skip
    if not trusted:  # a strategy weighing by sample counts would need what is withheld
        with pytest.raises(ConfigError, match=r"trainer.strategy weighted: true .* set weighted: false"):
            FederatedTrainer(strategy=FedAvg(weighted=True), **kinds[mechanism])


def neighbour(value: float):
    """The test data with client 0's first record's pixels all ``value``: data sets of two calls differ in that one
    record (the images are made float, so that the record can hold what uint8 cannot). A batch holds a client's 60
    records, so DP-SGD's Poisson rate is 1: every step draws the record."""
    dm = make_dm(augment=False, batch_size=64)
    dm.prepare_data()
    dm.setup("fit")
    images = dm._train.images.float()
    images[int(dm._clients[0][0])] = value
    dm._train.images = images
    return dm


def dp_sgd_classifier():
    """A GroupNorm CNN that Opacus wraps (``auto`` picks the opacus engine; the latent takes torch.func)."""
    from lightning_fl.methods import Classifier, Recipe
    from lightning_fl.models import SmallCNN

    torch.manual_seed(0)
    recipe = Recipe("sgd", 0.05, weight_decay=0.0, warmup_epochs=0, schedule="constant")
    return Classifier(SmallCNN(image_size=8, channels=[8, 16], norm_groups=4), 10, recipe=recipe)


@pytest.mark.parametrize(
    "mechanism", ["local", "local_cohort", "distributed", "dp_sgd_opacus", "dp_sgd_functorch", "dp_sgd_cohort"]
)
def test_a_non_finite_record_is_not_told_apart_by_the_reply_and_is_accounted(tmp_path, monkeypatch, mechanism):
    """Neighbouring data sets: client 0's first record finite in one, NaN in the other. Under a mechanism that does
    not trust the server the reply must not tell them apart: a noised upload every time, nothing else (no failure),
    the same shape; and the client is accounted in both. (A NaN record used to make the client reply "local training
    failed" with no upload, and local DP then left it unaccounted.)"""
    from lightning_fl.federated.transport import InProcess
    from lightning_fl.privacy import DPSGD, DistributedDP, LocalDP

    def kind():
        if mechanism.startswith("local"):
            return {"privacy": LocalDP(clip_norm=0.1, noise_multiplier=1.0)}
        if mechanism == "distributed":
            return {"privacy": DistributedDP(clip_norm=0.1, noise_multiplier=1.0)}
        engine = "opacus" if mechanism == "dp_sgd_opacus" else "functorch"
        return {"dp_sgd": DPSGD(max_grad_norm=1.0, noise_multiplier=1.0, engine=engine)}

    def spent(trainer):
        if trainer.dp_sgd is not None:
            return dict(trainer.dp_sgd.participations), trainer.history[-1]["privacy/record_epsilon_max"]
        counted = getattr(trainer.privacy, "uploads", None) or dict.fromkeys(trainer.privacy.precision, 1)
        return dict(counted), trainer.history[-1]["privacy/epsilon"]

    seen, inner = [], InProcess.replies

    def spy(self, *args, **kwargs):
        for reply in inner(self, *args, **kwargs):
            seen.append(reply)
            yield reply

    monkeypatch.setattr(InProcess, "replies", spy)
    cohort = {"client_batching": "vmap"} if mechanism.endswith("cohort") else {}
    replies, budgets = [], []
    for value in (0.0, math.nan):
        seen.clear()
        model = dp_sgd_classifier() if mechanism == "dp_sgd_opacus" else make_model()
        args = {"rounds": 1, "logger": False, "max_update_norm_ratio": None, "clients_per_round": 4, **cohort}
        trainer = make_trainer(tmp_path / str(value), **args, **kind())
        fit(trainer, model=model, dm=neighbour(value))
        replies.append(
            sorted((r.client, r.payload and r.payload.nbytes, r.failure, r.num_samples, r.logged) for r in seen)
        )
        budgets.append(spent(trainer))
    assert replies[0] == replies[1] and all(size and failure is None for _, size, failure, *_ in replies[1]), replies
    assert budgets[0] == budgets[1] and budgets[1][0] == {0: 1, 1: 1, 2: 1, 3: 1}, budgets


# ------------------------------------------------------------------------------------------ secret cohorts
def test_a_secret_cohort_is_uniform_and_changes_with_every_draw():
    """Seed ``None``: the OS's secure generator. Fixed-size sampling: ``count`` distinct clients, every client as
    often as any other (chi-square over 4,000 draws); Poisson: each client with probability ``q``; two draws at the
    same round and seed differ, where a seeded draw repeats itself."""
    from scipy import stats

    from lightning_fl.federated import FedAvg

    strategy, n = FedAvg(), 10
    cohorts = [strategy.sample(0, n, 3, None) for _ in range(4000)]
    assert all(len(set(c)) == 3 and c == sorted(c) and c[0] >= 0 and c[-1] < n for c in cohorts)
    counts = np.bincount(np.concatenate(cohorts), minlength=n)
    assert stats.chisquare(counts).pvalue > 1e-4 and len({tuple(c) for c in cohorts}) == 120  # every 3 of 10
    sizes = [len(strategy.sample_poisson(0, 1000, 0.05, None)) for _ in range(200)]
    assert abs(np.mean(sizes) - 50) < 4 * math.sqrt(1000 * 0.05 * 0.95 / 200)
    assert strategy.sample(5, n, 3, 7) == strategy.sample(5, n, 3, 7)
    assert len({tuple(strategy.sample_poisson(5, 1000, 0.05, None)) for _ in range(5)}) == 5


@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_central_dp_with_noise_seed_null_draws_its_cohorts_where_no_seed_reveals_them(tmp_path, sampling):
    """Amplification by sampling assumes nobody can tell who was sampled: under CentralDP with ``noise_seed`` null
    (the default) two runs with the same seed sample different clients, and the summary says so; with an integer
    ``noise_seed`` the cohorts are the run seed's (those of a run without DP) and the summary says the guarantee
    assumes the seeds stay secret. DistributedDP is not amplified: its cohorts stay seeded."""
    from lightning_fl.federated.round import RoundRunner
    from lightning_fl.privacy import DistributedDP

    def cohorts(privacy, name):
        drawn, inner = [], RoundRunner.sample

        def spy(self, *args):
            drawn.append(inner(self, *args))
            return drawn[-1]

        RoundRunner.sample = spy
        try:
            trainer = make_trainer(tmp_path, rounds=4, logger=False, name=name, sampling=sampling,
                                   max_update_norm_ratio=None, clients_per_round=2, privacy=privacy,
                                   population=name if privacy is not None else None)  # fmt: skip
            fit(trainer, dm=make_dm(num_clients=12))
        finally:
            RoundRunner.sample = inner
        return drawn, trainer

    seeded, _ = cohorts(None, "plain")
    first, trainer = cohorts(CentralDP(noise_multiplier=1.0), "a")
    second, _ = cohorts(CentralDP(noise_multiplier=1.0), "b")
    assert trainer.round_runner.settings.secret_cohorts and first != second and seeded not in (first, second)
    assert "noise and cohorts from the operating system's secure generator" in trainer.privacy.guarantee()
    pinned, trainer = cohorts(CentralDP(noise_multiplier=1.0, noise_seed=3), "c")
    assert pinned == seeded and not trainer.round_runner.settings.secret_cohorts
    assert ("noise and cohorts seeded by noise_seed 3 and the run's seed: the guarantee assumes the seeds stay "
            "secret") in trainer.privacy.guarantee()  # fmt: skip
    shares, trainer = cohorts(DistributedDP(noise_multiplier=1.0), "d")
    assert shares == seeded and "noise from the operating system's secure generator" in trainer.privacy.guarantee()


def test_a_secret_cohort_is_rank_zeros_on_every_process():
    """Processes draw from their own OS generators: the round trains and folds rank 0's cohort everywhere."""
    from types import SimpleNamespace

    from lightning_fl.federated import FedAvg
    from lightning_fl.federated.round import RoundRunner, RoundSettings

    class TwoProcesses:
        world_size = 2

        def __init__(self):
            self.sent = []

        def broadcast(self, obj, src=0):
            self.sent.append((obj, src))
            return [101, 202]  # what rank 0 drew

    fabric = TwoProcesses()
    runner = SimpleNamespace(fabric=fabric, strategy=FedAvg(), settings=RoundSettings(secret_cohorts=True))
    assert RoundRunner.sample(runner, 0, 10, 2, 0) == [101, 202] and fabric.sent[0][1] == 0
    assert len(fabric.sent[0][0]) == 2
    runner.settings = RoundSettings()
    assert RoundRunner.sample(runner, 0, 10, 2, 0) == FedAvg().sample(0, 10, 2, 0) and len(fabric.sent) == 1
