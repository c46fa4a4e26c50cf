"""Hugging Face folders a user (or an attacker) points ``HFCausalLM`` at: none runs code, and each one that cannot be
a causal LM's intact weights is one line naming the file and the fix (issue 72, item 10), never a traceback, never
a model that silently starts from random or non-finite weights."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import save_tiny_chat_model, task_text
from lightning_fl.errors import ConfigError
from lightning_fl.models import HFCausalLM

transformers = pytest.importorskip("transformers")  # the llm extra
safetensors_torch = pytest.importorskip("safetensors.torch")


class Payload:
    """Unpickling this runs ``touch MARKER``: a malicious ``pytorch_model.bin``."""

    marker = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def edit_weights(folder: Path, edit) -> None:
    weights = safetensors_torch.load_file(folder / "model.safetensors")
    edit(weights)
    safetensors_torch.save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def first(weights: dict, part: str) -> str:
    return next(k for k in weights if part in k)


def malicious_pickle(folder: Path, marker: Path) -> None:
    (folder / "model.safetensors").unlink()
    Payload.marker = str(marker)
    torch.save({"model.embed_tokens.weight": Payload()}, folder / "pytorch_model.bin")


def plain_pickle(folder: Path, marker: Path) -> None:  # a pickle of no tensors: every weight would start random
    (folder / "model.safetensors").unlink()
    torch.save({"notes": [1, 2, 3]}, folder / "pytorch_model.bin")


def truncated(folder: Path, marker: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def garbage(folder: Path, marker: Path) -> None:
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4)


def huge_header(folder: Path, marker: Path) -> None:
    (folder / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")


def empty(folder: Path, marker: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"")


def wrong_shape(folder: Path, marker: Path) -> None:
    edit_weights(folder, lambda w: w.__setitem__(first(w, "q_proj"), torch.zeros(3, 3)))


def missing_weight(folder: Path, marker: Path) -> None:
    edit_weights(folder, lambda w: w.pop(first(w, "down_proj")))


def non_finite(folder: Path, marker: Path) -> None:
    edit_weights(folder, lambda w: w[first(w, "v_proj")].__setitem__((0, 0), float("nan")))


def config_list(folder: Path, marker: Path) -> None:
    (folder / "config.json").write_text("[1, 2]")


def config_garbage(folder: Path, marker: Path) -> None:
    (folder / "config.json").write_text("{not json")


def encoder(folder: Path, marker: Path) -> None:  # BERT would load as a causal LM with a bidirectional encoder
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (folder / name).unlink(missing_ok=True)
    config = transformers.BertConfig(
        vocab_size=400, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    transformers.BertForMaskedLM(config).save_pretrained(folder)


def tokenizer_garbage(folder: Path, marker: Path) -> None:
    (folder / "tokenizer.json").write_text("{}")


HOSTILE = {
    "malicious_pickle": (malicious_pickle, "UnpicklingError"),
    "plain_pickle": (plain_pickle, "lacks"),
    "truncated": (truncated, "SafetensorError"),
    "garbage": (garbage, "SafetensorError"),
    "huge_header": (huge_header, "SafetensorError"),
    "empty": (empty, "SafetensorError"),
    "wrong_shape": (wrong_shape, "another shape"),
    "missing_weight": (missing_weight, "lacks 1 of the model's weights"),
    "non_finite": (non_finite, "NaN or Inf weights"),
    "config_list": (config_list, "holds a list, not a JSON object"),
    "config_garbage": (config_garbage, "is not readable JSON"),
    "encoder": (encoder, "names BertForMaskedLM, not a causal language model"),
    "tokenizer_garbage": (tokenizer_garbage, "no tokenizer could be loaded"),
}


@pytest.fixture(scope="module")
def intact(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("intact"), task_text())


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_or_broken_folder_is_one_line_and_runs_no_code(case, intact, tmp_path):
    folder = tmp_path / case
    shutil.copytree(intact, folder)
    marker = tmp_path / "code-ran"
    make, says = HOSTILE[case]
    make(folder, marker)
    with pytest.raises(ConfigError) as err:
        HFCausalLM(str(folder), context=32)
    message = str(err.value)
    assert message.startswith("model.network") and str(folder) in message and says in message, message
    assert "\n" not in message
    assert not marker.exists()


def test_a_tokenizers_auto_map_is_never_run_nor_asked_about(intact, tmp_path, monkeypatch):
    folder = tmp_path / "auto_map"
    shutil.copytree(intact, folder)
    marker = tmp_path / "code-ran"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
    )
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("transformers asked whether to run the code"))
    asked = []
    for auto in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        original = auto.from_pretrained.__func__

        def spy(cls, *args, original=original, **kwargs):
            asked.append(kwargs.get("trust_remote_code"))  # (None would ask on a terminal)
            return original(cls, *args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", classmethod(spy))
    net = HFCausalLM(str(folder), context=32)
    assert not marker.exists() and type(net.tokenizer).__name__ != "EvilTokenizer"
    assert asked == [False, False]


def test_the_command_line_refuses_a_broken_folder_in_one_line(intact, tmp_path, capsys):
    from conftest import CONFIGS, run_cli

    folder = tmp_path / "broken"
    shutil.copytree(intact, folder)
    truncated(folder, tmp_path / "unused")
    network = f"{{class_path: lightning_fl.models.HFCausalLM, init_args: {{path: {folder}, context: 64}}}}"
    code = run_cli(
        "fit",
        "--config",
        str(CONFIGS / "smollm2_instruct_lora.yaml"),
        "--model.init_args.network",
        network,
        "--data.init_args.tokenizer",
        str(intact),
        "--trainer.logger",
        "false",
    )
    err = capsys.readouterr().err
    assert code == 2 and "transformers could not load a causal LM from" in err and "Traceback" not in err
