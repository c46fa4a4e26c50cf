"""The contract of a one-shot method: it sees a task and a context, and returns parameter samples.

Every method sees the same :class:`Task` (M clients' points) and the same :class:`Context` (the
frozen predictive generator, the ERM penalty, the number of posterior samples and the base set
``E`` shared by all sampling methods on this task), and returns an :class:`Outcome`: parameter
samples ``W [G, S, C, D]`` for G models (1 for centralised and federated methods, M for local
ones, whose metrics are averaged over clients) and the bytes each client uploads. Predictions use
the posterior predictive, the mean softmax over the S samples.

Add a baseline by subclassing :class:`OneShotMethod` (one method, :meth:`OneShotMethod.run`) and
listing it under ``model.methods`` in a config; the same ``test`` command then evaluates it. What a
client sends goes through :func:`upload`: the context's codec and the server's upload gate.
The methods of the FMP paper's table are in :mod:`lightning_fl.oneshot.methods`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_fl.compress.base import FP32, Codec
from lightning_fl.federated.server.gate import UploadRejectedError, screen_upload
from lightning_fl.oneshot.predictive import Predictive, refit
from lightning_fl.oneshot.summarize import Summariser
from lightning_fl.oneshot.tasks import Task


@dataclass
class Context:
    """What a method may use besides the clients' data."""

    generator: Predictive
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
        """Parameter samples for ``task`` (what a subclass computes; see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} must define run(task, ctx) -> Outcome")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def upload(ctx: Context, tensors: dict[str, Tensor], client: int) -> tuple[dict[str, Tensor], int]:
    """What the server receives from one client: ``tensors`` encoded with the context's codec, then screened
    and decoded by the server's upload gate (:func:`~lightning_fl.federated.server.gate.screen_upload`, as in every
    federated round); returns the decoded tensors and the payload's bytes.

    The layout the server expects is that of ``tensors`` (their shapes and dtypes, which server and clients
    agree on from the method's settings). A payload the gate refuses (non-finite values, a wrong structure,
    more bytes than float32) raises :class:`~lightning_fl.federated.server.gate.UploadRejectedError` naming the client:
    one-shot methods have a single round, so there is nothing to drop a client from.
    """
    reference = {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in tensors.items()}
    payload = ctx.codec.encode(tensors, reference, client)
    decoded, problems = screen_upload(payload, ctx.codec, reference, client)
    if decoded is None:
        raise UploadRejectedError(f"one-shot upload of client {client} refused: {'; '.join(problems)}")
    return decoded, payload.nbytes


def martingale_samples(z: Tensor, ctx: Context) -> tuple[Tensor, Tensor]:
    """MP on a set ``z`` ``[N, P]`` with the shared base set: (``W`` ``[S, C, D]``, ``Z'`` ``[S, n', P]``)."""
    generated = ctx.generator(z.unsqueeze(0), ctx.noise.unsqueeze(0).to(z))  # (1, S, n', P)
    return refit(z.unsqueeze(0), generated, ctx.num_classes, ctx.l2, ctx.tol)[0], generated[0]
