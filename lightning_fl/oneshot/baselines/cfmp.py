"""CFMP: consensus federated martingale posterior (FMP paper, section III-B).

Every client draws ``S`` samples from its *local* martingale posterior (the shared predictive
generator on its own data, refit by ERM, with the task's shared base sets) and uploads them; the
server combines them by equation (3), the consensus Monte Carlo weighting of
:func:`lightning_fl.oneshot.baselines.cbnn.consensus`, with ``Sigma_m`` estimated from the client's
``S`` draws ("obtained using past samples"; diagonal by default, see there).
"""

from __future__ import annotations

import torch

from lightning_fl.oneshot.base import Context, OneShotMethod, Outcome, martingale_samples, upload
from lightning_fl.oneshot.baselines.cbnn import consensus
from lightning_fl.oneshot.tasks import Task


class CFMP(OneShotMethod):
    """Consensus FMP baseline (module docstring).

    Args:
        covariance: ``diagonal`` (default) or ``full`` consensus weights.
        shrinkage: For ``full``: weight of the diagonal in the shrunk sample covariance.
    """

    name = "cfmp"

    def __init__(self, covariance: str = "diagonal", shrinkage: float = 0.1) -> None:
        if covariance not in ("diagonal", "full"):
            raise ValueError(f"CFMP.covariance must be 'diagonal' or 'full', got {covariance!r}")
        self.covariance, self.shrinkage = covariance, shrinkage

    def run(self, task: Task, ctx: Context) -> Outcome:
        received, sizes = [], []
        for m, z in enumerate(task.clients):
            local, _ = martingale_samples(z, ctx)  # (S, C, D): this client's MP draws
            decoded, nbytes = upload(ctx, {"samples": local}, m)
            received.append(decoded["samples"].to(local))
            sizes.append(nbytes)
        W = consensus(torch.stack(received), self.covariance, self.shrinkage)
        return Outcome(W.unsqueeze(0), sum(sizes) / len(sizes))
