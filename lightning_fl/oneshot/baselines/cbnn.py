"""CBNN: consensus Monte Carlo over local Bayesian posteriors (Scott et al., 2016, "Bayes and big data:
the consensus Monte Carlo algorithm"), the FMP paper's one-shot Bayesian baseline.

Every client draws ``S`` samples from its local posterior (the Laplace posterior of
:mod:`lightning_fl.oneshot.baselines.laplace`) under the fractionated prior consensus Monte Carlo asks for,
the global prior raised to ``1/M``. Consensus Monte Carlo needs one prior shared by every client, so the
default ``prior_precision="erm"`` takes the ERM's prior for the pooled data, ``N * l2``, and each client
uses ``n * l2`` (``M`` clients of ``n`` points); a number ``delta`` gives ``delta / M``. ``"marglik"`` lets
client ``m`` estimate the global precision ``delta_m`` by its own Laplace evidence and use ``delta_m / M``:
the clients' priors then differ, and on small clients the evidence picks weaker priors than on the pooled
data (docs/results-fmp.md measures both). The client uploads the draws
(``S * C * D`` floats: 51.2 KB for S = 10 and a 10 x 128 model, the paper's figure). The server pairs
draws by index and combines them with inverse-covariance weights::

    theta_s = (sum_m W_m)^{-1} sum_m W_m theta_{m,s},    W_m = Sigma_m^{-1}

with ``Sigma_m`` estimated from the client's own ``S`` draws. With S = 10 draws in C*D = 1280
dimensions the sample covariance has rank 9, so by default each coordinate is weighted by its inverse
sample variance (``covariance="diagonal"``); ``"full"`` uses the sample covariance shrunk towards its
diagonal (``shrinkage``), for small models or many draws.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fl.oneshot.base import Context, OneShotMethod, Outcome, upload
from lightning_fl.oneshot.baselines.laplace import check_prior_precision, laplace_posterior
from lightning_fl.oneshot.tasks import Task


def consensus(samples: Tensor, covariance: str = "diagonal", shrinkage: float = 0.1, eps: float = 1e-8) -> Tensor:
    """Combine paired draws ``samples`` ``[M, S, ...]`` of M sub-posteriors into ``[S, ...]`` (module docstring)."""
    if covariance not in ("diagonal", "full"):
        raise ValueError(f"covariance must be 'diagonal' or 'full', got {covariance!r}")
    M, S = samples.shape[:2]
    if S < 2:
        raise ValueError(f"consensus needs at least 2 draws per client to estimate a covariance, got {S}")
    flat = samples.reshape(M, S, -1).double()  # (M, S, P)
    centred = flat - flat.mean(1, keepdim=True)
    if covariance == "diagonal":
        weights = 1.0 / (centred.pow(2).sum(1) / (S - 1) + eps)  # (M, P)
        combined = (weights.unsqueeze(1) * flat).sum(0) / weights.sum(0)  # (S, P)
    else:
        cov = centred.transpose(1, 2) @ centred / (S - 1)  # (M, P, P)
        diag = torch.diag_embed(torch.diagonal(cov, dim1=1, dim2=2))
        cov = (1 - shrinkage) * cov + shrinkage * diag + eps * torch.eye(cov.shape[-1], dtype=cov.dtype)
        prec = torch.linalg.inv(cov)  # (M, P, P)
        total = prec.sum(0)
        combined = torch.linalg.solve(total, torch.einsum("mpq,msq->sp", prec, flat).T).T  # (S, P)
    return combined.reshape(samples.shape[1:]).to(samples.dtype)


class CBNN(OneShotMethod):
    """Consensus Bayesian neural network (module docstring).

    Args:
        covariance: ``diagonal`` (default) or ``full`` consensus weights.
        shrinkage: For ``full``: weight of the diagonal in the shrunk sample covariance.
        prior_precision: ``"erm"`` (default), ``"marglik"`` or a positive global prior precision per weight
            (module docstring).
        name: Metric name (default ``cbnn``).
        seed: Seed of the clients' posterior draws.
    """

    name = "cbnn"

    def __init__(
        self,
        covariance: str = "diagonal",
        shrinkage: float = 0.1,
        prior_precision: str | float = "erm",
        name: str | None = None,
        seed: int = 0,
    ) -> None:
        if covariance not in ("diagonal", "full"):
            raise ValueError(f"CBNN.covariance must be 'diagonal' or 'full', got {covariance!r}")
        if not 0 <= shrinkage <= 1:
            raise ValueError(f"CBNN.shrinkage must be in [0, 1], got {shrinkage}")
        self.covariance, self.shrinkage, self.seed = covariance, shrinkage, seed
        self.prior_precision = check_prior_precision(prior_precision, "CBNN")
        super().__init__(name)

    def local_samples(self, z: Tensor, ctx: Context, client: int, num_clients: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + client)
        scale = 1.0 if self.prior_precision == "erm" else 1.0 / num_clients
        return laplace_posterior(z.cpu(), ctx, ctx.noise.shape[0], g, self.prior_precision, scale)[0]

    def run(self, task: Task, ctx: Context) -> Outcome:
        received, sizes = [], []
        for m, z in enumerate(task.clients):
            decoded, nbytes = upload(ctx, {"samples": self.local_samples(z, ctx, m, len(task.clients))}, m)
            received.append(decoded["samples"].float())
            sizes.append(nbytes)
        W = consensus(torch.stack(received), self.covariance, self.shrinkage)  # (S, C, D)
        return Outcome(W.unsqueeze(0).to(task.clients.device), sum(sizes) / len(sizes))
