"""LoRA and FFA-LoRA (PEFT adapters on a frozen base): exact start, the federated state and its bytes, the
aggregation error against a hand computation, FFA-LoRA's exact averaging, the shared base, resume."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from conftest import make_dm, make_trainer
from lightning_fl.compress import FP32
from lightning_fl.errors import ConfigError
from lightning_fl.methods import Classifier, LoRAClassifier
from lightning_fl.models import SmallCNN


def backbone():
    torch.manual_seed(0)
    return SmallCNN(image_size=8, channels=[8, 16], norm_groups=4)


def lora(**kwargs):
    return LoRAClassifier(backbone(), 10, **{"base": "scratch", "rank": 2, **kwargs})


@pytest.mark.parametrize("variant", ["lora", "ffa"])
def test_a_zero_initialised_adapter_leaves_the_base_output_exact(variant):
    plain = Classifier(backbone(), 10)
    model = lora(variant=variant)
    model.head.load_state_dict(plain.head.state_dict())
    x = torch.randn(5, 1, 8, 8)
    assert torch.equal(model(x), plain(x))
    assert all(not torch.equal(v, torch.zeros_like(v)) for k, v in model.state_dict().items() if ".lora_A." in k)


def test_the_federated_state_is_the_adapters_and_its_bytes_are_the_formula():
    full, ffa = lora(variant="lora", rank=3), lora(variant="ffa", rank=3)
    # SmallCNN(8x8, channels [8, 16]): conv 1->8 (3x3), conv 8->16 (3x3), linear 16*2*2 -> 128
    layers = [(1 * 9, 8), (8 * 9, 16), (16 * 2 * 2, 128)]  # (in x kh x kw, out)
    a_values, b_values = sum(3 * i for i, _ in layers), sum(o * 3 for _, o in layers)
    assert sorted(full.federated_state()) == sorted(k for k in full.state_dict() if ".lora_" in k)
    assert sorted(ffa.federated_state()) == sorted(k for k in ffa.state_dict() if ".lora_B." in k)
    reference = full.federated_state()
    assert FP32().encode(reference, reference, 0).nbytes == 4 * (a_values + b_values)
    reference = ffa.federated_state()
    assert FP32().encode(reference, reference, 0).nbytes == 4 * b_values


def test_lora_aggregation_error_matches_a_hand_computation_and_ffa_lora_averages_exactly():
    model = lora(layers=["fc.weight"], rank=1, alpha=2.0)  # one adapted layer, scale alpha / r = 2
    name_a, name_b, scale = model.adapters()["fc"]
    assert scale == 2.0
    a1, a2 = torch.zeros(1, 64), torch.zeros(1, 64)
    a1[0, 0], a2[0, 1] = 1.0, 1.0
    b1, b2 = torch.zeros(128, 1), torch.zeros(128, 1)
    b1[0, 0], b2[0, 0] = 1.0, 3.0
    # mean(B_k A_k) has 0.5 and 1.5 at (0, 0) and (0, 1); mean(B) mean(A) = 2 * [0.5, 0.5] there: errors 0.5 and 0.5
    error = model.averaging_identity_error([{name_a: a1, name_b: b1}, {name_a: a2, name_b: b2}])
    assert error == pytest.approx(2.0 * 0.5, abs=1e-12)
    assert model.averaging_identity_error([{name_a: a1, name_b: b1}, {name_a: a1, name_b: b2}]) == 0.0
    ffa = lora(layers=["fc.weight"], rank=1, variant="ffa")
    _, name_b, _ = ffa.adapters()["fc"]
    assert name_b in ffa.federated_state() and name_a not in ffa.federated_state()
    assert ffa.averaging_identity_error([{name_b: b1}, {name_b: b2}]) == 0.0  # the shared A: exact in float64
    # and the model the server rebuilds from mean(B) is the mean of the clients' adapted weights
    a = ffa.state_dict()[name_a]
    clients = [b1 @ a, b2 @ a]
    torch.testing.assert_close((b1 + b2) / 2 @ a, (clients[0] + clients[1]) / 2, rtol=0, atol=1e-7)


def test_lora_aggregation_error_is_taken_over_every_state_against_peft_s_own_delta_weights():
    """Three clients' random adapters on every layer (scale alpha / r = 2): the error equals the largest gap between
    the mean of the adapted weights PEFT's layers apply (``get_delta_weight``, loaded one client at a time) and the
    weights the averaged adapters give, that mean taken in float64; one state alone gives exactly 0."""
    from lightning_fl.methods.lora import ADAPTER

    model = lora(rank=2, alpha=4.0)
    g = torch.Generator().manual_seed(0)
    states = [{k: torch.randn(v.shape, generator=g) for k, v in model.federated_state().items()} for _ in range(3)]
    mean = {k: sum(s[k].double() for s in states).div(3).float() for k in states[0]}

    def deltas(state):
        model.load_federated_state(state)
        layers = {name: model.backbone.get_submodule(name) for name in model.adapters()}
        return {name: layer.get_delta_weight(ADAPTER).double() for name, layer in layers.items()}

    clients, of_mean = [deltas(s) for s in states], deltas(mean)
    assert {scale for _, _, scale in model.adapters().values()} == {2.0}
    expected = max((sum(d[name] for d in clients) / 3 - of_mean[name]).abs().max().item() for name in of_mean)
    assert expected > 1.0
    assert model.averaging_identity_error(states) == pytest.approx(expected, rel=1e-5)
    assert model.averaging_identity_error(states[:1]) == model.averaging_identity_error(states[-1:]) == 0.0


def test_the_base_keeps_its_plain_names_and_loads_from_a_plain_classifiers_checkpoint(tmp_path):
    plain = Classifier(backbone(), 10)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    torch.save({"state_dict": plain.state_dict()}, tmp_path / "base.ckpt")
    model = lora(variant="ffa")
    assert sorted(model.own_weights()) == sorted(plain.own_weights())
    assert model._init_digest == Classifier(backbone(), 10)._init_digest  # the same base cache as FLITE and FedAvg
    model.load_weights(tmp_path / "base.ckpt")
    for name, value in plain.own_weights().items():
        assert torch.equal(model.own_weights()[name], value), name
    assert model.base_backbone() is not model.backbone and not any(
        ".lora_" in k for k in model.base_backbone().state_dict()
    )


def test_adapters_come_from_adapter_seed_alone_and_the_fingerprint_names_the_frozen_tensors():
    torch.manual_seed(123)
    first = lora(variant="ffa")
    torch.manual_seed(456)
    second = lora(variant="ffa")
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in first.state_dict().items())
    assert first.factor_fingerprint() == second.factor_fingerprint()
    assert lora(variant="ffa", adapter_seed=1).factor_fingerprint() != first.factor_fingerprint()
    trained = lora(variant="lora")
    with torch.no_grad():  # what lora trains is not part of its fingerprint; what ffa freezes is
        next(p for n, p in trained.named_parameters() if ".lora_A." in n).add_(1.0)
    assert trained.factor_fingerprint() == lora(variant="lora").factor_fingerprint()


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="model.variant must be 'lora' or 'ffa'"):
        lora(variant="dora")
    with pytest.raises(ConfigError, match="model.rank must be an integer >= 1"):
        lora(rank=0)
    with pytest.raises(ConfigError, match=r"model.layers=\['nothing.\*'\] selects no weight"):
        lora(layers=["nothing.*"])


@pytest.mark.parametrize("variant", ["lora", "ffa"])
def test_federated_lora_trains_logs_its_aggregation_error_and_resumes_bit_for_bit(tmp_path, variant):
    def dm():
        return make_dm(num_clients=4, batch_size=8)

    full = make_trainer(tmp_path / "a", rounds=3, name="full")
    full.fit(lora(variant=variant), datamodule=dm())
    start = lora(variant=variant).federated_state()
    assert any(not torch.equal(v, start[k]) for k, v in full.global_state.items())
    errors = [h["fed/identity_error"] for h in full.history[1:]]
    # FFA-LoRA: zero but for float64 rounding (the sums of B_k A in another order); LoRA: the factors' error
    assert all(e > 1e-6 for e in errors) if variant == "lora" else all(e < 1e-15 for e in errors)
    first = make_trainer(tmp_path / "b", rounds=2, name="split")
    first.fit(lora(variant=variant), datamodule=dm())
    resumed = make_trainer(tmp_path / "b", rounds=3, name="split")
    resumed.fit(lora(variant=variant), datamodule=dm(), ckpt_path=str(first.log_dir / "checkpoints" / "last.ckpt"))
    for name, value in full.global_state.items():
        assert torch.equal(value, resumed.global_state[name]), name


def test_lora_trains_in_vectorised_cohorts_as_one_at_a_time_and_with_int8_uploads(tmp_path):
    import warnings

    from lightning_fl.compress import Quantize

    states = {}
    for batching in ("sequential", "vmap"):
        trainer = make_trainer(tmp_path, rounds=1, name=batching, client_batching=batching, cohort_size=4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(lora(), datamodule=make_dm(num_clients=4, batch_size=8))
        assert not any("one at a time" in str(w.message) for w in caught)
        states[batching] = trainer.global_state
    for name, value in states["sequential"].items():
        torch.testing.assert_close(states["vmap"][name], value, rtol=0, atol=1e-5)
    int8 = make_trainer(tmp_path, rounds=1, name="int8", codec=Quantize(8))
    int8.fit(lora(), datamodule=make_dm(num_clients=4, batch_size=8))
    fp32_bytes = FP32().encode(lora().federated_state(), lora().federated_state(), 0).nbytes
    assert 0 < int8.history[-1]["comm/client_up_bytes"] < fp32_bytes / 3
