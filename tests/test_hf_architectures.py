"""The models users bring: tiny random Llama, Qwen2, GPT-NeoX, Phi-3 and GPT-2 (built with ``transformers``, saved and
loaded through the real path). ``layers: linear`` selects their attention and MLP projections and never the output
head (tied or not: PEFT's ``all-linear``); FLITE's two-sided factors and LoRA train on each, GPT-2's ``Conv1D``
included; gradient checkpointing changes no gradient; a bf16 base keeps the trained parameters in float32."""

from __future__ import annotations

import pytest
import torch

from conftest import save_tiny_chat_model, task_text
from lightning_fl import FederatedTrainer, LatentLanguageModel
from lightning_fl.data import Dirichlet, FederatedInstructionDataModule, InstructionTasks
from lightning_fl.errors import ConfigError
from lightning_fl.methods import LanguageModel, LoRALanguageModel
from lightning_fl.models import HFCausalLM

pytest.importorskip("transformers")  # the llm extra

#: What ``layers: linear`` selects per architecture: 2 layers of these projections.
PROJECTIONS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc", "c_proj"],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    text = task_text()
    return {arch: save_tiny_chat_model(tmp_path_factory.mktemp(arch), text, arch) for arch in PROJECTIONS}


@pytest.mark.parametrize("arch", list(PROJECTIONS))
def test_linear_means_the_projections_and_never_the_output_head(arch, models):
    net = HFCausalLM(str(models[arch]), context=32)
    chosen = net.default_layers()
    kinds = sorted(name.removesuffix(".weight").rsplit(".", 1)[-1] for name in chosen)
    assert kinds == sorted(PROJECTIONS[arch] * 2)
    head = net.hf.get_output_embeddings()
    assert all(net.get_parameter(name) is not head.weight for name in chosen)
    assert arch not in ("qwen2", "gpt_neox", "phi3") or head.weight is not net.hf.get_input_embeddings().weight


def randomise(model) -> None:
    """Move FLITE's latent or LoRA's B away from zero, so the adapted model differs from the base."""
    with torch.no_grad():
        for p in model.trainable_parameters().values():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.3)


@pytest.mark.parametrize("method", ["flite", "lora"])
@pytest.mark.parametrize("arch", list(PROJECTIONS))
def test_the_adapted_forward_is_the_merged_weights_forward(arch, method, models):
    folder = models[arch]
    network = HFCausalLM(str(folder), context=32)
    if method == "flite":
        model = LatentLanguageModel(network, latent_dim=4, rank=4, factors="two_sided", sample_tokens=0)
    else:
        model = LoRALanguageModel(network, rank=2, sample_tokens=0)
    randomise(model)
    merged = HFCausalLM(str(folder), context=32)
    merged.load_state_dict(model.merged_weights())
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted, plain, base = model.eval()(ids), merged.eval()(ids), HFCausalLM(str(folder), context=32)(ids)
    assert (adapted - plain).abs().max().item() < 1e-5
    assert (adapted - base).abs().max().item() > 1e-3  # the adaptation changes the model


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_a_federated_round_trains_flite_and_lora_on_the_architecture(arch, models, tmp_path):
    folder = models[arch]
    source = InstructionTasks(
        tasks=["arithmetic", "units"], train_per_task=24, val_per_task=3, test_per_task=3, public_per_task=0
    )
    for method in ("flite", "lora"):
        network = HFCausalLM(str(folder), context=64)
        if method == "flite":
            model = LatentLanguageModel(network, latent_dim=4, rank=4, factors="two_sided", sample_tokens=0)
        else:
            model = LoRALanguageModel(network, rank=1, sample_tokens=0)
        data = FederatedInstructionDataModule(
            source, tokenizer=str(folder), num_clients=4, partition=Dirichlet(alpha=1.0), context=64, max_new_tokens=4
        )
        trainer = FederatedTrainer(
            rounds=1,
            clients_per_round=2,
            local_steps=2,
            accelerator="cpu",
            logger=False,
            default_root_dir=str(tmp_path / method),
            enable_progress_bar=False,
        )
        trainer.fit(model, datamodule=data)
        last = trainer.history[-1]
        assert last["val/ppl"] < trainer.history[0]["val/ppl"], (arch, method)
        assert last["fed/identity_error"] < 1e-6 or method == "lora"


def test_an_empty_selection_names_the_pattern_and_a_weight_it_could_match(models):
    net = HFCausalLM(str(models["llama"]), context=32)
    with pytest.raises(ConfigError) as err:
        LoRALanguageModel(net, layers=["*.qproj.weight"], sample_tokens=0)
    message = str(err.value)
    assert message.startswith("model.layers=['*.qproj.weight'] selects no weight of HFCausalLM")
    assert "hf.model.embed_tokens.weight" in message or "q_proj" in message


@pytest.mark.parametrize("method", ["lora", "flite"])
def test_gradient_checkpointing_gives_the_same_gradients(method, models):
    grads = []
    for checkpointing in (False, True):
        network = HFCausalLM(str(models["llama"]), context=32, gradient_checkpointing=checkpointing)
        if method == "lora":
            model = LoRALanguageModel(network, rank=2, sample_tokens=0)
        else:  # (its deltas ride on forward hooks: the recomputation must see them too)
            model = LatentLanguageModel(network, latent_dim=4, rank=4, factors="two_sided", sample_tokens=0)
        randomise(model)
        model.train()
        ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(2))
        loss = model.compute_loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.trainable_parameters().items()})
    assert network.hf.is_activation_checkpointing
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


def test_a_bf16_base_keeps_the_trained_parameters_and_their_updates_in_float32(models):
    network = HFCausalLM(str(models["llama"]), context=32, dtype="bfloat16")
    assert network.hf.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    for model in (
        LoRALanguageModel(network, rank=2, sample_tokens=0),
        LatentLanguageModel(
            HFCausalLM(str(models["llama"]), context=32, dtype="bfloat16"),
            latent_dim=4,
            rank=4,
            factors="two_sided",
            sample_tokens=0,
        ),
    ):
        trained = model.trainable_parameters()
        assert trained and all(p.dtype == torch.float32 for p in trained.values())
        optimizer = model.make_optimizer(list(trained.values()))
        ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(3))
        loss = model.compute_loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss) and all(p.grad.dtype == torch.float32 for p in trained.values())
    with pytest.raises(ConfigError, match="model.network.dtype=bfloat16 keeps a frozen base in low precision"):
        LanguageModel(HFCausalLM(str(models["llama"]), context=32, dtype="bfloat16"), sample_tokens=0)
    with pytest.raises(ConfigError, match="model.network.dtype must be one of 'float32', 'bfloat16'"):
        HFCausalLM(str(models["llama"]), context=32, dtype="float16")
