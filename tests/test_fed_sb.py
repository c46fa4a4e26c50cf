"""Fed-SB and FLITE's public subspace: two-sided parts from the SVD of a public-data statistic, never a client's
data; Fed-SB's r x r grid sends r^2 floats per adapted weight, averages exactly and starts at the statistic's top
singular values. The statistic and its subspace are checked against a computation written out here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fl import FederatedTrainer, LatentLanguageModel
from lightning_fl.data import Dirichlet, FederatedInstructionDataModule, InstructionTasks
from lightning_fl.errors import ConfigError
from lightning_fl.methods import FedSBLanguageModel
from lightning_fl.metrics import IGNORE_INDEX
from lightning_fl.models import HFCausalLM

pytest.importorskip("transformers")  # the llm extra
RANK = 2
PUBLIC = 12


def data(folder, public_per_task: int = PUBLIC) -> FederatedInstructionDataModule:
    source = InstructionTasks(
        tasks=["arithmetic", "units"],
        train_per_task=24,
        val_per_task=4,
        test_per_task=4,
        public_per_task=public_per_task,
    )
    dm = FederatedInstructionDataModule(
        source, tokenizer=str(folder), num_clients=4, partition=Dirichlet(alpha=1.0), context=64, max_new_tokens=4
    )
    dm.setup()
    return dm


def fed_sb(folder) -> FedSBLanguageModel:
    return FedSBLanguageModel(HFCausalLM(str(folder), context=64), rank=RANK, public_records=PUBLIC, sample_tokens=0)


@pytest.fixture
def prepared(tiny_chat_llama):
    model, dm = fed_sb(tiny_chat_llama), data(tiny_chat_llama)
    model.prepare_base(dm)
    return model, dm


def reference_statistic(folder, batches, names, lr: float) -> dict[str, np.ndarray]:
    """-lr sign(sum of the batches' mean-loss gradients), written out with a plain backward pass on a fresh copy."""
    network = HFCausalLM(str(folder), context=64)
    for name in names:
        network.get_parameter(name).requires_grad_(True)
    for x, y in batches:
        logits = network(x)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX
        )
        loss.backward()
    return {n: (-lr * np.sign(network.get_parameter(n).grad.double().numpy())) for n in names}


def test_the_parts_span_the_top_singular_vectors_of_the_public_statistic(prepared, tiny_chat_llama):
    model, dm = prepared
    mapping = model.mapping
    from lightning_fl.methods.subspace import public_batches

    batches = public_batches(dm, PUBLIC)
    assert sum(len(x) for x, _ in batches) == PUBLIC
    reference = reference_statistic(tiny_chat_llama, batches, mapping.names, model.recipe.lr)
    for lay in mapping.layers:
        u, s, vt = np.linalg.svd(reference[lay.name], full_matrices=False)
        left, right = (getattr(mapping, f"t{k}_{lay.index}").double().numpy() for k in ("a", "b"))
        # the same subspaces (singular vectors up to sign): equal projections
        np.testing.assert_allclose(left @ left.T, u[:, :RANK] @ u[:, :RANK].T, atol=1e-5)
        np.testing.assert_allclose(right @ right.T, vt[:RANK].T @ vt[:RANK], atol=1e-5)
        # Fed-SB's R starts at the top singular values: the model starts at base + U_r diag(s_r) V_r^T
        start = torch.tensor(left @ np.diag(s[:RANK]) @ right.T)
        delta = model.merged_weights()[lay.name].double() - model.network.get_parameter(lay.name).double()
        np.testing.assert_allclose(delta.numpy(), start.numpy(), atol=1e-5)
    assert mapping.subspace == f"public-sign-gradient:{PUBLIC}"


def test_fed_sb_sends_r_squared_floats_per_weight_and_averages_exactly(prepared):
    model, _ = prepared
    assert model.mapping.latent_size == RANK * RANK * len(model.mapping.layers)
    torch.manual_seed(0)
    states = [
        {"mapping.latent": model.mapping.latent.detach() + 0.1 * torch.randn(model.mapping.latent_size)}
        for _ in range(5)
    ]
    assert model.averaging_identity_error(states) <= 1e-6
    lay = model.mapping.layers[0]
    left, right = model.mapping.ta_0.double(), model.mapping.tb_0.double()
    grids = [s["mapping.latent"][: RANK * RANK].double().reshape(RANK, RANK) for s in states]
    mean_of_weights = sum(left @ g @ right.T for g in grids) / len(grids)
    weight_of_mean = left @ (sum(grids) / len(grids)) @ right.T
    assert lay.index == 0 and torch.allclose(mean_of_weights, weight_of_mean, atol=1e-12)


def test_the_subspace_never_reads_a_clients_records_and_is_the_same_on_every_client(tiny_chat_llama, monkeypatch):
    def private(*args, **kwargs):
        raise AssertionError("a client's records were read to choose the subspace")

    dm = data(tiny_chat_llama)
    for name in ("client_dataloader", "client_num_samples", "_client"):
        monkeypatch.setattr(dm, name, private)
    one, two = fed_sb(tiny_chat_llama), fed_sb(tiny_chat_llama)
    one.prepare_base(dm)
    two.prepare_base(dm)
    assert one.factor_fingerprint() == two.factor_fingerprint()
    random = LatentLanguageModel(
        HFCausalLM(str(tiny_chat_llama), context=64), latent_dim=4, rank=4, factors="two_sided", sample_tokens=0
    )
    assert one.factor_fingerprint() != random.factor_fingerprint()


def test_flite_with_a_public_subspace_starts_at_the_base_and_trains_federated(tiny_chat_llama, tmp_path):
    network = HFCausalLM(str(tiny_chat_llama), context=64)
    model = LatentLanguageModel(
        network, latent_dim=6, rank=6, factors="two_sided", subspace="public", public_records=PUBLIC, sample_tokens=0
    )
    trainer = FederatedTrainer(
        rounds=2,
        clients_per_round=2,
        local_steps=2,
        accelerator="cpu",
        logger=False,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
    )
    base = HFCausalLM(str(tiny_chat_llama), context=64)
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    model.prepare_base(data(tiny_chat_llama))
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))  # z = 0: the base, exactly
    trainer.fit(model, datamodule=data(tiny_chat_llama))
    last = trainer.history[-1]
    assert last["comm/client_up_bytes"] == 4 * 6 * len(model.mapping.layers)
    assert last["val/ppl"] < trainer.history[0]["val/ppl"] and last["fed/identity_error"] < 1e-6


def test_what_a_subspace_from_public_data_needs_is_said_in_one_line(tiny_chat_llama):
    network = HFCausalLM(str(tiny_chat_llama), context=64)
    with pytest.raises(ConfigError, match="model.subspace public chooses two-sided parts"):
        LatentLanguageModel(network, latent_dim=4, rank=4, factors="stored", subspace="public", sample_tokens=0)
    with pytest.raises(ConfigError, match="model.latent_init svd"):
        LatentLanguageModel(network, latent_dim=4, rank=4, factors="two_sided", latent_init="svd", sample_tokens=0)
    with pytest.raises(ConfigError, match="has no public records to compute it from"):
        fed_sb(tiny_chat_llama).prepare_base(data(tiny_chat_llama, public_per_task=0))


def test_a_fed_sb_run_exports_the_model_it_trained(tiny_chat_llama, tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightning_fl.cli.export import run_export

    model = fed_sb(tiny_chat_llama)
    trainer = FederatedTrainer(
        rounds=1,
        clients_per_round=2,
        local_steps=2,
        accelerator="cpu",
        logger=False,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
    )
    trainer.fit(model, datamodule=data(tiny_chat_llama))
    ckpt = next(tmp_path.rglob("last.ckpt"))
    run_export(fed_sb(tiny_chat_llama), str(ckpt), str(tmp_path / "hf"), False, data(tiny_chat_llama))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model.eval()(ids) - theirs(ids).logits).abs().max().item() < 1e-5
