"""Pretrained Hugging Face causal LMs (HFCausalLM, SmolLM2) as networks of the language-model methods, and text
tokenised by their tokenizers. A tiny random Llama with a BPE tokenizer trained on the test plays (conftest's
``tiny_llama``) goes through the real loading path; one slow test loads SmolLM2 itself."""

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from conftest import PLAYS, play_text, run_cli, write_corpus
from lightning_fl.data import ByRole, FederatedTextDataModule, Shakespeare, pretrained
from lightning_fl.errors import ConfigError, DatasetNotFoundError, UserError
from lightning_fl.methods import LM_RECIPE, LanguageModel, LatentLanguageModel, Pretraining
from lightning_fl.methods.centralised import train_classifier
from lightning_fl.methods.language import mapped_layers
from lightning_fl.models import HFCausalLM, SmolLM2

pytest.importorskip("transformers")  # the llm extra

CONTEXT = 16
# 2 layers x (q 32x32, k 32x16, v 32x16, o 32x32, gate/up 32x64, down 64x32) + 5 RMSNorms of 32 + embedding V x 32
TINY_PARAMS = 2 * (2 * 1024 + 2 * 512 + 3 * 2048) + 5 * 32 + 300 * 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plays") / "texts"
    return write_corpus(folder, {name: play_text(name.upper(), roles) for name, roles in PLAYS.items()})


@pytest.fixture
def net(tiny_llama):
    return HFCausalLM(str(tiny_llama), context=CONTEXT)


def token_dm(corpus, tokenizer, **kwargs) -> FederatedTextDataModule:
    args = {"partition": ByRole(min_lines=10), "pretrain_plays": 1, "context": CONTEXT, "batch_size": 8, "seed": 0}
    dm = FederatedTextDataModule(Shakespeare(root=str(corpus), download=False), tokenizer=tokenizer, **args | kwargs)
    dm.setup()
    return dm


# ------------------------------------------------------------------------------------------------ the network
def test_the_wrapper_loads_the_saved_model_counts_the_tied_weight_once_and_gives_logits(net):
    assert (net.vocab_size, net.context, net.pretrained) == (300, CONTEXT, True)
    assert net.hf.lm_head.weight is net.hf.model.embed_tokens.weight
    assert sum(p.numel() for p in net.parameters()) == TINY_PARAMS
    assert net.tied_weights() == {
        "hf.lm_head.weight": ["hf.model.embed_tokens.weight"],
        "hf.model.embed_tokens.weight": ["hf.lm_head.weight"],
    }
    assert not any("tokenizer" in k for k in net.state_dict())
    ids = torch.randint(0, 300, (2, CONTEXT), generator=torch.Generator().manual_seed(0))
    logits = net(ids)
    assert logits.shape == (2, CONTEXT, 300) and logits.dtype == torch.float32
    assert torch.equal(logits, net.hf(input_ids=ids).logits)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 300), ids[:, 1:].reshape(-1))
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(math.log(300), rel=0.1)  # near uniform


def test_a_loaded_state_dict_keeps_the_tie(net, tiny_llama):
    other = HFCausalLM(str(tiny_llama), context=CONTEXT)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    net.load_state_dict(other.state_dict())
    assert net.hf.lm_head.weight is net.hf.model.embed_tokens.weight
    assert torch.equal(net.hf.lm_head.weight, other.hf.model.embed_tokens.weight)


def test_the_tokenizer_digest_is_stable_and_names_the_tokenizer(net, tiny_llama, tmp_path):
    again = pretrained.tokenizer_digest(pretrained.load_tokenizer(pretrained.model_files(str(tiny_llama))))
    assert net.tokenizer_digest == again
    net.tokenizer(["x" * 40], truncation=True, max_length=4)  # run-time settings do not change the identity
    assert pretrained.tokenizer_digest(net.tokenizer) == again
    text = "".join(play_text("OTHER", {"ZED": 40, "YORICK": 30}))
    from conftest import save_tiny_llama

    other = save_tiny_llama(tmp_path / "other", text)
    assert HFCausalLM(str(other), context=CONTEXT).tokenizer_digest != again


def test_a_missing_model_or_a_bad_context_is_one_clear_line(tmp_path, tiny_llama):
    with pytest.raises(ConfigError) as err:
        HFCausalLM(str(tmp_path / "nowhere"), context=8)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "nowhere" / "config.json") in message
    assert "model.network.path" in message and ".[llm]" in message and "save_pretrained" in message
    with pytest.raises(ConfigError, match=r"no GGUF file at .*model\.gguf") as err:
        HFCausalLM(str(tmp_path / "model.gguf"), context=8)
    with pytest.raises(ConfigError, match=r"context must be an integer in \[1, 64\]"):
        HFCausalLM(str(tiny_llama), context=65)


def test_smollm2_without_its_file_and_without_download_names_the_path_and_the_command(tmp_path):
    with pytest.raises(DatasetNotFoundError) as err:
        SmolLM2(root=str(tmp_path), download=False)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / pretrained.SMOLLM2_GGUF) in message
    assert pretrained.PIP_COMMAND in message and "download is off" in message
    (tmp_path / pretrained.SMOLLM2_GGUF).write_bytes(b"GGUF not really")
    with pytest.raises(DatasetNotFoundError, match="is not the pinned .* delete it"):
        SmolLM2(root=str(tmp_path), download=False)


def test_a_missing_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(ConfigError, match=r"needs the Python package 'gguf'.*\.\[llm\]"):
        pretrained.require("gguf", "model.network")


# ------------------------------------------------------------------------------------------------ the data
def test_tokenised_windows_are_the_tokenizers_ids_of_each_roles_text(corpus, net):
    dm = token_dm(corpus, str(net.source))
    chars = token_dm(corpus, None)
    assert dm.tokenizer_digest == net.tokenizer_digest and dm.vocab_size == 300 and dm.vocabulary == []
    assert dm.client_names == chars.client_names  # the same roles, now in tokens
    cid = dm.client_names.index(chars.client_names[0])
    role, play = dm.client_names[cid].split("/")[1], dm.client_names[cid].split("/")[0]
    lines = [f"{role.lower()} says line {i} of {play}\n" for i in range(30)]
    train = "".join(lines[: 30 - int(30 * dm.test_fraction)])
    expected = torch.tensor(net.tokenizer.encode(train, add_special_tokens=False))
    windows = dm._client(cid)
    assert len(windows) == len(range(0, len(expected) - CONTEXT, CONTEXT))
    for i in range(len(windows)):
        x, y = windows[i]
        s = int(windows.starts[i]) - int(windows.starts[0])
        assert torch.equal(x, expected[s : s + CONTEXT]) and torch.equal(y, expected[s + 1 : s + CONTEXT + 1])
    assert "16-token windows" in dm.partition_table()
    assert dm.describe() == chars.describe() | {"tokenizer": str(net.source)}
    assert "tokenizer" not in chars.describe()  # the character path's cache keys are unchanged


def test_the_model_refuses_data_of_another_tokenizer_or_characters(corpus, net, tmp_path):
    model = LanguageModel(net, sample_tokens=0)
    model.check_data(token_dm(corpus, str(net.source)))
    with pytest.raises(ConfigError, match=r"data.tokenizer is null") as err:
        model.check_data(token_dm(corpus, None))
    assert "\n" not in str(err.value)
    from conftest import save_tiny_llama

    other = save_tiny_llama(tmp_path / "other", "completely different words " * 50, vocab_size=280)
    with pytest.raises(ConfigError, match=r"is not model.network's tokenizer"):
        model.check_data(token_dm(corpus, str(other)))
    with pytest.raises(ConfigError, match=r"data.context=32 is longer"):
        model.check_data(token_dm(corpus, str(net.source), context=32))
    from lightning_fl.models import TinyGPT

    with pytest.raises(ConfigError, match=r"reads characters: set data.tokenizer null"):
        LanguageModel(TinyGPT(300, n_layer=1, n_embd=8, n_head=2, context=16)).check_data(
            token_dm(corpus, str(net.source))
        )


# ------------------------------------------------------------------------------------------------ the methods
def test_a_pretrained_network_is_its_own_base_and_is_never_pretrained(net, corpus, tmp_path):
    recipe = Pretraining(epochs=1, cache_dir=str(tmp_path / "cache"))
    model = LatentLanguageModel(net, pretraining=recipe, latent_dim=4, rank=2, sample_tokens=0)
    assert model.pretraining is None and model._base_ready
    before = {k: v.clone() for k, v in model.own_weights().items()}
    model.prepare_base(token_dm(corpus, str(net.source)))
    assert not (tmp_path / "cache").exists()
    assert all(torch.equal(before[k], v) for k, v in model.own_weights().items())
    assert "vocabulary" not in model.state_dict()
    with pytest.raises(ConfigError, match=r"model.base is 'scratch' but model.network \(HFCausalLM\)"):
        LatentLanguageModel(net, base="scratch")


def test_full_weights_train_one_step_and_send_the_tied_weight_once(net, corpus):
    dm = token_dm(corpus, str(net.source))
    model = LanguageModel(net, recipe=dataclasses.replace(LM_RECIPE, lr=1e-2), sample_tokens=0)
    model.check_data(dm)
    state = model.federated_state()
    assert "network.hf.lm_head.weight" not in state and "network.hf.model.embed_tokens.weight" in state
    assert sum(t.numel() * t.element_size() for t in state.values()) == 4 * TINY_PARAMS
    x, y = next(iter(dm.client_dataloader(0, seed=0)))
    first = model.compute_loss(model(x), y).item()
    optimizer = model.make_optimizer(list(model.trainable_parameters().values()))
    model.compute_loss(model(x), y).backward()
    optimizer.step()
    assert math.isfinite(first) and model.compute_loss(model(x), y).item() < first
    assert net.hf.lm_head.weight is net.hf.model.embed_tokens.weight  # still one tensor after a step


def test_central_training_on_tokens_reports_loss_ppl_acc(net, corpus):
    dm = token_dm(corpus, str(net.source))
    model = LanguageModel(net, recipe=dataclasses.replace(LM_RECIPE, lr=1e-2), sample_tokens=0)
    model.check_data(dm)
    out = train_classifier(model, dm, epochs=1, accelerator="cpu")
    assert out["val/ppl"] == pytest.approx(math.exp(out["val/loss"]), rel=1e-5) and 0 <= out["val/acc"] <= 1


def test_the_latent_maps_the_untied_projections_and_trains_one_step(net, corpus):
    dm = token_dm(corpus, str(net.source))
    model = LatentLanguageModel(net, latent_dim=4, rank=2, sample_tokens=0)
    assert model.mapping.names == net.default_layers() and len(model.mapping.names) == 2 * 7
    assert "hf.lm_head.weight" not in model.mapping.names
    assert model.hparams.layers == net.default_layers()
    assert list(model.federated_state()) == ["mapping.latent"]
    x, y = next(iter(dm.client_dataloader(0, seed=0)))
    assert torch.equal(model(x), net(x))  # z = 0: exactly the pretrained model
    optimizer = model.make_optimizer(list(model.trainable_parameters().values()))
    model.compute_loss(model(x), y).backward()
    optimizer.step()
    assert model.mapping.latent.abs().sum() > 0 and not torch.equal(model(x), net.hf(input_ids=x).logits)


def test_a_tied_weight_is_refused_by_name(net):
    with pytest.raises(ConfigError, match=r"selects hf.model.embed_tokens.weight, which is tied to hf.lm_head"):
        LatentLanguageModel(net, layers=["*embed_tokens.weight"], latent_dim=4, rank=2)
    # ``linear`` on a network without default_layers reaches a tied nn.Linear through its module
    embedding, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    with pytest.raises(ConfigError, match=r"selects 1.weight, which is tied to 0.weight"):
        mapped_layers(torch.nn.Sequential(embedding, head), "linear")
    assert mapped_layers(net, "linear") == net.default_layers()


@pytest.mark.parametrize("variant", ["lora", "ffa"])
def test_lora_on_projection_patterns_trains_one_step_from_the_pretrained_weights(net, corpus, variant):
    pytest.importorskip("peft")
    from lightning_fl.methods import LoRALanguageModel

    dm = token_dm(corpus, str(net.source))
    x, y = next(iter(dm.client_dataloader(0, seed=0)))
    reference = net(x).detach()
    layers = ["*.q_proj.weight", "*.v_proj.weight"]
    model = LoRALanguageModel(net, variant=variant, rank=2, layers=layers, sample_tokens=0)
    model.check_data(dm)
    assert model._base_ready and model.pretraining is None and model.base_network() is None
    assert sorted(model.adapted) == [f"hf.model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qv"]
    assert torch.equal(model(x), reference)  # B = 0: exactly the pretrained model
    # per layer, r = 2: A (lora only) r x 32 for q and v; B 32 x r (q) and 16 x r (v, 2 key-value heads of 8)
    values = 2 * ((2 * 2 * 32 if variant == "lora" else 0) + 2 * (32 + 16))
    assert sum(t.numel() for t in model.federated_state().values()) == values
    optimizer = model.make_optimizer(list(model.trainable_parameters().values()))
    model.compute_loss(model(x), y).backward()
    optimizer.step()
    assert not torch.equal(model(x), reference)


def test_generated_text_is_decoded_by_the_tokenizer(net, corpus):
    model = LanguageModel(net, sample_tokens=5, sample_prompt="aaron says")
    prompt_ids = net.tokenizer.encode("aaron says", add_special_tokens=False)
    assert torch.equal(model.encode("aaron says"), torch.tensor(prompt_ids))
    text = model.generate_text("aaron says", 5)
    ids = torch.tensor([prompt_ids])
    for _ in range(5):
        ids = torch.cat([ids, net(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert text == net.tokenizer.decode(ids[0].tolist()) and text.startswith("aaron says")
    assert model.text_samples()["samples/generated"].startswith("5 tokens, greedy:")


# ------------------------------------------------------------------------------------------------ SmolLM2
@pytest.mark.slow
def test_smollm2_loads_with_134_515_008_parameters_and_a_finite_loss_on_shakespeare():
    try:
        net = SmolLM2(context=64)
    except (DatasetNotFoundError, subprocess.SubprocessError) as err:
        pytest.skip(f"SmolLM2's GGUF is not in the cache and could not be fetched: {err}")
    except UserError as err:  # the llm extra is missing
        pytest.skip(str(err))
    assert sum(p.numel() for p in net.parameters()) == 134_515_008
    assert net.hf.lm_head.weight is net.hf.model.embed_tokens.weight
    assert (net.vocab_size, len(net.tokenizer)) == (49152, 49152)
    model = LanguageModel(net, sample_tokens=0)
    assert sum(t.numel() * t.element_size() for t in model.federated_state().values()) == 538_060_032
    ids = model.encode("To be, or not to be, that is the question:")[None]
    with torch.no_grad():
        loss = model.compute_loss(model(ids[:, :-1]), ids[:, 1:]).item()
    assert math.isfinite(loss) and loss < 6.0  # far below a uniform guess over 49,152 tokens (10.8)


# ------------------------------------------------------------------------------------------------ the CLI
def test_a_cli_run_fine_tunes_the_tiny_model_with_lora_and_names_a_data_mismatch(tiny_llama, corpus, in_tmp, capsys):
    pytest.importorskip("peft")
    network = f"{{class_path: lightning_fl.models.HFCausalLM, init_args: {{path: {tiny_llama}, context: 16}}}}"
    source = f"{{class_path: lightning_fl.data.Shakespeare, init_args: {{root: {corpus}, download: false}}}}"
    args = [
        "fit",
        "--trainer",
        "lightning_fl.FederatedTrainer",
        "--trainer.rounds",
        "1",
        "--trainer.accelerator",
        "cpu",
        "--trainer.clients_per_round",
        "2",
        "--trainer.enable_progress_bar",
        "false",
        "--model",
        "lightning_fl.methods.LoRALanguageModel",
        "--model.network",
        network,
        "--model.layers",
        '["*.q_proj.weight", "*.v_proj.weight"]',
        "--model.sample_tokens",
        "0",
        "--data",
        "lightning_fl.data.FederatedTextDataModule",
        "--data.source",
        source,
        "--data.context",
        "16",
        "--data.partition.min_lines",
        "10",
        "--data.pretrain_plays",
        "1",
    ]
    assert run_cli(*args, "--data.tokenizer", str(tiny_llama)) == 0
    assert "round 1/1" in capsys.readouterr().out
    assert run_cli(*args) == 2  # data.tokenizer null: characters
    assert "data.tokenizer is null (characters): set data.tokenizer" in capsys.readouterr().err
