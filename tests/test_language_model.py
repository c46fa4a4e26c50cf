"""Language models: LanguageModel and its FLITE latent variant on TinyGPT, centrally and federated, and the configs.

Every corpus is a small set of plays the tests write in the modern edition's layout; nothing goes online.
"""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.func import functional_call

from conftest import CONFIGS, PLAYS, play_text, run_cli, write_corpus
from lightning_fl.compress import Quantize
from lightning_fl.data import ByRole, FederatedTextDataModule, Shakespeare
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.federated import FederatedTrainer
from lightning_fl.methods import LM_RECIPE, LanguageModel, LatentLanguageModel, Pretraining
from lightning_fl.methods.centralised import train_classifier
from lightning_fl.metrics import NextTokenMetrics
from lightning_fl.models import TinyGPT


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plays") / "texts"
    odd = {"AARON": " -- ¡Olé, naïve Æneas!"}  # characters outside ASCII reach the vocabulary
    return write_corpus(folder, {name: play_text(name.upper(), roles, odd) for name, roles in PLAYS.items()})


def text_dm(corpus, **kwargs) -> FederatedTextDataModule:
    args = {"partition": ByRole(min_lines=10), "pretrain_plays": 1, "context": 16, "batch_size": 8, "seed": 0}
    dm = FederatedTextDataModule(Shakespeare(root=str(corpus), download=False), **(args | kwargs))
    dm.setup()
    return dm


def network(vocab: int, seed: int = 0, **kwargs) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab, **({"n_layer": 2, "n_embd": 16, "n_head": 2, "context": 16} | kwargs))


def latent_model(vocab: int, seed: int = 0, **kwargs) -> LatentLanguageModel:
    args = {"base": "scratch", "latent_dim": 8, "rank": 4, "sample_tokens": 12}
    return LatentLanguageModel(network(vocab, seed), **(args | kwargs))


def trainer(tmp_path, **kwargs) -> FederatedTrainer:
    args = {"rounds": 2, "clients_per_round": 3, "default_root_dir": str(tmp_path / "runs"), "seed": 0}
    return FederatedTrainer(**(args | {"enable_progress_bar": False, "accelerator": "cpu"} | kwargs))


def scramble_latent(model: LatentLanguageModel, seed: int = 3) -> None:
    with torch.no_grad():
        model.mapping.latent.copy_(
            torch.randn(model.mapping.latent.shape, generator=torch.Generator().manual_seed(seed))
        )


def other_vocabulary(dm: FederatedTextDataModule) -> SimpleNamespace:
    """Data of the same size whose vocabulary differs at id 3 (e.g. text from another corpus)."""
    vocabulary = list(dm.vocabulary)
    vocabulary[3] = "Z" if vocabulary[3] != "Z" else "Y"
    return SimpleNamespace(vocabulary=vocabulary, context=dm.context)


# ------------------------------------------------------------------------------------------------ metrics
def test_next_token_metrics_match_a_direct_computation():
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(3, 5, 7, generator=gen), torch.randint(0, 7, (3, 5), generator=gen)) for _ in range(3)]
    metric = NextTokenMetrics("val/")
    for logits, y in batches:
        metric.update(logits, y)
    got = metric.compute()
    logits = torch.cat([b[0] for b in batches]).reshape(-1, 7)
    y = torch.cat([b[1] for b in batches]).reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits, y).item()
    assert got["val/loss"].item() == pytest.approx(loss, rel=1e-6)
    assert got["val/ppl"].item() == pytest.approx(math.exp(loss), rel=1e-6)
    assert got["val/acc"].item() == pytest.approx((logits.argmax(-1) == y).float().mean().item())


# ------------------------------------------------------------------------------------------------ vocabulary
def test_the_model_adopts_the_data_vocabulary_and_refuses_another(corpus):
    dm = text_dm(corpus)
    assert "Æ" in dm.vocabulary and dm.vocabulary[0] == "\ufffd"
    model = LanguageModel(network(dm.vocab_size))
    assert model.characters is None
    model.check_data(dm)
    assert model.characters == dm.vocabulary
    assert model.decode(model.encode("aaron says Æ")) == "aaron says Æ"
    assert model.decode(model.encode("aaron ☃")) == "aaron \ufffd"  # unknown characters map to id 0
    with pytest.raises(ConfigError, match="differs from the data's at id 3 \\('!' vs 'Z'\\)"):
        model.check_data(other_vocabulary(dm))


def test_data_that_does_not_fit_the_network_names_the_keys(corpus):
    dm = text_dm(corpus)
    with pytest.raises(
        ConfigError, match=f"vocab_size={dm.vocab_size + 1} .* --model.network.vocab_size {dm.vocab_size}"
    ):
        LanguageModel(network(dm.vocab_size + 1)).check_data(dm)
    with pytest.raises(ConfigError, match="data.context=16 is longer than model.network.context=8"):
        LanguageModel(network(dm.vocab_size, context=8)).check_data(dm)
    with pytest.raises(ConfigError, match="model.network must be a causal language model"):
        LanguageModel(torch.nn.Linear(3, 3))


def test_the_vocabulary_travels_with_the_weights(corpus, tmp_path):
    dm = text_dm(corpus)
    trained = LanguageModel(network(dm.vocab_size))
    trained.check_data(dm)
    torch.save({"state_dict": trained.state_dict()}, tmp_path / "model.ckpt")
    fresh = LanguageModel(network(dm.vocab_size, seed=5), init_from=str(tmp_path / "model.ckpt"))
    assert fresh.characters == dm.vocabulary
    assert torch.equal(fresh.network.wte.weight, trained.network.wte.weight)
    with pytest.raises(ConfigError, match="differs from the data's"):
        fresh.check_data(other_vocabulary(dm))
    with pytest.raises(CheckpointError, match=r"model.network \(vocab_size"):
        LanguageModel(network(dm.vocab_size + 2), init_from=str(tmp_path / "model.ckpt"))


# ------------------------------------------------------------------------------------------------ training
def test_central_training_lowers_perplexity_and_reports_loss_ppl_acc(corpus):
    dm = text_dm(corpus)
    model = LanguageModel(network(dm.vocab_size), recipe=dataclasses.replace(LM_RECIPE, lr=1e-2))
    model.check_data(dm)
    from lightning_fl.methods.centralised import evaluate_classifier

    before = evaluate_classifier(model, dm.val_dataloader(), torch.device("cpu"))
    after = train_classifier(model, dm, epochs=3, accelerator="cpu")
    assert set(before) == {"val/loss", "val/ppl", "val/acc"}
    assert after["val/ppl"] == pytest.approx(math.exp(after["val/loss"]), rel=1e-5)
    assert after["val/ppl"] < 0.8 * before["val/ppl"] and after["val/acc"] > before["val/acc"]
    assert before["val/ppl"] == pytest.approx(dm.vocab_size, rel=0.3)  # an untrained model is near uniform


def test_a_diverging_loss_is_reported(corpus):
    dm = text_dm(corpus)
    model = LanguageModel(network(dm.vocab_size))
    with torch.no_grad():
        model.network.wte.weight.fill_(float("nan"))
    x, y = next(iter(dm.client_dataloader(0)))
    with pytest.raises(FloatingPointError, match="Lower model.recipe.lr"):
        model.training_step((x, y), 0)


# ------------------------------------------------------------------------------------------------ latent
def test_latent_sends_only_its_latent_and_starts_exactly_at_the_base(corpus):
    dm = text_dm(corpus)
    model = latent_model(dm.vocab_size)
    n_mats = 6 * 2  # six projections per block, two blocks
    assert set(model.federated_state()) == {"mapping.latent"}
    assert model.federated_state()["mapping.latent"].numel() == n_mats * 8
    assert not any(p.requires_grad for p in model.network.parameters())
    x = torch.randint(0, dm.vocab_size, (2, 16))
    assert torch.equal(model(x), model.network(x))  # z = 0 is the base, bit for bit
    scramble_latent(model)
    mapped = model.mapping.weights(model.mapped_base())
    assert torch.equal(model(x), functional_call(model.network, mapped, (x,), strict=False))
    assert not torch.allclose(model(x), model.network(x))


def test_latent_generation_uses_the_mapped_weights(corpus):
    dm = text_dm(corpus)
    model = latent_model(dm.vocab_size)
    model.check_data(dm)
    at_base = model.generate_text("aaron", 20)
    assert at_base == model.decode(model.network.generate(model.encode("aaron")[None], 20, temperature=0)[0])
    scramble_latent(model, seed=1)
    with torch.no_grad():
        model.mapping.latent.mul_(50)
    steered = model.generate_text("aaron", 20)
    assert steered != at_base and steered.startswith("aaron") and len(steered) == 25
    sampled = model.generate_text("aaron", 20, top_k=3, seed=4)
    assert sampled == model.generate_text("aaron", 20, top_k=3, seed=4) != steered


def test_federated_latent_logs_identity_bytes_and_text_and_resumes_bitwise(corpus, tmp_path):
    def run(root, rounds, ckpt=None, name="lm"):
        t = trainer(root, rounds=rounds, name=name, codec=Quantize(8))
        t.fit(latent_model(text_dm(corpus).vocab_size), datamodule=text_dm(corpus), ckpt_path=ckpt)
        return t

    full = run(tmp_path / "a", 3)
    rounds = full.history[1:]
    assert all(0 <= h["fed/identity_error"] <= 1e-6 for h in rounds)
    assert all(h["comm/client_up_bytes"] == 12 * 8 + 8 for h in rounds)  # 96 int8 codes, scale and zero point
    assert {"val/ppl", "val/acc", "val/loss"} <= set(full.history[0])
    events = EventAccumulator(str(full.log_dir), size_guidance={"tensors": 0}).Reload()
    samples = events.Tensors("samples/generated/text_summary")
    assert [s.step for s in samples] == [0, 3]
    assert b"characters, greedy" in samples[0].tensor_proto.string_val[0]

    first = run(tmp_path / "b", 1, name="split")
    resumed = run(tmp_path / "b", 3, ckpt=str(first.log_dir / "checkpoints" / "last.ckpt"), name="split")
    assert torch.equal(full.global_state["mapping.latent"], resumed.global_state["mapping.latent"])
    assert [h["val/ppl"] for h in full.history[2:]] == [h["val/ppl"] for h in resumed.history[2:]]


def test_a_client_with_another_base_or_factors_is_refused(corpus, tmp_path):
    first = trainer(tmp_path, rounds=1, name="fp")
    first.fit(latent_model(text_dm(corpus).vocab_size), datamodule=text_dm(corpus))
    ckpt = str(first.log_dir / "checkpoints" / "last.ckpt")
    other = latent_model(text_dm(corpus).vocab_size, seed=1)  # another base
    with pytest.raises(CheckpointError, match="fingerprint"):
        trainer(tmp_path, rounds=2, name="fp").fit(other, datamodule=text_dm(corpus), ckpt_path=ckpt)


def test_the_base_is_pretrained_once_and_shared_by_latent_and_full_weights(corpus, tmp_path):
    dm = text_dm(corpus)
    recipe = Pretraining(epochs=1, optimizer="adamw", lr=1e-2, warmup_epochs=0, cache_dir=str(tmp_path / "cache"))
    latent = LatentLanguageModel(network(dm.vocab_size), pretraining=recipe, latent_dim=8, rank=4)
    full = LanguageModel(network(dm.vocab_size), pretraining=recipe)
    latent.check_data(dm)
    full.check_data(dm)
    assert latent.base_cache_path(dm) == full.base_cache_path(dm)
    latent.prepare_base(dm)
    full.prepare_base(dm, allow_training=False)  # read from the cache, never trained again
    assert torch.equal(latent.network.wte.weight, full.network.wte.weight)
    assert not torch.equal(latent.network.wte.weight, network(dm.vocab_size).wte.weight)
    assert latent.characters == dm.vocabulary
    assert LanguageModel(network(dm.vocab_size, seed=1), pretraining=recipe).base_cache_path(
        dm
    ) != full.base_cache_path(dm)


# ------------------------------------------------------------------------------------------------ configs
def shrink(corpus, vocab: int) -> list[str]:
    return [
        "--data.source.root",
        str(corpus),
        "--data.source.download",
        "false",
        "--data.partition.min_lines",
        "10",
        "--data.pretrain_plays",
        "1",
        "--data.context",
        "16",
        "--data.batch_size",
        "8",
        "--model.network.vocab_size",
        str(vocab),
        "--model.network.n_layer",
        "1",
        "--model.network.n_embd",
        "16",
        "--model.network.n_head",
        "2",
        "--model.network.context",
        "16",
        "--model.sample_tokens",
        "20",
    ]


FEDERATED = ["--trainer.rounds", "2", "--trainer.clients_per_round", "3", "--model.pretraining.epochs", "1"]


def test_pretrain_config_runs_and_its_checkpoint_is_a_flite_base(corpus, in_tmp, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    args = shrink(corpus, text_dm(corpus).vocab_size)
    pretrain = ["--trainer.max_epochs", "1", "--trainer.enable_model_summary", "false"]
    assert run_cli("fit", "--config", str(CONFIGS / "pretrain_shakespeare.yaml"), *args, *pretrain) == 0
    run = in_tmp / "runs" / "pretrain_shakespeare" / "version_0"
    events = EventAccumulator(str(run), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    assert {"val/ppl", "val/acc", "val/loss"} <= set(events.Tags()["scalars"])
    assert len(events.Tensors("samples/generated/text_summary")) == 2  # before and after training
    ckpt = run / "checkpoints" / "last.ckpt"
    base = ["--model.base_checkpoint", str(ckpt), "--model.latent_dim", "4", "--model.rank", "2"]
    assert run_cli("fit", "--config", str(CONFIGS / "flite_shakespeare.yaml"), *args, *FEDERATED, *base) == 0
    assert not (in_tmp / "cache" / "bases").exists()  # the checkpoint was the base: nothing pretrained
    (last,) = (in_tmp / "runs" / "flite_shakespeare").glob("version_*/checkpoints/last.ckpt")
    history = torch.load(last, weights_only=True)["history"]
    assert history[0]["val/ppl"] == pytest.approx(events.Scalars("val/ppl")[-1].value, rel=1e-5)  # the same model


def test_flite_and_fedavg_configs_share_the_base_and_count_their_bytes(corpus, in_tmp, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    args = [*shrink(corpus, text_dm(corpus).vocab_size), *FEDERATED]
    runs = {"flite_shakespeare": ["--model.latent_dim", "4", "--model.rank", "2"], "fedavg_shakespeare": []}
    for config, extra in runs.items():
        assert run_cli("fit", "--config", str(CONFIGS / f"{config}.yaml"), *args, *extra) == 0
    assert len(list((in_tmp / "cache" / "bases").iterdir())) == 1
    flite, fedavg = (
        torch.load(next((in_tmp / "runs" / n).glob("version_*/checkpoints/last.ckpt")), weights_only=True)["history"]
        for n in runs
    )
    assert flite[0]["val/ppl"] == fedavg[0]["val/ppl"]  # round 0 of both is the same base
    assert flite[-1]["comm/client_up_bytes"] == 6 * 4 * 4  # 6 projections x d=4 x float32
    full = sum(p.numel() for p in network(text_dm(corpus).vocab_size, n_layer=1).parameters())
    assert fedavg[-1]["comm/client_up_bytes"] == 4 * full
    assert all(0 <= h["fed/identity_error"] <= 1e-6 for h in flite[1:])


def test_a_wrong_vocab_size_exits_2_naming_the_key(corpus, in_tmp, monkeypatch, capsys):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    args = shrink(corpus, text_dm(corpus).vocab_size + 3)
    assert run_cli("fit", "--config", str(CONFIGS / "flite_shakespeare.yaml"), *args, *FEDERATED) == 2
    err = capsys.readouterr().err
    assert f"--model.network.vocab_size {text_dm(corpus).vocab_size}" in err


# ------------------------------------------------------------------------------------------------ LoRA
@pytest.mark.parametrize("variant", ["lora", "ffa"])
def test_lora_on_tinygpt_shares_the_base_starts_exactly_there_and_sends_its_adapters(corpus, tmp_path, variant):
    pytest.importorskip("peft")
    from lightning_fl.methods import LoRALanguageModel

    dm = text_dm(corpus)
    recipe = Pretraining(epochs=1, optimizer="adamw", lr=1e-2, warmup_epochs=0, cache_dir=str(tmp_path / "cache"))
    full = LanguageModel(network(dm.vocab_size), pretraining=recipe)
    lora = LoRALanguageModel(network(dm.vocab_size), pretraining=recipe, variant=variant, rank=2, sample_tokens=0)
    full.check_data(dm)
    lora.check_data(dm)
    assert lora.base_cache_path(dm) == full.base_cache_path(dm)
    full.prepare_base(dm)
    lora.prepare_base(dm, allow_training=False)  # FLITE's and FedAvg's cached base, read through the plain names
    x = dm.client_dataloader(0, seed=0).__iter__().__next__()[0]
    assert torch.equal(lora(x), full(x))
    linears = {n: m for n, m in lora.base_network().named_modules() if isinstance(m, torch.nn.Linear)}
    assert sorted(lora.adapted) == sorted(linears)
    values = sum(2 * (m.in_features if variant == "lora" else 0) + 2 * m.out_features for m in linears.values())
    assert sum(t.numel() for t in lora.federated_state().values()) == values

    t = trainer(tmp_path, rounds=2, name=variant)
    t.fit(lora, datamodule=text_dm(corpus))
    errors = [h["fed/identity_error"] for h in t.history[1:]]
    assert all(e > 1e-9 for e in errors) if variant == "lora" else all(e < 1e-15 for e in errors)
    assert all(h["comm/client_up_bytes"] == 4 * values for h in t.history[1:])
