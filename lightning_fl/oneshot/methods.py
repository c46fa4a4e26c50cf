"""The methods of the FMP paper's comparison that need nothing beyond the predictive generator and ERM.

Centralised (:class:`MP`, :class:`ANN`), local (:class:`LMP`, :class:`LANN`) and federated one-shot
(:class:`FMP`, :class:`CANN`) methods; the other baselines are in :mod:`lightning_fl.oneshot.baselines`.
"""

from __future__ import annotations

import torch

from lightning_fl.federated.server.gate import UploadRejectedError
from lightning_fl.oneshot.base import Context, OneShotMethod, Outcome, martingale_samples, upload
from lightning_fl.oneshot.predictive import refit
from lightning_fl.oneshot.summarize import Summariser
from lightning_fl.oneshot.tasks import Task, make_points, project_labels, split_points


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
        labels: What a summary point carries as its label. ``soft`` (default): the label distribution over the
            C classes (``s (D + C)`` floats per client). ``hard``: one label value per point, the most likely
            class of that distribution (``s (D + 1)`` floats, the paper's count: 30 x 129 x 4 = 15,480 bytes at
            D = 128); the server refits on it one-hot. The summariser is meta-trained with soft labels either way.
    """

    name = "fmp"

    def __init__(
        self, summariser: Summariser | None = None, name: str | None = None, seed: int = 0, labels: str = "soft"
    ) -> None:
        super().__init__(name)
        if labels not in ("soft", "hard"):
            raise ValueError(f"FMP: labels must be 'soft' or 'hard', got {labels!r}")
        self.summariser, self.seed, self.labels = summariser, seed, labels

    def run(self, task: Task, ctx: Context) -> Outcome:
        summaries, sizes = [], []
        summariser = self.summariser if self.summariser is not None else ctx.summariser
        if not summariser.feature_dim:
            summariser.configure(task.feature_dim, task.num_classes)
        with torch.no_grad():
            local = summariser(task.clients, generator=torch.Generator().manual_seed(self.seed))  # (M, s, P)
        for m in range(task.clients.shape[0]):
            if self.labels == "hard":
                summary, nbytes = upload_hard_labels(ctx, local[m], task.num_classes, m)
            else:
                decoded, nbytes = upload(ctx, {"summary": local[m]}, m)
                # A lossy codec may move label parts off the simplex: the server projects them back.
                summary = project_labels(decoded["summary"].to(task.clients), task.num_classes)
            summaries.append(summary.to(task.clients))
            sizes.append(nbytes)
        pooled = torch.cat(summaries)  # (M * s, P)
        W, generated = martingale_samples(pooled, ctx)
        return Outcome(W.unsqueeze(0), sum(sizes) / len(sizes), {"summary": pooled, "generated": generated})


def upload_hard_labels(ctx: Context, summary: torch.Tensor, num_classes: int, client: int) -> tuple[torch.Tensor, int]:
    """One client's summary ``[s, D + C]`` sent as its features and one label value per point (the most likely
    class, as a float32 like the features): the points the server rebuilds, one-hot, and the payload's bytes.

    The server rounds each received label to the nearest class (a lossy codec moves it a little) and refuses
    the upload, naming the client, if any label is not within half a class of ``0 .. C - 1``.
    """
    h, p = split_points(summary, num_classes)
    decoded, nbytes = upload(ctx, {"features": h, "labels": p.argmax(-1).to(torch.float32)}, client)
    labels = decoded["labels"].double()
    outside = int(((labels < -0.5) | (labels >= num_classes - 0.5)).sum())
    if outside:
        raise UploadRejectedError(
            f"one-shot upload of client {client} refused: labels: {outside} value(s) outside the classes "
            f"0..{num_classes - 1}"
        )
    return make_points(decoded["features"], labels.round().long(), num_classes), nbytes


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
