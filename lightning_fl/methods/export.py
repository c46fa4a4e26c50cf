"""A fine-tuned language model out as a Hugging Face folder: ``python -m lightning_fl export``.

:func:`export_model` writes what ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads offline: the
merged weights as safetensors (float32; full weights as trained, FLITE's latent and LoRA's adapters merged into the
weights they adapt, :meth:`~lightning_fl.methods.LanguageModel.merged_weights`), the model's config, its
tokenizer (with its chat template) and a generation config that stops where our generation stops (greedy, the
end-of-sequence tokens). :func:`export_adapter` writes a PEFT adapter folder instead (LoRA and FFA-LoRA: their
``A`` and ``B``), which ``peft.PeftModel.from_pretrained(base, DIR)`` puts on the base model. Each folder also
holds ``lightning_fl_export.json``: the method, the checkpoint and its round, and the source model.

A folder is written beside ``out`` and renamed into place when complete; an ``out`` that exists and is not empty
is refused (an export never overwrites another's files).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_fl.errors import ConfigError, UserError
from lightning_fl.models.hf import quiet_loading

#: The provenance file written into every exported folder.
PROVENANCE = "lightning_fl_export.json"


def _network(model: Any) -> Any:
    network = getattr(model, "network", None)
    if network is None or not hasattr(network, "hf") or not callable(getattr(model, "merged_weights", None)):
        raise ConfigError(
            f"export writes Hugging Face models: model.network must be a pretrained HFCausalLM or SmolLM2 (a language "
            f"model the methods fine-tune), got {type(network).__name__} in {type(model).__name__}"
        )
    return network


def _fresh(network: Any) -> Any:
    """A new float32 model of the network's architecture and config (random weights, to be overwritten)."""
    import transformers

    config = network.hf.config
    with torch.random.fork_rng(devices=[]):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _generation_config(network: Any) -> Any:
    from lightning_fl.models.hf import stop_ids

    config = network.hf.generation_config.__class__.from_dict(network.hf.generation_config.to_dict())
    stops = stop_ids(network)
    config.eos_token_id = stops if len(stops) > 1 else stops[0]
    pad = network.tokenizer.pad_token_id
    config.pad_token_id = pad if pad is not None else stops[0]
    config.do_sample = False
    return config


class _Target:
    """A temporary folder beside ``out``, renamed to ``out`` when the export is complete."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out).expanduser()
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise UserError(f"--out {self.out} exists and is not an empty folder; give a new folder")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", dir=self.out.parent))

    def __enter__(self) -> Path:
        return self.tmp

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.out.exists():
            self.out.rmdir()  # (empty: checked when the export started)
        os.replace(self.tmp, self.out)


def _provenance(folder: Path, model: Any, what: str, checkpoint: dict[str, Any]) -> None:
    info = {
        "written_by": "lightning_fl export",
        "what": what,
        "method": type(model).__name__,
        "source_model": getattr(model.network, "source", None),
        **checkpoint,
    }
    (folder / PROVENANCE).write_text(json.dumps(info, indent=2) + "\n")


def export_model(model: Any, out: str | Path, checkpoint: dict[str, Any] | None = None) -> Path:
    """Write ``model``'s fine-tuned network as a Hugging Face model folder ``out`` (module docstring); return it.

    ``checkpoint``: what to record of where the weights came from (path, round)."""
    import transformers

    network = _network(model)
    state = {k.removeprefix("hf."): v for k, v in model.merged_weights().items() if k.startswith("hf.")}
    fresh = _fresh(network)
    result = fresh.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ConfigError(
            f"export: the merged weights do not fit {type(fresh).__name__} (missing {result.missing_keys[:3]}, "
            f"unexpected {result.unexpected_keys[:3]})"
        )
    bad = [k for k, v in state.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise UserError(f"export: the fine-tuned weights hold NaN or Inf ({bad[:3]}); export a checkpoint before it")
    fresh.generation_config = _generation_config(network)
    with _Target(out) as folder, quiet_loading(transformers):
        fresh.save_pretrained(folder, safe_serialization=True)
        network.tokenizer.save_pretrained(folder)
        _provenance(
            folder, model, "merged weights (transformers.AutoModelForCausalLM.from_pretrained)", checkpoint or {}
        )
    return Path(out)


def export_adapter(model: Any, out: str | Path, checkpoint: dict[str, Any] | None = None) -> Path:
    """Write ``model``'s LoRA or FFA-LoRA adapters as a PEFT adapter folder ``out`` (``PeftModel.from_pretrained(base,
    out)`` loads it on the base model, e.g. SmolLM2's GGUF loaded by transformers); return it."""
    network = _network(model)
    adapters = getattr(model, "adapter_config", None)
    if not callable(adapters):
        raise ConfigError(
            f"export --adapter writes LoRA and FFA-LoRA adapters as a PEFT folder; {type(model).__name__} has none "
            "(a FLITE latent is not a PEFT adapter): export its merged weights, without --adapter"
        )
    import transformers
    from peft import LoraConfig, get_peft_model

    from lightning_fl.methods.lora import ADAPTER, plain_name

    spec = adapters()
    fresh = _fresh(network)
    prefix = "network.hf."
    base = {
        plain_name(k).removeprefix(prefix): v.float() for k, v in model.own_weights().items() if k.startswith(prefix)
    }
    result = fresh.load_state_dict(base, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ConfigError(f"export --adapter: the base weights do not fit {type(fresh).__name__} ({result})")
    exactly = "|".join(t.replace(".", r"\.") for t in spec["targets"])
    config = LoraConfig(
        r=spec["r"],
        lora_alpha=spec["lora_alpha"],
        target_modules=f"(?:{exactly})",
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=getattr(network, "source", None),
    )
    with warnings.catch_warnings():  # (PEFT calls an attribute transformers 5 renamed: nothing a user can act on)
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
        peft_model = get_peft_model(fresh, config)
    with torch.no_grad():
        for target in spec["targets"]:
            mine = network.hf.get_submodule(target)
            theirs = peft_model.base_model.model.get_submodule(target)
            for part in ("lora_A", "lora_B"):
                getattr(theirs, part)[ADAPTER].weight.copy_(getattr(mine, part)[ADAPTER].weight.float())
    with _Target(out) as folder, quiet_loading(transformers):
        peft_model.save_pretrained(folder)
        network.tokenizer.save_pretrained(folder)
        _provenance(folder, model, "PEFT LoRA adapter (peft.PeftModel.from_pretrained(base, folder))", checkpoint or {})
    return Path(out)
