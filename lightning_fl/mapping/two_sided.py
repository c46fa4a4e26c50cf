"""The two-sided factor family: FLITE's ``U`` shaped by the weight matrix it maps, applied to activations.

For an ``m x n`` weight (``nn.Linear``: out x in; GPT-2's ``Conv1D``: in x out), ``U = A kron B`` with ``A``
(``m x p``) and ``B`` (``n x q``) orthonormal, ``p q = r``: with the weight flattened row-major,
``U c = vec(A C B^T)`` for the ``p x q`` grid ``C`` holding ``c = V^T z``. ``U`` has exactly orthonormal columns
(``(A kron B)^T (A kron B) = I``), is regenerated from the seed like every other family and is linear in ``z``, so
averaging latents is exactly averaging weights (FLITE's equation 4). What it adds: a linear layer can apply its
delta to its input, ``x B C^T A^T``, instead of adding ``A C B^T`` to the weight, so a client step never forms a
weight-sized delta nor the weight's gradient (``n q + q p + p m`` multiply-adds per token, ``4 (m p + n q)`` bytes
of factors per layer). That is what makes FLITE affordable on a 135M-parameter language model, where the other
families either store ``4 P r`` bytes or form every mapped weight and its gradient at each step. The delta has rank
at most ``min(p, q)``, within a random ``p``-dimensional column space and ``q``-dimensional row space of the layer.
"""

from __future__ import annotations

import torch

from lightning_fl.mapping.factors import OrthonormalFactor
from lightning_fl.seeding import STREAM_TWO_SIDED_A, STREAM_TWO_SIDED_B


def two_sided_shape(out_features: int, in_features: int, rank: int) -> tuple[int, int]:
    """``(p, q)`` with ``p q = rank``, ``p <= out_features`` and ``q <= in_features``, as square as those allow
    (ties: the larger ``p``)."""
    fits = [(p, rank // p) for p in range(1, rank + 1) if rank % p == 0 and p <= out_features]
    fits = [(p, q) for p, q in fits if q <= in_features]
    if not fits:
        raise ValueError(
            f"rank {rank} cannot be split as p x q with p <= {out_features} and q <= {in_features}; lower the rank"
        )
    return min(fits, key=lambda pq: (abs(pq[0] - pq[1]), -pq[0]))


class TwoSidedFactor:
    """``U = A kron B`` (``(m n, p q)``) for one ``m x n`` weight, producible as its two small parts."""

    def __init__(self, out_features: int, in_features: int, rank: int, seed: int, layer: int) -> None:
        self.m, self.n, self.rank, self.seed, self.layer = out_features, in_features, rank, seed, layer
        self.p, self.q = two_sided_shape(out_features, in_features, rank)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)``: float32 ``(m, p)`` and ``(n, q)`` with orthonormal columns."""
        left = OrthonormalFactor(self.m, self.p, self.seed, self.layer, STREAM_TWO_SIDED_A).full()
        right = OrthonormalFactor(self.n, self.q, self.seed, self.layer, STREAM_TWO_SIDED_B).full()
        return left, right

    def full(self) -> torch.Tensor:
        """The whole ``(m n, p q)`` float32 factor (for tests and the least-squares warm start; never formed in use)."""
        left, right = self.parts()  # column a q + b is A[:, a] kron B[:, b]
        return torch.einsum("ip,jq->ijpq", left, right).reshape(self.m * self.n, self.p * self.q)


def two_sided_delta(coeff: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``A C B^T`` (``m x n``) for the coefficients ``coeff`` (``p q``, row-major ``C``) and the parts ``A``, ``B``."""
    grid = coeff.reshape(left.shape[1], right.shape[1])
    return (left @ grid) @ right.T


def add_two_sided(
    output: torch.Tensor,
    x: torch.Tensor,
    left: torch.Tensor,
    grid: torch.Tensor,
    right: torch.Tensor,
    transposed: bool = False,
) -> torch.Tensor:
    """A linear layer's output ``x W^T + b`` plus ``x B C^T A^T`` (``grid`` is ``C``, differentiable): what the layer
    computes with ``W + A C B^T``; backward reaches ``C`` through three small products. ``transposed``: the layer
    stores its weight ``in x out`` and computes ``x W + b`` (GPT-2's ``Conv1D``), so ``x A C B^T`` is added."""
    if transposed:
        return output + ((x @ left.to(x.dtype)) @ grid.to(x.dtype)) @ right.to(x.dtype).T
    return output + ((x @ right.to(x.dtype)) @ grid.to(x.dtype).T) @ left.to(x.dtype).T


def two_sided_hook(left: torch.Tensor, grid: torch.Tensor, right: torch.Tensor, transposed: bool = False):
    """A forward hook adding :func:`add_two_sided`'s delta for a fixed ``grid`` to a linear layer's output."""

    def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return add_two_sided(output, inputs[0], left, grid, right, transposed)

    return hook
