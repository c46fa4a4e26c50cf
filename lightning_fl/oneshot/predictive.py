"""The predictive generator of martingale-posterior sampling: ``Z' = ISAB(Z, E) = MAB(E, MAB(R, E))``.

FMP (section II-2, after the MPNP of Lee et al. 2023, "Martingale Posterior Neural Processes") draws unseen
data with a set transformer: the observed points are mapped to inducing points ``R = g(Z)``, a base set
``E ~ N(0, I)`` of ``n'`` noise vectors attends to them, and the result is ``n'`` new points. Permuting ``Z``
does not change the output's distribution and permuting ``E`` permutes the output (conditional exchangeability).

A generated point is ``[h', p']``: features and a label distribution, so the ERM refit treats
generated labels as soft targets. ``labels`` chooses where ``p'`` comes from:

* ``learned`` (default): a softmax over label logits the set transformer emits with the features;
* ``predictive``: ``softmax(W_Z h' + l')``, the predictive of the model refit on the observed ``Z``
  (ERM, differentiable) corrected by the emitted logits ``l'``;
* ``sampled``: a one-hot label drawn from that predictive distribution, with the uniform
  variate taken from the base set itself (``Phi(e_0)``), so a shared ``E`` gives MP and FMP the
  same draws. This is predictive resampling as in Fong et al.'s martingale posterior (a new label is
  drawn from the current predictive), with the features from the set transformer.

How the label modes compare on held-out NLL, and the trained generator's label entropy, are measured in
docs/results-fmp.md (section "FMP", the claim on naive resampling).

Training (the paper leaves it open; this is our reading): the generator must be trained before it is
frozen. :func:`generator_loss` is our objective, on tasks from the meta-training corpus with a
context ``Z`` and held-out points ``T`` of the same task:

* ``-log (1/S) sum_s p(y_t | x_t, W_s)`` averaged over ``t in T``: the held-out log-likelihood of
  the posterior predictive, where ``W_s`` is refit by ERM on ``Z u Z'_s`` (MPNP's marginal term);
  gradients reach the generator through the ERM solution (implicit function theorem);
* ``beta * ED(Z'_s, T)``: the energy distance between generated and held-out points, a
  sample-based distribution score that keeps ``Z'`` looking like data of the task;
* ``gamma * -log p(y_t | x_t, W'_s)`` with ``W'_s`` refit on ``Z'_s`` alone (MPNP's pseudo-context
  term): without it the generator may learn uninformative, near-uniform labels that only act as a
  regulariser of the refit, which lowers held-out NLL a little but makes MP under-confident;
* ``delta * (log spread(W_s) - log spread(W^urn_s))^2`` per task: the refits on ``Z u Z'_s`` must spread as
  much as the refits on ``Z`` plus the Polya urn's draws of the same size (the Bayesian bootstrap: the classic
  martingale posterior), a posterior's spread the held-out NLL alone does not ask for. ``spread`` is the mean
  distance of the S refits from their mean (:func:`~lightning_fl.oneshot.quality.sample_spread`); the urn's side
  is a fixed target (no gradient).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_fl.models.set_transformer import MAB
from lightning_fl.oneshot.distances import energy_distance
from lightning_fl.oneshot.erm import fit_softmax
from lightning_fl.oneshot.quality import sample_spread
from lightning_fl.oneshot.tasks import split_points


class Predictive(nn.Module):
    """Base of the predictives martingale-posterior sampling draws unseen data from (select one with
    ``model.generator.class_path``): ``forward(z [B, N, D + C], noise [B, S, n', e]) -> [B, S, n', D + C]``.

    ``noise`` is the base set ``E`` (:meth:`noise`), shared by every sampling method on a task so that MP and FMP
    see the same draws. A predictive with parameters (``trainable``) is trained before it is frozen and cached;
    one without is ready as built.
    """

    _plugin_base = True  # not offered as a choice in CLI messages
    trainable = True

    def __init__(self) -> None:
        super().__init__()
        self.feature_dim = self.num_classes = 0
        self.noise_dim = 1

    def configure(self, feature_dim: int, num_classes: int) -> None:
        """Called once the point layout is known (before any forward or checkpoint load)."""
        self.feature_dim, self.num_classes = feature_dim, num_classes

    def noise(self, *shape: int, generator: torch.Generator | None = None, device=None) -> Tensor:
        """A base set ``E``: ``shape + (noise_dim,)`` standard normal draws."""
        return torch.randn(*shape, self.noise_dim, generator=generator, device=device)

    def forward(self, z: Tensor, noise: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define forward(z, noise)")


class PolyaUrn(Predictive):
    """The Polya urn: the classic martingale posterior's predictive (Fong, Holmes and Walker 2023), as a control.

    The ``i``-th unseen point (0-based) is a copy of one of the ``N + i`` points seen so far, observed or
    already drawn, chosen uniformly: ``k_i = floor(u_i (N + i))`` with ``u_i = Phi(e_i0)`` taken from the base set,
    so a shared ``E`` gives every method the same draws. As ``n'`` grows, refitting on ``Z u Z'`` weights the
    observed points by Dirichlet(1, ..., 1) draws: Rubin's Bayesian bootstrap, the martingale posterior with
    the empirical predictive. With ``bandwidth > 0`` each drawn point's features move by ``bandwidth`` times a
    standard normal vector (also from ``E``; labels are copied): a kernel-smoothed urn, whose draws leave the
    observed points.

    Args:
        bandwidth: Standard deviation of the Gaussian kernel on the features (0: the plain urn).
    """

    trainable = False

    def __init__(self, bandwidth: float = 0.0) -> None:
        super().__init__()
        if not (math.isfinite(bandwidth) and bandwidth >= 0):
            raise ValueError(f"model.generator.bandwidth must be >= 0 (finite), got {bandwidth!r}")
        self.bandwidth = bandwidth

    def configure(self, feature_dim: int, num_classes: int) -> None:
        super().configure(feature_dim, num_classes)
        self.noise_dim = 1 + (feature_dim if self.bandwidth > 0 else 0)

    def forward(self, z: Tensor, noise: Tensor) -> Tensor:
        if not self.num_classes:
            raise RuntimeError("PolyaUrn.configure(feature_dim, num_classes) must be called first")
        B, S, n_new, _ = noise.shape
        N, P, D = z.shape[1], z.shape[2], self.feature_dim
        u = torch.special.ndtr(noise[..., 0].double())  # (B, S, n'): uniform in (0, 1)
        # Which observed point each draw copies in the end (a copy of a draw copies what that draw copied), and
        # the kernel moves it gathered on the way. Only indices and noise are written in place: the points come
        # from one gather of z, so gradients reach z (FMP meta-trains its summariser through this).
        roots = torch.zeros(B, S, n_new, dtype=torch.long, device=z.device)
        moves = noise.new_zeros(B, S, n_new, D) if self.bandwidth > 0 else None
        for i in range(n_new):
            k = (u[..., i] * (N + i)).long().clamp(max=N + i - 1)  # (B, S): uniform over the N + i points so far
            drawn, j = k >= N, (k - N).clamp(min=0)  # a copy of draw j, or of observed point k
            roots[..., i] = torch.where(drawn, roots.gather(2, j.unsqueeze(-1)).squeeze(-1), k)
            if moves is not None:
                before = moves.gather(2, j[..., None, None].expand(B, S, 1, D)).squeeze(2)
                moves[..., i, :] = torch.where(drawn.unsqueeze(-1), before, 0.0) + noise[..., i, 1 : 1 + D]
        out = z.unsqueeze(1).expand(B, S, N, P).gather(2, roots.unsqueeze(-1).expand(B, S, n_new, P))
        if moves is None:
            return out
        h, p = split_points(out, self.num_classes)
        return torch.cat([h + self.bandwidth * moves.to(h), p], dim=-1)

    def extra_repr(self) -> str:
        return f"bandwidth={self.bandwidth}"


class PredictiveGenerator(Predictive):
    """``Z' = MAB(E, MAB(g(Z), E))`` with ``E ~ N(0, I)``; layers are built by :meth:`configure`.

    Args:
        hidden: Width of the inducing points and attention blocks.
        num_heads: Attention heads.
        noise_dim: Dimension of each base-set vector (default ``hidden``).
        layer_norm: LayerNorm inside the MABs (the set-transformer paper's equations).
        labels: ``sampled``, ``predictive`` or ``learned`` (module docstring).
        label_l2: ERM penalty of the refit on ``Z`` that gives ``W_Z`` for ``predictive``/``sampled`` labels.
    """

    def __init__(
        self,
        hidden: int = 128,
        num_heads: int = 4,
        noise_dim: int | None = None,
        layer_norm: bool = True,
        labels: str = "learned",
        label_l2: float = 0.01,
    ):
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"model.generator: hidden ({hidden}) must be divisible by num_heads ({num_heads})")
        if labels not in ("sampled", "predictive", "learned"):
            raise ValueError(f"model.generator.labels must be 'sampled', 'predictive' or 'learned', got {labels!r}")
        self.labels, self.label_l2 = labels, label_l2
        self.hidden, self.num_heads = hidden, num_heads
        self.noise_dim = noise_dim or hidden
        self.layer_norm = layer_norm

    def configure(self, feature_dim: int, num_classes: int) -> None:
        """Build the layers for points of ``feature_dim + num_classes`` values."""
        super().configure(feature_dim, num_classes)
        point_dim, h = feature_dim + num_classes, self.hidden
        self.g = nn.Sequential(nn.Linear(point_dim, h), nn.ReLU(), nn.Linear(h, h))
        self.inducing = MAB(h, self.noise_dim, h, self.num_heads, layer_norm=self.layer_norm)  # MAB(R, E)
        self.generate = MAB(self.noise_dim, h, h, self.num_heads, layer_norm=self.layer_norm)  # MAB(E, H)
        self.out = nn.Linear(h, point_dim)

    def extra_repr(self) -> str:
        # every setting, so the generator cache (keyed on this text) never serves weights trained with other ones
        return (
            f"hidden={self.hidden}, num_heads={self.num_heads}, noise_dim={self.noise_dim}, "
            f"layer_norm={self.layer_norm}, labels={self.labels!r}, label_l2={self.label_l2}"
        )

    def forward(self, z: Tensor, noise: Tensor) -> Tensor:
        """``z``: ``[B, N, D + C]`` observed points; ``noise``: ``[B, S, n', e]`` base sets -> ``[B, S, n', D + C]``."""
        if not self.feature_dim:
            raise RuntimeError("PredictiveGenerator.configure(feature_dim, num_classes) must be called first")
        B, S, n_new, _ = noise.shape
        r = self.g(z)  # (B, N, h): inducing points R = g(Z)
        r = r.unsqueeze(1).expand(B, S, *r.shape[1:]).reshape(B * S, -1, self.hidden)
        e = noise.reshape(B * S, n_new, self.noise_dim)
        out = self.out(self.generate(e, self.inducing(r, e)))  # (B*S, n', D + C)
        h, logits = split_points(out.reshape(B, S, n_new, -1), self.num_classes)
        logits = logits.float()
        if self.labels != "learned":
            x, t = split_points(z, self.num_classes)
            W = fit_softmax(x, t, self.label_l2)  # (B, C, D): the model refit on the observed points
            logits = logits + torch.einsum("bcd,bsnd->bsnc", W, h.float())
        p = logits.softmax(-1)  # (B, S, n', C)
        if self.labels == "sampled":
            u = torch.special.ndtr(noise[..., 0].float()).unsqueeze(-1)  # (B, S, n', 1): uniform, from E itself
            k = (p.cumsum(-1) < u).sum(-1, keepdim=True).clamp(max=self.num_classes - 1)  # inverse-CDF draw
            p = torch.zeros_like(p).scatter_(-1, k, 1.0)
        return torch.cat([h, p.to(h.dtype)], dim=-1)


def refit(z: Tensor, generated: Tensor | None, num_classes: int, l2: float, tol: float = 1e-5) -> Tensor:
    """ERM on ``Z u Z'``: ``z`` ``[B, N, P]``, ``generated`` ``[B, S, n', P]`` -> ``W`` ``[B, S, C, D]``."""
    B, N, P = z.shape
    if generated is None:
        x, t = split_points(z, num_classes)
        return fit_softmax(x, t, l2, tol=tol).unsqueeze(1)
    S = generated.shape[1]
    pts = torch.cat([z.unsqueeze(1).expand(B, S, N, P), generated.to(z.dtype)], dim=2)  # (B, S, N + n', P)
    x, t = split_points(pts.reshape(B * S, -1, P), num_classes)
    W = fit_softmax(x, t, l2, tol=tol)  # (B*S, C, D)
    return W.reshape(B, S, *W.shape[1:])


def log_predictive(W: Tensor, points: Tensor, num_classes: int) -> Tensor:
    """Log posterior-predictive probability of each point's label: ``log mean_s softmax(W_s x)`` scored
    against the point's label distribution. ``W`` ``[B, S, C, D]``, ``points`` ``[B, T, D + C]`` -> ``[B, T]``."""
    x, t = split_points(points, num_classes)
    logp = torch.einsum("bscd,btd->bstc", W.float(), x.float()).log_softmax(-1)  # (B, S, T, C)
    log_mix = torch.logsumexp(logp, dim=1) - math.log(W.shape[1])  # (B, T, C): log of the mean softmax
    return (t.float() * log_mix).sum(-1)


def generator_loss(
    generator: PredictiveGenerator,
    context: Tensor,
    heldout: Tensor,
    num_generated: int,
    num_samples: int,
    l2: float,
    beta: float = 1.0,
    gamma: float = 0.0,
    delta: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """The generator's training objective on a batch of tasks (see the module docstring).

    ``context`` ``[B, N, P]``, ``heldout`` ``[B, T, P]``. Returns the loss and its terms (with ``delta > 0`` also
    ``spread_ratio``: the generator's refit spread over the urn's, averaged over the tasks).
    """
    if delta > 0 and num_samples < 2:
        raise ValueError(f"matching the refits' spread needs num_samples >= 2, got {num_samples}")
    B = context.shape[0]
    noise = generator.noise(B, num_samples, num_generated, device=context.device)
    generated = generator(context, noise)  # (B, S, n', P)
    W = refit(context, generated, generator.num_classes, l2)
    nll = -log_predictive(W, heldout, generator.num_classes).mean()
    S = num_samples
    ed = energy_distance(
        generated.reshape(B * S, num_generated, -1).float(),
        heldout.unsqueeze(1).expand(B, S, *heldout.shape[1:]).reshape(B * S, heldout.shape[1], -1).float(),
    ).mean()
    terms = {"nll": float(nll.detach()), "energy": float(ed.detach())}
    loss = nll + beta * ed
    if gamma > 0:
        x, t = split_points(generated.reshape(B * S, num_generated, -1), generator.num_classes)
        W_pseudo = fit_softmax(x, t, l2).reshape(B, S, generator.num_classes, -1)
        pseudo = -log_predictive(W_pseudo, heldout, generator.num_classes).mean()
        loss = loss + gamma * pseudo
        terms["pseudo_nll"] = float(pseudo.detach())
    if delta > 0:
        with torch.no_grad():  # the target: the Bayesian bootstrap's spread at the same n'
            urn = PolyaUrn()
            urn.configure(generator.feature_dim, generator.num_classes)
            drawn = urn(context, urn.noise(B, S, num_generated, device=context.device))
            target = sample_spread(refit(context, drawn, generator.num_classes, l2).float())  # (B,)
        spread = sample_spread(W.float())  # (B,)
        mismatch = (spread.clamp_min(1e-12).log() - target.clamp_min(1e-12).log()).pow(2).mean()
        loss = loss + delta * mismatch
        terms["spread_mismatch"] = float(mismatch.detach())
        terms["spread_ratio"] = float((spread / target.clamp_min(1e-12)).mean().detach())
    return loss, terms


def bootstrap(z: Tensor, num_samples: int, num_generated: int, generator: torch.Generator | None = None) -> Tensor:
    """Naive predictive resampling: ``n'`` points drawn with replacement from ``Z`` -> ``[B, S, n', P]``."""
    B, N, P = z.shape
    idx = torch.randint(N, (B, num_samples * num_generated), generator=generator, device=z.device)
    picked = torch.gather(z, 1, idx.unsqueeze(-1).expand(-1, -1, P))
    return picked.reshape(B, num_samples, num_generated, P)
