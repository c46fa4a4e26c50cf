"""``python -m lightning_fl export``: a fine-tuned model out as a folder plain ``transformers`` (and PEFT) load, whose
logits and greedy answers are ours. Tiny random models in the default suite; SmolLM2 itself in a slow test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import CONFIGS, run_cli
from lightning_fl import FederatedTrainer, LatentLanguageModel
from lightning_fl.checkpoint import read_checkpoint
from lightning_fl.cli.export import run_export
from lightning_fl.data import Dirichlet, FederatedInstructionDataModule, InstructionTasks
from lightning_fl.errors import CheckpointError, ConfigError, UserError
from lightning_fl.methods import LanguageModel, LoRALanguageModel, Recipe
from lightning_fl.methods.export import PROVENANCE, export_model
from lightning_fl.models import HFCausalLM

transformers = pytest.importorskip("transformers")  # the llm extra
#: What "equal" means for logits of the same weights computed by two code paths (ours hooks or adapters, theirs a
#: merged weight): float32 rounding of sums taken in another order.
ATOL = 1e-5
QUESTION = "What is 12 + 30? Answer with the number only."
METHODS = ["full", "flite_two_sided", "flite_stored", "flite_kronecker", "lora", "ffa"]


def build(folder: Path, method: str, **kwargs):
    network = HFCausalLM(str(folder), context=64)
    constant = {"schedule": "constant", "warmup_epochs": 0.0}
    if method in ("lora", "ffa"):
        recipe = Recipe(optimizer="adam", lr=0.05, weight_decay=0.0, **constant)
        return LoRALanguageModel(network, rank=2, variant=method, sample_tokens=0, recipe=recipe, **kwargs)
    if method.startswith("flite"):
        recipe = Recipe(optimizer="adam", lr=0.5, **constant)
        family = method.removeprefix("flite_")
        return LatentLanguageModel(
            network, latent_dim=16, rank=16, factors=family, sample_tokens=0, recipe=recipe, **kwargs
        )
    return LanguageModel(network, recipe=Recipe(optimizer="adamw", lr=1e-2, **constant), sample_tokens=0)


@pytest.fixture(scope="module")
def trained(tiny_chat_llama, tmp_path_factory):
    """Each method fine-tuned for 2 rounds on the built-in task: ``{method: (model, last.ckpt)}``."""
    out = {}
    for method in METHODS:
        root = tmp_path_factory.mktemp(method)
        source = InstructionTasks(
            tasks=["arithmetic", "units"], train_per_task=24, val_per_task=4, test_per_task=4, public_per_task=0
        )
        data = FederatedInstructionDataModule(
            source,
            tokenizer=str(tiny_chat_llama),
            num_clients=4,
            partition=Dirichlet(alpha=0.5),
            context=64,
            max_new_tokens=6,
        )
        model = build(tiny_chat_llama, method)
        FederatedTrainer(
            rounds=2,
            clients_per_round=2,
            local_steps=3,
            accelerator="cpu",
            logger=False,
            default_root_dir=str(root),
            enable_progress_bar=False,
            val_every_n_rounds=2,
        ).fit(model, datamodule=data)
        out[method] = (model.eval(), next(root.rglob("last.ckpt")))
    return out


def their_answer(model, tokenizer, question: str, max_new_tokens: int = 8) -> str:
    """Plain transformers: the chat template, greedy ``generate`` with the folder's generation config."""
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=max_new_tokens)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("method", METHODS)
def test_the_exported_folder_loads_in_plain_transformers_with_our_logits_and_answers(
    method, trained, tiny_chat_llama, tmp_path
):
    model, ckpt = trained[method]
    line = run_export(build(tiny_chat_llama, method), str(ckpt), str(tmp_path / "out"), adapter=False)
    assert line.startswith(f"export: wrote a Hugging Face model folder (merged weights) to {tmp_path / 'out'}")
    folder = tmp_path / "out"
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert json.loads((folder / PROVENANCE).read_text())["round"] == 2
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours_logits, their_logits = model(ids), theirs(ids).logits
    assert (ours_logits - their_logits).abs().max().item() < ATOL
    assert (ours_logits - build(tiny_chat_llama, "full")(ids)).abs().max().item() > 100 * ATOL  # it was trained
    assert their_answer(theirs, tokenizer, QUESTION) == model.generate_text(QUESTION, 8, chat=True)


@pytest.mark.parametrize("method", ["lora", "ffa"])
def test_lora_adapters_export_as_a_peft_folder_the_base_model_takes(method, trained, tiny_chat_llama, tmp_path):
    peft = pytest.importorskip("peft")
    model, ckpt = trained[method]
    run_export(build(tiny_chat_llama, method), str(ckpt), str(tmp_path / "adapter"), adapter=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["peft_type"]) == (2, "LORA")
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_chat_llama, local_files_only=True)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids) - theirs(ids).logits).abs().max().item() < ATOL


def test_what_cannot_be_exported_is_one_clear_line(trained, tiny_chat_llama, tmp_path):
    _, flite_ckpt = trained["flite_two_sided"]
    with pytest.raises(ConfigError, match="a FLITE latent is not a PEFT adapter"):
        run_export(build(tiny_chat_llama, "flite_two_sided"), str(flite_ckpt), str(tmp_path / "a"), adapter=True)
    other_factors = build(tiny_chat_llama, "flite_two_sided", factor_seed=7)
    with pytest.raises(CheckpointError, match="fingerprint differs from this config's"):
        run_export(other_factors, str(flite_ckpt), str(tmp_path / "b"), adapter=False)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("another run's file")
    with pytest.raises(UserError, match="exists and is not an empty folder"):
        run_export(build(tiny_chat_llama, "flite_two_sided"), str(flite_ckpt), str(tmp_path / "taken"), False)
    assert (tmp_path / "taken" / "keep.txt").read_text() == "another run's file"
    with pytest.raises(UserError, match="export needs --ckpt_path"):
        run_export(build(tiny_chat_llama, "lora"), None, str(tmp_path / "c"), False)
    from lightning_fl.models import TinyGPT

    characters = LanguageModel(TinyGPT(vocab_size=20, n_layer=1, n_embd=8, n_head=2, context=8), sample_tokens=0)
    with pytest.raises(ConfigError, match="export writes Hugging Face models"):
        export_model(characters, tmp_path / "d")
    assert not any(p.name.startswith((".a.", ".b.", ".d.")) for p in tmp_path.iterdir())  # no half-written folder


def tiny_instruction_args(folder: Path) -> list[str]:
    """Overrides that put the tiny chat model into configs/smollm2_instruct_*.yaml, shrunk to seconds."""
    network = f"{{class_path: lightning_fl.models.HFCausalLM, init_args: {{path: {folder}, context: 64}}}}"
    return [
        "--model.init_args.network",
        network,
        "--data.init_args.tokenizer",
        str(folder),
        "--data.init_args.source.init_args.tasks",
        "[arithmetic, units]",
        "--data.init_args.source.init_args.train_per_task",
        "24",
        "--data.init_args.source.init_args.val_per_task",
        "3",
        "--data.init_args.source.init_args.test_per_task",
        "3",
        "--data.init_args.source.init_args.public_per_task",
        "0",
        "--data.init_args.num_clients",
        "4",
        "--data.init_args.context",
        "64",
        "--trainer.clients_per_round",
        "2",
        "--trainer.local_steps",
        "2",
        "--trainer.rounds",
        "1",
        "--trainer.val_every_n_rounds",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger",
        "false",
        "--trainer.threads",
        "1",
    ]


def test_the_command_line_fits_then_exports_the_instruction_config(tiny_chat_llama, in_tmp, capsys):
    config = str(CONFIGS / "smollm2_instruct_lora.yaml")
    args = ["--config", config, *tiny_instruction_args(tiny_chat_llama)]
    assert run_cli("fit", *args) == 0
    fit_out = capsys.readouterr().out
    assert "test/exact_match: " in fit_out and "val/exact_match: " in fit_out
    ckpt = next(Path("runs").rglob("last.ckpt"))
    saved = ckpt.parent.parent / "config.yaml"
    assert run_cli("export", "--config", str(saved), "--ckpt_path", str(ckpt), "--out", "hf") == 0
    assert "export: wrote a Hugging Face model folder" in capsys.readouterr().out
    transformers.AutoModelForCausalLM.from_pretrained("hf", local_files_only=True)
    assert (
        run_cli("export", "--config", str(saved), "--ckpt_path", str(ckpt), "--out", "peft", "--adapter", "true") == 0
    )
    assert (Path("peft") / "adapter_model.safetensors").is_file()
    assert run_cli("export", "--config", str(saved), "--ckpt_path", str(ckpt), "--out", "hf") == 2
    assert "--out hf exists and is not an empty folder; give a new folder" in capsys.readouterr().err


#: What each other shipped instruction config needs beyond :func:`tiny_instruction_args` to fit the tiny model:
#: FLITE's and Fed-SB's sizes must fit the tiny model's 32- and 64-wide layers, and Fed-SB's adapters come from
#: the task's public records.
OTHER_INSTRUCTION_CONFIGS = {
    "flite": ["--model.init_args.latent_dim", "16", "--model.init_args.rank", "16"],
    "fedavg": [],
    "fed_sb": [
        "--data.init_args.source.init_args.public_per_task",
        "4",
        "--model.init_args.rank",
        "4",
        "--model.init_args.public_records",
        "4",
    ],
}


@pytest.mark.parametrize("name", sorted(OTHER_INSTRUCTION_CONFIGS))
def test_each_instruction_config_fits_scores_and_exports_on_the_tiny_model(name, tiny_chat_llama, in_tmp, capsys):
    """configs/smollm2_instruct_{flite,fed_sb,fedavg}.yaml as shipped (their method, recipe, strategy and scoring),
    the tiny chat model in SmolLM2's place: a round fits, the base and final models are scored on the task, and
    the export is a folder transformers loads."""
    config = str(CONFIGS / f"smollm2_instruct_{name}.yaml")
    args = ["--config", config, *tiny_instruction_args(tiny_chat_llama), *OTHER_INSTRUCTION_CONFIGS[name]]
    assert run_cli("fit", *args) == 0
    fit_out = capsys.readouterr().out
    assert "test/exact_match: " in fit_out and "val/exact_match: " in fit_out
    ckpt = next(Path("runs").rglob("last.ckpt"))
    saved = str(ckpt.parent.parent / "config.yaml")
    assert run_cli("export", "--config", saved, "--ckpt_path", str(ckpt), "--out", "hf") == 0
    transformers.AutoModelForCausalLM.from_pretrained("hf", local_files_only=True)


@pytest.mark.slow
def test_smollm2_fine_tuned_with_lora_exports_a_model_transformers_generates_from_as_we_do(tmp_path, monkeypatch):
    """SmolLM2 itself (fetched once, 98 MB): one round of LoRA on the built-in task, exported, loaded by plain
    transformers; logits within ATOL (float32 sums in another order) and the same greedy answers."""
    monkeypatch.chdir(tmp_path)
    config = str(CONFIGS / "smollm2_instruct_lora.yaml")
    shrink = [
        "--trainer.rounds",
        "1",
        "--trainer.val_every_n_rounds",
        "1",
        "--trainer.clients_per_round",
        "2",
        "--trainer.local_steps",
        "2",
        "--trainer.test_after_fit",
        "false",
        "--trainer.logger",
        "false",
        "--data.init_args.source.init_args.val_per_task",
        "2",
        "--model.init_args.recipe.lr",
        "0.01",
        "--trainer.enable_progress_bar",
        "false",
    ]
    assert run_cli("fit", "--config", config, *shrink) == 0
    ckpt = next(Path("runs").rglob("last.ckpt"))
    saved = str(ckpt.parent.parent / "config.yaml")
    assert run_cli("export", "--config", saved, "--ckpt_path", str(ckpt), "--out", "hf") == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained("hf", local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained("hf", local_files_only=True)
    from lightning_fl.cli import build

    ours = build(["validate", "--config", saved]).model
    from lightning_fl.federated.persistence.checkpoint import load_for_evaluation

    load_for_evaluation(ours, ckpt, torch.device("cpu"))
    ours.eval()
    ids = torch.tensor([tokenizer.encode("To be, or not to be, that is the question", add_special_tokens=False)])
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-4
    for question in (QUESTION, "Which number is larger, 4817 or 4871? Answer with the number only."):
        assert their_answer(theirs, tokenizer, question, 12) == ours.generate_text(question, 12, chat=True)


def test_the_how_to_runs_as_written_with_a_tiny_model_in_smollm2s_place(tiny_chat_llama, in_tmp, capsys):
    """docs/how-to/instruction-data.md: its ten records, its fit and export commands (the tiny chat model put in
    SmolLM2's place by overrides) and its Python that generates with plain transformers."""
    import contextlib
    import io
    import shlex

    from conftest import REPO

    page = (REPO / "docs" / "how-to" / "instruction-data.md").read_text()
    records = page.split("```json\n", 1)[1].split("```", 1)[0]
    assert len(records.strip().splitlines()) == 10
    (in_tmp / "my_instructions.jsonl").write_text(records)
    (in_tmp / "configs").mkdir()
    (in_tmp / "configs" / "smollm2_instruct_lora.yaml").write_text((CONFIGS / "smollm2_instruct_lora.yaml").read_text())
    commands = [" ".join(b.split("```", 1)[0].replace("\\\n", " ").split()) for b in page.split("```bash\n")[1:]]
    fit, export = (shlex.split(c)[3:] for c in commands)  # (after "python -m lightning_fl")
    network = f"{{class_path: lightning_fl.models.HFCausalLM, init_args: {{path: {tiny_chat_llama}, context: 64}}}}"
    tiny = [
        "--model.init_args.network",
        network,
        "--data.init_args.tokenizer",
        str(tiny_chat_llama),
        "--data.init_args.context",
        "64",
        "--trainer.threads",
        "1",
        "--trainer.logger",
        "false",
        "--trainer.enable_progress_bar",
        "false",
    ]
    assert run_cli(*fit, *tiny) == 0
    out = capsys.readouterr()
    assert "instruction data: train: 8 records" in out.out and "val/exact_match: " in out.out
    assert "4 clients" in out.err  # alice, bob, carol, dave
    assert run_cli(*export) == 0
    python = page.split("```python\n", 1)[1].split("```", 1)[0]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(python, "instruction-data.md", "exec"), {})
    from lightning_fl.cli import build
    from lightning_fl.federated.persistence.checkpoint import load_for_evaluation

    folder = in_tmp / "runs" / "my_instructions" / "version_0"
    ours = build(["validate", "--config", str(folder / "config.yaml")]).model
    load_for_evaluation(ours, folder / "checkpoints" / "last.ckpt", torch.device("cpu"))
    assert printed.getvalue() == ours.eval().generate_text("What is the capital of Spain?", 16, chat=True) + "\n"


def test_the_llm_tutorial_ends_with_text_generated_by_plain_transformers(tiny_chat_llama, in_tmp, capsys):
    """docs/tutorials/llm.md, section 7: its fit and export commands as written (the tiny chat model put in
    SmolLM2's place and the run shrunk by overrides), then its Python, which must print our model's answers."""
    import ast
    import contextlib
    import io
    import shlex

    from conftest import REPO

    page = (REPO / "docs" / "tutorials" / "llm.md").read_text().split("## 7. ", 1)[1]
    (in_tmp / "configs").mkdir()
    (in_tmp / "configs" / "smollm2_instruct_lora.yaml").write_text((CONFIGS / "smollm2_instruct_lora.yaml").read_text())
    commands = [" ".join(b.split("```", 1)[0].replace("\\\n", " ").split()) for b in page.split("```bash\n")[1:]]
    fit, export = (shlex.split(c)[3:] for c in commands)  # (after "python -m lightning_fl")
    assert run_cli(*fit, *tiny_instruction_args(tiny_chat_llama)) == 0
    assert "test/exact_match: " in capsys.readouterr().out
    assert run_cli(*export) == 0
    python = page.split("```python\n", 1)[1].split("```", 1)[0]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(python, "llm.md", "exec"), {})
    from lightning_fl.cli import build
    from lightning_fl.federated.persistence.checkpoint import load_for_evaluation

    folder = in_tmp / "runs" / "smollm2_instruct_lora" / "version_0"
    ours = build(["validate", "--config", str(folder / "config.yaml")]).model.eval()
    load_for_evaluation(ours, folder / "checkpoints" / "last.ckpt", torch.device("cpu"))
    loop = next(node for node in ast.walk(ast.parse(python)) if isinstance(node, ast.For))
    questions = [ast.literal_eval(q) for q in loop.iter.elts]
    assert len(questions) == 3
    assert printed.getvalue() == "".join(f"{q} -> {ours.generate_text(q, 16, chat=True)}\n" for q in questions)


@pytest.mark.parametrize(
    "private",
    [
        [
            "--trainer.privacy",
            "CentralDP",
            "--trainer.privacy.noise_multiplier",
            "1.0",
            "--trainer.privacy.clip_norm",
            "0.05",
            "--trainer.max_update_norm_ratio",
            "null",
            "--trainer.strategy.init_args.weighted",
            "false",
        ],
        [
            "--trainer.dp_sgd",
            "DPSGD",
            "--trainer.dp_sgd.noise_multiplier",
            "1.0",
            "--trainer.dp_sgd.max_grad_norm",
            "1.0",
            "--trainer.strategy.init_args.weighted",
            "false",
        ],
    ],
    ids=["central_dp", "dp_sgd"],
)
def test_instruction_tuning_runs_privately_and_spends_a_budget(private, tiny_chat_llama, in_tmp, capsys):
    config = str(CONFIGS / "smollm2_instruct_lora.yaml")
    args = ["--config", config, *tiny_instruction_args(tiny_chat_llama), "--trainer.rounds", "2"]
    assert run_cli("fit", *args, *private) == 0
    out = capsys.readouterr().out
    assert "val/exact_match: " in out and "epsilon" in out
    ckpt = read_checkpoint(next(Path("runs").rglob("last.ckpt")))
    if "--trainer.privacy" in private:  # user-level: every round spends
        spent = [h["privacy/epsilon"] for h in ckpt["history"][1:]]
        assert 0 < spent[0] < spent[1] < float("inf")
    else:  # record-level: the worst client's spend, which grows when that client trains again
        spent = [h["privacy/record_epsilon_max"] for h in ckpt["history"][1:]]
        assert 0 < spent[0] <= spent[1] < float("inf")
