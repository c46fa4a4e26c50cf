"""FedLPA: One-Shot Federated Learning with Layer-Wise Posterior Aggregation (Liu et al., NeurIPS 2024;
arXiv 2310.00339; reference code ``lebronlambert/FedLPA_NeurIPS2024@08dd729:experiments_our.py``).

Each client fits its local ERM ``W_m`` (C x D) and a Kronecker-factored Laplace approximation of its
posterior at ``W_m``; it uploads ``W_m`` and the two factors once. The server multiplies the Gaussians.

Our model is one bias-free linear softmax layer, so "layer-wise" is the whole model. With rows of ``W``
flattened row-major (``W.reshape(-1)``, the torch convention) the K-FAC curvature of the mean
cross-entropy is ``G kron A`` with

    A_m = mean_i x_i x_i^T                           (D x D, input second moment)
    G_m = mean_i diag(p_i) - p_i p_i^T,  p_i = softmax(W_m x_i)   (C x C)

We use the *expected* Fisher for ``G``: for softmax cross-entropy it equals the generalised Gauss-Newton
and the exact Hessian, ``mean_i (diag p_i - p_i p_i^T) kron x_i x_i^T``, so K-FAC's factorisation of
the expectation is the only approximation; it is also what the reference's ``KFACOptimizer`` estimates
(it back-propagates labels sampled from the model). The empirical Fisher ``mean (p - t)(p - t)^T``
collapses towards 0 wherever the client fits its data, i.e. exactly where it would claim certainty.

Prior and damping. The local ERM objective ``mean CE + (l2/2)||W||^2`` is, as a posterior,
likelihood^n times ``N(0, (n l2)^-1 I)``. Following Ritter et al. (ICLR 2018) the prior is folded into
the factors as damping, ``A + delta I`` and ``G + delta I`` with ``delta = sqrt(l2)``, whose Kronecker
product contains ``l2 I`` (plus cross terms, K-FAC's usual overestimate). The reference damps both
factors by ``sqrt(1 - 0.999) ~= 0.032`` regardless of the prior; pass ``damping`` to use a fixed value.
Client ``m``'s posterior precision is ``n_m (G_m kron A_m)`` (damped factors), so the product over
clients has precision ``N sum_k w_k (G_k kron A_k)``, ``w_k = n_k / N``; summing the clients' priors
``n_m l2`` gives ``N l2``, the prior of centralised ERM on the pooled data.

Aggregated mean. ``M`` solves ``sum_k w_k G_k M A_k = sum_k w_k G_k W_k A_k``. The reference runs 10,000
gradient steps from the "expectation approximation" ``(sum w G)^-1 Z (sum w A)^-1``; at ``C D <= a few
thousand`` we solve the ``CD x CD`` system exactly (``(sum_k w_k G_k kron A_k) vec(M) = vec(Z)``).
The reference also evaluates both its candidates on the test set and reports the better one; we do no
selection at all, so nothing here sees the test set.

Upload. ``A`` and ``G`` are symmetric, so a client sends their upper triangles (diagonal included) with ``W``,
as the paper does: ``C D + D (D + 1) / 2 + C (C + 1) / 2`` floats, i.e. ``(1280 + 8256 + 55) x 4 = 38,364`` bytes
for C = 10 classes of D = 128 features (the paper's 38.36 KB). The server rebuilds the full factors, symmetric
by construction whatever the codec did to the values.

Ensemble. ``S = ctx.noise.shape[0]`` samples from ``N(M, (N sum_k w_k G_k kron A_k)^-1)`` (a Cholesky
factor of the dense precision), drawn with a ``torch.Generator`` seeded by ``seed``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_fl.oneshot.base import Context, OneShotMethod, Outcome, upload
from lightning_fl.oneshot.baselines.laplace import gaussian_samples
from lightning_fl.oneshot.erm import fit_softmax
from lightning_fl.oneshot.tasks import Task, split_points

__all__ = ["FedLPA", "from_upper", "gaussian_samples", "kfac_aggregate", "kfac_factors", "upper"]


def upper(S: Tensor) -> Tensor:
    """The upper triangle of the square ``S``, diagonal included, row by row: ``k (k + 1) / 2`` values."""
    rows, cols = torch.triu_indices(S.shape[-1], S.shape[-1], device=S.device)
    return S[..., rows, cols]


def from_upper(values: Tensor, k: int) -> Tensor:
    """The symmetric ``k x k`` matrix whose upper triangle (row by row, diagonal included) is ``values``."""
    if values.shape[-1] != k * (k + 1) // 2:
        raise ValueError(
            f"an upper triangle of a {k} x {k} matrix has {k * (k + 1) // 2} values, got {values.shape[-1]}"
        )
    rows, cols = torch.triu_indices(k, k, device=values.device)
    S = values.new_zeros((*values.shape[:-1], k, k))
    S[..., rows, cols] = values
    S[..., cols, rows] = values
    return S


def kfac_factors(x: Tensor, W: Tensor) -> tuple[Tensor, Tensor]:
    """Undamped K-FAC factors of the mean cross-entropy at ``W``: ``x`` ``[N, D]``, ``W`` ``[C, D]`` ->
    (``A`` ``[D, D]``, ``G`` ``[C, C]``), ``G`` the expected-Fisher (= Hessian) factor."""
    N = x.shape[0]
    A = x.T @ x / N  # (D, D)
    p = torch.softmax(x @ W.T, dim=-1)  # (N, C)
    G = (torch.diag(p.sum(0)) - p.T @ p) / N  # (C, C)
    return A, G


def kfac_aggregate(W: Tensor, A: Tensor, G: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Product of K clients' Kronecker-factored Gaussians, solved exactly.

    Args:
        W: Client means ``[K, C, D]``.
        A: Damped input factors ``[K, D, D]`` (symmetric positive definite).
        G: Damped output factors ``[K, C, C]`` (symmetric positive definite).
        weights: Client weights ``[K]`` (``n_k / N``).

    Returns:
        (``M`` ``[C, D]``, ``P`` ``[C D, C D]``): the mean and the weighted precision ``sum_k w_k G_k kron A_k``
        acting on row-major ``vec(W) = W.reshape(-1)``; the posterior precision is ``N P``.
    """
    K, C, D = W.shape
    # sum_k w_k G_k kron A_k as one matmul over k (an einsum may materialise [K, C, C, D, D]).
    P = ((weights[:, None] * G.reshape(K, C * C)).T @ A.reshape(K, D * D)).reshape(C, C, D, D)  # (a, b, i, j)
    P = P.permute(0, 2, 1, 3).reshape(C * D, C * D)  # rows (a, i), columns (b, j)
    Z = torch.einsum("k,kab,kbi,kij->aj", weights, G, W, A)  # (C, D): sum_k w_k G_k W_k A_k
    M = torch.linalg.solve(P, Z.reshape(C * D)).reshape(C, D)
    return M, P


class FedLPA(OneShotMethod):
    """One-shot FedLPA: K-FAC Laplace posteriors per client, multiplied on the server (module docstring).

    Args:
        damping: ``delta`` added to both K-FAC factors (``A + delta I``, ``G + delta I``); ``None`` uses
            ``sqrt(l2)``, which folds the ERM prior into the factors (the reference uses ``sqrt(1 - 0.999)``).
        seed: Seeds the ``torch.Generator`` of the posterior samples (same task and seed, same samples).
        sample: Draw ``S = ctx.noise.shape[0]`` posterior samples; ``False`` returns the mean only.
    """

    name = "fedlpa"

    def __init__(self, damping: float | None = None, seed: int = 0, sample: bool = True) -> None:
        problems = []
        if damping is not None and not (math.isfinite(damping) and damping > 0):
            problems.append(f"damping must be > 0 (finite) or None for sqrt(l2), got {damping!r}")
        if not isinstance(seed, int):
            problems.append(f"seed must be an int, got {seed!r}")
        if problems:
            raise ValueError("FedLPA: " + "; ".join(problems))
        self.damping, self.seed, self.sample = damping, seed, sample

    def run(self, task: Task, ctx: Context) -> Outcome:
        C = task.num_classes
        M, n, _ = task.clients.shape
        delta = math.sqrt(ctx.l2) if self.damping is None else self.damping
        with torch.no_grad():
            x, t = split_points(task.clients, C)  # (M, n, D), (M, n, C)
            local = fit_softmax(x, t, ctx.l2, tol=ctx.tol)  # (M, C, D)
            received, sizes = {"W": [], "A": [], "G": []}, []
            for m in range(M):
                A, G = kfac_factors(x[m], local[m])
                decoded, nbytes = upload(ctx, {"W": local[m], "A": upper(A), "G": upper(G)}, m)
                for key in received:
                    received[key].append(decoded[key].to(device=x.device, dtype=torch.float64))
                sizes.append(nbytes)
            W = torch.stack(received["W"])  # (M, C, D)
            D = W.shape[-1]
            # The full factors from their upper triangles, then damped: the prior folded in.
            A = from_upper(torch.stack(received["A"]), D) + delta * torch.eye(D, dtype=W.dtype, device=W.device)
            G = from_upper(torch.stack(received["G"]), C) + delta * torch.eye(C, dtype=W.dtype, device=W.device)
            sizes_n = torch.full((M,), float(n), dtype=torch.float64, device=x.device)  # n_k (equal in a Task)
            total = float(sizes_n.sum())  # N
            mean, P = kfac_aggregate(W, A, G, sizes_n / total)
            if self.sample:
                g = torch.Generator().manual_seed(self.seed)
                samples = gaussian_samples(mean, total * P, ctx.noise.shape[0], g)  # (S, C, D)
            else:
                samples = mean.unsqueeze(0)  # (1, C, D)
        dtype = task.clients.dtype
        return Outcome(samples.to(dtype).unsqueeze(0), sum(sizes) / len(sizes), {"mean": mean.to(dtype)})

    def __repr__(self) -> str:
        return f"FedLPA(damping={self.damping}, seed={self.seed}, sample={self.sample})"
