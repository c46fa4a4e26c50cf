"""The stages that screen uploads: the cap on declared weights, the simulated attack and the norm gate.

An upload reaches them decoded and checked by the upload gate (:mod:`lightning_fl.federated.server.gate`: layout, dtype,
size, finite values). In simulation :class:`SimulatedAttack` may then forge it, and a forged upload passes the
finiteness check again. :class:`NormGate` measures every update's norm (for the logs and the collapse alarm), refuses
those beyond ``trainer.max_update_norm`` or ``max_update_norm_ratio`` times the round's median, and checks the
aggregate before it becomes the global state: finite values, and a step within the same bounds.
"""

from __future__ import annotations

import math
import warnings

import torch

from lightning_fl.federated.clients.transport import Reply
from lightning_fl.federated.server.attacks import Attack
from lightning_fl.federated.server.gate import non_finite_rows
from lightning_fl.federated.server.stages.base import Stage, Step
from lightning_fl.federated.server.strategies import Strategy
from lightning_fl.federated.server.uploads import Entry, Round, Rows, update_norms


class WeightCap(Stage):
    """``trainer.max_client_weight``: a client's declared sample count, as a weighted strategy weighs it, is capped
    (and the cap warned about); a node can claim any number."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def on_reply(self, rnd: Round, reply: Reply, entry: Entry) -> None:
        if entry.weight > self.cap and not reply.lost:
            warnings.warn(
                f"round {rnd.index + 1}, client {reply.client}: declared {reply.num_samples} samples; its "
                f"weight is capped at trainer.max_client_weight={self.cap:g}",
                stacklevel=3,
            )
            entry.weight = float(self.cap)

    def __repr__(self) -> str:
        return f"WeightCap({self.cap:g})"


class SimulatedAttack(Stage):
    """``trainer.attack``: the hostile clients' uploads replaced by the attack's, then checked for finite values
    again; per upload as it arrives, or over every row when the attack forges from the whole round (ALIE)."""

    def __init__(self, attack: Attack) -> None:
        self.attack = attack
        self.needs_rows = not attack.per_client

    def on_upload(self, rnd: Round, entry: Entry, row: torch.Tensor) -> torch.Tensor | None:
        forged, attacked = self.attack.apply(rnd.index, rnd.current, row.unsqueeze(0), [entry.client], rnd.seed)
        if attacked:
            row = forged[0]
            rnd.counts["attacked"] += 1
        if not bool(torch.isfinite(row).all()):
            rnd.reject(entry, ["non-finite values"])
            return None
        return row

    def on_rows(self, rnd: Round, rows: Rows) -> None:
        rows.values, attacked = self.attack.apply(rnd.index, rnd.current, rows.values, rows.clients, rnd.seed)
        rnd.counts["attacked"] = len(attacked)
        bad = set(non_finite_rows(rows.values))
        for i in sorted(bad):
            rnd.reject(rnd.entry(rows.clients[i]), ["non-finite values"])
        rows.keep([i for i in range(len(rows.clients)) if i not in bad])

    def end_round(self, rnd: Round) -> None:
        rnd.metrics["fed/attacked_clients"] = rnd.counts["attacked"]

    def __repr__(self) -> str:
        return f"SimulatedAttack({self.attack!r})"


class NormGate(Stage):
    """The update norms: measured for every accepted upload, bounded by ``max_update_norm`` (absolute) and
    ``max_update_norm_ratio`` (times the round's median: every norm must be known first, so the round keeps rows),
    and the aggregate's own check.

    Args:
        strategy: The run's strategy: the relative bound applies to its step too when it is linear (an affine
            combination of the uploads; a server optimiser's step is not bounded by the clients' updates, so only the
            absolute bound applies to it).
        max_update_norm: The absolute bound on an update's L2 norm (``None``: none).
        max_update_norm_ratio: The bound relative to the round's median norm (``None``: none).
        note: The summary's line on the gate (why the relative bound is off by default), if any.
    """

    def __init__(
        self,
        strategy: Strategy,
        max_update_norm: float | None = None,
        max_update_norm_ratio: float | None = None,
        note: str | None = None,
    ) -> None:
        self.strategy, self.note = strategy, note
        self.max_update_norm, self.max_update_norm_ratio = max_update_norm, max_update_norm_ratio
        self.needs_rows = max_update_norm_ratio is not None

    def limits(self, norms: torch.Tensor | None = None, relative: bool = True) -> list[tuple[float, str]]:
        """The update-norm bounds of a round whose uploads have ``norms``, each with the reason it names.

        ``relative``: include ``max_update_norm_ratio`` times the round's median (skipped when the median is 0 or
        ``norms`` is not given).
        """
        out = []
        if self.max_update_norm is not None:
            out.append((self.max_update_norm, f"exceeds trainer.max_update_norm={self.max_update_norm:g}"))
        if relative and self.max_update_norm_ratio is not None and norms is not None and len(norms):
            median = float(norms.median())  # the lower median: an honest majority keeps it honest
            if median > 0:
                out.append(
                    (
                        self.max_update_norm_ratio * median,
                        f"is more than trainer.max_update_norm_ratio={self.max_update_norm_ratio:g} times the round's "
                        f"median update norm {median:.4g}",
                    )
                )
        return out

    def on_upload(self, rnd: Round, entry: Entry, row: torch.Tensor) -> torch.Tensor | None:
        entry.norm = float(update_norms(row.unsqueeze(0), rnd.current64)[0])
        if problems := [f"update norm {entry.norm:.4g} {why}" for limit, why in self.limits() if entry.norm > limit]:
            rnd.reject(entry, problems)
            return None
        return row

    def on_rows(self, rnd: Round, rows: Rows) -> None:
        norms = update_norms(rows.values, rnd.current64)
        limits = self.limits(norms)
        kept = []
        for i, client in enumerate(rows.clients):
            entry = rnd.entry(client)
            entry.norm = float(norms[i])
            if problems := [f"update norm {entry.norm:.4g} {why}" for limit, why in limits if entry.norm > limit]:
                rnd.reject(entry, problems)
            else:
                kept.append(i)
        rows.keep(kept)

    @staticmethod
    def norms(rnd: Round) -> torch.Tensor:
        """The norms of the round's aggregated updates (none in a secure round: it never sees an update)."""
        measured = [rnd.entry(c).norm for c in rnd.folded]
        return torch.tensor([n for n in measured if not math.isnan(n)], dtype=torch.float64)

    def on_step(self, rnd: Round, step: Step) -> None:
        """The aggregate becomes the global state only if it is finite and its step is within the bounds."""
        if step.flat is None or not step.accepted:
            return
        norms, name = self.norms(rnd), self.strategy.name
        distance = float((step.flat.double() - rnd.current.double()).norm())
        if not bool(torch.isfinite(step.flat).all()):
            step.problem = f"aggregate refused: {name} produced non-finite values"
        elif too_far := [why for limit, why in self.limits(norms, relative=self.strategy.linear) if distance > limit]:
            step.problem = f"aggregate refused: {name}'s step has norm {distance:.4g}, which " + "; ".join(too_far)
        if step.problem is not None and len(norms):
            top = int(norms.argmax())
            step.problem += (
                f"; the largest update came from client {rnd.folded[top]} (norm {float(norms[top]):.4g}, the "
                f"round's median {float(norms.median()):.4g})"
            )

    def end_round(self, rnd: Round) -> None:
        norms = self.norms(rnd)
        if len(norms):  # of the accepted updates, before any clipping: what a clip bound is chosen from
            rnd.metrics["fed/update_norm_median"] = median = float(norms.median())
            if median > 0:  # the largest over the median: the gate ratio under which this round refuses nothing
                rnd.metrics["fed/update_norm_max_ratio"] = float(norms.max()) / median
            rnd.unprotected.update({"fed/update_norm_median", "fed/update_norm_max_ratio"})

    def summary(self, history: list[dict[str, float]]) -> list[str]:
        return [self.note] if self.note is not None else []

    def __repr__(self) -> str:
        return f"NormGate(max_update_norm={self.max_update_norm}, max_update_norm_ratio={self.max_update_norm_ratio})"
