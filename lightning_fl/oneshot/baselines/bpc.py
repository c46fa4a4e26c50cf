"""Bayesian pseudocoresets for one-shot federated learning (d'Hondt, Pechenizkiy, Peharz 2024,
arXiv 2406.02177; pseudocoresets after Manousakas et al., NeurIPS 2020 and NeurIPS 2022).

Each client learns ``s`` pseudo-points that stand in for its ``n`` points and uploads them once
(``s (D + C)`` floats, FMP's summary size); the server pools every client's pseudo-points and samples
the posterior they define.

Client. Labels are fixed and class-balanced (Manousakas et al. 2022's default): pseudo-point ``j`` gets
the ``j``-th class, cycling over the classes the client holds (under label skew a client cannot summarise
a class it never saw); its features start at a random real point of that class. The features ``u`` are
learned by the bilevel problem of Manousakas et al. (2022), with our exact, implicitly differentiated ERM
(:func:`lightning_fl.oneshot.erm.fit_softmax`) as the inner solve:

    min_u  D(W(u), W_m),   W(u) = argmin_W mean_j CE(W u_j, y_j) + (l2/2)||W||^2,

where ``W_m`` is the client's ERM on its own data and ``D`` is either

* ``"kl"`` (default): function space, ``mean_i KL(softmax(W_m x_i) || softmax(W(u) x_i))`` over the
  client's points -- d'Hondt et al. summarise clients in function space to avoid weight-space
  symmetries; this is the one-model analogue; or
* ``"weights"``: ``||W(u) - W_m||_F^2`` (the softmax model has no weight symmetries to avoid).

Adam on ``u`` for ``steps`` steps, all clients batched; every inner solve starts from the previous one.

Server. Every pseudo-point gets weight ``n_m / s`` (so the pooled set stands in for ``N`` points) and the
pseudocoreset posterior ``prior x prod_j p(y_j | u_j, W)^{n_m / s}`` -- with the ERM prior
``N(0, (N l2)^-1 I)``, as centralised ERM on ``N`` points -- is approximated by a Laplace approximation at
its mode (the pooled weighted ERM fit) with the exact dense Hessian ``N (H + l2 I)``, ``H`` the Hessian of
the weighted mean cross-entropy. ``S = ctx.noise.shape[0]`` samples are drawn from it with a seeded
generator.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_fl.oneshot.base import Context, OneShotMethod, Outcome, upload
from lightning_fl.oneshot.baselines.laplace import gaussian_samples, softmax_hessian
from lightning_fl.oneshot.erm import fit_softmax
from lightning_fl.oneshot.summarize import Identity
from lightning_fl.oneshot.tasks import Task, project_labels, split_points

__all__ = ["BPC", "softmax_hessian"]

_DIVERGENCES = ("kl", "weights")


class BPC(OneShotMethod):
    """One-shot FL with Bayesian pseudocoresets (module docstring).

    Args:
        num_points: Pseudo-points ``s`` per client; ``None`` uses the context summariser's size (``n`` for
            ``Identity``), so BPC and FMP upload the same bytes.
        steps: Adam steps on the pseudo-points' features.
        lr: Adam learning rate.
        divergence: ``"kl"`` (function space, on the client's points) or ``"weights"`` (squared distance).
        seed: Seeds the pseudo-points' initialisation and the posterior samples.
    """

    name = "bpc"

    def __init__(
        self,
        num_points: int | None = None,
        steps: int = 100,
        lr: float = 0.05,
        divergence: str = "kl",
        seed: int = 0,
    ) -> None:
        problems = []
        if num_points is not None and not (isinstance(num_points, int) and num_points >= 1):
            problems.append(f"num_points must be an int >= 1 or None, got {num_points!r}")
        if not (isinstance(steps, int) and steps >= 0):
            problems.append(f"steps must be an int >= 0, got {steps!r}")
        if not (math.isfinite(lr) and lr > 0):
            problems.append(f"lr must be > 0 (finite), got {lr!r}")
        if divergence not in _DIVERGENCES:
            problems.append(f"divergence must be one of {_DIVERGENCES}, got {divergence!r}")
        if not isinstance(seed, int):
            problems.append(f"seed must be an int, got {seed!r}")
        if problems:
            raise ValueError("BPC: " + "; ".join(problems))
        self.num_points, self.steps, self.lr = num_points, steps, lr
        self.divergence, self.seed = divergence, seed

    def _size(self, ctx: Context, n: int) -> int:
        if self.num_points is not None:
            return self.num_points
        return n if isinstance(ctx.summariser, Identity) else ctx.summariser.num_points

    def initial_points(self, clients: Tensor, num_classes: int, s: int, g: torch.Generator) -> Tensor:
        """Class-balanced hard labels over each client's classes, features from random real points of the class:
        ``clients`` ``[M, n, D + C]`` -> ``[M, s, D + C]``."""
        x, t = split_points(clients, num_classes)
        y = t.argmax(-1)  # (M, n)
        out = []
        for m in range(clients.shape[0]):
            present = torch.unique(y[m])  # sorted classes the client holds
            labels = present[torch.arange(s) % len(present)]  # (s,)
            rows = []
            for c in labels.tolist():
                idx = torch.nonzero(y[m] == c).flatten()
                rows.append(idx[torch.randint(len(idx), (1,), generator=g)])
            feats = x[m, torch.cat(rows)]  # (s, D)
            onehot = torch.nn.functional.one_hot(labels, num_classes).to(feats)  # (s, C)
            out.append(torch.cat([feats, onehot], -1))
        return torch.stack(out)

    def optimise(self, clients: Tensor, init: Tensor, num_classes: int, l2: float, tol: float) -> tuple[Tensor, Tensor]:
        """Optimise the features of ``init`` ``[M, s, D + C]`` for ``clients`` ``[M, n, D + C]``.

        Returns:
            (pseudo-points ``[M, s, D + C]``, objective per client ``[steps + 1, M]``: before each step, then after
            the last).
        """
        x, t = split_points(clients, num_classes)  # (M, n, D), (M, n, C)
        u0, labels = split_points(init, num_classes)  # (M, s, D), (M, s, C)
        with torch.no_grad():
            target = fit_softmax(x, t, l2, tol=tol)  # (M, C, D)
            p_target = torch.softmax(x @ target.transpose(1, 2), -1)  # (M, n, C)
        u = u0.detach().clone().requires_grad_(True)
        opt = torch.optim.Adam([u], lr=self.lr)
        W_prev, history = None, []

        def objective() -> tuple[Tensor, Tensor]:
            W = fit_softmax(u, labels, l2, tol=tol, init=W_prev)  # (M, C, D), differentiable in u
            if self.divergence == "weights":
                return (W - target).square().sum((1, 2)), W  # (M,)
            logq = torch.log_softmax(x @ W.transpose(1, 2), -1)  # (M, n, C)
            kl = (p_target * (p_target.clamp_min(1e-30).log() - logq)).sum(-1).mean(-1)  # (M,)
            return kl, W

        for _ in range(self.steps):
            with torch.enable_grad():  # also when the caller evaluates under no_grad
                loss, W = objective()
                history.append(loss.detach())
                opt.zero_grad()
                loss.sum().backward()  # clients are independent: the sum gives each its own gradient
            opt.step()
            W_prev = W.detach()
        with torch.no_grad():
            history.append(objective()[0])
        return torch.cat([u.detach(), labels], -1), torch.stack(history)

    def run(self, task: Task, ctx: Context) -> Outcome:
        C = task.num_classes
        M, n, _ = task.clients.shape
        s = self._size(ctx, n)
        g = torch.Generator().manual_seed(self.seed)
        init = self.initial_points(task.clients, C, s, g)  # (M, s, D + C)
        local, history = self.optimise(task.clients, init, C, ctx.l2, ctx.tol)
        received, sizes = [], []
        with torch.no_grad():
            for m in range(M):
                decoded, nbytes = upload(ctx, {"pseudocoreset": local[m]}, m)
                # A lossy codec may move label parts off the simplex: the server projects them back.
                received.append(project_labels(decoded["pseudocoreset"].to(local), C))
                sizes.append(nbytes)
            pooled = torch.cat(received).double()  # (M * s, D + C)
            weights = torch.full((M * s,), n / s, dtype=torch.float64, device=pooled.device)  # n_m / s each
            total = float(weights.sum())  # N
            xp, tp = split_points(pooled, C)
            mode = fit_softmax(xp, tp, ctx.l2, weights, tol=ctx.tol)  # (C, D)
            H = softmax_hessian(mode, xp, weights / total)  # (CD, CD), weighted-mean CE
            precision = total * (H + ctx.l2 * torch.eye(H.shape[0], dtype=H.dtype, device=H.device))
            samples = gaussian_samples(mode, precision, ctx.noise.shape[0], g)  # (S, C, D)
        dtype = task.clients.dtype
        extras = {"pseudocoreset": pooled.to(dtype), "history": history, "mode": mode.to(dtype)}
        return Outcome(samples.to(dtype).unsqueeze(0), sum(sizes) / len(sizes), extras)

    def __repr__(self) -> str:
        return (
            f"BPC(num_points={self.num_points}, steps={self.steps}, lr={self.lr}, divergence={self.divergence!r}, "
            f"seed={self.seed})"
        )
