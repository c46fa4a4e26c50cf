"""How far a run's adapted projections moved from the base: the spectral and Frobenius norms of each weight change.

For each run folder (``.../<name>/version_N``: its ``config.yaml`` and ``checkpoints/last.ckpt``) the tool builds the
run's model from its config (the CLI's own parser), loads the checkpoint's global state and, for every adapted linear
layer, measures the weight the layer computes with, ``W = W0 + dW``, by probing it with the identity: FLITE's
``two_sided`` latent (the deltas ride on the layers' outputs, :meth:`~lightning_fl.mapping.LatentMapping.applied`)
and PEFT's LoRA / FFA-LoRA modules (the base layer against the adapted one). It prints, per run, the median and the
largest over the layers of ``||dW||_2 / ||W0||_2`` (spectral: how much one input direction can be moved) and
``||dW||_F / ||W0||_F``, and the median stable rank ``||dW||_F^2 / ||dW||_2^2`` (1 for a rank-1 change; large
when the change is spread over many directions).

    python tools/weight_deltas.py runs/sweeps/smollm2_dp_frontier/lora_r1_eps8__seed0/version_0 \\
        runs/sweeps/smollm2_dp_frontier/flite_d1444_eps8__seed0/version_0 [--json deltas.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
from torch import nn

from lightning_fl import threads
from lightning_fl.cli import build
from lightning_fl.errors import UserError
from lightning_fl.federated.trainer import setup


def probe(layer: nn.Module, features: int) -> torch.Tensor:
    """The ``out x in`` weight a linear layer computes with (its output on the identity, less its bias)."""
    eye = torch.eye(features, dtype=torch.float32)
    out = layer(eye)
    bias = getattr(layer, "bias", None)
    return (out - (bias if bias is not None else 0)).T.detach()


def deltas(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, W0, dW)`` of every adapted linear layer of a FLITE ``two_sided`` or a LoRA model."""
    mapping = getattr(model, "mapping", None)
    if mapping is not None:
        if mapping.mode != "two_sided":
            raise UserError(f"model.factors is {mapping.mode!r}: this tool reads the two_sided family's layers")
        network = model.network
        names = [lay.name.rpartition(".")[0] for lay in mapping.layers]
        base = {n: probe(network.get_submodule(n), network.get_submodule(n).in_features) for n in names}
        with mapping.applied(network):
            for n in names:
                layer = network.get_submodule(n)
                yield n, base[n], probe(layer, layer.in_features) - base[n]
        return
    adapted = [(n, m) for n, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    if not adapted:
        raise UserError(f"{type(model).__name__}: neither FLITE's two_sided latent nor LoRA adapters to measure")
    for n, m in adapted:
        w0 = probe(m.base_layer, m.base_layer.in_features)
        yield n, w0, probe(m, m.base_layer.in_features) - w0


def measure(folder: Path) -> dict:
    """One run's per-layer norms, summarised."""
    config, ckpt = folder / "config.yaml", folder / "checkpoints" / "last.ckpt"
    for path in (config, ckpt):
        if not path.is_file():
            raise UserError(f"{path} not found: give a run folder (runs/<name>/version_N) of a finished run")
    run = build(["fit", "--config", str(config), "--trainer.logger", "false"])
    threads.for_run(run.trainer.threads)
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[])
    model, _ = setup.prepare(fabric, run.model, run.data, "fit")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    model.load_federated_state(state["global_state"])
    model.eval()
    spectral, frobenius, stable = [], [], []
    with torch.no_grad():
        for _name, w0, dw in deltas(model):
            d2, dfro = torch.linalg.matrix_norm(dw, ord=2).item(), torch.linalg.matrix_norm(dw).item()
            spectral.append(d2 / torch.linalg.matrix_norm(w0, ord=2).item())
            frobenius.append(dfro / torch.linalg.matrix_norm(w0).item())
            stable.append(dfro**2 / d2**2 if d2 > 0 else 0.0)
    return {
        "run": str(folder),
        "round": int(state["round"]),
        "layers": len(spectral),
        "spectral_median": statistics.median(spectral),
        "spectral_max": max(spectral),
        "frobenius_median": statistics.median(frobenius),
        "frobenius_max": max(frobenius),
        "stable_rank_median": statistics.median(stable),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run folders (runs/<name>/version_N)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rows = [measure(folder) for folder in args.runs]
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        "| run | round | layers | ||dW||_2 / ||W0||_2, median / max | ||dW||_F / ||W0||_F, median / max | "
        "stable rank of dW, median |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['run']} | {r['round']} | {r['layers']} | {r['spectral_median']:.4f} / {r['spectral_max']:.4f} | "
            f"{r['frobenius_median']:.4f} / {r['frobenius_max']:.4f} | {r['stable_rank_median']:.1f} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
