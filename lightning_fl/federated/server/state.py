"""Federated states (named tensors) and the flat float32 layout that strategies and processes exchange."""

from __future__ import annotations

from collections.abc import Sequence

import torch

State = dict[str, torch.Tensor]


def flatten(state: State, names: Sequence[str], out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate the tensors of ``state`` in ``names`` order into one flat float32 vector (on the CPU).

    ``out``: a float32 CPU vector of the right length to write into (and return) instead of a new one.
    """
    parts = [state[n].detach().reshape(-1).to("cpu", torch.float32) for n in names]
    return torch.cat(parts) if out is None else torch.cat(parts, out=out)


def unflatten(flat: torch.Tensor, like: State, names: Sequence[str], *, typed: bool = True) -> State:
    """Split ``flat`` back into tensors shaped (and, with ``typed``, typed) like ``like``; ``typed=False`` keeps
    ``flat``'s dtype (views of it)."""
    out, offset = {}, 0
    for n in names:
        t = like[n]
        part = flat[offset : offset + t.numel()].view(t.shape)
        out[n] = part.to(t.dtype) if typed else part
        offset += t.numel()
    return out
