"""Vectorised cohorts (trainer.client_batching: vmap): clients of a latent method trained together equal the same
clients trained one at a time, up to float32 rounding; what cannot be vectorised trains one at a time."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from conftest import make_dm, make_model, make_trainer
from lightning_fl.compress import TopK
from lightning_fl.data import Dirichlet
from lightning_fl.federated.clients.client import ClientJob, LocalTraining, _cpu_fabric, run_client
from lightning_fl.federated.clients.cohort import cohort_problem, run_cohort
from lightning_fl.methods import LATENT_RECIPE

# Stated tolerance: after 3 rounds the latents of cohort and sequential runs differ by at most 1e-5 (float32
# rounding of the batched products; measured about 1e-7 after one round).
ATOL = 1e-5


def fit(tmp_path, name, batching, rounds=3, model=None, dm=None, **kwargs):
    trainer = make_trainer(tmp_path, rounds=rounds, name=name, client_batching=batching, cohort_size=8, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(
            model if model is not None else make_model(),
            datamodule=dm if dm is not None else make_dm(num_clients=8, batch_size=8),
        )
    trainer.caught = [str(w.message) for w in caught]
    return trainer


def assert_same_run(a, b, atol=ATOL):
    for name, value in a.global_state.items():
        torch.testing.assert_close(value, b.global_state[name], rtol=0, atol=atol)
    assert torch.equal(a.ledger.up, b.ledger.up) and torch.equal(a.ledger.down, b.ledger.down)
    assert [h["round"] for h in a.history] == [h["round"] for h in b.history]
    for ha, hb in zip(a.history[1:], b.history[1:], strict=True):  # round 0 is the starting model
        assert ha["train/loss"] == pytest.approx(hb["train/loss"], rel=1e-5)
        assert ha["train/acc"] == pytest.approx(hb["train/acc"], abs=1e-9)


def quickstart_model(factors="stored", layers="conv+linear"):
    """configs/quickstart.yaml's model (from a random base instead of the pretrained one)."""
    from lightning_fl.methods import LatentClassifier
    from lightning_fl.models import SmallCNN

    torch.manual_seed(0)
    backbone = SmallCNN(in_channels=1, image_size=8, channels=[32, 64], feature_dim=128, norm_groups=8)
    return LatentClassifier(backbone, 10, base="scratch", latent_dim=64, rank=32, layers=layers, factors=factors)


def test_a_cohort_of_8_clients_equals_8_clients_one_at_a_time_over_3_rounds(tmp_path):
    sequential = fit(tmp_path, "seq", "sequential", model=quickstart_model())
    cohort = fit(tmp_path, "vmap", "vmap", model=quickstart_model())
    assert not any("one at a time" in w for w in cohort.caught)
    assert_same_run(sequential, cohort)
    assert not torch.equal(
        sequential.global_state["mapping.latent"], torch.zeros_like(cohort.global_state["mapping.latent"])
    )
    again = fit(tmp_path, "vmap_again", "vmap", model=quickstart_model())  # deterministic given the seed
    assert torch.equal(cohort.global_state["mapping.latent"], again.global_state["mapping.latent"])


@pytest.mark.parametrize(("factors", "layers"), [("kronecker", "conv+linear"), ("two_sided", "linear")])
def test_structured_factors_train_in_cohorts_as_one_at_a_time(tmp_path, factors, layers):
    sequential = fit(tmp_path, "seq", "sequential", rounds=2, model=quickstart_model(factors, layers))
    cohort = fit(tmp_path, "vmap", "vmap", rounds=2, model=quickstart_model(factors, layers))
    assert not any("one at a time" in w for w in cohort.caught)
    assert_same_run(sequential, cohort)


@pytest.mark.parametrize(
    ("model_args", "trainer_args"),
    [
        ({"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}, {"local_steps": 5}),
        ({"grad_clip": 0.05}, {"local_epochs": 2}),  # the rest of FLITE's recipe (Adam) as it is
    ],
    ids=["sgd_momentum_local_steps", "clipping_two_epochs"],
)
def test_unequal_clients_sgd_steps_and_clipping_equal_sequential(tmp_path, model_args, trainer_args):
    """Dirichlet clients of unequal sizes: their last batches differ in size, so each step runs in groups."""
    dm = lambda: make_dm(num_clients=8, batch_size=8, partition=Dirichlet(alpha=0.5, min_partition_size=5))
    recipe = dataclasses.replace(LATENT_RECIPE, **model_args)
    sequential = fit(tmp_path, "seq", "sequential", model=make_model(recipe=recipe), dm=dm(), **trainer_args)
    cohort = fit(tmp_path, "vmap", "vmap", model=make_model(recipe=recipe), dm=dm(), **trainer_args)
    split = dm()
    split.setup()
    assert len({split.client_num_samples(c) for c in range(8)}) > 1  # the clients really differ in size
    assert_same_run(sequential, cohort)


def test_cohorts_smaller_than_the_round_and_codec_memory_equal_sequential(tmp_path):
    args = {"codec": TopK(density=0.25), "clients_per_round": 6}
    sequential = fit(tmp_path, "seq", "sequential", **args)
    args["codec"] = TopK(density=0.25)
    trainer = make_trainer(tmp_path, rounds=3, name="vmap3", client_batching="vmap", cohort_size=4, **args)
    trainer.fit(make_model(), datamodule=make_dm(num_clients=8, batch_size=8))
    assert_same_run(sequential, trainer)
    residuals = sequential.codec.residuals
    assert list(residuals) == list(trainer.codec.residuals)
    for c in residuals:
        torch.testing.assert_close(
            residuals[c]["mapping.latent"], trainer.codec.residuals[c]["mapping.latent"], rtol=0, atol=ATOL
        )


def test_a_cohort_run_resumes_bit_for_bit(tmp_path):
    full = fit(tmp_path / "a", "full", "vmap", rounds=4)
    first = fit(tmp_path / "b", "split", "vmap", rounds=2)
    resumed = make_trainer(tmp_path / "b", rounds=4, name="split", client_batching="vmap", cohort_size=8)
    resumed.fit(
        make_model(),
        datamodule=make_dm(num_clients=8, batch_size=8),
        ckpt_path=str(first.log_dir / "checkpoints" / "last.ckpt"),
    )
    assert torch.equal(full.global_state["mapping.latent"], resumed.global_state["mapping.latent"])
    assert [h["train/loss"] for h in full.history[-2:]] == [h["train/loss"] for h in resumed.history[-2:]]


def test_what_cannot_be_vectorised_trains_one_at_a_time_with_a_warning(tmp_path):
    fabric = _cpu_fabric()
    assert cohort_problem(make_model(), fabric) is None
    assert "regenerate" in cohort_problem(make_model(factors="regenerate"), fabric)
    from lightning_fl.methods.fedprox import FedProx
    from lightning_fl.models import SmallCNN

    prox = FedProx(SmallCNN(image_size=8, channels=[8, 16], norm_groups=4), 10, mu=0.01)
    assert "FedProx defines its own training_step" in cohort_problem(prox, fabric)
    model = make_model()
    model.backbone.add_module("drop", torch.nn.Dropout(0.1))
    assert "dropout" in cohort_problem(model, fabric)
    fallback = fit(tmp_path, "fallback", "vmap", rounds=1, model=make_model(factors="regenerate"))
    assert any("client_batching is 'vmap' but its factors are 'regenerate'" in w for w in fallback.caught)
    sequential = fit(tmp_path, "seq", "sequential", rounds=1, model=make_model(factors="regenerate"))
    assert torch.equal(fallback.global_state["mapping.latent"], sequential.global_state["mapping.latent"])


def test_cohorts_whose_activations_outgrow_the_measured_limits_train_one_at_a_time(tmp_path, monkeypatch):
    """The CPU rule (cohorts slower than sequential beyond the limits): the activation measured on a client's first
    batch, per client and per cohort, against each limit; the run then trains one at a time with one line why."""
    from lightning_fl.federated.clients import cohort

    fabric, dm = _cpu_fabric(), make_dm(num_clients=8, batch_size=8)
    dm.setup()
    # make_model's first convolution: 8 images x 8 channels x 8 x 8 pixels, its largest output
    assert cohort.largest_activation(make_model(), torch.zeros(8, 1, 8, 8)) == 8 * 8 * 8 * 8
    assert cohort.cohort_too_large(make_model(), dm, 0, 0, 0, 8, fabric) is None
    monkeypatch.setattr(cohort, "MAX_CLIENT_ACTIVATION", 4095)
    assert "largest activation is 4,096 values (32,768 for a cohort of 8" in cohort.cohort_too_large(
        make_model(), dm, 0, 0, 0, 8, fabric
    )
    monkeypatch.setattr(cohort, "MAX_CLIENT_ACTIVATION", 4096)
    assert cohort.cohort_too_large(make_model(), dm, 0, 0, 0, 8, fabric) is None
    monkeypatch.setattr(cohort, "MAX_COHORT_ACTIVATION", 32_767)
    assert "4,096 values (32,768 for a cohort of 8" in cohort.cohort_too_large(make_model(), dm, 0, 0, 0, 8, fabric)
    declined = fit(tmp_path, "declined", "vmap", rounds=1)
    assert sum("largest activation is 4,096 values" in w and "one at a time" in w for w in declined.caught) == 1
    sequential = fit(tmp_path, "seq", "sequential", rounds=1)
    assert torch.equal(declined.global_state["mapping.latent"], sequential.global_state["mapping.latent"])


def test_the_activation_probe_leaves_random_state_and_modes_as_it_found_them():
    import random

    import numpy as np

    from lightning_fl.federated.clients.cohort import cohort_too_large

    dm = make_dm(num_clients=4, batch_size=8, augment=True)
    dm.setup()
    model = make_model()
    model.train()
    model.head.eval()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    assert cohort_too_large(model, dm, 0, 0, 0, 8, _cpu_fabric()) is None
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])
    assert model.training and model.backbone.training and not model.head.training


def test_a_diverging_client_fails_alone_with_the_sequential_message(tmp_path):
    dm = make_dm(num_clients=4, batch_size=8)
    dm.setup()
    model, fabric, local = (
        make_model(recipe=dataclasses.replace(LATENT_RECIPE, lr=1e30, grad_clip=None)),
        _cpu_fabric(),
        LocalTraining(epochs=3),
    )
    state = model.federated_state()
    job = ClientJob(model, dm, state, 0, 0, TopK(density=1.0, error_feedback=False), local, fabric)
    sequential = [run_client(job, c) for c in range(4)]
    cohort = run_cohort(job, list(range(4)))
    failures = [r.failure for r in sequential]
    assert any(f is not None and "train/loss became" in f for f in failures), failures
    assert [r.failure for r in cohort] == failures
    assert [r.payload is None for r in cohort] == [f is not None for f in failures]


def test_bad_settings_are_named(tmp_path):
    from lightning_fl.errors import ConfigError

    with pytest.raises(ConfigError, match="trainer.cohort_size must be >= 1"):
        make_trainer(tmp_path, client_batching="vmap", cohort_size=0)
    with pytest.raises(ConfigError, match="trainer.client_batching must be 'sequential', 'vmap' or 'lockstep'"):
        make_trainer(tmp_path, client_batching="parallel")


def test_augmented_batches_are_drawn_as_sequential_training_draws_them(tmp_path):
    """Random flips come from the global generator, seeded per client: a cohort draws each client's batches in
    turn before its steps, and they are the batches a client trained alone would see."""
    from lightning_fl.data import Synthetic

    class Flipped(Synthetic):
        hflip = True

    dm = lambda: make_dm(source=Flipped(train_size=240, test_size=60), num_clients=8, batch_size=8)
    sequential = fit(tmp_path, "seq", "sequential", rounds=2, dm=dm())
    cohort = fit(tmp_path, "vmap", "vmap", rounds=2, dm=dm())
    assert_same_run(sequential, cohort)
