"""The privacy mechanisms' server stages: user-level DP on the round's sum, and the accounting of the mechanisms that
act on the clients (local DP, record-level DP-SGD).

The plug-ins themselves (:mod:`lightning_fl.privacy`) own the mathematics: clipping, noise, calibration and the
accountants. These stages put them at their places in the round. A client's own stage (local DP's noise, distributed
DP's clipping and noise share, DP-SGD's steps) runs where the client trains, before its upload is encoded.
"""

from __future__ import annotations

import warnings

import lightning as L
import torch

from lightning_fl.federated.local import LocalTraining
from lightning_fl.federated.stages.base import Stage
from lightning_fl.federated.transport import Reply
from lightning_fl.federated.uploads import Entry, Round, Total
from lightning_fl.privacy import population
from lightning_fl.privacy.base import Privacy
from lightning_fl.privacy.dpsgd import DPSGD


class CentralPrivacy(Stage):
    """User-level DP on the server's sum (:class:`~lightning_fl.privacy.CentralDP`, and
    :class:`~lightning_fl.privacy.DistributedDP`, whose clients clipped and noised already): each accepted update is
    clipped as it is folded, the sum is released with noise over the fixed denominator ``m``, and every round is
    accounted, with or without uploads (every round releases its noised sum), except a round whose sum the plug-in
    refuses (:meth:`~lightning_fl.privacy.Privacy.refusal`: distributed DP with fewer shares than its
    ``min_shares``), which releases nothing and charges nobody."""

    def __init__(self, privacy: Privacy, fabric: L.Fabric) -> None:
        self.privacy, self.fabric = privacy, fabric
        self.refused = False

    def on_fold(self, rnd: Round, entry: Entry, row: torch.Tensor) -> torch.Tensor:
        """The client's update ``x_k - x`` (float64), clipped to the bound; counted when the clip left it unchanged."""
        clipped, _, within = self.privacy.clip(row.double() - rnd.current64, rnd.layers)
        rnd.counts["unclipped"] += int(within)
        return clipped

    def on_aggregate(self, rnd: Round, total: Total) -> Total:
        """The noisy mean update (the plug-in's release); under several processes rank 0's holds (noise from the OS
        differs per process). A sum the plug-in refuses is not released: the strategy does not step from it."""
        self.refused = (why := self.privacy.refusal(len(rnd.folded))) is not None
        if self.refused:
            rnd.metrics["privacy/noise_shares"] = float(len(rnd.folded))
            return Total(total.total, total.weight, total.count, updates=True, refused=f"privacy: {why}")
        mean, released = self.privacy.release(total.total, rnd.counts["unclipped"], len(rnd.folded), rnd.index)
        if self.fabric.world_size > 1:
            mean, released, self.privacy.bound = self.fabric.broadcast((mean, released, self.privacy.bound))
        rnd.metrics.update(released)
        return Total(mean, 1.0, total.count, updates=True, released=True)  # (dividing by 1.0 changes no bit)

    def end_round(self, rnd: Round) -> None:
        released = [] if self.refused else rnd.folded
        rnd.metrics.update(self.privacy.end_round(rnd.index, released))
        self.privacy.released = None if self.refused else population.user_release(self.privacy, released)

    def __repr__(self) -> str:
        return f"CentralPrivacy({self.privacy!r})"


class ClientPrivacy(Stage):
    """User-level DP applied by each client to its own upload (:class:`~lightning_fl.privacy.LocalDP`): the server
    only accounts, for every client whose upload left it this round (rejected or not: it was released)."""

    def __init__(self, privacy: Privacy) -> None:
        self.privacy = privacy

    def end_round(self, rnd: Round) -> None:
        released = [e.client for e in rnd.answered if e.up]
        rnd.metrics.update(self.privacy.end_round(rnd.index, released))
        self.privacy.released = population.user_release(self.privacy, released)

    def __repr__(self) -> str:
        return f"ClientPrivacy({self.privacy!r})"


class RecordPrivacy(Stage):
    """Record-level DP-SGD inside the clients (``trainer.dp_sgd``): a node's own record count and batch size, when it
    reports them, go to its client's accountant; every client asked to train has spent its round."""

    def __init__(self, dp_sgd: DPSGD, local: LocalTraining) -> None:
        self.dp_sgd, self.local = dp_sgd, local

    def on_reply(self, rnd: Round, reply: Reply, entry: Entry) -> None:
        """A node's reported plan (warned about if unusable: the client's epsilon then comes from the server's data)."""
        if reply.dp_sgd_plan is None:
            return
        problem = self.dp_sgd.report_plan(reply.client, *reply.dp_sgd_plan, self.local)
        if problem is not None:
            warnings.warn(f"round {rnd.index + 1}, client {reply.client}: {problem}; its record-level epsilon is "
                          "accounted with the server's data module", stacklevel=3)  # fmt: skip

    def end_round(self, rnd: Round) -> None:
        rnd.metrics.update(self.dp_sgd.end_round(rnd.available, rnd.datamodule, self.local))
        self.dp_sgd.released = population.record_release(self.dp_sgd, rnd.available)

    def __repr__(self) -> str:
        return f"RecordPrivacy({self.dp_sgd!r})"
