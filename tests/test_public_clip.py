"""tools/public_clip.py: a CentralDP clip bound from public pseudo-clients, never from the private clients.

On the tiny Llama (conftest's ``tiny_llama``) in place of SmolLM2 in ``configs/smollm2_lora.yaml``, on a small
TinyGPT character model in ``configs/fedavg_shakespeare.yaml`` and on synthetic images in
``configs/fedavg_fashion_mnist.yaml``: the tool's norms are those of updates computed here by calling
:func:`~lightning_fl.federated.clients.client.run_client` directly, it runs with the private clients' data unreachable,
and a data module without public data is refused in one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import CONFIGS, PLAYS, play_text, tiny_llama_args, tool_module, write_corpus
from lightning_fl.cli import build
from lightning_fl.data import ByRole, FederatedDataModule, FederatedTextDataModule, Shakespeare
from lightning_fl.errors import ConfigError
from lightning_fl.federated.clients.client import ClientJob, run_client

clip = tool_module("public_clip")
SMALL = ["--clients", "3", "--windows", "5", "--seed", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plays") / "texts"
    return write_corpus(folder, {name: play_text(name.upper(), roles) for name, roles in PLAYS.items()})


def smollm2(method: str, tiny_llama, corpus) -> list[str]:
    """``fit`` of configs/smollm2_{method}.yaml on the tiny model, as tests/test_llm_federated.py's ``tiny``."""
    pytest.importorskip("peft")  # (and transformers, through tiny_llama: the llm extra)
    latent = ["--model.init_args.latent_dim", "8", "--model.init_args.rank", "4"] if method == "flite" else []
    return ["fit", "--config", str(CONFIGS / f"smollm2_{method}.yaml"), *latent, *tiny_llama_args(tiny_llama, corpus)]


@pytest.fixture
def lora(tiny_llama, corpus):
    return smollm2("lora", tiny_llama, corpus)


def tool(args: list[str], tmp_path) -> dict:
    out = tmp_path / "clip.json"
    assert clip.main([*args, *SMALL, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def direct_norm(args: list[str]) -> float:
    """Pseudo-client 0's update norm, trained here by ``run_client`` on a loader built here (not the tool's)."""
    run = build(args)
    data, model = run.data, run.model
    data.setup("fit")
    model.setup("fit")
    groups = data.public_groups()
    rng = np.random.default_rng(1)  # the tool's draw with --seed 1: the roles' order, then client 0's windows
    group = groups[rng.permutation(len(groups))[0]]
    take = np.sort(rng.choice(len(group), min(5, len(group)), replace=False))
    windows = type(group)(group.ids, group.starts[take], group.context)

    class One:  # pseudo-client 0 alone, served as the data module serves a client: shuffled, its batch size
        def client_num_samples(self, cid):
            return len(windows)

        def client_dataloader(self, cid, seed=None):
            return DataLoader(windows, data.batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))

    start = model.federated_state()
    run_client(ClientJob(model, One(), start, 0, 1, run.trainer.codec, run.trainer.local), 0)
    trained = model.federated_state()
    assert trained.keys() == start.keys()
    return float(sum(((trained[k].double() - start[k].double()) ** 2).sum() for k in start).sqrt())


@pytest.mark.parametrize("method", ["lora", "flite"])
def test_the_norms_are_those_of_a_direct_client_round(method, tiny_llama, corpus, tmp_path, capsys):
    args = smollm2(method, tiny_llama, corpus)
    out = tool(args, tmp_path)
    printed = capsys.readouterr().out
    norms = out["norms"]
    assert len(norms) == 3 and all(n > 0 for n in norms)
    assert out["min"] == min(norms) and out["max"] == max(norms)
    assert out["clip_norm"] == out["median"] == sorted(norms)[1]
    assert f"--trainer.privacy.clip_norm {out['median']:.6g}" in printed
    assert norms[0] == pytest.approx(direct_norm(args), rel=1e-9, abs=1e-12)


def test_the_private_clients_are_never_read(lora, tmp_path, monkeypatch):
    def private(*args, **kwargs):
        raise AssertionError("a private client's data was read")

    for name in ("client_dataloader", "client_num_samples", "_client"):
        monkeypatch.setattr(FederatedTextDataModule, name, private)
    assert len(tool(lora, tmp_path)["norms"]) == 3


def test_no_public_split_is_one_line(lora, capsys):
    assert clip.main([*lora, "--data.init_args.pretrain_plays", "0", *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # (after the lines that say the model is loading)
    assert err[-1].startswith("error: data.pretrain_plays=0:") and "--data.pretrain_plays" in err[-1]
    assert [line for line in err if line.startswith("error")] == err[-1:] and not any("Traceback" in x for x in err)
    with pytest.raises(ConfigError, match="has no public split") as raised:  # no public split at all
        clip.public_clients(object(), 2, 4, 0)
    assert "\n" not in str(raised.value)
    images = FederatedDataModule.__new__(FederatedDataModule)  # (a public split of 0 samples)
    images.public_fraction, images.split_indices = 0.0, lambda name: np.zeros(0, dtype=np.int64)
    with pytest.raises(ConfigError, match=r"data.public_fraction=0.0: .* set --data.public_fraction"):
        clip.public_clients(images, 2, 4, 0)


def test_tinygpt_character_model(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(tmp_path / "cache"))
    data = FederatedTextDataModule(Shakespeare(str(corpus), download=False), partition=ByRole(10), pretrain_plays=1)
    data.setup()
    args = [
        "fit",
        "--config",
        str(CONFIGS / "fedavg_shakespeare.yaml"),
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
        str(data.vocab_size),
        "--model.network.n_layer",
        "1",
        "--model.network.n_embd",
        "16",
        "--model.network.n_head",
        "2",
        "--model.network.context",
        "16",
        "--model.sample_tokens",
        "0",
        "--model.pretraining.epochs",
        "1",
        "--trainer.local_steps",
        "2",
        "--trainer.logger",
        "false",
        "--trainer.threads",
        "1",
    ]
    out = tool(args, tmp_path)
    assert len(out["norms"]) == 3 and out["min"] <= out["median"] <= out["max"] and out["min"] > 0


def test_image_public_split(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(tmp_path / "cache"))
    for name in ("client_dataloader", "client_num_samples", "client_indices"):  # the clients stay unread here too
        monkeypatch.setattr(FederatedDataModule, name, lambda *a, **k: pytest.fail("a private client was read"))
    args = [
        "fit",
        "--config",
        str(CONFIGS / "fedavg_fashion_mnist.yaml"),
        "--data.source",
        "Synthetic",
        "--data.source.image_size",
        "28",
        "--data.source.train_size",
        "320",
        "--data.source.test_size",
        "64",
        "--model.pretraining.epochs",
        "1",
        "--trainer.logger",
        "false",
        "--trainer.threads",
        "1",
    ]
    out = tool(args, tmp_path)
    assert len(out["norms"]) == 3 and 0 < out["min"] <= out["median"] <= out["max"]
    # With public_samples, the pseudo-clients are the public images pretraining never saw (a base fits its own).
    served, serve = [], FederatedDataModule.indices_dataloader

    def watched(self, idx, seed=None):
        served.append((idx, self.split_indices("public"), self.split_indices("public_held_out")))
        return serve(self, idx, seed)

    monkeypatch.setattr(FederatedDataModule, "indices_dataloader", watched)
    tool([*args, "--data.public_samples", "20"], tmp_path)
    assert len(served) == 3
    for idx, pretraining, held_out in served:
        assert len(pretraining) == 20 and len(idx) == 5 and set(idx) <= set(held_out)
        assert not set(idx) & set(pretraining)
    served.clear()  # --pretraining-images: the images the base was fitted on (to measure the bias)
    tool([*args, "--data.public_samples", "20", "--pretraining-images"], tmp_path)
    assert len(served) == 3 and all(set(idx) <= set(pretraining) for idx, pretraining, _ in served)


def test_instruction_data_draws_pseudo_clients_from_its_public_records_only(tiny_chat_llama, tmp_path, monkeypatch):
    """configs/smollm2_instruct_lora.yaml on the tiny chat model: the public records (InstructionTasks'
    public_per_task), in groups of a mean client's size, never a client's."""
    from lightning_fl.data import FederatedInstructionDataModule

    network = f"{{class_path: lightning_fl.models.HFCausalLM, init_args: {{path: {tiny_chat_llama}, context: 64}}}}"
    args = [
        "fit",
        "--config",
        str(CONFIGS / "smollm2_instruct_lora.yaml"),
        "--model.init_args.network",
        network,
        "--data.init_args.tokenizer",
        str(tiny_chat_llama),
        "--data.init_args.context",
        "64",
        "--data.init_args.source.init_args.tasks",
        "[arithmetic, units]",
        "--data.init_args.source.init_args.train_per_task",
        "24",
        "--data.init_args.source.init_args.public_per_task",
        "12",
        "--data.init_args.num_clients",
        "4",
        "--trainer.local_steps",
        "2",
        "--trainer.threads",
        "1",
    ]
    run = build(args)
    run.data.setup()
    groups = run.data.public_groups()
    assert [len(g) for g in groups] == [12, 12]  # 24 public records, clients of 12 on average
    public = {tuple(e.prompt.tolist()) for g in groups for e in g}  # the questions
    held = {tuple(e.prompt.tolist()) for k in range(4) for e in run.data._client(k)}
    assert public and not public & held

    def private(*a, **k):
        raise AssertionError("a private client's data was read")

    for name in ("client_dataloader", "client_num_samples", "_client"):
        monkeypatch.setattr(FederatedInstructionDataModule, name, private)
    out = tool(args, tmp_path)
    assert len(out["norms"]) == 3 and all(n > 0 for n in out["norms"])
    without = [*args, "--data.init_args.source.init_args.public_per_task", "0"]
    with pytest.raises(ConfigError, match="has no public records to draw pseudo-clients from"):
        clip.update_norms(build(without), 3, 5, 1)
