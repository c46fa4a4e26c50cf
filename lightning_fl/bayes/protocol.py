"""One-shot methods on a task: each returns parameter samples of the linear softmax classifier.

Every method sees the same :class:`Task` (M clients' points) and the same :class:`Context` (the
frozen predictive generator, the ERM penalty, the number of posterior samples and the base set
``E`` shared by all sampling methods on this task), and returns an :class:`Outcome`: parameter
samples ``W [G, S, C, D]`` for G models (1 for centralised and federated methods, M for local
ones, whose metrics are averaged over clients) and the bytes each client uploads. Predictions use
the posterior predictive, the mean softmax over the S samples.

Add a baseline by subclassing :class:`OneShotMethod` (one method, :meth:`OneShotMethod.run`) and
listing it under ``model.methods`` in a config; the same ``test`` command then evaluates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_fl.bayes.predictive import PredictiveGenerator, refit
from lightning_fl.bayes.summarize import Summariser
from lightning_fl.bayes.tasks import Task, project_labels
from lightning_fl.compress.base import FP32, Codec


@dataclass
class Context:
    """What a method may use besides the clients' data."""

    generator: PredictiveGenerator
    summariser: Summariser
    l2: float
    noise: Tensor  # (S, n', e): the base set E shared by every sampling method on this task
    codec: Codec = field(default_factory=FP32)
    tol: float = 1e-5

    @property
    def num_classes(self) -> int:
        return self.generator.num_classes


@dataclass
class Outcome:
    """``W`` ``[G, S, C, D]``; ``bytes_per_client``: upload size (``None`` for local / centralised methods);
    ``extras``: what else the method made (0-dim entries are logged by ``test`` as ``test/<name>/<key>``)."""

    W: Tensor
    bytes_per_client: float | None = None
    extras: dict[str, Tensor] = field(default_factory=dict)


class OneShotMethod:
    """Base class; ``name`` keys the metrics (``test/{name}/acc``). A subclass that takes a ``name`` argument
    (two variants of one method in the same test) passes it to ``__init__`` here."""

    _plugin_base = True  # not offered as a choice in CLI messages
    name = "method"

    def __init__(self, name: str | None = None) -> None:
        if name is not None:  # else the class's default
            self.name = name

    def run(self, task: Task, ctx: Context) -> Outcome:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def upload(ctx: Context, tensors: dict[str, Tensor], client: int) -> tuple[dict[str, Tensor], int]:
    """Encode what a client sends with the context's codec; return what the server decodes and the bytes."""
    payload = ctx.codec.encode(tensors, {}, client)
    return ctx.codec.decode(payload, {}, client), payload.nbytes


def martingale_samples(z: Tensor, ctx: Context) -> tuple[Tensor, Tensor]:
    """MP on a set ``z`` ``[N, P]`` with the shared base set: (``W`` ``[S, C, D]``, ``Z'`` ``[S, n', P]``)."""
    generated = ctx.generator(z.unsqueeze(0), ctx.noise.unsqueeze(0).to(z))  # (1, S, n', P)
    return refit(z.unsqueeze(0), generated, ctx.num_classes, ctx.l2, ctx.tol)[0], generated[0]


class MP(OneShotMethod):
    """Centralised martingale posterior on the pooled data (Fong et al. 2023; the FMP paper's target)."""

    name = "mp"

    def run(self, task: Task, ctx: Context) -> Outcome:
        W, generated = martingale_samples(task.pooled, ctx)
        return Outcome(W.unsqueeze(0), extras={"generated": generated})


class FMP(OneShotMethod):
    """Federated martingale posterior: every client uploads ``s`` summary points; the server pools them,
    generates ``Z~' = ISAB(Z~, E)`` and refits (FMP section IV-1).

    Args:
        summariser: A fixed summariser to use instead of the meta-trained one (the paper's compression
            ablation: ``RandomSelection(s)`` or ``MeanPooling(s)`` with the same sampler and classifier).
        name: Metric name (default ``fmp``; e.g. ``fmp_random``).
        seed: Seed of a random summariser's choices.
    """

    name = "fmp"

    def __init__(self, summariser: Summariser | None = None, name: str | None = None, seed: int = 0) -> None:
        super().__init__(name)
        self.summariser, self.seed = summariser, seed

    def run(self, task: Task, ctx: Context) -> Outcome:
        summaries, sizes = [], []
        summariser = self.summariser if self.summariser is not None else ctx.summariser
        if not summariser.feature_dim:
            summariser.configure(task.feature_dim, task.num_classes)
        with torch.no_grad():
            local = summariser(task.clients, generator=torch.Generator().manual_seed(self.seed))  # (M, s, P)
        for m in range(task.clients.shape[0]):
            decoded, nbytes = upload(ctx, {"summary": local[m]}, m)
            summary = decoded["summary"].to(task.clients)
            if summary.shape != local[m].shape or not bool(torch.isfinite(summary).all()):
                raise ValueError(
                    f"FMP: client {m} uploaded a malformed summary (shape {tuple(summary.shape)}, expected "
                    f"{tuple(local[m].shape)}; non-finite values: {int((~torch.isfinite(summary)).sum())})"
                )
            # A lossy codec may move label parts off the simplex: the server projects them back.
            summaries.append(project_labels(summary, task.num_classes))
            sizes.append(nbytes)
        pooled = torch.cat(summaries)  # (M * s, P)
        W, generated = martingale_samples(pooled, ctx)
        return Outcome(W.unsqueeze(0), sum(sizes) / len(sizes), {"summary": pooled, "generated": generated})


class ANN(OneShotMethod):
    """Centralised ERM on the pooled data (one point estimate)."""

    name = "ann"

    def run(self, task: Task, ctx: Context) -> Outcome:
        return Outcome(refit(task.pooled.unsqueeze(0), None, ctx.num_classes, ctx.l2, ctx.tol))


class LANN(OneShotMethod):
    """Local ERM: every client fits alone; metrics are the mean over clients."""

    name = "lann"

    def run(self, task: Task, ctx: Context) -> Outcome:
        return Outcome(refit(task.clients, None, ctx.num_classes, ctx.l2, ctx.tol))


class LMP(OneShotMethod):
    """Local martingale posterior: MP on each client's own data; metrics are the mean over clients."""

    name = "lmp"

    def run(self, task: Task, ctx: Context) -> Outcome:
        return Outcome(torch.stack([martingale_samples(z, ctx)[0] for z in task.clients]))


class CANN(OneShotMethod):
    """One-shot FedAvg: every client sends its local ERM solution, the server averages them once
    (McMahan et al. 2017 with a single round; the FMP paper's CANN)."""

    name = "cann"

    def run(self, task: Task, ctx: Context) -> Outcome:
        local = refit(task.clients, None, ctx.num_classes, ctx.l2, ctx.tol)[:, 0]  # (M, C, D)
        received, sizes = [], []
        for m in range(local.shape[0]):
            decoded, nbytes = upload(ctx, {"W": local[m]}, m)
            received.append(decoded["W"].to(local))
            sizes.append(nbytes)
        return Outcome(torch.stack(received).mean(0)[None, None], sum(sizes) / len(sizes))


def predictive_probs(W: Tensor, h: Tensor) -> Tensor:
    """Posterior predictive: mean over S of softmax(h W_s^T). ``W`` ``[S, C, D]``, ``h`` ``[N, D]`` -> ``[N, C]``."""
    return torch.einsum("scd,nd->snc", W.float(), h.float()).softmax(-1).mean(0)
