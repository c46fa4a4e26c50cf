"""Update compressors with error feedback: the shared mechanism of top-k and PowerSGD.

A client sends a compressed version of its update ``u = (state - reference) + e``, where ``e`` is
what previous compressions left out (error feedback, Karimireddy et al. 2019); after sending
``C(u)`` it keeps ``e' = u - C(u)``, so ``C(u) + e' = (state - reference) + e`` exactly. The server
adds the decompressed update back to the reference. Residuals are per client and live in
:meth:`UpdateCompressor.state_dict`, so they are saved in every round checkpoint.

Subclasses implement :meth:`UpdateCompressor.compress` (update -> payload and the approximation the
server will reconstruct) and :meth:`UpdateCompressor.decompress`, and state their payload's structure with
:meth:`~lightning_fl.compress.base.Codec.layout` so the server refuses a malformed upload before decompressing it.

Residuals live in a :class:`~lightning_fl.compress.client_state.ClientStateStore`: only clients that have
uploaded hold one, and with ``trainer.client_state_memory_mb`` those not used lately wait in files.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_fl.compress.base import Codec, Payload
from lightning_fl.compress.client_state import ClientStateStore

State = dict[str, torch.Tensor]


class UpdateCompressor(Codec):
    """Base for compressors of ``state - reference`` with optional per-client error feedback.

    Args:
        error_feedback: Carry what compression dropped into the client's next update.
    """

    _plugin_base = True  # not offered as a choice in CLI messages

    def __init__(self, error_feedback: bool = True) -> None:
        self.error_feedback = error_feedback
        self.residuals = ClientStateStore()

    def compress(self, update: State, client: int) -> tuple[Payload, State]:
        """Encode ``update``; return the payload and the update the server will reconstruct from it."""
        raise NotImplementedError

    def decompress(self, payload: Payload, reference: State, client: int) -> State:
        """The update (same keys and shapes as ``reference``) carried by ``payload``."""
        raise NotImplementedError

    def encode(self, state: State, reference: State, client: int) -> Payload:
        update = {
            n: state[n].detach().to("cpu", torch.float32) - reference[n].detach().to("cpu", torch.float32)
            for n in sorted(state)
        }
        return self.encode_update(update, client)

    def encode_update(self, update: State, client: int) -> Payload:
        """Compress ``update`` (float32 CPU tensors) for ``client``, with its error feedback: what :meth:`encode`
        sends for ``state - reference``, and what the server's compressed broadcast sends for its own step
        (:class:`~lightning_fl.compress.downlink.Downlink`)."""
        update = {n: update[n] for n in sorted(update)}
        if self.error_feedback and client in self.residuals:
            residual = self.residuals[client]
            update = {n: u + residual[n] for n, u in update.items()}
        payload, approx = self.compress(update, client)
        if self.error_feedback:
            self.residuals[client] = {n: update[n] - approx[n] for n in update}
        return payload

    def decode(self, payload: Payload, reference: State, client: int) -> State:
        delta = self.decompress(payload, reference, client)
        return {n: (reference[n].detach().to("cpu", torch.float32) + delta[n]).to(reference[n].dtype) for n in delta}

    def client_stores(self) -> dict[str, ClientStateStore]:
        return {"residuals": self.residuals}

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": self.residuals.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals.load_state_dict(state.get("residuals", {}))
