"""Lockstep cohorts (trainer.client_batching: lockstep): FLITE clients stepping together and sharing the mapping's
matrix products equal the same clients trained one at a time, up to float32 rounding; what cannot train in lockstep
trains one at a time."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cohort import ATOL, assert_same_run, fit, quickstart_model

from conftest import make_dm, make_model
from lightning_fl.data import Dirichlet
from lightning_fl.federated.clients.client import _cpu_fabric
from lightning_fl.federated.clients.lockstep import lockstep_problem
from lightning_fl.methods import LATENT_RECIPE


def test_a_lockstep_cohort_of_8_clients_equals_8_clients_one_at_a_time_over_3_rounds(tmp_path):
    sequential = fit(tmp_path, "seq", "sequential", model=quickstart_model())
    lockstep = fit(tmp_path, "lock", "lockstep", model=quickstart_model())
    assert not any("one at a time" in w for w in lockstep.caught)
    assert_same_run(sequential, lockstep)
    assert not torch.equal(
        sequential.global_state["mapping.latent"], torch.zeros_like(lockstep.global_state["mapping.latent"])
    )
    again = fit(tmp_path, "lock_again", "lockstep", model=quickstart_model())  # deterministic given the seed
    assert torch.equal(lockstep.global_state["mapping.latent"], again.global_state["mapping.latent"])


@pytest.mark.parametrize(
    ("model_args", "recipe_args", "trainer_args"),
    [
        ({}, {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}, {"local_steps": 5}),
        ({"head": "trainable"}, {"grad_clip": 0.05}, {"local_epochs": 2}),  # a head that trains beside the latent
        ({"factors": "dense"}, {}, {}),
    ],
    ids=["sgd_momentum_local_steps", "trainable_head_clipping_two_epochs", "dense"],
)
def test_unequal_clients_heads_optimisers_and_dense_factors_equal_sequential(
    tmp_path, model_args, recipe_args, trainer_args
):
    """Dirichlet clients of unequal sizes: their last batches differ in size, and some clients stop early."""
    dm = lambda: make_dm(num_clients=8, batch_size=8, partition=Dirichlet(alpha=0.5, min_partition_size=5))
    recipe = dataclasses.replace(LATENT_RECIPE, **recipe_args)
    model = lambda: make_model(recipe=recipe, **model_args)
    sequential = fit(tmp_path, "seq", "sequential", model=model(), dm=dm(), **trainer_args)
    lockstep = fit(tmp_path, "lock", "lockstep", model=model(), dm=dm(), **trainer_args)
    assert not any("one at a time" in w for w in lockstep.caught)
    assert set(sequential.global_state) == set(lockstep.global_state)
    assert_same_run(sequential, lockstep, atol=ATOL)


def test_what_cannot_train_in_lockstep_trains_one_at_a_time_with_a_warning(tmp_path):
    fabric = _cpu_fabric()
    assert lockstep_problem(make_model(), fabric) is None
    assert "'kronecker'" in lockstep_problem(make_model(factors="kronecker"), fabric)
    from lightning_fl.methods import Classifier
    from lightning_fl.models import SmallCNN

    assert "not a latent method" in lockstep_problem(Classifier(SmallCNN(image_size=8, channels=[8, 16]), 10), fabric)
    fallback = fit(tmp_path, "fallback", "lockstep", rounds=1, model=make_model(factors="regenerate"))
    assert any("client_batching is 'lockstep' but its factors are 'regenerate'" in w for w in fallback.caught)
    sequential = fit(tmp_path, "seq", "sequential", rounds=1, model=make_model(factors="regenerate"))
    assert torch.equal(fallback.global_state["mapping.latent"], sequential.global_state["mapping.latent"])
