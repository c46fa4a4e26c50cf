"""The privacy audit: its estimators against closed forms, and canary clients through real private runs."""

import contextlib
import io
import json
import math
import warnings

import numpy as np
import pytest
import torch
from scipy import stats

from conftest import CONFIGS, make_dm, make_model, make_trainer, run_cli
from lightning_fl.errors import ConfigError
from lightning_fl.privacy import DPSGD, CentralDP, LocalDP, PrivacyAudit, gaussian_epsilon_closed_form
from lightning_fl.privacy.audit import (
    audit_lines,
    gaussian_pair_epsilon,
    one_run_ceiling,
    one_run_lower_bound,
    one_run_p_value,
)


# ------------------------------------------------------------------------------------------ the estimators
@pytest.mark.parametrize("z", [0.7, 1.5, 4.0])
def test_two_unit_gaussians_are_as_private_as_the_gaussian_mechanism(z):
    """N(0, 1) against N(1/z, 1) is the Gaussian mechanism of multiplier z: Balle and Wang's exact epsilon; shifted
    and scaled together, the same; two equal Gaussians, 0."""
    exact = gaussian_epsilon_closed_form(z, 1e-5)
    assert gaussian_pair_epsilon(0.0, 1.0, 1 / z, 1.0, 1e-5) == pytest.approx(exact, rel=2e-3)
    assert gaussian_pair_epsilon(3.0, 0.1, 3.0 + 0.1 / z, 0.1, 1e-5) == pytest.approx(exact, rel=2e-3)
    assert gaussian_pair_epsilon(0.0, 1.0, 0.0, 1.0, 1e-5) == 0.0


def test_the_one_run_bound_is_the_binomial_tail_without_delta_and_pays_for_delta():
    """At delta 0 the bound is where P[Binom(r, e^eps / (1 + e^eps)) >= v] reaches 1 - confidence (checked by
    putting it back); a delta makes it smaller; chance-level guessing rules out nothing."""
    m, r, v = 1000, 200, 170
    eps = one_run_lower_bound(m, r, v, 0.0, 0.95)
    p = 1 / (1 + math.exp(-eps))
    assert stats.binom.sf(v - 1, r, p) == pytest.approx(0.05, rel=1e-3)
    assert one_run_p_value(m, r, v, eps, 0.0) == pytest.approx(0.05, rel=1e-3)
    assert 0 < one_run_lower_bound(m, r, v, 1e-5, 0.95) < eps
    assert one_run_lower_bound(m, r, r // 2, 1e-5, 0.95) == 0.0


def test_the_audit_states_the_largest_epsilon_its_guesses_can_show():
    """Steinke et al.'s bound cannot exceed what all guesses right give: 2.55 for the 40 guesses of 200 canaries,
    4.17 for the 200 of 1,000. The report and the summary say so beside the result, and whether the bound could
    contradict the accountant at all."""
    assert one_run_ceiling(200, 40, 1e-5, 0.95) == pytest.approx(2.55, abs=0.005)
    assert one_run_ceiling(1000, 200, 1e-5, 0.95) == pytest.approx(4.17, abs=0.005)
    audit = PrivacyAudit(canaries=200, seed=1)
    audit.setup(64, 1.0)
    audit.rounds, audit.every = 30, torch.from_numpy(np.where(audit.inserted, 1.0, 0.0) + np.linspace(0, 0.1, 200))
    for epsilon, can_fail in ((1.0, True), (110.4, False), (math.inf, False)):
        report = audit.report(epsilon, 1e-5)
        assert report["one_run_correct"] == report["one_run_guesses"] == 40  # every guess right: the ceiling
        assert report["one_run_lower_bound"] == report["one_run_ceiling"] == pytest.approx(2.55, abs=0.005)
        assert report["one_run_can_fail"] is can_fail and (report["violation"] is not None) == can_fail
        power = audit_lines(report)[2]
        assert power.startswith("  the largest epsilon 40 guesses can show is 2.55 (all right): ")
        assert ("lies above it: this bound cannot contradict it" in power) != can_fail


def test_a_confidence_below_one_half_is_refused_and_chance_guesses_bound_nothing():
    """At confidence 1e-6 chance-level guesses (20 of 40 right) used to give a lower bound of 1.5: a "bound" that
    holds with probability one in a million. Below 1/2 the confidence is refused; from 1/2 up chance rules out
    nothing."""
    for confidence in (0.5, 0.8, 0.95, 0.999999):
        assert one_run_lower_bound(200, 40, 20, 1e-5, confidence) == 0.0
    with pytest.raises(ValueError, match=r"confidence must be in \[0.5, 1\), got 1e-06"):
        one_run_lower_bound(200, 40, 20, 1e-5, 1e-6)
    with pytest.raises(
        ConfigError, match=r"trainer.privacy_audit.confidence must be in \[0.5, 1\), e.g. 0.95, got 1e-06"
    ):
        PrivacyAudit(confidence=1e-6)
    with pytest.raises(ConfigError, match=r"trainer.privacy_audit.max_memory_mb must be a finite number > 0, got 0"):
        PrivacyAudit(max_memory_mb=0)


def test_a_negative_audit_seed_is_one_line_from_the_command_line(in_tmp, capsys, monkeypatch):
    """``--trainer.privacy_audit.seed -1`` ended in a traceback from NumPy when the canaries were drawn."""
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    base = ["--config", str(CONFIGS / "quickstart.yaml"), "--trainer.rounds", "1", "--model.pretraining.epochs", "1"]
    dp = ["--trainer.privacy", "CentralDP", "--trainer.privacy.noise_multiplier", "1.0"]
    dp += ["--trainer.max_update_norm_ratio", "null", "--trainer.privacy_audit", "PrivacyAudit"]
    assert run_cli("fit", *base, *dp, "--trainer.privacy_audit.seed", "-1") == 2
    err = capsys.readouterr().err
    assert "trainer.privacy_audit.seed must be an integer >= 0 or null, got -1" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2, err


# ------------------------------------------------------------------------------------------ through a run
def audited(tmp_path, name, privacy, audit=True, rounds=10, ckpt_path=None, **kwargs):
    if isinstance(privacy, DPSGD):  # record-level: the canaries are one client's records
        privacy, kwargs = None, {**kwargs, "dp_sgd": privacy}
    trainer = make_trainer(tmp_path, rounds=rounds, logger=False, name=name, clients_per_round=4,
                           max_update_norm_ratio=None, privacy=privacy,
                           privacy_audit=PrivacyAudit(canaries=100, seed=1) if audit else None, **kwargs)  # fmt: skip
    out = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(out):
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(make_model(latent_dim=1024), datamodule=make_dm(num_clients=8), ckpt_path=ckpt_path)  # D = 3,072
    report = json.loads((trainer.log_dir / "privacy_audit.json").read_text()) if audit else None
    return trainer, report, out.getvalue()


@pytest.mark.parametrize("mechanism", ["central", "dp_sgd"])
def test_without_noise_the_audit_sees_the_canaries(tmp_path, mechanism):
    privacy = {"central": CentralDP(clip_norm=1.0, noise_multiplier=0.0, noise_seed=0),
               "dp_sgd": DPSGD(max_grad_norm=1.0, noise_multiplier=0.0, noise_seed=0)}[mechanism]  # fmt: skip
    _, report, out = audited(tmp_path, "off", privacy)
    assert report["epsilon_hat_every_round"] >= 50 and report["one_run_correct"] == report["one_run_guesses"]
    what = {"central": "canary clients, ", "dp_sgd": "canary records of client "}[mechanism]
    assert report["one_run_lower_bound"] > 1 and f"privacy audit (100 {what}" in out


@pytest.mark.parametrize("mechanism", ["central", "local", "dp_sgd"])
def test_an_honest_mechanism_leaks_less_than_its_accountant_says(tmp_path, mechanism):
    privacy = {"central": CentralDP(clip_norm=1.0, noise_multiplier=5.0, noise_seed=0),
               "local": LocalDP(clip_norm=1.0, noise_multiplier=5.0, noise_seed=0),
               "dp_sgd": DPSGD(max_grad_norm=1.0, noise_multiplier=3.0, noise_seed=0)}[mechanism]  # fmt: skip
    trainer, report, out = audited(tmp_path, mechanism, privacy)
    if mechanism == "dp_sgd":  # the audited client's record-level epsilon
        epsilon = trainer.dp_sgd.client_epsilon(trainer.dp_sgd.canaries.client)
    else:
        epsilon = trainer.privacy.epsilon()
    assert 0 < report["epsilon_hat_every_round"] < report["accountant_epsilon"] == epsilon
    assert report["one_run_lower_bound"] <= report["accountant_epsilon"] and report["violation"] is None
    assert f"the accountant's epsilon {epsilon:.4g} is an upper bound" in out


def test_noise_cut_behind_the_accountants_back_is_caught(tmp_path, monkeypatch):
    """Central DP releasing a tenth of the noise it accounts: the estimate's whole interval lies above the
    accountant's epsilon, and the summary says so."""
    import lightning_fl.privacy.central as central

    real = central.randomness

    class Tenth:
        def __init__(self, g):
            self.g = g

        def randn(self, *args, **kwargs):
            return self.g.randn(*args, **kwargs) / 10

    monkeypatch.setattr(central, "randomness", lambda *a, **k: Tenth(real(*a, **k)))
    trainer, report, out = audited(tmp_path, "broken", CentralDP(clip_norm=1.0, noise_multiplier=5.0, noise_seed=0))
    assert report["interval_every_round"][0] > report["accountant_epsilon"] == trainer.privacy.epsilon() < 10
    assert "warning: the estimate's whole interval lies above the accountant's epsilon" in out


def test_the_canaries_never_reach_the_model(tmp_path):
    """With the audit and without: the same global state, bit for bit (its draws are its own)."""
    privacy = {"clip_norm": 1.0, "noise_multiplier": 2.0, "noise_seed": 0}
    with_audit, _, _ = audited(tmp_path, "with", CentralDP(**privacy))
    without, _, _ = audited(tmp_path, "without", CentralDP(**privacy), audit=False)
    for name, t in without.global_state.items():
        assert torch.equal(t, with_audit.global_state[name]), name
    local = {"clip_norm": 1.0, "noise_multiplier": 2.0, "noise_seed": 0}
    with_audit, _, _ = audited(tmp_path, "lwith", LocalDP(**local), population="local")  # (not central DP's ledger)
    without, _, _ = audited(tmp_path, "lwithout", LocalDP(**local), audit=False, population="local")
    assert all(torch.equal(t, with_audit.global_state[n]) for n, t in without.global_state.items())
    record = {"max_grad_norm": 1.0, "noise_multiplier": 2.0, "noise_seed": 0}
    with_audit, _, _ = audited(tmp_path, "rwith", DPSGD(**record))
    without, _, _ = audited(tmp_path, "rwithout", DPSGD(**record), audit=False)
    assert all(torch.equal(t, with_audit.global_state[n]) for n, t in without.global_state.items())


def test_what_the_audit_cannot_do_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="trainer.privacy_audit audits trainer.privacy or trainer.dp_sgd: set one"):
        make_trainer(tmp_path, privacy_audit=PrivacyAudit())
    with pytest.raises(ConfigError, match="scores each step of one client trained alone: set trainer.client_batching"):
        make_trainer(tmp_path, privacy_audit=PrivacyAudit(), dp_sgd=DPSGD(noise_multiplier=1.0), client_batching="vmap")
    with pytest.raises(ConfigError, match="trainer.privacy_audit.canaries must be an integer >= 10"):
        PrivacyAudit(canaries=3)
    run, _, _ = audited(tmp_path, "once", CentralDP(clip_norm=1.0, noise_multiplier=2.0), rounds=2)
    last = str(run.log_dir / "checkpoints" / "last.ckpt")
    with pytest.raises(ConfigError, match="trainer.privacy_audit covers one uninterrupted run"):
        audited(tmp_path, "once", CentralDP(clip_norm=1.0, noise_multiplier=2.0), ckpt_path=last)
    big = PrivacyAudit(canaries=1000, max_memory_mb=1)
    with pytest.raises(ConfigError, match=r"1000 canaries of 3,072 numbers take 12 MiB, more than max_memory_mb=1"):
        big.setup(3072, 0.5)
    assert np.isfinite(PrivacyAudit(canaries=10).confidence)
