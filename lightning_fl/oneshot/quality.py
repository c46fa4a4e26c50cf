"""How good a posterior is, measured directly: the spread of its parameter samples and what its predictive says
about points it should and should not know.

* :func:`theta_spread`: the mean distance of the S parameter samples from their mean (0 for a point estimate;
  :func:`sample_spread` per model);
* :func:`predictive_entropy`: the entropy (nats) of each point's posterior predictive distribution;
* :func:`ood_scores`: the mean entropy on in-distribution and on out-of-distribution points, and the AUROC of
  telling them apart by that entropy (0.5: the predictive cannot tell; 1: every OOD point is less certain than
  every in-distribution point).

The test of :class:`~lightning_fl.oneshot.FMPMetaLearner` logs these for every method; with
``data.target_classes`` the target tasks leave classes out, and the test points of those classes are the
out-of-distribution points.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sample_spread(W: Tensor) -> Tensor:
    """Mean Frobenius distance of each posterior sample from the samples' mean, per model: ``W`` ``[G, S, C, D]``
    -> ``[G]`` (0 when S = 1). Differentiable (the norm's gradient at 0 is 0), so a generator can be trained on it."""
    return (W - W.mean(dim=1, keepdim=True)).flatten(2).norm(dim=-1).mean(1)


def theta_spread(W: Tensor) -> Tensor:
    """:func:`sample_spread` averaged over the G models of ``W`` ``[G, S, C, D]``."""
    return sample_spread(W).mean()


def predictive_entropy(probs: Tensor) -> Tensor:
    """Entropy in nats of each row of ``probs`` ``[N, C]`` (a predictive distribution per point) -> ``[N]``."""
    p = probs.clamp_min(1e-12)
    return -(probs * p.log()).sum(-1)


def ood_scores(probs_in: Tensor, probs_out: Tensor) -> dict[str, Tensor]:
    """Mean predictive entropy on in- and out-of-distribution points, and the AUROC of telling them apart by it
    (ties count one half: the Mann-Whitney statistic)."""
    h_in, h_out = predictive_entropy(probs_in).double(), predictive_entropy(probs_out).double()
    n_in, n_out = len(h_in), len(h_out)
    values = torch.cat([h_in, h_out])
    order = values.argsort()
    _, inverse, counts = torch.unique_consecutive(values[order], return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    average_rank = ends - (counts.double() - 1) / 2  # 1-based; tied values share their mean rank
    ranks = torch.empty_like(values)
    ranks[order] = average_rank[inverse]
    auroc = (ranks[n_in:].sum() - n_out * (n_out + 1) / 2) / (n_in * n_out)
    return {"entropy": h_in.mean(), "ood_entropy": h_out.mean(), "ood_auroc": auroc}
