"""The stages at the server's end of a round: the compressed broadcast of the new state, and the averaging identity
check of a method whose aggregate lives in another space than its weights (FLITE's latents, LoRA's adapters)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch

from lightning_fl.compress.downlink import Downlink
from lightning_fl.federated.server.stages.base import Stage, Step
from lightning_fl.federated.server.state import State, unflatten
from lightning_fl.federated.server.uploads import Round


class CompressedBroadcast(Stage):
    """``trainer.compressed_downloads``: every sampled client downloads the broadcasts it missed (or the full state,
    if fewer bytes), and the server's step goes out compressed with the server's error feedback: the next global
    state is what every client computes from the broadcast (:mod:`lightning_fl.compress.downlink`)."""

    state_key = "downlink"
    without = (
        "it was written without trainer.compressed_downloads (no downlink memory to continue); remove the key, or "
        "start afresh"
    )

    def __init__(self, downlink: Downlink) -> None:
        self.downlink = downlink

    def state_dict(self) -> dict[str, Any]:
        """The server's downlink memory and which state each client holds."""
        return self.downlink.state_dict()

    def load_state_dict(self, state: dict[str, Any], completed: int) -> None:
        self.downlink.load_state_dict(state, completed)

    def start(self, rnd: Round) -> None:
        rnd.downloads = {c: self.downlink.download(c, rnd.index, rnd.full_bytes) for c in rnd.sampled}

    def on_step(self, rnd: Round, step: Step) -> None:
        if not step.accepted:  # nothing changed: nothing to broadcast
            self.downlink.skip()
            rnd.metrics["comm/broadcast_bytes"] = 0.0
            return
        delta = (step.flat.to(torch.float64) - rnd.current.to(torch.float64)).to(torch.float32)
        step.state, payload = self.downlink.broadcast(unflatten(delta, rnd.state, rnd.names, typed=False), rnd.state)
        rnd.metrics["comm/broadcast_bytes"] = float(payload.nbytes)

    def __repr__(self) -> str:
        return f"CompressedBroadcast({self.downlink!r})"


class IdentityCheck(Stage):
    """``trainer.check_identity``: the module's averaging identity error over the round's aggregated uploads, logged
    as ``fed/identity_error`` (by the first process) when the aggregate is accepted. It reads every upload, so the
    round keeps them as rows.

    Args:
        identity: The module's ``averaging_identity_error``: from the uploads (as states) to a number.
        fabric: The run's processes (only the first computes it).
    """

    needs_rows = True

    def __init__(self, identity: Callable[[list[State]], float], fabric: L.Fabric) -> None:
        self.identity, self.fabric = identity, fabric

    def on_step(self, rnd: Round, step: Step) -> None:
        if step.accepted and self.fabric.is_global_zero and len(rnd.folded):
            uploads = [unflatten(u, rnd.state, rnd.names) for u in rnd.rows.values]
            rnd.metrics["fed/identity_error"] = self.identity(uploads)
            rnd.unprotected.add("fed/identity_error")  # (computed from the uploads themselves)

    def __repr__(self) -> str:
        return f"IdentityCheck({getattr(self.identity, '__qualname__', self.identity)})"
