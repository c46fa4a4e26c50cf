"""The privacy mechanisms' server stages: user-level DP on the round's sum, and the accounting of the mechanisms that
act on the clients (local DP, record-level DP-SGD).

The plug-ins themselves (:mod:`lightning_fl.privacy`) own the mathematics: clipping, noise, calibration and the
accountants. These stages put them at their places in the round. A client's own stage (local DP's noise, distributed
DP's clipping and noise share, DP-SGD's steps) runs where the client trains, before its upload is encoded.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_fl.federated.clients.local import LocalTraining
from lightning_fl.federated.clients.transport import Reply
from lightning_fl.federated.server.stages.base import Stage
from lightning_fl.federated.server.uploads import Entry, Round, Total
from lightning_fl.privacy import population
from lightning_fl.privacy.base import Privacy
from lightning_fl.privacy.dpsgd import DPSGD


def write_client_epsilons(dp_sgd: DPSGD, path: Path) -> None:
    """Every client's record-level DP-SGD spend (``trainer.dp_sgd``) as a CSV row, written atomically."""
    rows = dp_sgd.report()
    if not rows:
        return
    header = list(rows[0])
    body = "".join(",".join(_cell(r[k]) for k in header) + "\n" for r in rows)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(",".join(header) + "\n" + body)
    tmp.replace(path)


def _cell(value: object) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


class UserLevelBudget(Stage):
    """What the user-level mechanisms' stages share: the plug-in's budget in the checkpoint, its epsilon in the
    summary."""

    state_key = "privacy"

    def __init__(self, privacy: Privacy, secure: bool = False) -> None:
        self.privacy, self.secure = privacy, secure

    def state_dict(self) -> dict[str, Any]:
        return self.privacy.state_dict()

    def load_state_dict(self, state: dict[str, Any], completed: int) -> None:
        self.privacy.load_state_dict(state)

    def summary(self, history: list[dict[str, float]]) -> list[str]:
        last = history[-1]
        if "privacy/epsilon" not in last:
            return []
        eps, delta = last["privacy/epsilon"], last.get("privacy/delta")
        at = f" at delta {delta:.3g}" if delta is not None else ""
        z, rounds = last.get("privacy/noise_multiplier", float("nan")), int(last["round"])
        lines = [f"privacy: user-level epsilon {eps:.4g}{at} after {rounds} rounds (noise multiplier {z:.4g})"]
        lines += [f"  {line}" for line in self.privacy.guarantee(self.secure).splitlines()]
        if "privacy/population_epsilon" in last:  # every run that drew on the population (its ledger)
            spent, released = last["privacy/population_epsilon"], last.get("privacy/population_rounds")
            over = f" over {int(released)} released rounds" if released is not None else ""
            lines.append(
                f"  the population (data set and partition), every run that drew on it: epsilon {spent:.4g}{over}"
            )
        return lines


class CentralPrivacy(UserLevelBudget):
    """User-level DP on the server's sum (:class:`~lightning_fl.privacy.CentralDP`, and
    :class:`~lightning_fl.privacy.DistributedDP`, whose clients clipped and noised already): each accepted update is
    clipped as it is folded, the sum is released with noise over the fixed denominator ``m``, and every round is
    accounted, with or without uploads (every round releases its noised sum), except a round whose sum the plug-in
    refuses (:meth:`~lightning_fl.privacy.Privacy.refusal`: distributed DP with fewer shares than its
    ``min_shares``), which releases nothing and charges nobody."""

    def __init__(self, privacy: Privacy, fabric: L.Fabric, secure: bool = False) -> None:
        super().__init__(privacy, secure)
        self.fabric = fabric
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


class ClientPrivacy(UserLevelBudget):
    """User-level DP applied by each client to its own upload (:class:`~lightning_fl.privacy.LocalDP`): the server
    only accounts, for every client whose upload left it this round (rejected or not: it was released)."""

    def end_round(self, rnd: Round) -> None:
        released = [e.client for e in rnd.answered if e.up]
        rnd.metrics.update(self.privacy.end_round(rnd.index, released))
        self.privacy.released = population.user_release(self.privacy, released)

    def __repr__(self) -> str:
        return f"ClientPrivacy({self.privacy!r})"


class RecordPrivacy(Stage):
    """Record-level DP-SGD inside the clients (``trainer.dp_sgd``): a node's own record count and batch size, when it
    reports them, go to its client's accountant; every client asked to train has spent its round. Its clients'
    budgets go into the checkpoint, their epsilons into ``dp_sgd_clients.csv`` when the rounds end."""

    state_key = "dp_sgd"

    def __init__(self, dp_sgd: DPSGD, local: LocalTraining) -> None:
        self.dp_sgd, self.local = dp_sgd, local

    def state_dict(self) -> dict[str, Any]:
        return self.dp_sgd.state_dict()

    def load_state_dict(self, state: dict[str, Any], completed: int) -> None:
        self.dp_sgd.load_state_dict(state)

    def summary(self, history: list[dict[str, float]]) -> list[str]:
        last = history[-1]
        if "privacy/record_epsilon_max" not in last:
            return []
        worst, median = last["privacy/record_epsilon_max"], last.get("privacy/record_epsilon_median", float("nan"))
        delta = last.get("privacy/record_delta", float("nan"))
        lines = [
            f"record-level DP-SGD: worst client's epsilon {worst:.4g} at delta {delta:.3g}, median {median:.4g} "
            "(every client: dp_sgd_clients.csv)"
        ]
        lines += [f"  {line}" for line in self.dp_sgd.guarantee().splitlines()]
        if "privacy/record_population_epsilon_max" in last:
            worst = last["privacy/record_population_epsilon_max"]
            lines.append(f"  the population, every run that drew on it: worst client's epsilon {worst:.4g}")
        return lines

    def finish(self, log_dir: Path, rank_zero: bool) -> None:
        if rank_zero:
            write_client_epsilons(self.dp_sgd, log_dir / "dp_sgd_clients.csv")

    def on_reply(self, rnd: Round, reply: Reply, entry: Entry) -> None:
        """A node's reported plan (warned about if unusable: the client's epsilon then comes from the server's data)."""
        if reply.dp_sgd_plan is None:
            return
        problem = self.dp_sgd.report_plan(reply.client, *reply.dp_sgd_plan, self.local)
        if problem is not None:
            warnings.warn(
                f"round {rnd.index + 1}, client {reply.client}: {problem}; its record-level epsilon is "
                "accounted with the server's data module",
                stacklevel=3,
            )

    def end_round(self, rnd: Round) -> None:
        rnd.metrics.update(self.dp_sgd.end_round(rnd.available, rnd.datamodule, self.local))
        self.dp_sgd.released = population.record_release(self.dp_sgd, rnd.available)

    def __repr__(self) -> str:
        return f"RecordPrivacy({self.dp_sgd!r})"
