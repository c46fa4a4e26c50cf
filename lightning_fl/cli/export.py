"""``python -m lightning_fl export --config FILE --ckpt_path CKPT --out DIR [--adapter]``: a fine-tuned language
model out of a run's checkpoint as a Hugging Face folder (:mod:`lightning_fl.methods.export`).

The config builds the model as the run built it (give the run folder's ``config.yaml``); the checkpoint's global
state (its latent, adapters or weights) is loaded into it, checked as ``validate`` checks it, and a round
checkpoint's model fingerprint must equal the model's: FLITE's factors are regenerated from the config's seed, so a
config with another ``factor_seed``, ``layers`` or ``rank`` would merge another model, and is refused (so does
``validate``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_fl.errors import UserError

#: The export subcommand's own options (besides the config's keys), with their help.
EXPORT_OPTIONS = {
    "out": "The folder to write (new, or empty).",
    "adapter": "Write a PEFT adapter folder (LoRA, FFA-LoRA) instead of merged weights.",
}


def run_export(model: Any, ckpt_path: str | None, out: str | None, adapter: bool, data: Any = None) -> str:
    """Load ``ckpt_path`` into ``model`` and write it to ``out``; the lines to print. ``data``: the config's data
    module, which prepares what the model makes from data before the checkpoint is loaded (a subspace from public
    records: Fed-SB, ``subspace: public``)."""
    from lightning_fl.federated.persistence.checkpoint import load_for_evaluation
    from lightning_fl.methods.export import export_adapter, export_model

    if ckpt_path is None:
        raise UserError("export needs --ckpt_path: the run's checkpoint (e.g. <run>/checkpoints/last.ckpt)")
    if not out:
        raise UserError("export needs --out DIR: the folder to write the model to")
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise UserError(
            f"ckpt_path {ckpt_path} does not exist; pass a checkpoint file (e.g. <run>/checkpoints/last.ckpt)"
        )
    if data is not None and getattr(model, "hparams", {}).get("subspace") == "public":
        data.prepare_data()
        data.setup("fit")
        model.prepare_base(data)
    fingerprint = model.factor_fingerprint() if callable(getattr(model, "factor_fingerprint", None)) else None
    completed = load_for_evaluation(model, path, torch.device("cpu"), fingerprint)
    record: dict[str, Any] = {"checkpoint": str(path)} | ({"round": completed} if completed is not None else {})
    written = (export_adapter if adapter else export_model)(model, out, record)
    what = "a PEFT adapter folder" if adapter else "a Hugging Face model folder (merged weights)"
    load = (
        f"peft.PeftModel.from_pretrained(base_model, {str(written)!r})"
        if adapter
        else f"transformers.AutoModelForCausalLM.from_pretrained({str(written)!r})"
    )
    return f"export: wrote {what} to {written} (from {path}); load it with {load}"
