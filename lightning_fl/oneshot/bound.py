"""FMP's Proposition 1, evaluated term by term on a task.

For M clients of n points, s summary points each and n' generated points, the bound on the distance between the
centralised MP sample and the FMP sample drawn with the same base set ``E`` reads

    ||theta_MP - theta_FMP|| <= 2 sqrt( (L_z / mu) [ (b_s + (1 - b_s) C) delta_s + Delta_s D ] )

with ``b_s = M s / (M s + n')``, ``Delta_s = M n / (M n + n') - b_s``, ``delta_s = W1(P_Z, P_Z~)`` (pooled data
against pooled summaries), ``D = W1(P_Z, P_Z')`` (the data against its generated points), ``mu`` the loss's
strong convexity in theta, ``L_z`` its Lipschitz constant in the point z and ``C`` the generator's stability
constant (``W1(ISAB(Z1, E), ISAB(Z2, E)) <= C W1(Z1, Z2)``).

What we can compute exactly, we do: ``b_s``, ``Delta_s``, ``delta_s`` and ``D`` (exact W1 by POT), and ``mu`` =
``l2`` (the ERM loss is the mean cross-entropy plus ``l2/2 ||W||^2``, whose Hessian is at least ``l2 I``). The
two constants are suprema we can only estimate from below on what a run produces:

* :func:`lipschitz_z`: the largest gradient norm ``||grad_z l(z, theta)||`` over the points and parameter samples
  at hand (features and label parts together, the Euclidean metric W1 uses);
* ``C``: the one ratio the task offers, ``W1(Z', Z~') / W1(Z, Z~)`` with ``Z' = ISAB(Z, E)`` and
  ``Z~' = ISAB(Z~, E)`` for the same ``E``.

So the bound computed here is a lower estimate of the proposition's right-hand side; if even that is far above the
measured distance, the bound says little about this setting.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_fl.oneshot.tasks import split_points


def proposition1(
    M: int, n: int, s: int, n_new: int, mu: float, L_z: float, C: float, delta_s: float, D: float
) -> dict[str, float]:
    """The bound and its terms (``b_s``, ``Delta_s``, ``mu``, ``L_z``, ``C``, ``delta_s``, ``D``)."""
    b_s = M * s / (M * s + n_new)
    Delta_s = M * n / (M * n + n_new) - b_s
    inner = (L_z / mu) * ((b_s + (1 - b_s) * C) * delta_s + Delta_s * D)
    return {
        "b_s": b_s,
        "Delta_s": Delta_s,
        "mu": mu,
        "L_z": L_z,
        "C": C,
        "delta_s": delta_s,
        "D": D,
        "bound": 2 * math.sqrt(max(inner, 0.0)),
    }


def lipschitz_z(W: Tensor, points: Tensor, num_classes: int) -> float:
    """``max ||grad_z l(z, W_k)||`` over parameter samples ``W`` ``[K, C, D]`` and points ``[N, D + C]``, where
    ``l(z, W) = -t . log softmax(W x)`` for ``z = [x, t]`` (the penalty does not depend on z):
    ``grad_x = W^T (softmax(W x) sum(t) - t)`` and ``grad_t = -log softmax(W x)``."""
    x, t = split_points(points.double(), num_classes)  # (N, D), (N, C)
    W = W.double()
    logits = torch.einsum("kcd,nd->knc", W, x)
    logp = logits.log_softmax(-1)  # (K, N, C)
    residual = logp.exp() * t.sum(-1, keepdim=True) - t  # (K, N, C)
    grad_x = torch.einsum("kcd,knc->knd", W, residual)
    norms = (grad_x.pow(2).sum(-1) + logp.pow(2).sum(-1)).sqrt()
    return float(norms.max())
