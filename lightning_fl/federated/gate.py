"""The upload gate: what keeps a malformed, non-finite or oversized upload out of every strategy.

Every decoded upload passes :func:`check_upload` before the server aggregates it; robust strategies
therefore never see a NaN or an Inf (a NaN breaks medians and Krum's ``argmin`` silently). Uploads an
attack rewrote in simulation are checked again with :func:`non_finite_rows`.
"""

from __future__ import annotations

import math

import torch

from lightning_fl.compress.base import Payload
from lightning_fl.errors import UserError
from lightning_fl.federated.state import State


class UploadRejectedError(UserError):
    """A client's upload failed the gate and the policy is ``raise``."""


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


def check_layout(payload: Payload, reference: State) -> list[str]:
    """Problems with a payload's declared sizes, found before the codec decodes it.

    A payload that crossed a network says what shape each tensor has; no tensor may declare more values
    than the whole reference state holds, so a hostile header cannot make the decoder allocate without bound.
    """
    total = sum(t.numel() for t in reference.values())
    problems = []
    for name, enc in payload.tensors.items():
        numel = math.prod(enc.shape)
        if numel > total:
            problems.append(f"{name}: declares {numel} values; the whole state has {total}")
    return problems


def non_finite_rows(flats: torch.Tensor) -> list[int]:
    """Indices of the rows of ``flats`` (uploads, one per row) that hold a NaN or an Inf."""
    return [int(i) for i in torch.nonzero(~torch.isfinite(flats).all(dim=1)).flatten()]
