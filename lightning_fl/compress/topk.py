"""Top-k sparsification of the client update with error feedback.

Aji & Heafield (2017), "Sparse Communication for Distributed Gradient Descent", with the error
feedback of Stich et al. (2018) / Karimireddy et al. (2019). The client keeps the ``k`` entries of
largest magnitude of its error-corrected update (``k = ceil(density * n)``, over the whole flattened
update, or per tensor with ``scope: tensor``) and sends their float32 values and int32 positions:
8 bytes per kept entry.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from lightning_fl.compress.base import Encoded, Layout, Payload
from lightning_fl.compress.error_feedback import State, UpdateCompressor
from lightning_fl.errors import ConfigError


class TopK(UpdateCompressor):
    """Send the ``density`` share of update entries with the largest magnitude.

    Args:
        density: Share of entries kept (0.01 and 0.1 in the FLITE paper).
        scope: ``global`` (top-k over the whole update) or ``tensor`` (top-k of each tensor).
        error_feedback: Carry the dropped entries into the client's next update.
    """

    def __init__(
        self, density: float = 0.01, scope: Literal["global", "tensor"] = "global", error_feedback: bool = True
    ) -> None:
        super().__init__(error_feedback)
        if not 0 < density <= 1:
            raise ConfigError(f"codec.density must be in (0, 1], got {density}")
        if scope not in ("global", "tensor"):
            raise ConfigError(f"codec.scope must be 'global' or 'tensor', got {scope!r}")
        self.density, self.scope = density, scope

    @staticmethod
    def select(flat: torch.Tensor, k: int) -> torch.Tensor:
        """Positions of the ``k`` entries of largest magnitude, ascending."""
        return torch.topk(flat.abs(), k, sorted=False).indices.sort().values

    def kept(self, numel: int) -> int:
        """How many of ``numel`` entries are sent."""
        return max(1, math.ceil(self.density * numel))

    def _sparsify(self, flat: torch.Tensor) -> tuple[Encoded, torch.Tensor]:
        k = self.kept(flat.numel())
        idx = self.select(flat, k)
        values = flat[idx]
        approx = torch.zeros_like(flat)
        approx[idx] = values
        parts = {"values": values.contiguous(), "indices": idx.to(torch.int32)}
        return Encoded(parts, (flat.numel(),)), approx

    def compress(self, update: State, client: int) -> tuple[Payload, State]:
        names = sorted(update)
        if self.scope == "tensor":
            tensors, approx = {}, {}
            for n in names:
                enc, flat = self._sparsify(update[n].reshape(-1))
                tensors[n], approx[n] = enc, flat.view(update[n].shape)
            return Payload(tensors), approx
        flat = torch.cat([update[n].reshape(-1) for n in names])
        enc, approx_flat = self._sparsify(flat)
        approx, offset = {}, 0
        for n in names:
            approx[n] = approx_flat[offset : offset + update[n].numel()].view(update[n].shape)
            offset += update[n].numel()
        return Payload({"update": enc}), approx

    def decompress(self, payload: Payload, reference: State, client: int) -> State:
        def dense(enc: Encoded, numel: int) -> torch.Tensor:
            out = torch.zeros(numel)
            out[enc.parts["indices"].to(torch.int64)] = enc.parts["values"].to(torch.float32)
            return out

        names = sorted(reference)
        if self.scope == "tensor":
            return {n: dense(payload.tensors[n], reference[n].numel()).view(reference[n].shape) for n in names}
        flat = dense(payload.tensors["update"], sum(reference[n].numel() for n in names))
        out, offset = {}, 0
        for n in names:
            out[n] = flat[offset : offset + reference[n].numel()].view(reference[n].shape)
            offset += reference[n].numel()
        return out

    def layout(self, reference: State) -> dict[str, Layout]:
        """One flat float32 entry (``update``, or one per state tensor with ``scope: tensor``) of ``numel``
        values, carrying ``k`` float32 values and their ``k`` int32 positions."""

        def flat(numel: int) -> Layout:
            k = self.kept(numel)
            return Layout((numel,), torch.float32, {"values": (torch.float32, (k,)), "indices": (torch.int32, (k,))})

        if self.scope == "tensor":
            return {n: flat(t.numel()) for n, t in reference.items()}
        return {"update": flat(sum(t.numel() for t in reference.values()))}

    def check_payload(self, payload: Payload, reference: State) -> list[str]:
        """The layout, and positions as :meth:`select` makes them: ascending, distinct and inside the tensor
        (a negative one would silently index from the end)."""
        problems = super().check_payload(payload, reference)
        if problems:
            return problems
        for name, enc in sorted(payload.tensors.items()):
            idx = enc.parts["indices"].to(torch.int64)
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= enc.shape[0]):
                problems.append(f"{name}: positions must lie in [0, {enc.shape[0]})")
            elif bool((idx[1:] <= idx[:-1]).any()):
                problems.append(f"{name}: positions must be strictly ascending")
        return problems

    def __repr__(self) -> str:
        return f"TopK(density={self.density}, scope={self.scope!r}, error_feedback={self.error_feedback})"
