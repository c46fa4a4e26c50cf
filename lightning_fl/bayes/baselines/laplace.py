"""Bayesian neural networks by the Laplace approximation: BNN (pooled data) and LBNN (per client).

For the bias-free linear softmax model the FMP paper uses everywhere, the ERM objective
``mean CE + (l2/2) ||W||^2`` over ``N`` points is ``-1/N log`` of a posterior with a Gaussian prior of
precision ``N * l2`` per weight. The Laplace approximation (MacKay 1992; for softmax regression see
Bishop 2006, section 4.5) centres a Gaussian at the ERM solution ``W*`` with the exact Hessian of
``N * objective`` as precision::

    Lambda = sum_i (diag(p_i) - p_i p_i^T) kron x_i x_i^T + N * l2 * I,    p_i = softmax(W* x_i)

and the ensemble uses ``S`` samples from ``N(W*, Lambda^{-1})``. The paper does not say which
approximate inference its BNN baselines use (mean-field VI or Laplace); we use the exact-Hessian
Laplace, which is deterministic and needs no tuning.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fl.bayes.erm import fit_softmax
from lightning_fl.bayes.protocol import Context, OneShotMethod, Outcome
from lightning_fl.bayes.tasks import Task, split_points


def laplace_precision(W: Tensor, x: Tensor, l2: float) -> Tensor:
    """Precision of the Laplace posterior at ``W`` ``[C, D]`` for data ``x`` ``[N, D]``: ``[C*D, C*D]``
    in the row-major order of ``W.flatten()`` (index ``c * D + d``)."""
    N, D = x.shape
    C = W.shape[0]
    p = (x.double() @ W.double().T).softmax(-1)  # (N, C)
    xd = x.double()
    # sum_i diag(p_i) kron x_i x_i^T: a block diagonal of C blocks X^T diag(p_c) X
    blocks = torch.einsum("nc,nd,ne->cde", p, xd, xd)  # (C, D, D)
    H = torch.block_diag(*blocks)
    # - sum_i (p_i kron x_i)(p_i kron x_i)^T
    q = (p.unsqueeze(-1) * xd.unsqueeze(1)).reshape(N, C * D)  # (N, C*D)
    H = H - q.T @ q
    return H + N * l2 * torch.eye(C * D, dtype=H.dtype)


def laplace_samples(W: Tensor, precision: Tensor, num_samples: int, generator: torch.Generator) -> Tensor:
    """``num_samples`` draws from ``N(W, precision^{-1})`` -> ``[S, C, D]`` (float32)."""
    L = torch.linalg.cholesky(precision)  # precision = L L^T
    eps = torch.randn(precision.shape[0], num_samples, generator=generator, dtype=precision.dtype)
    # L^T z = eps gives z ~ N(0, (L L^T)^{-1})
    z = torch.linalg.solve_triangular(L.T, eps, upper=True)  # (C*D, S)
    return (W.double().reshape(-1, 1) + z).T.reshape(num_samples, *W.shape).float()


def laplace_posterior(z: Tensor, ctx: Context, num_samples: int, generator: torch.Generator) -> Tensor:
    """ERM on points ``z`` ``[N, D + C]`` then Laplace samples ``[S, C, D]``."""
    x, t = split_points(z, ctx.num_classes)
    W = fit_softmax(x, t, ctx.l2, tol=ctx.tol)
    return laplace_samples(W, laplace_precision(W, x, ctx.l2), num_samples, generator)


class BNN(OneShotMethod):
    """Centralised Bayesian baseline: Laplace posterior on the pooled data (module docstring).

    Args:
        seed: Seed of the posterior draws (the same for every task).
    """

    name = "bnn"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def run(self, task: Task, ctx: Context) -> Outcome:
        g = torch.Generator().manual_seed(self.seed)
        S = ctx.noise.shape[0]
        return Outcome(laplace_posterior(task.pooled.cpu(), ctx, S, g).unsqueeze(0).to(task.clients.device))


class LBNN(BNN):
    """Local Bayesian baseline: each client's own Laplace posterior; metrics are the mean over clients."""

    name = "lbnn"

    def run(self, task: Task, ctx: Context) -> Outcome:
        g = torch.Generator().manual_seed(self.seed)
        S = ctx.noise.shape[0]
        W = torch.stack([laplace_posterior(z.cpu(), ctx, S, g) for z in task.clients])  # (M, S, C, D)
        return Outcome(W.to(task.clients.device))
