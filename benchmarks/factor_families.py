"""The mapping's two passes over its factors (``U c`` forward, ``U^T g`` backward), for four ways of holding ``U``.

For every conv layer of a ResNet-18 (CIFAR stem; d = 64, r = 32 as in ``latent_overhead.py``), one side
computes ``theta_pre + U c`` and ``U^T g`` for a random coefficient ``c`` and upstream gradient ``g``:

- ``stored``: the Gaussian family's float32 ``U`` (``model.factors stored``);
- ``bf16``: the same ``U`` rounded to bfloat16 (a candidate: half the bytes to read);
- ``hadamard``: a seeded randomised Hadamard transform, ``U = D H S`` per power-of-two block of the layer
  (random signs ``D``, the Walsh-Hadamard matrix ``H`` applied by a fast transform with 16 x 16 stages, ``r``
  seeded columns ``S``; blocks weighted so the columns stay orthonormal): a candidate with O(P) memory,
  written here only;
- ``kronecker``: the Kronecker family (``model.factors kronecker``).

Sides alternate ``--repeats`` times; it prints min and median wall and CPU time per side and, for each
candidate, the largest ``|U^T U - I|`` over the layers (computed in float64 from the factor each side uses),
since a family is only usable if averaging latents stays averaging weights.

    python benchmarks/factor_families.py --repeats 10 --json docs/results/factor_families.json

Results: docs/results-flite-extras.md, "A second factor family".
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from _harness import add_arguments, alternate, fmt, machine, report, summarise

from lightning_fl.mapping import LatentMapping
from lightning_fl.mapping.factors import kronecker_projection
from lightning_fl.models import ResNet18


def hadamard(bits: int) -> torch.Tensor:
    """The unnormalised ``2^bits`` Walsh-Hadamard matrix (Sylvester order)."""
    h = torch.ones(1, 1)
    for _ in range(bits):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


STAGES = {bits: hadamard(bits) for bits in range(1, 5)}


def fwht(x: torch.Tensor) -> torch.Tensor:
    """``H x`` for a vector of length ``2^k``, in stages of at most 16 x 16 (``k / 4`` passes over ``x``)."""
    n = x.numel()
    left, post = n.bit_length() - 1, n
    while left > 0:
        bits = min(4, left)
        m, left = 1 << bits, left - bits
        post //= m
        x = STAGES[bits] @ x.view(-1, m, post) if post > 1 else x.view(-1, m) @ STAGES[bits]
    return x.reshape(n)


class HadamardFactor:
    """``U = D H S`` over the power-of-two blocks (each at least ``rank`` long) that sum to the layer's size."""

    def __init__(self, rows: int, rank: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.sizes = [1 << b for b in reversed(range(rows.bit_length())) if rows >> b & 1 and 1 << b >= rank]
        self.rows, self.scale = rows, 1 / math.sqrt(sum(self.sizes))  # rows in blocks < rank stay frozen
        self.signs = [torch.randint(0, 2, (n,), generator=g).float() * 2 - 1 for n in self.sizes]
        self.cols = [torch.randperm(n, generator=g)[:rank] for n in self.sizes]

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        out, start = torch.zeros(self.rows), 0
        for n, signs, cols in zip(self.sizes, self.signs, self.cols, strict=True):
            x = torch.zeros(n)
            x[cols] = c
            out[start : start + n] = fwht(x) * signs * self.scale
            start += n
        return out

    def adjoint(self, g: torch.Tensor) -> torch.Tensor:
        total, start = None, 0
        for n, signs, cols in zip(self.sizes, self.signs, self.cols, strict=True):
            part = fwht(g[start : start + n] * signs)[cols] * self.scale
            total = part if total is None else total + part
            start += n
        return total


def orthonormality_error(u: torch.Tensor) -> float:
    u = u.double()
    return (u.T @ u - torch.eye(u.shape[1], dtype=torch.float64)).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--width", type=int, default=64, help="ResNet-18 base channels (smaller: quicker)")
    add_arguments(parser, repeats=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before = machine()
    torch.manual_seed(0)
    net = ResNet18(width=args.width, norm_groups=min(32, args.width // 2))
    stored = LatentMapping(net, 64, 32, "conv", "stored")
    kron = LatentMapping(net, 64, 32, "conv", "kronecker")
    stored.materialise()
    kron.materialise()
    layers = stored.layers
    u = {lay.index: getattr(stored, f"u_{lay.index}") for lay in layers}
    u16 = {i: t.to(torch.bfloat16) for i, t in u.items()}
    had = {lay.index: HadamardFactor(lay.numel, lay.rank, lay.index) for lay in layers}
    base = {lay.index: torch.randn(lay.numel) for lay in layers}
    coeff = {lay.index: torch.randn(lay.rank) for lay in layers}
    grad = {lay.index: torch.randn(lay.numel) for lay in layers}

    def run_stored() -> None:
        for i in u:
            torch.addmv(base[i], u[i], coeff[i]), u[i].T @ grad[i]

    def run_bf16() -> None:
        for i in u16:
            base[i] + (u16[i] @ coeff[i].bfloat16()).float(), grad[i].bfloat16() @ u16[i]

    def run_hadamard() -> None:
        for i, factor in had.items():
            base[i] + factor.forward(coeff[i]), factor.adjoint(grad[i])

    parts = {lay.index: [getattr(kron, f"k{name}_{lay.index}") for name in ("a", "b", "s")] for lay in layers}

    def run_kronecker() -> None:
        for i, (left, right, signs) in parts.items():
            kronecker_projection(base[i], coeff[i], left, right, signs)
            g = (grad[i] * signs).view(left.shape[0], right.shape[0])  # U^T g: the grid A^T G B, first r entries
            (left.T @ g @ right).reshape(-1)[: coeff[i].numel()]

    sides = {"stored": run_stored, "bf16": run_bf16, "hadamard": run_hadamard, "kronecker": run_kronecker}
    for side in sides.values():
        side()  # warm-up
    samples = alternate(sides, args.repeats)
    summary = summarise(samples)

    errors = {
        "stored": max(orthonormality_error(t) for t in u.values()),
        "bf16": max(orthonormality_error(t.float()) for t in u16.values()),
        "hadamard": max(
            orthonormality_error(torch.stack([f.forward(e) for e in torch.eye(lay.rank)], 1))
            for lay, f in zip(layers, had.values(), strict=True)
            if lay.numel <= 2**17  # forming U of the larger layers column by column takes long; same construction
        ),
        "kronecker": max(orthonormality_error(kron.u_factor(lay)) for lay in layers if lay.numel <= 2**17),
    }
    print(
        f"ResNet-18 (width {args.width}) conv layers, d = 64, r = 32, {args.threads} threads: U c and U^T g for "
        f"every layer, {args.repeats} alternations"
    )
    for name in sides:
        wall, cpu = summary[name]["wall"], summary[name]["cpu"]
        times = f"wall {fmt(wall, 'ms', 1e3, 1)}; CPU {fmt(cpu, 'ms', 1e3, 1)}"
        print(f"{name:<10} {times}; max |U^T U - I| {errors[name]:.1e}")
    results = {"threads": args.threads, "width": args.width, "repeats": args.repeats, "seconds": summary}
    results["orthonormality_error"] = errors
    report("factor_families", before, {**results, "raw": samples}, args.json)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
