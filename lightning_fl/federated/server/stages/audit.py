"""The privacy audit's stages: canary clients scored on what each round releases (:mod:`lightning_fl.privacy.audit`).

They run after the privacy stage, one per kind of release. Under central and distributed DP
(:class:`CentralCanaries`) the round's sampled, inserted canaries' updates (each ``S c_i``, at the round's clip bound)
are added to the released sum, over the same ``m`` and under the same noise, and that is scored; under local DP
(:class:`LocalCanaries`) each sampled canary's upload goes through the mechanism's ``privatize`` and is scored alone.
The round itself goes on with the release as the mechanism made it: the canaries never reach the global state. Under
DP-SGD alone the canaries are one client's records, scored inside its steps (:class:`RecordCanaryReport` only
reports them). Each writes ``privacy_audit.json`` when the rounds end and adds its lines to the summary; an audit
covers one uninterrupted run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

from lightning_fl.federated.server.stages.base import Stage
from lightning_fl.federated.server.uploads import Round, Total
from lightning_fl.privacy.audit import PrivacyAudit, RecordCanaries, audit_lines, write_report
from lightning_fl.privacy.base import Privacy, apply_update, flat_update
from lightning_fl.privacy.dpsgd import DPSGD


class AuditReport(Stage):
    """What every audit stage does when the rounds end: its report, in ``privacy_audit.json`` and the summary."""

    not_resumable = "trainer.privacy_audit covers one uninterrupted run: resume without it, or start afresh"

    def __init__(self, audit: PrivacyAudit) -> None:
        self.audit = audit
        self.report: dict[str, Any] | None = None

    def make_report(self) -> dict[str, Any]:
        raise NotImplementedError

    def finish(self, log_dir: Path, rank_zero: bool) -> None:
        self.report = self.make_report()
        if rank_zero:
            write_report(self.report, log_dir / "privacy_audit.json")

    def summary(self, history: list[dict[str, float]]) -> list[str]:
        return audit_lines(self.report) if self.report is not None else []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.audit!r})"


class CentralCanaries(AuditReport):
    """Scores ``audit``'s canaries on each round's noised sum of ``privacy`` (central or distributed DP)."""

    def __init__(self, audit: PrivacyAudit, privacy: Privacy, fabric: L.Fabric) -> None:
        super().__init__(audit)
        self.privacy, self.fabric = privacy, fabric
        self.ready, self.bound, self.picked = False, 0.0, np.zeros(0, dtype=np.int64)

    def start(self, rnd: Round) -> None:
        if not self.ready:  # (every process draws the same canaries: rank 0's seed)
            plan = self.privacy.plan
            seed = self.fabric.broadcast(self.audit.seed if self.audit.seed is not None else None)
            self.audit.setup(len(rnd.current), plan.expected_clients / plan.num_clients, seed)
            self.ready = True
        self.bound = self.privacy.clip_bound
        self.picked = self.audit.sampled()

    def on_aggregate(self, rnd: Round, total: Total) -> Total:
        if total.released:
            inserted = self.picked[self.audit.inserted[self.picked]]
            canaries = self.audit.directions[torch.from_numpy(inserted)].double().sum(0) * self.bound
            self.audit.observe(total.total + canaries / self.privacy.plan.expected_clients)
        return total

    def make_report(self) -> dict[str, Any]:
        return self.audit.report(self.privacy.epsilon(), self.privacy.delta)


class LocalCanaries(CentralCanaries):
    """Scores ``audit``'s canaries one by one, each upload noised by ``privacy``'s ``privatize`` (local DP)."""

    def on_aggregate(self, rnd: Round, total: Total) -> Total:
        return total

    def end_round(self, rnd: Round) -> None:
        uploads = []
        for i in self.picked:  # an inserted canary sends its direction; one not inserted, its replacement's
            direction = self.audit.directions[i].double()
            if not self.audit.inserted[i]:
                other = torch.from_numpy(self.audit.rng.standard_normal(len(direction)))
                direction = other / other.norm()
            state = apply_update(rnd.state, self.bound * direction)  # what a client at the bound would hold
            client = self.privacy.plan.num_clients + int(i)  # (its own noise stream, never a real client's)
            released = self.privacy.privatize(state, rnd.state, client, rnd.index, rnd.seed)
            uploads.append(flat_update(released, rnd.state))
        empty = torch.zeros((0, len(rnd.current)), dtype=torch.float64)
        self.audit.observe_each(self.picked, torch.stack(uploads) if uploads else empty)


class RecordCanaryReport(AuditReport):
    """DP-SGD alone (``trainer.dp_sgd`` without ``trainer.privacy``): the canaries are one client's records, scored
    inside its steps (:class:`~lightning_fl.privacy.audit.RecordCanaries`); this stage reports them against that
    client's record-level epsilon."""

    def __init__(self, audit: PrivacyAudit, dp_sgd: DPSGD, canaries: RecordCanaries) -> None:
        super().__init__(audit)
        self.dp_sgd, self.canaries = dp_sgd, canaries

    def make_report(self) -> dict[str, Any]:
        client = self.canaries.client
        epsilon = self.dp_sgd.client_epsilon(client) if client is not None else math.nan
        report = self.audit.report(epsilon, self.dp_sgd.delta)
        report["level"], report["unit"] = f"canary records of client {client}", "step"
        return report
