"""FLITE's cost per step and the memory of each factor mode, measured side by side.

Prints, for one model on one batch:
- the time of a latent training step (stored / regenerate / streamed / kronecker factors) and of a full fine-tuning
  step (every backbone weight trained with Adam): after one warm-up step each, the sides (full, then each
  mode) take turns ``--repeats`` times, ``--steps`` steps per turn (their mean is one sample); for each side
  the min and median of the wall time and of the CPU time (user + system, all threads) per step, and the
  min and median of the per-repeat ratio latent / full (wall and CPU);
- the mapping's own cost per mode: ``weights(z)`` for every mapped layer and its backward for a random
  upstream gradient (the two passes over the factors a step makes), alternated the same way;
- the extra peak memory of each factor mode (analytic, and measured as the peak resident set (VmHWM,
  Linux) of a fresh process that builds the mapping and runs one forward/backward of the weights,
  minus the same for a process that builds the weights without a mapping; both first run the factor
  code on tiny inputs so shared-library pages are not counted as factor memory).

It also prints the torch thread count and the load average before and after, and last its results as one
JSON line (``--json PATH`` also writes them with the machine's state to a file).

    python benchmarks/latent_overhead.py                          # ResNet-18, CIFAR shape, batch 128, 5 repeats
    python benchmarks/latent_overhead.py --batch 32 --repeats 3   # quicker
    python benchmarks/latent_overhead.py --modes stored --json latent_overhead.json

Goals (ours, not the paper's): latent/full <= 1.05 with stored factors; streamed <= 16 MB extra peak.
Results: docs/results-flite-extras.md, "Overheads".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable

import torch
from _harness import add_arguments, alternate, fmt, machine, ratios, report, summarise

from lightning_fl.mapping import memory_report
from lightning_fl.methods import Classifier, LatentClassifier
from lightning_fl.models import ResNet18

MIB = 2**20
MODES = ("stored", "regenerate", "streamed", "kronecker")


def resnet18(width: int) -> ResNet18:
    """ResNet-18 with ``width`` base channels (64: the paper's), GroupNorm groups as many as fit (32 at 64)."""
    return ResNet18(width=width, norm_groups=min(32, width // 2))


def stepper(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, clip: float | None) -> Callable:
    """``steps`` training steps of ``model`` with Adam; one is run here (warm-up, lazy factor construction)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-3)

    def one() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def run() -> None:
        for _ in range(steps):
            one()

    one()
    return run


def projector(mode: str, width: int) -> Callable:
    """One forward (``theta = theta_pre + U V^T z`` for every mapped layer) and backward of the mapping alone."""
    from lightning_fl.mapping import LatentMapping

    net = resnet18(width)
    base = {n: p.detach() for n, p in net.named_parameters()}
    mapping = LatentMapping(net, 64, 32, "conv", mode)
    upstream = {lay.name: torch.randn(lay.shape) for lay in mapping.layers}
    z = torch.randn(mapping.latent_size, requires_grad=True)

    def run() -> None:
        weights = mapping.weights(base, z)
        torch.autograd.backward(list(weights.values()), [upstream[n] for n in weights])
        z.grad = None

    run()
    return run


def peak_rss_child(mode: str, width: int = 64) -> int:
    """Peak RSS (bytes) of a fresh process that builds the mapping in ``mode`` and runs forward+backward once."""
    code = f"""
import torch
from lightning_fl.mapping import CHUNK_ROWS, LatentMapping, OrthonormalFactor
from lightning_fl.models import ResNet18
# Load the LAPACK/BLAS code paths every mode uses (library pages count in RSS) with tiny factors, so the
# baseline and each mode differ only by the memory their data needs.
for rows in (16, CHUNK_ROWS + 1):
    OrthonormalFactor(rows, 2, 0, 0, 1).full()
net = ResNet18(width={width}, norm_groups={min(32, width // 2)})
base = {{n: p.detach() for n, p in net.named_parameters()}}
names = [n for n, p in net.named_parameters() if p.ndim == 4]
z = torch.zeros(1280, requires_grad=True)
if "{mode}" == "none":
    w = {{n: base[n] + 0 * z.sum() for n in names}}
else:
    w = LatentMapping(net, 64, 32, "conv", "{mode}").weights(base, z)
sum((v * v).sum() for v in w.values()).backward()
# VmHWM: this process's peak resident memory (ru_maxrss would inherit the parent's peak across exec)
print(int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) * 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1, help="steps per side and repeat (their mean is a sample)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--width", type=int, default=64, help="ResNet-18 base channels (smaller: quicker)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="factor modes to measure")
    add_arguments(parser, repeats=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before = machine()
    torch.manual_seed(0)
    x, y = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 100, (args.batch,))

    full = Classifier(resnet18(args.width), 100)  # every backbone weight trains (the head stays frozen)
    sides = {"full": stepper(full, x, y, args.steps, None)}
    for mode in args.modes:
        latent = LatentClassifier(resnet18(args.width), 100, base="scratch", latent_dim=64, rank=32, factors=mode)
        latent.load_state_dict({**full.state_dict(), "mapping.latent": torch.zeros(1280)})
        sides[mode] = stepper(latent, x, y, args.steps, 1.0)
    samples = alternate(sides, args.repeats)  # full, stored, regenerate, streamed, kronecker, full, ...
    del sides, full, latent
    projection = summarise(alternate({mode: projector(mode, args.width) for mode in args.modes}, args.repeats))
    summary = summarise(samples, per=args.steps)
    per_repeat = {mode: ratios(samples, mode, "full") for mode in args.modes}
    results = {"batch": args.batch, "threads": args.threads, "width": args.width, "steps": args.steps}
    results["repeats"] = args.repeats
    results.update({f"{side}_s": summary[side]["wall"]["min"] for side in summary})  # min wall per step
    results["step_s"] = summary
    results["ratio_to_full"] = per_repeat
    results["projection_s"] = projection

    report_ = memory_report(resnet18(args.width), 64, 32)
    baseline = peak_rss_child("none", args.width)
    measured = {mode: peak_rss_child(mode, args.width) - baseline for mode in args.modes}

    print(
        f"ResNet-18 (CIFAR stem, width {args.width}), batch {args.batch}, {args.threads} threads; per step, over "
        f"{args.repeats} repeats of {args.steps} step(s) per side, alternated"
    )
    for side in summary:
        name = "full fine-tune (Adam)" if side == "full" else f"latent, {side}"
        wall, cpu = summary[side]["wall"], summary[side]["cpu"]
        print(f"{name:<24} wall {fmt(wall)}; CPU {fmt(cpu)}")
    for mode in args.modes:
        r = per_repeat[mode]
        print(f"{'latent, ' + mode + ' / full':<24} wall {fmt(r['wall'], '')}; CPU {fmt(r['cpu'], '')} (per repeat)")
    print("the mapping alone (forward of every mapped layer + backward), per call:")
    for mode in args.modes:
        wall, cpu = projection[mode]["wall"], projection[mode]["cpu"]
        print(f"{'mapping, ' + mode:<24} wall {fmt(wall)}; CPU {fmt(cpu)}")
    print()
    print(f"{'factor memory (r=32, d=64)':<28}{'analytic MiB':>14}{'measured MiB':>14}")
    print(f"{'dense (not allocated)':<28}{report_.dense_bytes / MIB:>14.1f}{'-':>14}")
    analytic = {
        "stored": report_.stored_bytes,
        "regenerate": report_.regenerate_peak_bytes,
        "streamed": report_.streamed_peak_bytes,
        "kronecker": report_.kronecker_bytes,
    }
    for mode, extra in measured.items():
        print(f"{mode:<28}{analytic[mode] / MIB:>14.1f}{extra / MIB:>14.1f}")
    results.update({f"{m}_extra_peak_bytes": v for m, v in measured.items()})
    results.update({f"{m}_analytic_bytes": v for m, v in analytic.items()})
    print()
    report("latent_overhead", before, {**results, "raw_per_repeat_of_steps": samples}, args.json)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
