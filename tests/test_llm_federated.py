"""The SmolLM2 configs (configs/smollm2_*.yaml), run federated on a tiny random Llama instead of SmolLM2: exact
bytes for every method, FLITE's averaging identity, bitwise resume, central DP, secure aggregation and Flower.

The tiny model (conftest's ``tiny_llama``: 2 layers, 32 wide, tied embeddings, a 300-token BPE tokenizer trained on
the test plays) replaces the network and the tokenizer on the command line; everything else is the shipped config,
so what runs here is what a user runs, at a size that takes seconds. One slow test runs a config on SmolLM2 itself.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import CONFIGS, PLAYS, play_text, run_cli, tiny_llama_args, tool_module, write_corpus
from lightning_fl.checkpoint import read_checkpoint

pytest.importorskip("transformers")  # the llm extra
pytest.importorskip("peft")

METHODS = ["flite", "lora", "ffa_lora", "fedavg"]
# The tiny Llama's 14 projections per the config's ``layers: linear``: per layer q 32x32, k 16x32, v 16x32,
# o 32x32, gate 64x32, up 64x32, down 32x64 (out x in).
PROJECTIONS = [(32, 32), (16, 32), (16, 32), (32, 32), (64, 32), (64, 32), (32, 64)] * 2
TINY_PARAMS = 2 * (2 * 1024 + 2 * 512 + 3 * 2048) + 5 * 32 + 300 * 32  # the embedding tied to the head, once
LATENT_DIM = 8
UPLOAD_BYTES = {  # float32 bytes per upload, in closed form
    "flite": 4 * LATENT_DIM * len(PROJECTIONS),  # d floats per mapped projection
    "lora": 4 * sum(m + n for m, n in PROJECTIONS),  # r (m + n) per adapted matrix, r = 1
    "ffa_lora": 4 * sum(m for m, _ in PROJECTIONS),  # r m: only B travels
    "fedavg": 4 * TINY_PARAMS,
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plays") / "texts"
    return write_corpus(folder, {name: play_text(name.upper(), roles) for name, roles in PLAYS.items()})


@pytest.fixture
def tiny(tiny_llama, corpus):
    """Command-line arguments that put the tiny model, its tokenizer and the test plays into a SmolLM2 config."""
    return tiny_llama_args(tiny_llama, corpus)


def fit(root, method: str, tiny: list[str], *extra: str, name: str = "run") -> dict:
    config = CONFIGS / f"smollm2_{method}.yaml"
    latent = (
        ["--model.init_args.latent_dim", str(LATENT_DIM), "--model.init_args.rank", "4"] if method == "flite" else []
    )
    args = ["fit", "--config", str(config), *tiny, *latent, "--trainer.default_root_dir", str(root), "--trainer.name"]
    assert run_cli(*args, name, *extra) == 0
    (path,) = (root / name).glob("*/checkpoints/last.ckpt")
    return read_checkpoint(path)


@pytest.mark.parametrize("method", METHODS)
def test_each_config_runs_federated_and_counts_its_upload_in_closed_form(method, tiny, tmp_path):
    done = fit(tmp_path, method, tiny)
    rounds = done["history"][1:]
    assert len(rounds) == 2
    assert all(h["comm/client_up_bytes"] == UPLOAD_BYTES[method] for h in rounds)
    assert all(math.isfinite(h["val/ppl"]) and 0 <= h["val/acc"] <= 1 for h in done["history"])
    assert done["history"][-1]["val/loss"] != done["history"][0]["val/loss"]  # the model moved
    identity = [h.get("fed/identity_error") for h in rounds]
    if method == "flite":  # the latent averages exactly: float rounding only
        assert all(0 <= e <= 1e-6 for e in identity)
    elif method == "ffa_lora":  # A is shared: exact in float64 up to rounding
        assert all(0 <= e <= 1e-12 for e in identity)
    elif method == "lora":  # A and B both averaged: the product of means is not the mean of products
        assert all(e > 1e-9 for e in identity)


@pytest.mark.parametrize("method", ["flite", "lora"])
def test_a_resumed_run_ends_bit_for_bit_where_an_unbroken_one_does(method, tiny, tmp_path):
    unbroken = fit(tmp_path / "a", method, tiny, "--trainer.rounds", "3")
    fit(tmp_path / "b", method, tiny, "--trainer.rounds", "1", name="split")
    resumed = fit(tmp_path / "b", method, tiny, "--trainer.rounds", "3", "--trainer.resume", "auto", name="split")
    for key, value in unbroken["global_state"].items():
        assert torch.equal(value, resumed["global_state"][key]), key
    assert [h["val/loss"] for h in unbroken["history"]] == [h["val/loss"] for h in resumed["history"]]


CENTRAL_DP = [
    "--trainer.privacy",
    "CentralDP",
    "--trainer.privacy.noise_multiplier",
    "1.0",
    "--trainer.privacy.clip_norm",
    "0.05",
    "--trainer.privacy.noise_seed",
    "0",
    "--trainer.max_update_norm_ratio",
    "null",
    "--trainer.strategy.init_args.weighted",
    "false",
]


@pytest.mark.parametrize("method", ["flite", "lora", "ffa_lora"])
def test_central_dp_clips_noises_and_spends_a_budget(method, tiny, tmp_path):
    plain = fit(tmp_path, method, tiny, name="plain")
    private = fit(tmp_path, method, tiny, *CENTRAL_DP, name="private")
    again = fit(tmp_path, method, tiny, *CENTRAL_DP, name="again")
    eps = [h["privacy/epsilon"] for h in private["history"][1:]]
    assert 0 < eps[0] < eps[1] < math.inf
    trained = [k for k in private["global_state"] if k in plain["global_state"]]
    assert any(not torch.equal(private["global_state"][k], plain["global_state"][k]) for k in trained)
    for key in trained:  # seeded noise: the same private run twice is the same run
        assert torch.equal(private["global_state"][key], again["global_state"][key])


SECURE = [
    "--trainer.secure_aggregation",
    "lightning_fl.privacy.secure.SecureAggregation",
    "--trainer.secure_aggregation.clipping_range",
    "1.0",
    "--trainer.max_update_norm_ratio",
    "null",
    "--trainer.strategy.init_args.weighted",
    "false",
]


@pytest.mark.parametrize("method", ["flite", "lora"])
def test_secure_aggregation_steps_by_the_mean_of_the_quantised_updates(method, tiny, tmp_path):
    clear = fit(
        tmp_path,
        method,
        tiny,
        "--trainer.max_update_norm_ratio",
        "null",
        "--trainer.strategy.init_args.weighted",
        "false",
        name="clear",
    )
    secure = fit(tmp_path, method, tiny, *SECURE, name="secure")
    for key, value in clear["global_state"].items():
        if value.is_floating_point():  # equal up to SecAgg+'s quantisation of each update
            torch.testing.assert_close(secure["global_state"][key], value, atol=1e-3, rtol=0)
    assert any(not torch.equal(secure["global_state"][k], v) for k, v in clear["global_state"].items())


@pytest.mark.slow
def test_a_smollm2_config_runs_a_round_on_smollm2_itself(tmp_path):
    """The real model through the shipped LoRA config: one round of two clients, one step each, offline."""
    small = [
        "--trainer.rounds",
        "1",
        "--trainer.clients_per_round",
        "2",
        "--trainer.local_steps",
        "1",
        "--data.init_args.num_clients",
        "2",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger",
        "false",
    ]
    done = fit(tmp_path, "lora", small)
    assert done["history"][-1]["comm/client_up_bytes"] == 4 * 305_280  # r = 1 on 210 projections
    assert math.isfinite(done["history"][-1]["val/ppl"])


@pytest.mark.parametrize("method", ["flite", "lora"])
def test_on_flower_the_run_equals_the_in_process_run_bit_for_bit(method, tiny, tmp_path, monkeypatch):
    """The ServerApp and ClientApps (messages through test_flower's LocalGrid, four nodes, one client each): the same
    global state and bytes as in process."""
    pytest.importorskip("flwr")
    from flwr.supercore.task_identity import TaskIdentity
    from test_flower import LocalGrid, nodes, on_flower

    for attribute, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, attribute, value)
    reference = fit(tmp_path, method, tiny, name="inproc")
    latent = (
        ["--model.init_args.latent_dim", str(LATENT_DIM), "--model.init_args.rank", "4"] if method == "flite" else []
    )
    _, got = on_flower(tmp_path, CONFIGS / f"smollm2_{method}.yaml", LocalGrid(nodes()), *tiny, *latent)
    assert sorted(got["global_state"]) == sorted(reference["global_state"])
    for key, value in reference["global_state"].items():
        assert torch.equal(got["global_state"][key], value), key
    assert torch.equal(got["ledger"]["up"], reference["ledger"]["up"])


@pytest.mark.parametrize("method", ["flite", "lora", "ffa_lora"])
def test_weight_deltas_measures_each_layers_change_as_its_closed_form(method, tiny, tmp_path):
    """tools/weight_deltas.py probes each adapted layer with the identity; here the same changes in closed form:
    FLITE's ``dW = reshape(U_l V_l^T z_l)`` from the full factor, LoRA's ``(alpha / r) B A``."""
    import statistics

    import lightning as L

    from lightning_fl.cli import build
    from lightning_fl.federated.trainer import setup

    fit(tmp_path, method, tiny)
    (folder,) = (tmp_path / "run").glob("version_*")
    measured = tool_module("weight_deltas").measure(folder)
    run = build(["fit", "--config", str(folder / "config.yaml"), "--trainer.logger", "false"])
    model, _ = setup.prepare(L.Fabric(accelerator="cpu", devices=1, loggers=[]), run.model, run.data, "fit")
    model.load_federated_state(read_checkpoint(folder / "checkpoints" / "last.ckpt")["global_state"])
    pairs = []  # (W0, dW) per adapted layer, in closed form
    if method == "flite":
        mapping = model.mapping
        for lay, z_l in zip(mapping.layers, mapping.split(mapping.latent), strict=True):
            w0 = model.network.get_submodule(lay.name.rpartition(".")[0]).weight
            coefficients = mapping.v_factor(lay).double().T @ z_l.detach().double()
            dw = (mapping.u_factor(lay).double() @ coefficients).reshape(w0.shape)
            pairs.append((w0.double(), dw))
    else:
        for _, m in model.named_modules():
            if hasattr(m, "base_layer") and hasattr(m, "lora_A"):
                b, a = m.lora_B["default"].weight.double(), m.lora_A["default"].weight.double()
                pairs.append((m.base_layer.weight.double(), m.scaling["default"] * b @ a))
    assert measured["layers"] == len(pairs) == len(PROJECTIONS)  # every projection of both layers
    norm = torch.linalg.matrix_norm
    spectral = [float(norm(dw, ord=2) / norm(w0, ord=2)) for w0, dw in pairs]
    assert min(spectral) > 0  # the run moved every adapted layer
    assert measured["spectral_median"] == pytest.approx(statistics.median(spectral), rel=1e-4)
    assert measured["spectral_max"] == pytest.approx(max(spectral), rel=1e-4)
    frobenius = [float(norm(dw) / norm(w0)) for w0, dw in pairs]
    assert measured["frobenius_median"] == pytest.approx(statistics.median(frobenius), rel=1e-4)
    stable = [float(norm(dw) ** 2 / norm(dw, ord=2) ** 2) for _, dw in pairs]
    assert measured["stable_rank_median"] == pytest.approx(statistics.median(stable), rel=1e-4)
    if method != "flite":
        assert measured["stable_rank_median"] == pytest.approx(1.0, abs=1e-4)  # rank 1
