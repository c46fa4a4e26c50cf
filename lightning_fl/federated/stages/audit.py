"""The privacy audit's stage: canary clients scored on what each round releases (:mod:`lightning_fl.privacy.audit`).

It runs after the privacy stage. Under central and distributed DP it adds the round's sampled, inserted canaries'
updates (each ``S c_i``, at the round's clip bound) to the released sum, over the same ``m`` and under the same
noise, and scores that; under local DP each sampled canary's upload goes through the mechanism's ``privatize``
and is scored alone. The round itself goes on with the release as the mechanism made it: the canaries never reach
the global state.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch

from lightning_fl.federated.stages.base import Stage
from lightning_fl.federated.uploads import Round, Total
from lightning_fl.privacy.audit import PrivacyAudit
from lightning_fl.privacy.base import Privacy, apply_update, flat_update


class CanaryStage(Stage):
    """Scores ``audit``'s canaries on each round's release of ``privacy`` (module docstring)."""

    def __init__(self, audit: PrivacyAudit, privacy: Privacy, fabric: L.Fabric) -> None:
        self.audit, self.privacy, self.fabric = audit, privacy, fabric
        self.ready, self.bound, self.picked = False, 0.0, np.zeros(0, dtype=np.int64)

    def start(self, rnd: Round) -> None:
        if not self.ready:  # (every process draws the same canaries: rank 0's seed)
            plan = self.privacy.plan
            seed = self.fabric.broadcast(self.audit.seed if self.audit.seed is not None else None)
            self.audit.setup(len(rnd.current), plan.expected_clients / plan.num_clients, seed)
            self.ready = True
        self.bound = float(getattr(self.privacy, "bound", getattr(self.privacy, "clip_norm", 0.0)))
        self.picked = self.audit.sampled()

    def on_aggregate(self, rnd: Round, total: Total) -> Total:
        if self.privacy.central and total.released:
            inserted = self.picked[self.audit.inserted[self.picked]]
            canaries = self.audit.directions[torch.from_numpy(inserted)].double().sum(0) * self.bound
            self.audit.observe(total.total + canaries / self.privacy.plan.expected_clients)
        return total

    def end_round(self, rnd: Round) -> None:
        if self.privacy.central:
            return
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

    def __repr__(self) -> str:
        return f"CanaryStage({self.audit!r})"
