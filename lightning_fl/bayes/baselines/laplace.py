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


def softmax_hessian(W: Tensor, x: Tensor, weights: Tensor) -> Tensor:
    """Hessian of ``sum_i w_i CE(softmax(W x_i), t_i)`` in ``W`` (targets on the simplex): ``W`` ``[C, D]``,
    ``x`` ``[N, D]``, ``weights`` ``[N]`` -> ``[C D, C D]`` on row-major ``vec(W)``."""
    C, D = W.shape
    p = torch.softmax(x @ W.T, dim=-1)  # (N, C)
    lam = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)  # (N, C, C): diag(p) - p p^T
    N = x.shape[0]
    # sum_n w_n lam_n kron x_n x_n^T as one [C^2, N] x [N, D^2] matmul (an einsum may materialise [N, C, C, D, D]).
    xx = (x.unsqueeze(2) * x.unsqueeze(1)).reshape(N, D * D)  # (N, D^2)
    H = ((weights[:, None] * lam.reshape(N, C * C)).T @ xx).reshape(C, C, D, D)  # (a, b, i, j)
    return H.permute(0, 2, 1, 3).reshape(C * D, C * D)


def gaussian_samples(mean: Tensor, precision: Tensor, num_samples: int, generator: torch.Generator) -> Tensor:
    """``num_samples`` draws from ``N(mean, precision^-1)``: ``mean`` ``[C, D]``, ``precision`` ``[CD, CD]``
    (row-major ``vec``) -> ``[S, C, D]``. The noise comes from ``generator`` (on the CPU) for reproducibility."""
    L = torch.linalg.cholesky(precision)  # (CD, CD), precision = L L^T
    eps = torch.randn(precision.shape[0], num_samples, generator=generator, dtype=torch.float64)  # (CD, S)
    # x = L^-T eps has covariance L^-T L^-1 = precision^-1.
    dev = torch.linalg.solve_triangular(L.T, eps.to(L), upper=True)  # (CD, S)
    return mean.unsqueeze(0) + dev.T.reshape(num_samples, *mean.shape)


def laplace_precision(W: Tensor, x: Tensor, l2: float) -> Tensor:
    """Precision of the Laplace posterior at ``W`` ``[C, D]`` for data ``x`` ``[N, D]``: ``[C*D, C*D]`` in float64,
    in the row-major order of ``W.flatten()`` (index ``c * D + d``)."""
    N = x.shape[0]
    H = softmax_hessian(W.double(), x.double(), torch.ones(N, dtype=torch.float64))
    return H + N * l2 * torch.eye(H.shape[0], dtype=H.dtype)


def laplace_posterior(z: Tensor, ctx: Context, num_samples: int, generator: torch.Generator) -> Tensor:
    """ERM on points ``z`` ``[N, D + C]`` then Laplace samples ``[S, C, D]``."""
    x, t = split_points(z, ctx.num_classes)
    W = fit_softmax(x, t, ctx.l2, tol=ctx.tol)
    return gaussian_samples(W.double(), laplace_precision(W, x, ctx.l2), num_samples, generator).float()


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
