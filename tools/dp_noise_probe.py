"""Where central DP's noise lands in a linear layer: on the input directions the data uses, or elsewhere
(docs/results-privacy.md, "Private federated learning").

Two finished runs of the same config that differ only in the noise (e.g. ``target_epsilon 1`` and ``.inf``, same
seed): ``W`` is the layer's weight in the run without noise, ``N`` the difference of the noised run's weight from
it. Over the validation set, with ``X`` the layer's inputs (under ``W``'s model), the probe prints

* ``||W||_F`` and ``||N||_F``;
* the mean over images of ``||N x|| / ||W x||``: how far the noise moves the layer's output, relative to the
  output itself;
* for the principal subspace of ``X`` holding 90% and 99% of its energy (``k`` of ``D`` input directions): the
  share of ``||N||_F^2`` and of ``||W||_F^2`` that lies there. Isotropic noise puts ``k / D`` there; a trained
  weight puts far more.

    python tools/dp_noise_probe.py fit --config configs/dp_fedavg_fashion_mnist.yaml --layer backbone.fc \\
        --noised runs/sweeps/dp_fashion_mnist/fedavg_eps1_iid__seed0/version_0/checkpoints/last.ckpt \\
        --clean runs/sweeps/dp_fashion_mnist/fedavg_epsinf_iid__seed0/version_0/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse
import sys

import torch

from lightning_fl.checkpoint import read_checkpoint
from lightning_fl.cli import build
from lightning_fl.errors import UserError


def subspace_shares(
    X: torch.Tensor, W: torch.Tensor, N: torch.Tensor, fractions: tuple[float, ...] = (0.9, 0.99)
) -> dict[str, float]:
    """``X`` (n, D) inputs, ``W`` and ``N`` (out, D) weights: output ratio and each weight's share of the subspaces."""
    X, W, N = X.double(), W.double(), N.double()
    out = {
        "W_norm": float(W.norm()),
        "N_norm": float(N.norm()),
        "output_ratio": float(((X @ N.T).norm(dim=1) / (X @ W.T).norm(dim=1)).mean()),
    }
    _, S, Vh = torch.linalg.svd(X, full_matrices=False)
    energy = (S**2).cumsum(0) / (S**2).sum()
    for frac in fractions:
        k = int((energy < frac - 1e-12).sum()) + 1
        P = Vh[:k]  # (k, D): an orthonormal basis of the subspace
        out[f"k{frac:g}"] = k
        out[f"N_share{frac:g}"] = float((N @ P.T).norm() ** 2 / N.norm() ** 2)
        out[f"W_share{frac:g}"] = float((W @ P.T).norm() ** 2 / W.norm() ** 2)
        out[f"isotropic{frac:g}"] = k / X.shape[1]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", default="backbone.fc", help="a torch.nn.Linear of the model, by name")
    parser.add_argument("--noised", required=True, help="the noised run's checkpoint")
    parser.add_argument("--clean", required=True, help="the run without noise")
    parser.add_argument("--batches", type=int, default=16, help="validation batches to read")
    args, rest = parser.parse_known_args()
    try:  # a config typo or an unreadable checkpoint: one line, exit code 2
        run = build(rest)
        noised = read_checkpoint(args.noised, "--noised")["global_state"]
        clean = read_checkpoint(args.clean, "--clean")["global_state"]
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model, data = run.model, run.data
    key = f"{args.layer}.weight"
    if key not in clean:
        layers = sorted(k.removesuffix(".weight") for k in clean if k.endswith(".weight") and clean[k].dim() == 2)
        print(f"error: --layer {args.layer}: no {key} in the federated state; use one of {layers}", file=sys.stderr)
        return 2
    model.load_federated_state(clean)
    model.eval()
    data.prepare_data()
    data.setup("validate")
    inputs: list[torch.Tensor] = []
    hook = model.get_submodule(args.layer).register_forward_hook(lambda m, i, o: inputs.append(i[0].detach()))
    with torch.no_grad():
        for i, batch in enumerate(data.val_dataloader()):
            if i >= args.batches:
                break
            model(batch[0])
    hook.remove()
    X = torch.cat(inputs).flatten(1)
    shares = subspace_shares(X, clean[key], noised[key] - clean[key])
    print(f"{args.layer}: {X.shape[0]} images, D = {X.shape[1]}")
    for name, value in shares.items():
        print(f"  {name}: {value:.4f}" if isinstance(value, float) else f"  {name}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
