"""Record-level DP-SGD inside clients (trainer.dp_sgd): the Opacus engine equals Opacus used directly, the
torch.func engine equals the Opacus engine, per-record clipping equals hand-computed per-record gradients, the
noise has the stated scale, each client's epsilon equals Opacus' own accountant, and a run logs, reports and
resumes its clients' budgets."""

from __future__ import annotations

import csv
import math
import warnings

import pytest
import torch

from conftest import make_dm, make_model, make_trainer
from lightning_fl.compress import FP32
from lightning_fl.errors import ConfigError
from lightning_fl.federated.clients.client import (
    ClientJob,
    LocalTraining,
    client_loader,
    configure_optimizer,
    run_client,
)
from lightning_fl.privacy import DPSGD
from lightning_fl.privacy.dpsgd import epsilon, noise_multiplier

CLIENT, ROUND, SEED = 1, 0, 0


def classifier(optimizer="adam", lr=1e-3, norm="group"):
    from lightning_fl.methods import Classifier, Recipe
    from lightning_fl.models import SmallCNN

    torch.manual_seed(0)
    backbone = SmallCNN(image_size=8, channels=[8, 16], norm_groups=4)
    if norm == "batch":
        backbone.features[1] = torch.nn.BatchNorm2d(8)
    return Classifier(
        backbone, 10, recipe=Recipe(optimizer, lr, weight_decay=0.0, warmup_epochs=0, schedule="constant")
    )


@pytest.fixture(scope="module")
def dm():
    dm = make_dm(augment=False)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def trained(module, dm, dp, local=None):
    """The client's uploaded state after one round under ``dp`` (``local``: its epochs or steps; the codec is
    lossless), and its result."""
    local = local or LocalTraining(epochs=1)
    local = LocalTraining(local.epochs, local.steps, local.gradient_clip_val, local.upload_stage, dp)
    state = module.federated_state()
    result = run_client(ClientJob(module, dm, state, ROUND, SEED, FP32(), local), CLIENT)
    assert result.failure is None
    return FP32().decode(result.payload, state, CLIENT), result


def client_records(dm):
    """The client's records in its loader's order, transformed as its batches are."""
    loader = client_loader(dm, CLIENT, ROUND, SEED)
    return loader.transform.batch(loader.images[loader.positions]), loader.targets[loader.positions]


def test_the_opacus_engine_equals_opacus_used_directly(dm):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    dp = DPSGD(noise_seed=0, max_grad_norm=0.5, noise_multiplier=1.1, engine="opacus")
    ours, _ = trained(classifier(), dm, dp)
    # Opacus directly: its Poisson loader over the same records with the same generators, its wrappers, Adam
    x, y = client_records(dm)
    plan = dp.client_plan(dm, CLIENT, LocalTraining(epochs=1))
    sampling, noise = (g.generator for g in dp.generators(SEED, ROUND, CLIENT))  # seeded: torch generators
    sampler = UniformWithReplacementSampler(
        num_samples=len(x), sample_rate=plan.q, generator=sampling, steps=plan.steps
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_sampler=sampler)
    module = classifier()
    for m in module.modules():  # Opacus' hooks and in-place activations do not mix
        if hasattr(m, "inplace"):
            m.inplace = False
    model = GradSampleModule(module)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = DPOptimizer(
        torch.optim.Adam(trainable, lr=1e-3),
        noise_multiplier=1.1,
        max_grad_norm=0.5,
        expected_batch_size=plan.batch_size,
        generator=noise,
    )
    for xb, yb in loader:
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()
    theirs = {n: p.detach() for n, p in module.named_parameters()}
    assert plan.steps == 4 and not torch.equal(
        ours["backbone.fc.weight"], classifier().federated_state()["backbone.fc.weight"]
    )
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], rtol=0, atol=1e-6)


def test_the_torch_func_engine_equals_the_opacus_engine(dm):
    a, ra = trained(classifier(), dm, DPSGD(noise_seed=0, max_grad_norm=0.5, noise_multiplier=1.1, engine="opacus"))
    b, rb = trained(classifier(), dm, DPSGD(noise_seed=0, max_grad_norm=0.5, noise_multiplier=1.1, engine="functorch"))
    for name, value in a.items():
        torch.testing.assert_close(value, b[name], rtol=0, atol=1e-6)
    assert ra.logged["train/loss"] == pytest.approx(rb.logged["train/loss"], rel=1e-6)


def test_the_torch_func_engine_is_torch_func_gradients_stepped_by_opacus_dpoptimizer_bit_for_bit(dm):
    """The functorch engine differs from the Opacus engine only in how per-record gradients are obtained: its
    steps equal, bit for bit, Opacus' DPOptimizer (clipping, noise from the same generator, scaling) stepping the
    module's optimiser on torch.func's per-record gradients of the same Poisson batches. A step of its own that
    drifted from DPOptimizer's by one rounding would fail here."""
    from opacus.optimizers import DPOptimizer
    from torch.func import functional_call, grad, vmap

    dp = DPSGD(noise_seed=0, max_grad_norm=0.5, noise_multiplier=1.1, engine="functorch")
    ours, _ = trained(classifier(), dm, dp)
    x, y = client_records(dm)
    plan = dp.client_plan(dm, CLIENT, LocalTraining(epochs=1))
    sampling, noise = (g.generator for g in dp.generators(SEED, ROUND, CLIENT))  # seeded: torch generators
    module = classifier()
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    optimizer = DPOptimizer(
        configure_optimizer(module)[0],
        noise_multiplier=plan.z,
        max_grad_norm=0.5,
        expected_batch_size=plan.batch_size,
        generator=noise,
    )

    def record_loss(params, xi, yi):
        return module.compute_loss(functional_call(module, params, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_record = vmap(grad(record_loss), in_dims=(None, 0, 0))
    for _ in range(plan.steps):
        drawn = (torch.rand(len(x), generator=sampling) < plan.q).nonzero().reshape(-1)
        grads = per_record({n: p.detach() for n, p in trainable.items()}, x[drawn], y[drawn])
        for n, p in trainable.items():
            p.grad_sample = grads[n]
        optimizer.step()
        optimizer.zero_grad()
    assert plan.steps == 4 and set(ours) == set(trainable)
    differ = {
        n: float((v - trainable[n].detach()).abs().max())
        for n, v in ours.items()
        if not torch.equal(v, trainable[n].detach())
    }
    assert not differ, f"max differences from DPOptimizer's steps: {differ}"


def test_auto_picks_opacus_for_standard_layers_and_torch_func_for_the_latent(dm):
    from lightning_fl.federated.clients.dp_client import choose_engine

    dp = DPSGD(noise_multiplier=1.0)
    assert choose_engine(classifier(), dp) == "opacus"
    assert choose_engine(make_model(), dp) == "functorch"
    with pytest.raises(ConfigError, match="trainer.dp_sgd.engine opacus cannot train this model.*LatentMapping"):
        choose_engine(make_model(), DPSGD(noise_multiplier=1.0, engine="opacus"))


def test_either_engine_without_opacus_says_how_to_install_it(monkeypatch):
    import sys

    from lightning_fl.federated.clients.dp_client import choose_engine

    dp = DPSGD(noise_multiplier=1.0, engine="functorch")  # (made without Opacus, it is refused: test_privacy.py)
    monkeypatch.setitem(sys.modules, "opacus", None)  # (import opacus then raises ImportError)
    with pytest.raises(ConfigError, match=r"trainer.dp_sgd needs Opacus: pip install 'lightning-fl\[privacy\]'"):
        choose_engine(make_model(), dp)


@pytest.mark.parametrize("engine", ["opacus", "functorch"])
def test_per_record_clipping_equals_hand_computed_per_record_gradients(dm, engine):
    """One SGD step (lr 1), no noise: the update is minus the sum of the drawn records' gradients, each clipped
    to C, over the expected batch size."""
    C = 0.05  # below every record's gradient norm here, so every record is clipped
    dp = DPSGD(noise_seed=0, max_grad_norm=C, noise_multiplier=0.0, engine=engine)
    module = classifier("sgd", lr=1.0)
    before = module.federated_state()
    after, _ = trained(module, dm, dp, LocalTraining(steps=1, dp_sgd=dp))
    x, y = client_records(dm)
    plan = dp.client_plan(dm, CLIENT, LocalTraining(steps=1))
    sampling = dp.generators(SEED, ROUND, CLIENT)[0].generator
    drawn = (torch.rand(len(x), generator=sampling) < plan.q).nonzero().reshape(-1)
    reference = classifier("sgd", lr=1.0)
    total = {n: torch.zeros_like(p) for n, p in before.items()}
    norms = []
    for i in drawn.tolist():  # one record at a time, plain autograd
        reference.zero_grad()
        torch.nn.functional.cross_entropy(reference(x[i : i + 1]), y[i : i + 1]).backward()
        g = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}
        norm = torch.sqrt(sum((v**2).sum() for v in g.values()))
        norms.append(float(norm))
        for n in total:
            total[n] += g[n] * min(1.0, C / (float(norm) + 1e-6))
    assert len(drawn) > 5 and min(norms) > C
    for n, value in after.items():
        torch.testing.assert_close(before[n] - value, total[n] / plan.batch_size, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("engine", ["opacus", "functorch"])
def test_the_noise_has_standard_deviation_z_c_over_the_expected_batch(dm, engine):
    """One SGD step with and without noise, on the same drawn records: the difference is the noise over B."""
    z, C = 2.0, 0.3
    clean, _ = trained(classifier("sgd", 1.0), dm, DPSGD(C, 0.0, engine=engine), LocalTraining(steps=1))
    noisy, _ = trained(classifier("sgd", 1.0), dm, DPSGD(C, z, engine=engine), LocalTraining(steps=1))
    plan = DPSGD(C, z).client_plan(dm, CLIENT, LocalTraining(steps=1))
    diff = torch.cat([(noisy[n] - clean[n]).reshape(-1) for n in clean]) * plan.batch_size
    assert diff.numel() > 5000
    assert float(diff.std()) == pytest.approx(z * C, rel=0.05)
    assert abs(float(diff.mean())) < 4 * z * C / math.sqrt(diff.numel())


def one_step_epsilon(q: float, z: float, delta: float) -> float:
    """Epsilon of one Poisson-subsampled Gaussian step under replace-one neighbours, by direct integration of its
    privacy profile: the worst pair of outputs is ``P = (1-q) N(0, z^2) + q N(1, z^2)`` against ``Q``, its mirror
    image (one record's clipped gradient ``+C`` replaced by ``-C``, ``C = 1``); ``delta(eps) = int (P - e^eps Q)+``."""
    from scipy import integrate, optimize, stats

    def p(x):
        return (1 - q) * stats.norm.pdf(x, 0, z) + q * stats.norm.pdf(x, 1, z)

    def delta_at(eps):
        return integrate.quad(lambda x: max(0.0, p(x) - math.exp(eps) * p(-x)), -40 * z, 40 * z + 1, limit=400)[0]

    return optimize.brentq(lambda eps: delta_at(eps) - delta, 1e-6, 50, xtol=1e-8)


@pytest.mark.parametrize(("q", "z"), [(0.05, 0.8), (0.25, 1.1), (0.5, 0.7)])
def test_one_subsampled_step_is_accounted_replace_one_as_its_privacy_profile_says(q, z):
    assert epsilon(q, 1, z, 1e-5) == pytest.approx(one_step_epsilon(q, z, 1e-5), rel=2e-3)


@pytest.mark.parametrize(("z", "steps"), [(2.0, 1), (4.0, 10), (3.0, 250)])
def test_without_subsampling_steps_are_one_gaussian_of_twice_the_sensitivity(z, steps):
    """``q = 1``: replacing a record moves the sum by up to ``2C``, and ``k`` compositions are one Gaussian with
    ``sqrt(k)`` times less noise: Balle and Wang's exact curve at ``z / (2 sqrt(k))``."""
    from lightning_fl.privacy.accountant import gaussian_epsilon_closed_form

    want = gaussian_epsilon_closed_form(z / 2 / math.sqrt(steps), 1e-5)
    assert epsilon(1.0, steps, z, 1e-5) == pytest.approx(want, rel=2e-3)


def test_replace_one_spends_more_than_opacus_add_or_remove_on_the_audited_setting():
    """n = 600 records, B = 32, z = 1.1, 500 steps: 11.43 replace-one (the record count is public), where Opacus'
    add/remove-one RDP accountant says 7.44."""
    from opacus.accountants import RDPAccountant

    opacus = RDPAccountant()
    opacus.history = [(1.1, 32 / 600, 500)]
    assert opacus.get_epsilon(1e-5) == pytest.approx(7.44, abs=0.01)
    assert epsilon(32 / 600, 500, 1.1, 1e-5) == pytest.approx(11.43, abs=0.01)


def test_calibration_spends_the_target_under_replace_one_and_needs_more_noise_than_add_or_remove():
    from opacus.accountants.utils import get_noise_multiplier

    z = noise_multiplier(4.0, 1e-5, 0.1, 500)
    assert epsilon(0.1, 500, z, 1e-5) == pytest.approx(4.0, abs=2e-3)
    assert epsilon(0.1, 500, z * 0.98, 1e-5) > 4.0  # no less noise would do
    add_remove = get_noise_multiplier(
        target_epsilon=4.0, target_delta=1e-5, sample_rate=0.1, steps=500, epsilon_tolerance=0.001
    )
    assert z > 1.2 * add_remove


def dp_fit(tmp_path, rounds, version, dp, **kwargs):
    trainer = make_trainer(
        tmp_path, rounds=rounds, name="dp", version=version, clients_per_round=2, dp_sgd=dp, **kwargs
    )
    trainer.fit(make_model(), datamodule=make_dm(num_clients=4))
    return trainer


def test_a_run_logs_each_clients_budget_and_reports_it(tmp_path):
    run = dp_fit(tmp_path, 3, "calibrated", DPSGD(max_grad_norm=1.0, target_epsilon=3.0))
    spent = [h["privacy/record_epsilon_max"] for h in run.history[1:]]
    assert spent == sorted(spent) and 0 < spent[0] < spent[-1] <= 3.0 + 1e-3
    with open(run.log_dir / "dp_sgd_clients.csv") as f:
        rows = list(csv.DictReader(f))
    assert sum(int(r["rounds"]) for r in rows) == 6  # 2 clients in each of 3 rounds
    worst = max(rows, key=lambda r: float(r["epsilon"]))
    assert float(worst["epsilon"]) == pytest.approx(spent[-1], rel=1e-4)
    q, steps, z = float(worst["sample_rate"]), int(worst["steps_per_round"]), float(worst["noise_multiplier"])
    assert float(worst["epsilon"]) == pytest.approx(epsilon(q, steps * int(worst["rounds"]), z, 1e-5), rel=1e-4)
    assert epsilon(q, steps * 3, z, 1e-5) == pytest.approx(3.0, abs=2e-3)  # calibrated for every round


def test_a_resumed_run_continues_its_clients_budgets_exactly(tmp_path):
    whole = dp_fit(tmp_path, 3, "whole", DPSGD(noise_seed=0, max_grad_norm=1.0, noise_multiplier=1.2))
    dp_fit(tmp_path, 2, "part", DPSGD(noise_seed=0, max_grad_norm=1.0, noise_multiplier=1.2))
    resumed = dp_fit(tmp_path, 3, "part", DPSGD(noise_seed=0, max_grad_norm=1.0, noise_multiplier=1.2), resume=True)
    for name, value in whole.global_state.items():
        assert torch.equal(value, resumed.global_state[name])
    assert resumed.dp_sgd.participations == whole.dp_sgd.participations
    assert resumed.history[-1]["privacy/record_epsilon_max"] == whole.history[-1]["privacy/record_epsilon_max"]
    with pytest.raises(ConfigError, match="resume with the same trainer.dp_sgd"):
        dp_fit(tmp_path, 4, "part", DPSGD(noise_seed=0, max_grad_norm=1.0, noise_multiplier=0.9), resume=True)


def test_bad_settings_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of noise_multiplier and target_epsilon"):
        DPSGD()
    with pytest.raises(ConfigError, match="trainer.dp_sgd.max_grad_norm"):
        DPSGD(max_grad_norm=0, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="trainer.dp_sgd.engine"):
        DPSGD(noise_multiplier=1.0, engine="jax")
    with pytest.raises(ConfigError, match="remove trainer.gradient_clip_val"):
        make_trainer(tmp_path, gradient_clip_val=1.0, dp_sgd=DPSGD(noise_multiplier=1.0))


def test_batchnorm_is_refused_with_one_line(dm):
    with pytest.raises(ConfigError, match="BatchNorm2d.*use a GroupNorm model"):
        trained(classifier(norm="batch"), dm, DPSGD(noise_multiplier=1.0))


@pytest.mark.parametrize("model", ["latent", "classifier"])
def test_a_vectorised_cohort_equals_its_clients_trained_one_at_a_time(tmp_path, model):
    """DP-SGD in a vmap cohort (per-record gradients vmapped over records and clients) against one client at a
    time (torch.func for the latent; Opacus for the classifier): equal up to float32 rounding over 2 rounds."""
    make = make_model if model == "latent" else classifier
    dm_args = {"num_clients": 4, "batch_size": 8}

    def fit(batching):
        trainer = make_trainer(
            tmp_path,
            rounds=2,
            name=batching,
            client_batching=batching,
            cohort_size=4,
            dp_sgd=DPSGD(noise_seed=0, max_grad_norm=0.5, noise_multiplier=0.8),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(make(), datamodule=make_dm(**dm_args))
        assert not any("one at a time" in str(w.message) for w in caught)  # the cohort did run as a cohort
        return trainer

    one, cohort = fit("sequential"), fit("vmap")
    start = make().federated_state()
    for name, value in one.global_state.items():
        torch.testing.assert_close(cohort.global_state[name], value, rtol=0, atol=2e-6)
    assert any(not torch.equal(v, start[n]) for n, v in one.global_state.items())
    assert "train/loss" not in cohort.history[-1] and "train/loss" not in one.history[-1]  # withheld from the server
    assert cohort.history[-1]["privacy/record_epsilon_max"] == one.history[-1]["privacy/record_epsilon_max"]


def test_a_cohort_step_in_which_no_client_drew_a_record_is_each_clients_noise_alone():
    """Batch size 1 over 60 records (q = 1/60): clients 0 and 3 both draw nobody at step 0 of round 0, so the cohort's
    first step has no records at all; each client's step is its noise alone, as when it trains by itself."""
    from lightning_fl.federated.clients.client import _cpu_fabric
    from lightning_fl.federated.clients.dp_cohort import run_cohort_dp_sgd

    dm = make_dm(augment=False, batch_size=1)
    dm.setup("fit")
    module, dp = make_model(), DPSGD(noise_seed=0, max_grad_norm=0.5, noise_multiplier=0.8, engine="functorch")
    state, local = module.federated_state(), LocalTraining(steps=6, dp_sgd=dp)
    plan = dp.client_plan(dm, 0, local)
    first = [
        int((torch.rand(plan.records, generator=dp.generators(0, 0, c)[0].generator) < plan.q).sum()) for c in (0, 3)
    ]
    assert first == [0, 0] and plan.records == dm.client_num_samples(3)
    alone = [run_client(ClientJob(module, dm, state, 0, 0, FP32(), local), c) for c in (0, 3)]
    together = run_cohort_dp_sgd(ClientJob(module, dm, state, 0, 0, FP32(), local, _cpu_fabric()), [0, 3])
    for a, b in zip(alone, together, strict=True):
        assert a.failure is None and b.failure is None
        for name, value in FP32().decode(a.payload, state, a.client).items():
            torch.testing.assert_close(FP32().decode(b.payload, state, b.client)[name], value, rtol=0, atol=1e-6)
        assert b.logged["train/loss"] == pytest.approx(a.logged["train/loss"], rel=1e-6)


def test_a_client_whose_noised_steps_diverge_fails_alike_alone_and_in_a_dp_sgd_cohort():
    """The cohort runs the plain cohort's step loop. Under DP-SGD a non-finite loss stops nothing (its records'
    gradients are zeroed); a client whose noised steps blow its state up (learning rate 1e30) fails on the state's
    non-finite values, a function of the noised steps alone, as one at a time. run_cohort itself trains without
    DP-SGD and says which function does."""
    import dataclasses

    from lightning_fl.federated.clients.client import _cpu_fabric
    from lightning_fl.federated.clients.cohort import run_cohort
    from lightning_fl.federated.clients.dp_cohort import run_cohort_dp_sgd
    from lightning_fl.methods import LATENT_RECIPE

    dm = make_dm(augment=False, batch_size=8)
    dm.setup("fit")
    module = make_model(recipe=dataclasses.replace(LATENT_RECIPE, lr=1e30, grad_clip=None))
    dp = DPSGD(max_grad_norm=1e30, noise_multiplier=0.5, engine="functorch")
    state, local, fabric = module.federated_state(), LocalTraining(epochs=3, dp_sgd=dp), _cpu_fabric()
    alone = [run_client(ClientJob(module, dm, state, 0, 0, FP32(), local), c) for c in range(4)]
    together = run_cohort_dp_sgd(ClientJob(module, dm, state, 0, 0, FP32(), local, fabric), list(range(4)))
    failures = [r.failure for r in alone]
    assert all(f == "mapping.latent: non-finite values" for f in failures), failures
    assert [r.failure for r in together] == failures and all(r.payload is None for r in together)
    with pytest.raises(ValueError, match="run_cohort_dp_sgd"):
        run_cohort(ClientJob(module, dm, state, 0, 0, FP32(), local, fabric), [0])


def test_record_level_and_user_level_dp_run_together(tmp_path, capsys):
    from lightning_fl.privacy import CentralDP

    trainer = make_trainer(
        tmp_path,
        rounds=2,
        clients_per_round=2,
        max_update_norm_ratio=None,
        privacy=CentralDP(clip_norm=0.1, noise_multiplier=1.0),
        dp_sgd=DPSGD(max_grad_norm=1.0, noise_multiplier=1.0),
    )
    trainer.fit(make_model(), datamodule=make_dm(num_clients=4))
    last = trainer.history[-1]
    assert 0 < last["privacy/epsilon"] < math.inf and 0 < last["privacy/record_epsilon_max"] < math.inf
    out = capsys.readouterr().out.splitlines()  # the summary: what each epsilon protects, under it
    user = next(i for i, line in enumerate(out) if line.startswith("  privacy: user-level epsilon "))
    assert out[user + 1] == (
        "    trust: central, the server clips and noises the sum; neighbours: one client's data "
        "replaced (fixed-size sampling)"
    )
    record = next(i for i, line in enumerate(out) if line.startswith("  record-level DP-SGD: worst client's epsilon"))
    assert out[record + 1] == (
        "    trust: local, each client runs DP-SGD on its own records (neither the server "
        "nor other clients trusted); neighbours: one record of a client replaced (its record count is public)"
    )


def test_the_planning_command_prints_each_budgets_noise_and_refuses_bad_input(capsys):
    from lightning_fl.privacy.__main__ import main

    assert (
        main(["dp-sgd", "--records", "6750", "--batch", "64", "--steps", "25", "--rounds", "10", "--epsilon", "4"]) == 0
    )
    out = capsys.readouterr().out
    z = noise_multiplier(4.0, 1e-5, 64 / 6750, 250)
    assert f"| {z:.4f} | " in out and "250 steps" in out
    assert main(["dp-sgd", "--records", "0", "--batch", "64", "--steps", "25", "--rounds", "10", "--epsilon", "4"]) == 2
    assert capsys.readouterr().err.strip() == "error: --records must be >= 1, got 0"
