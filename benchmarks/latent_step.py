"""A FLITE latent client's local step against a full-weight client's, on small CNNs, and where the difference goes.

Issue 39 measured a latent client at 2.03x the full-weight floor on the cross-device CNN. This script times, one
thread, sides alternated ``--repeats`` times, ``--steps`` steps per side and repeat (CPU seconds per step, min and
median, and the per-repeat ratio to ``full``):

- ``full``: every weight trained (the ``Classifier`` of configs/fedavg_*.yaml: Adam, lr 0.01);
- ``latent-<mode>``: FLITE's latent over conv+linear layers at d=64, r=32 (the quickstart's mapping) with
  ``stored`` or ``kronecker`` factors, its own optimiser and clipping (Adam on ``z``, clip 1.0);

each step as a client takes it: the module's ``training_step`` (forward and loss), backward, the module's gradient
clipping, the optimiser step, gradients cleared. And the parts of a latent step, alone:

- ``mapping-<mode>``: ``theta = theta_pre + U V^T z`` for every mapped layer and its backward for a fixed upstream
  gradient (the two passes over the factors a step makes); ``mapping-stored-row-major``: the same with the stored
  ``U`` laid out row-major (``P x r`` contiguous), as it was kept before it became column-major;
- ``network``: forward, loss and backward of the same network at fixed (already mapped) weights with respect to
  those weights: what the latent step costs without its mapping;
- ``adam-z`` and ``clip-z``: the optimiser step and gradient clipping on ``z`` alone.

Models: ``cross-device``, issue 39's plain CNN (two 3x3 conv stages of 32 and 64 channels with biases, a
3,136 -> 128 linear layer, 421,642 values) on 28x28 images, batch 20; ``quickstart``, the quickstart's SmallCNN on
8x8 images, batch 32. Random Synthetic batches (the values do not change the cost).

    python benchmarks/latent_step.py --json docs/results/latent_step.json
    python benchmarks/latent_step.py --models cross-device --repeats 3      # quicker
"""

from __future__ import annotations

import argparse
import logging
import warnings
from collections.abc import Callable

import torch
from _harness import add_arguments, alternate, fmt, machine, ratios, report, summarise
from client_overhead import make_module

from lightning_fl.federated.clients.client import LocalTraining, configure_optimizer, gradient_clip

MODELS = {"cross-device": (28, 20), "quickstart": (8, 32)}  # image size, batch


def module(model: str, kind: str):
    """``full``, ``latent-stored`` or ``latent-kronecker`` on ``model``'s network (client_overhead.py's modules)."""
    args = argparse.Namespace(backbone="plain" if model == "cross-device" else "smallcnn", image_size=MODELS[model][0])
    if kind == "full":
        return make_module("full", args)
    return make_module("latent", args, factors=kind.removeprefix("latent-"))


def client_step(m, x: torch.Tensor, y: torch.Tensor, steps: int) -> Callable[[], None]:
    """``steps`` local steps of ``m`` as a client takes them (one taken here: warm-up, lazy factors)."""
    m.train()
    optimizer, _ = configure_optimizer(m)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    clip = gradient_clip(m, LocalTraining())

    def one() -> None:
        loss = m.training_step((x, y), 0)
        loss = loss["loss"] if isinstance(loss, dict) else loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    one()
    return lambda: [one() for _ in range(steps)]


def parts(model: str, mode: str, x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, Callable[[], None]]:
    """The latent step's pieces, alone (see the module docstring)."""
    m = module(model, f"latent-{mode}")
    mapping, base = m.mapping, {n: p.detach() for n, p in m.mapped_base().items()}
    z = torch.zeros(mapping.latent_size, requires_grad=True)
    upstream = {lay.name: torch.randn(lay.shape) for lay in mapping.layers}

    def map_once(mapping=mapping) -> None:
        weights = mapping.weights(base, z)
        torch.autograd.backward(list(weights.values()), [upstream[n] for n in weights])
        z.grad = None

    fixed = {n: w.detach().clone().requires_grad_(True) for n, w in mapping.weights(base, z).items()}

    def network_once() -> None:
        logits = m.head(torch.func.functional_call(m.steered, fixed, (x,), strict=False))
        m.compute_loss(logits, y).backward()
        for w in fixed.values():
            w.grad = None

    zp = torch.nn.Parameter(torch.zeros(mapping.latent_size))
    zp.grad = torch.randn(mapping.latent_size)
    adam = torch.optim.Adam([zp], lr=0.01)
    out = {
        f"mapping-{mode}": map_once,
        "network": network_once,
        "adam-z": adam.step,
        "clip-z": lambda: torch.nn.utils.clip_grad_norm_([zp], 1.0),
    }
    if mode == "stored":  # the same factors, row-major
        rows = module(model, "latent-stored").mapping
        rows.materialise()
        for lay in rows.layers:
            setattr(rows, f"u_{lay.index}", getattr(rows, f"u_{lay.index}").contiguous())
        out["mapping-stored-row-major"] = lambda: map_once(rows)
    for run in out.values():
        run()
    return {name: (lambda run=run: [run() for _ in range(steps)]) for name, run in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=5, help="steps per side and repeat (default 5)")
    add_arguments(parser, repeats=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning_fl").setLevel(logging.ERROR)
    before = machine()
    results = {}
    for model in args.models:
        size, batch = MODELS[model]
        torch.manual_seed(1)
        x, y = torch.randn(batch, 1, size, size), torch.randint(0, 10, (batch,))
        sides = {
            kind: client_step(module(model, kind), x, y, args.steps)
            for kind in ("full", "latent-stored", "latent-kronecker")
        }
        for mode in ("stored", "kronecker"):
            sides.update(parts(model, mode, x, y, args.steps))
        samples = alternate(sides, args.repeats)
        per_step = summarise(samples, per=args.steps)
        over_full = {name: ratios(samples, name, "full") for name in sides if name != "full"}
        results[model] = {"image": size, "batch": batch, "seconds_per_step": per_step, "over_full": over_full}
        for name, summary in per_step.items():
            line = f"[{model}] {name}: CPU per step {fmt({k: v * 1e3 for k, v in summary['cpu'].items()}, ' ms')}"
            if name in over_full:
                line += f"; / full, per repeat: {fmt(over_full[name]['cpu'], 'x', 1, 3)}"
            print(line, flush=True)
    report("latent_step", before, {"args": vars(args), "models": results}, args.json)


if __name__ == "__main__":
    main()
