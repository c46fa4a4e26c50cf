"""Batched, differentiable ERM for the linear softmax classifier that (F)MP refits.

Federated Martingale Posterior Sampling (equations 1 and 4): every posterior
sample is ``theta = argmin_theta sum_{z in Z u Z'} loss(z, theta)``. Here ``theta`` is a bias-free
linear classifier ``W`` (C x D; 10 x 128 floats = 5.12 KB) and, for each sample ``s``,

    L_s(W) = sum_i w_i CE(softmax(W x_i), t_i) / sum_i w_i + (l2 / 2) ||W||_F^2,
    CE(p, t) = -sum_c t_c log p_c,

with soft targets ``t_i`` (non-negative rows, normally on the simplex; one-hot for hard labels) and
optional non-negative point weights ``w_i``. ``L_s`` is ``l2``-strongly convex, so ``W*_s`` is unique.

Solver: truncated Newton (Newton-CG; Nocedal & Wright, Numerical Optimization, 2nd ed., Algorithm 7.1),
batched over the S samples. CG uses Hessian-vector products (``O(N C D)`` each; the ``(CD)^2``
Hessian is never formed) and a Kronecker preconditioner ``(A kron B + l2 I)^-1`` as in K-FAC (Martens &
Grosse, 2015): ``B`` is the weighted second moment of the features (fixed, eigendecomposed once),
``A`` the mean softmax covariance ``diag(p) - p p^T`` (refreshed every Newton step); the pair is exact
at ``W = 0``. The backtracking Armijo line search runs in logit space: CG's Hessian-vector products
already give the logits of its search directions, so a trial step costs no product with the data.

Gradients with respect to ``x``, ``targets`` and ``weights`` follow from the implicit function
theorem: ``grad_W L(W*(data), data) = 0``, so ``dW*/d(data) = -H^-1 d(grad_W L)/d(data)``. The
backward pass solves ``H v = grad_output`` by the same preconditioned CG and returns
``-d<grad_W L(W*, data), v>/d(data)`` by autograd; ``l2`` is a constant.

Kept as one file: it is one solver; :func:`fit_softmax`'s Newton-CG and its implicit-function backward share the
private problem, preconditioner, conjugate gradients and line search derived above; apart, these would become a
public interface with one caller, and the derivation would describe code in another file.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_fl.errors import UserError

__all__ = ["ERMNotConverged", "erm_objective", "fit_softmax", "predict_proba"]

_CG_MAX_ITER = 50  # per Newton step: a truncated direction is still a descent direction
_BACKWARD_RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}  # relative CG residual of H v = grad_output
_BACKWARD_MAX_ITER = 1000
_ARMIJO = 1e-4
_MAX_BACKTRACKS = 40
_POINTS_PER_FEATURE = 32  # B is estimated from at most 32 D points (it only preconditions)
_FORCING = 0.3  # relative CG residual of a Newton step


class ERMNotConverged(UserError, RuntimeError):
    """The ERM solve (or the implicit-gradient solve) stopped before reaching its tolerance.

    Attributes:
        max_grad: The largest ``max |grad_W L_s|`` over samples when the solver stopped (``nan`` for
            the implicit-gradient solve).
    """

    def __init__(self, message: str, max_grad: float = math.nan) -> None:
        super().__init__(message)
        self.max_grad = max_grad


def fit_softmax(
    x: Tensor,
    targets: Tensor,
    l2: float,
    weights: Tensor | None = None,
    *,
    tol: float = 1e-5,
    max_iter: int = 100,
    init: Tensor | None = None,
) -> Tensor:
    """Minimise ``L_s(W)`` (module docstring) for every sample ``s`` at once; differentiable.

    Args:
        x: Features ``[S, N, D]`` (or ``[N, D]`` for one problem).
        targets: Target distributions ``[S, N, C]`` (or ``[N, C]``): non-negative rows, normally on the
            simplex (one-hot for hard labels). A row summing to ``tau`` weighs its point by ``tau``.
        l2: Ridge strength ``lambda > 0`` in ``(lambda / 2) ||W||_F^2``; no gradient flows to it.
        weights: Non-negative point weights ``[S, N]`` (or ``[N]``), each sample with a positive sum;
            ``None`` weighs all points equally (the mean).
        tol: Stop when ``max_{c,d} |grad_W L_s(W)|_{c,d} <= tol`` for every sample ``s``, the gradient
            evaluated at the returned ``W`` (an absolute tolerance on the loss above, whose data term is
            a weighted mean). Samples stop changing as soon as they meet it.
        max_iter: Newton steps allowed; each runs at most 50 Hessian-vector products.
        init: Starting point ``[S, C, D]`` (or ``[C, D]``), e.g. a previous solution; default zeros.

    Returns:
        ``W`` ``[S, C, D]`` (or ``[C, D]``) in float64 if ``x`` is float64, else float32 (half and
        bfloat16 inputs are promoted; autocast is disabled inside, so calling this in an autocast
        region is safe and gives the same result). Backpropagating through it costs one CG solve.

    Raises:
        ValueError: Inputs with bad shapes, non-finite values, negative targets or weights, ``l2 <= 0``.
        ERMNotConverged: ``max_iter`` Newton steps did not reach ``tol``, or the line search stalled at
            the precision of the solve dtype. Nothing is returned then: downstream gradients assume
            stationarity, and an unconverged ``W`` would silently corrupt them.
    """
    _check_inputs(x, targets, weights, init, l2, tol, max_iter)
    dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    one = x.dim() == 2
    with torch.autocast(device_type=x.device.type, enabled=False):
        xs, ts = x.to(dtype), targets.to(dtype)
        ws = None if weights is None else weights.to(dtype)
        W0 = None if init is None else init.detach().to(dtype)
        if one:
            xs, ts = xs.unsqueeze(0), ts.unsqueeze(0)
            ws = None if ws is None else ws.unsqueeze(0)
            W0 = None if W0 is None else W0.unsqueeze(0)
        W = _FitSoftmax.apply(xs, ts, ws, W0, float(l2), float(tol), int(max_iter))
    return W.squeeze(0) if one else W


def erm_objective(W: Tensor, x: Tensor, targets: Tensor, l2: float, weights: Tensor | None = None) -> Tensor:
    """``L_s(W)`` per sample by plain autograd-friendly ops: ``[S]`` (or a scalar for unbatched inputs).

    Shapes as in :func:`fit_softmax`, with ``W`` ``[S, C, D]`` (or ``[C, D]``).
    """
    logp = torch.log_softmax(x @ W.transpose(-1, -2), dim=-1)  # (S, N, C)
    ce = -(targets * logp).sum(-1)  # (S, N)
    data = ce.mean(-1) if weights is None else (weights * ce).sum(-1) / weights.sum(-1)
    return data + 0.5 * l2 * W.square().sum((-2, -1))


def predict_proba(W: Tensor, x: Tensor) -> Tensor:
    """Posterior predictive ``mean_s softmax(W_s x)``: ``W`` ``[S, C, D]`` (or ``[C, D]``), ``x`` ``[M, D]``
    -> ``[M, C]``, computed in float32 (float64 if either input is float64)."""
    if W.dim() == 2:
        W = W.unsqueeze(0)
    if W.dim() != 3 or x.dim() != 2 or x.shape[-1] != W.shape[-1]:
        raise ValueError(
            f"Expected W [S, C, D] or [C, D] and x [M, D] with the same D, got {_shape(W)} and {_shape(x)}"
        )
    dtype = torch.float64 if torch.float64 in (W.dtype, x.dtype) else torch.float32
    with torch.autocast(device_type=x.device.type, enabled=False):
        logits = torch.einsum("md,scd->smc", x.to(dtype), W.to(dtype))  # (S, M, C)
        return logits.softmax(-1).mean(0)  # (M, C)


class _FitSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, targets, weights, init, l2, tol, max_iter):  # type: ignore[override]
        problem = _Problem(x, targets, weights, l2)
        try:
            W = _newton(problem, init, tol, max_iter)
        except ERMNotConverged:
            if x.dtype != torch.float32:
                raise

            # float32 can stall just above a tight tol (nearly separable data): solve again in float64; only a
            # failure there is reported. The result is returned in float32 like the inputs.
            def wide(t):
                return None if t is None else t.double()

            W = _newton(_Problem(x.double(), targets.double(), wide(weights), l2), wide(init), tol, max_iter).float()
        ctx.save_for_backward(x, targets, weights, W)
        ctx.l2, ctx.b_eig = l2, problem.b_eig  # B's eigendecomposition, reused by the backward solve
        return W

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_W):  # type: ignore[override]
        x, targets, weights, W = ctx.saved_tensors
        data, need = (x, targets, weights), ctx.needs_input_grad[:3]
        if not any(need):
            return (None,) * 7
        with torch.autocast(device_type=x.device.type, enabled=False):
            problem = _Problem(x, targets, weights, ctx.l2, b_eig=ctx.b_eig)
            P = torch.softmax(problem.logits(W), dim=1)
            rtol = _BACKWARD_RTOL[W.dtype]
            hvp = functools.partial(problem.hvp, P)
            v, _, residual = _pcg(
                hvp, grad_W.to(W.dtype), _KroneckerPreconditioner(problem, P), rtol, _BACKWARD_MAX_ITER
            )
            if bool((residual > rtol).any()):
                raise ERMNotConverged(
                    f"The implicit-gradient solve H v = grad_output stopped at a relative residual of "
                    f"{float(residual.max()):.3g} > {rtol:g} after {_BACKWARD_MAX_ITER} CG steps; raise l2 "
                    f"(better conditioned) or solve in float64"
                )
            with torch.enable_grad():
                leaves = [
                    t.detach().requires_grad_(n) if t is not None else None for t, n in zip(data, need, strict=True)
                ]
                g = _gradient(W, *leaves, ctx.l2)  # grad_W L(W*, data), differentiable in the data
                wrt = [t for t in leaves if t is not None and t.requires_grad]
                found = iter(torch.autograd.grad(g, wrt, grad_outputs=-v))  # -d<g, v>/d(data)
        grads = [next(found) if t is not None and t.requires_grad else None for t in leaves]
        return (*grads, None, None, None, None)


def _gradient(W: Tensor, x: Tensor, targets: Tensor, weights: Tensor | None, l2: float) -> Tensor:
    """``grad_W L_s(W)`` in closed form, ``[S, C, D]``; differentiable in ``x``, ``targets`` and ``weights``."""
    P = torch.softmax(torch.bmm(x, W.transpose(1, 2)), dim=-1)  # (S, N, C)
    w = torch.full_like(targets[..., 0], 1 / x.shape[1]) if weights is None else weights / weights.sum(-1, keepdim=True)
    R = w.unsqueeze(-1) * (targets.sum(-1, keepdim=True) * P - targets)  # (S, N, C)
    return torch.bmm(R.transpose(1, 2), x) + l2 * W


class _Problem:
    """``L_s`` for a batch of samples, in the layout the solver wants: logits ``[S, C, N]``."""

    def __init__(
        self, x: Tensor, targets: Tensor, weights: Tensor | None, l2: float, b_eig: tuple[Tensor, Tensor] | None = None
    ) -> None:
        S, N, _ = x.shape
        self.x, self.l2 = x, l2  # (S, N, D)
        self.t = targets.transpose(1, 2).contiguous()  # (S, C, N)
        w = x.new_full((S, 1, N), 1 / N) if weights is None else (weights / weights.sum(-1, keepdim=True)).unsqueeze(1)
        self.w = w  # (S, 1, N), sums to 1 per sample
        self.wt = w * self.t.sum(1, keepdim=True)  # (S, 1, N): weight times the target row's mass
        self.b_eig = b_eig if b_eig is not None else self._feature_moment_eig()

    def _feature_moment_eig(self) -> tuple[Tensor, Tensor]:
        """Eigenpairs of ``B = sum_i w_i tau_i x_i x_i^T`` (``[S, D]``, ``[S, D, D]``), from a strided subset."""
        N, D = self.x.shape[1:]
        step = max(1, N // (_POINTS_PER_FEATURE * D))
        xs, ws = self.x[:, ::step], self.wt[:, :, ::step] * step  # (S, n, D), (S, 1, n)
        B = torch.bmm(xs.transpose(1, 2) * ws, xs)  # (S, D, D)
        return torch.linalg.eigh(B)

    def logits(self, W: Tensor) -> Tensor:
        return torch.bmm(W, self.x.transpose(1, 2))  # (S, C, N)

    def loss(self, Z: Tensor, W: Tensor) -> Tensor:
        data = self.wt * torch.logsumexp(Z, dim=1, keepdim=True) - self.w * (self.t * Z).sum(1, keepdim=True)
        return data.sum((1, 2)) + 0.5 * self.l2 * _dot(W, W)  # (S,)

    def grad(self, P: Tensor, W: Tensor) -> Tensor:
        return torch.bmm(self.wt * P - self.w * self.t, self.x) + self.l2 * W  # (S, C, D)

    def slope(self, P: Tensor, W: Tensor, A: Tensor, d: Tensor) -> Tensor:
        """``<grad L(W), d>`` from the logits ``A`` of ``d`` (no product with the data): ``[S]``."""
        return ((self.wt * P - self.w * self.t) * A).sum((1, 2)) + self.l2 * _dot(W, d)

    def hvp(self, P: Tensor, V: Tensor) -> tuple[Tensor, Tensor]:
        """Hessian-vector product at softmax ``P`` and the logits of ``V`` (both reused by the caller)."""
        A = self.logits(V)  # (S, C, N)
        J = P * (A - (P * A).sum(1, keepdim=True))  # (diag p - p p^T) a, per point
        return torch.bmm(self.wt * J, self.x) + self.l2 * V, A


class _KroneckerPreconditioner:
    """``V -> (A kron B + l2 I)^-1 V`` with ``A`` the mean softmax covariance at ``P`` and ``B`` fixed."""

    def __init__(self, problem: _Problem, P: Tensor) -> None:
        wp = problem.wt * P  # (S, C, N)
        mass = problem.wt.sum((1, 2)).clamp_min(torch.finfo(P.dtype).tiny)[:, None, None]
        A = (torch.diag_embed(wp.sum(2)) - torch.bmm(wp, P.transpose(1, 2))) / mass  # (S, C, C)
        la, self.Ua = torch.linalg.eigh(A)
        lb, self.Ub = problem.b_eig
        self.den = la.clamp_min(0).unsqueeze(2) * lb.clamp_min(0).unsqueeze(1) + problem.l2  # (S, C, D)

    def __call__(self, V: Tensor) -> Tensor:
        Y = self.Ua.transpose(1, 2) @ V @ self.Ub
        return self.Ua @ (Y / self.den) @ self.Ub.transpose(1, 2)


def _newton(problem: _Problem, init: Tensor | None, tol: float, max_iter: int) -> Tensor:
    x = problem.x
    S, C, N = problem.t.shape
    W = x.new_zeros(S, C, x.shape[2]) if init is None else init.clone()
    Z = x.new_zeros(S, C, N) if init is None else problem.logits(W)
    exact = True  # Z == logits(W) from a product with the data; line-search updates add rounding
    f, P = problem.loss(Z, W), torch.softmax(Z, dim=1)
    g = problem.grad(P, W)
    eps = torch.finfo(x.dtype).eps
    steps = 0
    while True:
        gmax = g.abs().amax((1, 2))  # (S,)
        active = gmax > tol
        if not bool(active.any()):
            if exact:
                return W
            # Confirm the stopping rule with exact logits (float32 updates drift by ~1e-7 relative).
            Z, exact = problem.logits(W), True
            f, P = problem.loss(Z, W), torch.softmax(Z, dim=1)
            g = problem.grad(P, W)
            continue
        if steps == max_iter:
            worst = float(gmax.max())
            raise ERMNotConverged(
                f"ERM did not converge in max_iter={max_iter} Newton steps: max |grad| = {worst:.3g} > tol = {tol:g} "
                f"for {int(active.sum())} of {S} samples; raise max_iter, or l2 (better conditioned), or loosen tol",
                worst,
            )
        steps += 1
        # Inexact Newton: ||H d + g|| <= eta ||g||, with eta = 0.3 (tighter solves cost more CG steps than the
        # Newton steps they save, on the problems of benchmarks/erm.py) but looser on the last step, where the next
        # gradient, ~ H d + g, only has to meet the stopping rule: ||H d + g|| <= tol / 2.
        gnorm = g.flatten(1).norm(dim=1)
        rtol = _forcing(gnorm, tol)
        b = torch.where(active[:, None, None], -g, 0)
        hvp = functools.partial(problem.hvp, P)
        d, Ad, _ = _pcg(hvp, b, _KroneckerPreconditioner(problem, P), rtol, _CG_MAX_ITER)
        assert Ad is not None  # an active sample has ||r|| = ||b|| > rtol ||b||, so CG takes a step
        W, Z, f, P = _line_search(problem, W, Z, f, g, d, Ad, eps)
        g, exact = problem.grad(P, W), False


def _forcing(gnorm: Tensor, tol: float) -> Tensor:
    return (0.5 * tol / gnorm).clamp(min=_FORCING, max=0.5)


def _line_search(
    problem: _Problem, W: Tensor, Z: Tensor, f: Tensor, g: Tensor, d: Tensor, Ad: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backtracking from ``t = 1`` per sample; returns the new ``W, Z, f, softmax(Z)``.

    A step passes Armijo's test, or, once the decrease is below the rounding of ``f``, Hager & Zhang's
    (2005) approximate Wolfe test ``slope(t) <= (1 - 2 c) |slope(0)|``, which float32 needs near the optimum.
    """
    gd = _dot(g, d)  # (S,), <= 0; 0 for samples that have converged
    t = torch.ones_like(f)
    for _ in range(_MAX_BACKTRACKS):
        Wn, Zn = W + t[:, None, None] * d, Z + t[:, None, None] * Ad
        fn, Pn = problem.loss(Zn, Wn), torch.softmax(Zn, dim=1)
        ok = fn <= f + _ARMIJO * t * gd
        if not bool(ok.all()):
            flat = fn <= f + 16 * eps * f.abs()
            ok |= flat & (problem.slope(Pn, Wn, Ad, d) <= (1 - 2 * _ARMIJO) * gd.abs())
        if bool(ok.all()):
            return Wn, Zn, fn, Pn
        t = torch.where(ok, t, 0.5 * t)
    worst = float(g.abs().amax())
    raise ERMNotConverged(
        f"ERM line search stalled at max |grad| = {worst:.3g}, the precision limit of {W.dtype} for this problem; "
        f"loosen tol, raise l2, or pass float64 inputs",
        worst,
    )


def _pcg(
    hvp: Callable[[Tensor], tuple[Tensor, Tensor]],
    b: Tensor,
    precond: Callable[[Tensor], Tensor],
    rtol: Tensor | float,
    max_iter: int,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Preconditioned CG on ``H v = b`` per sample, to ``||H v - b|| <= rtol ||b||`` or ``max_iter`` steps.

    Returns ``v``, the logits of ``v`` (summed from those of the search directions; ``None`` if no step
    was needed) and the relative residual per sample. Samples that meet their tolerance stop changing.
    """
    v, Av = torch.zeros_like(b), None
    r = b.clone()
    bnorm = b.flatten(1).norm(dim=1)  # (S,)
    target = rtol * bnorm
    done = r.flatten(1).norm(dim=1) <= target
    z = precond(r)
    p, rz = z, _dot(r, z)
    for _ in range(max_iter):
        if bool(done.all()):
            break
        Hp, Ap = hvp(p)
        pHp = _dot(p, Hp)
        live = ~done & (pHp > 0)  # pHp > 0 unless rounding ate the direction
        alpha = torch.where(live, rz / torch.where(live, pHp, 1), 0)[:, None, None]
        v, r = v + alpha * p, r - alpha * Hp
        Av = alpha * Ap if Av is None else Av + alpha * Ap
        done = done | ~live | (r.flatten(1).norm(dim=1) <= target)
        z = precond(r)
        rz_next = _dot(r, z)
        beta = torch.where(done, 0, rz_next / torch.where(done, 1, rz))[:, None, None]
        p, rz = z + beta * p, rz_next
    residual = r.flatten(1).norm(dim=1) / bnorm.clamp_min(torch.finfo(b.dtype).tiny)
    return v, Av, residual


def _dot(a: Tensor, b: Tensor) -> Tensor:
    return (a * b).sum((1, 2))  # (S,)


def _shape(t: Tensor | None) -> str:
    return "None" if t is None else str(list(t.shape))


def _check_inputs(
    x: Tensor,
    targets: Tensor,
    weights: Tensor | None,
    init: Tensor | None,
    l2: float,
    tol: float,
    max_iter: int,
) -> None:
    """Raise one ValueError listing every problem with the inputs of :func:`fit_softmax`."""
    problems: list[str] = []
    if not (isinstance(l2, numbers.Real) and math.isfinite(l2) and l2 > 0):
        problems.append(f"Expected l2 > 0 (finite), got {l2!r}")
    if not (isinstance(tol, numbers.Real) and tol > 0):
        problems.append(f"Expected tol > 0, got {tol!r}")
    if not (isinstance(max_iter, numbers.Integral) and max_iter >= 1):
        problems.append(f"Expected max_iter >= 1, got {max_iter!r}")
    if x.dim() not in (2, 3) or not x.is_floating_point() or 0 in x.shape:
        problems.append(
            f"Expected x of floating dtype and non-empty shape [S, N, D] or [N, D], got {x.dtype} {_shape(x)}"
        )
        raise ValueError("; ".join(problems))
    lead = tuple(x.shape[:-1])  # (S, N) or (N,)
    if targets.dim() != x.dim() or tuple(targets.shape[:-1]) != lead or targets.shape[-1] == 0:
        problems.append(
            f"Expected targets of shape [{', '.join(map(str, lead))}, C] (as x {_shape(x)}), got {_shape(targets)}"
        )
    elif not targets.is_floating_point():
        problems.append(f"Expected floating-point targets (one-hot rows for hard labels), got {targets.dtype}")
    if weights is not None and tuple(weights.shape) != lead:
        problems.append(f"Expected weights of shape {list(lead)} (x's leading dimensions), got {_shape(weights)}")
    if init is not None:
        want = [*x.shape[:-2], targets.shape[-1], x.shape[-1]]
        if list(init.shape) != want:
            problems.append(f"Expected init of shape {want}, got {_shape(init)}")
    for name, t in (("targets", targets), ("weights", weights), ("init", init)):
        if t is not None and t.device != x.device:
            problems.append(f"Expected {name} on x's device {x.device}, got {t.device}")
    if problems:
        raise ValueError("; ".join(problems))
    for name, t in (("x", x), ("targets", targets), ("weights", weights), ("init", init)):
        # A finite sum proves every entry finite in one cheap pass; count the bad ones only when it is not.
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t.sum())):
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                problems.append(f"Expected finite {name}, got {bad} non-finite values")
    if problems:
        raise ValueError("; ".join(problems))
    if bool((targets < 0).any()):
        problems.append(f"Expected non-negative targets, got a minimum of {float(targets.min()):.3g}")
    if weights is not None:
        if bool((weights < 0).any()):
            problems.append(f"Expected non-negative weights, got a minimum of {float(weights.min()):.3g}")
        elif bool((weights.sum(-1) <= 0).any()):
            problems.append("Expected weights with a positive sum for every sample, got an all-zero sample")
    if problems:
        raise ValueError("; ".join(problems))
