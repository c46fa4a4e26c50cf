"""Server side: the upload gate, aggregation, and the flat layout used to move states between processes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_fl.compress.base import Payload
from lightning_fl.errors import UserError

State = dict[str, torch.Tensor]


class UploadRejectedError(UserError):
    """A client's upload failed the gate and the policy is ``raise``."""


def get_federated_state(model: torch.nn.Module) -> State:
    """The module's declared federated state, or every trainable parameter if it declares none."""
    if callable(getattr(model, "federated_state", None)):
        return model.federated_state()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_federated_state(model: torch.nn.Module, state: State) -> None:
    if callable(getattr(model, "load_federated_state", None)):
        model.load_federated_state(state)
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


def check_upload(decoded: State, reference: State, payload: Payload) -> list[str]:
    """Problems that keep an upload out of the aggregate: keys, shape, dtype, size, non-finite values.

    ``reference`` is the global state the client started from: the upload must match its layout.
    The payload may not be larger than sending the reference in float32 (plus 64 bytes per tensor).
    """
    problems = []
    missing, extra = sorted(set(reference) - set(decoded)), sorted(set(decoded) - set(reference))
    if missing or extra:
        problems.append(f"keys differ (missing {missing}, unexpected {extra})")
    for name in sorted(set(reference) & set(decoded)):
        got, want = decoded[name], reference[name]
        if not isinstance(got, torch.Tensor):
            problems.append(f"{name}: expected a tensor, got {type(got).__name__}")
            continue
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"{name}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}")
        elif got.dtype != want.dtype:
            problems.append(f"{name}: expected dtype {want.dtype}, got {got.dtype}")
        elif not torch.isfinite(got).all():
            bad = int((~torch.isfinite(got)).sum())
            problems.append(f"{name}: {bad} non-finite values")
    cap = sum(t.numel() * 4 + 64 for t in reference.values())
    if payload.nbytes > cap:
        problems.append(f"payload is {payload.nbytes} bytes, more than the {cap} of sending the state in float32")
    return problems


def flatten(state: State, names: Sequence[str]) -> torch.Tensor:
    """Concatenate the tensors of ``state`` in ``names`` order into one flat float32 vector (on the CPU)."""
    return torch.cat([state[n].detach().reshape(-1).to("cpu", torch.float32) for n in names])


def unflatten(flat: torch.Tensor, like: State, names: Sequence[str]) -> State:
    out, offset = {}, 0
    for n in names:
        t = like[n]
        out[n] = flat[offset : offset + t.numel()].view(t.shape).to(t.dtype)
        offset += t.numel()
    return out


def weighted_mean(flats: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum_k w_k x_k / sum_k w_k`` in float64, summed in the given order (so every process agrees bit for bit)."""
    if not flats:
        raise ValueError("Expected at least one upload to aggregate")
    total = sum(float(w) for w in weights)
    if not total > 0:
        raise ValueError(f"Expected positive aggregation weights, got {list(weights)}")
    acc = torch.zeros_like(flats[0], dtype=torch.float64)
    for x, w in zip(flats, weights, strict=True):
        acc += float(w) * x.to(torch.float64)
    return acc / total
