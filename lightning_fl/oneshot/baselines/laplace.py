"""Bayesian neural networks by the Laplace approximation: BNN (pooled data) and LBNN (per client).

For the bias-free linear softmax model the FMP paper uses everywhere, the ERM objective
``mean CE + (l2/2) ||W||^2`` over ``N`` points is ``-1/N log`` of a posterior with a Gaussian prior of
precision ``N * l2`` per weight. The Laplace approximation (MacKay 1992; for softmax regression see
Bishop 2006, section 4.5) centres a Gaussian at the ERM solution ``W*`` with the exact Hessian of the
negative log posterior as precision::

    Lambda = H + delta * I,    H = sum_i (diag(p_i) - p_i p_i^T) kron x_i x_i^T,    p_i = softmax(W* x_i)

and the ensemble uses ``S`` samples from ``N(W*, Lambda^{-1})``. The paper does not say which
approximate inference its BNN baselines use (mean-field VI or Laplace), nor how it set the prior; we use
the exact-Hessian Laplace, deterministic given the seed, with the prior precision ``delta`` chosen by
``prior_precision``:

- ``"marglik"`` (default): the ``delta`` that maximises the Laplace evidence at the fixed mode ``W*``
  (MacKay's evidence framework applied post hoc, as in Daxberger et al. 2021, "Laplace Redux")::

      log Z(delta) = log p(D | W*) - delta/2 ||W*||^2 + P/2 log delta - 1/2 sum_k log(lambda_k + delta)

  with ``lambda_k`` the eigenvalues of ``H`` and ``P = C * D``. It is concave in ``log delta``; its
  stationary point is MacKay's ``delta = gamma / ||W*||^2`` with ``gamma = sum_k lambda_k / (lambda_k +
  delta)`` the effective number of parameters. Uses the clients' own data only.
- ``"erm"``: the ERM's own prior, ``N * l2`` (on a client's 50-100 points this is weaker than the evidence's
  choice and leaves the posterior wide where the data say little, so sampled models disagree).
- a positive number: that precision per weight.

The mean ``W*`` is always the ERM solution with ``l2``, the same model ANN and LANN predict with.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_fl.oneshot.base import Context, OneShotMethod, Outcome
from lightning_fl.oneshot.erm import fit_softmax
from lightning_fl.oneshot.tasks import Task, split_points


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


def log_evidence(delta: Tensor, eigenvalues: Tensor, sq_norm: Tensor) -> Tensor:
    """The ``delta``-dependent part of the Laplace log evidence at a fixed mode (module docstring), for the
    likelihood Hessian's ``eigenvalues`` ``[P]`` and ``sq_norm = ||W*||^2``; ``delta`` may be a tensor of values."""
    delta = torch.as_tensor(delta, dtype=torch.float64).unsqueeze(-1)
    lam = eigenvalues.double().clamp_min(0.0)
    P = lam.shape[0]
    log_det = (lam + delta).log().sum(-1, keepdim=True)
    return (-0.5 * delta * sq_norm + 0.5 * P * delta.log() - 0.5 * log_det).squeeze(-1)


def marglik_prior_precision(H: Tensor, W: Tensor, lo: float = 1e-8, hi: float = 1e8) -> float:
    """Prior precision that maximises the Laplace evidence at the fixed mode ``W`` for the likelihood Hessian
    ``H`` ``[P, P]`` (module docstring). The derivative in ``t = log delta``,
    ``-delta ||W||^2 / 2 + P / 2 - 1/2 sum_k delta / (lambda_k + delta)``, is decreasing, so its root is found
    by bisection in ``t`` on ``[log lo, log hi]`` (an end point when the root lies outside)."""
    if not (torch.isfinite(H).all() and torch.isfinite(W).all()):
        raise ValueError("marglik prior precision: the Hessian or the mode is not finite; check the client's data")
    lam = torch.linalg.eigvalsh(H.double()).clamp_min(0.0)
    sq_norm = W.double().pow(2).sum()
    P = lam.shape[0]

    def slope(t: float) -> float:
        d = math.exp(t)
        return float(-d * sq_norm / 2 + P / 2 - 0.5 * (d / (lam + d)).sum())

    a, b = math.log(lo), math.log(hi)
    if slope(a) <= 0:
        return lo
    if slope(b) >= 0:
        return hi
    for _ in range(100):  # |b - a| = 37 -> below 1e-28 in log delta
        mid = 0.5 * (a + b)
        a, b = (mid, b) if slope(mid) > 0 else (a, mid)
    return math.exp(0.5 * (a + b))


def check_prior_precision(value: str | float, owner: str) -> str | float:
    """Validate a ``prior_precision`` argument (module docstring) for a clear configuration error."""
    if value in ("marglik", "erm"):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise ValueError(f"{owner}.prior_precision must be 'marglik', 'erm' or a positive number, got {value!r}")


def laplace_fit(z: Tensor, ctx: Context, prior_precision: str | float = "marglik") -> tuple[Tensor, Tensor, float]:
    """ERM on points ``z`` ``[N, D + C]``, then the Laplace posterior: the mode ``[C, D]``, the likelihood Hessian
    ``[CD, CD]`` (float64) and the prior precision per weight chosen by ``prior_precision``."""
    x, t = split_points(z, ctx.num_classes)
    W = fit_softmax(x, t, ctx.l2, tol=ctx.tol)
    H = softmax_hessian(W.double(), x.double(), torch.ones(x.shape[0], dtype=torch.float64))
    if prior_precision == "marglik":
        delta = marglik_prior_precision(H, W)
    elif prior_precision == "erm":
        delta = x.shape[0] * ctx.l2
    else:
        delta = float(prior_precision)
    return W, H, delta


def laplace_posterior(
    z: Tensor,
    ctx: Context,
    num_samples: int,
    generator: torch.Generator,
    prior_precision: str | float = "marglik",
    prior_scale: float = 1.0,
) -> tuple[Tensor, float]:
    """ERM on points ``z`` ``[N, D + C]`` then Laplace samples ``[S, C, D]`` with precision
    ``H + prior_scale * delta * I``; returns the samples and ``delta`` (before ``prior_scale``)."""
    W, H, delta = laplace_fit(z, ctx, prior_precision)
    precision = H + prior_scale * delta * torch.eye(H.shape[0], dtype=H.dtype)
    return gaussian_samples(W.double(), precision, num_samples, generator).float(), delta


class BNN(OneShotMethod):
    """Centralised Bayesian baseline: Laplace posterior on the pooled data (module docstring).

    Args:
        prior_precision: ``"marglik"`` (evidence-maximising, default), ``"erm"`` (the ERM's ``N * l2``) or a
            positive precision per weight.
        name: Metric name (default ``bnn`` / ``lbnn``; e.g. ``bnn_erm`` to compare priors in one test).
        seed: Seed of the posterior draws (the same for every task).
    """

    name = "bnn"

    def __init__(self, prior_precision: str | float = "marglik", name: str | None = None, seed: int = 0) -> None:
        self.prior_precision = check_prior_precision(prior_precision, type(self).__name__)
        super().__init__(name)
        self.seed = seed

    def run(self, task: Task, ctx: Context) -> Outcome:
        g = torch.Generator().manual_seed(self.seed)
        S = ctx.noise.shape[0]
        W, delta = laplace_posterior(task.pooled.cpu(), ctx, S, g, self.prior_precision)
        return Outcome(W.unsqueeze(0).to(task.clients.device), extras={"prior_precision": torch.tensor(delta)})


class LBNN(BNN):
    """Local Bayesian baseline: each client's own Laplace posterior; metrics are the mean over clients."""

    name = "lbnn"

    def run(self, task: Task, ctx: Context) -> Outcome:
        g = torch.Generator().manual_seed(self.seed)
        S = ctx.noise.shape[0]
        fits = [laplace_posterior(z.cpu(), ctx, S, g, self.prior_precision) for z in task.clients]
        W = torch.stack([w for w, _ in fits])  # (M, S, C, D)
        delta = torch.tensor([d for _, d in fits]).mean()
        return Outcome(W.to(task.clients.device), extras={"prior_precision": delta})
