"""The upload gate: what keeps a malformed, non-finite or oversized upload out of every strategy.

Every decoded upload passes :func:`check_upload` before the server aggregates it; robust strategies
therefore never see a NaN or an Inf (a NaN breaks medians and Krum's ``argmin`` silently). Uploads an
attack rewrote in simulation are checked again with :func:`non_finite_rows`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_fl.compress.base import (
    Codec,
    Encoded,
    Payload,
    PayloadDecodeError,
    check_containers,
    non_finite,
    non_finite_parts,
)
from lightning_fl.errors import UserError
from lightning_fl.federated.server.state import State


class UploadRejectedError(UserError):
    """A client's upload failed the gate and the policy is ``raise``."""


def check_upload(
    decoded: State, reference: State, payload: Payload, finite: Sequence[tuple[torch.Tensor, int]] = ()
) -> list[str]:
    """Problems that keep an upload out of the aggregate: keys, shape, dtype, size, non-finite values.

    ``reference`` is the global state the client started from: the upload must match its layout.
    The payload may not be larger than sending the reference in float32 (plus 64 bytes per tensor).
    ``finite``: tensors already found finite, each with its version counter then; a decoded tensor that lies in
    the memory of one of them, unchanged since (FP32's decoded tensors are views of its parts), is not summed
    again, so each value of an upload is checked once.
    """
    problems = []
    missing, extra = sorted(set(reference) - set(decoded)), sorted(set(decoded) - set(reference))
    if missing or extra:
        problems.append(f"keys differ (missing {missing}, unexpected {extra})")
    fitting = {}
    for name in sorted(set(reference) & set(decoded)):
        got, want = decoded[name], reference[name]
        if not isinstance(got, torch.Tensor):
            problems.append(f"{name}: expected a tensor, got {type(got).__name__}")
        elif tuple(got.shape) != tuple(want.shape):
            problems.append(f"{name}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}")
        elif got.dtype != want.dtype:
            problems.append(f"{name}: expected dtype {want.dtype}, got {got.dtype}")
        elif not _within(got, finite):
            fitting[name] = got
    problems += [f"{name}: {count} non-finite values" for name, count in non_finite(fitting).items()]
    problems += size_problems(payload, reference)
    return problems


def _within(t: torch.Tensor, finite: Sequence[tuple[torch.Tensor, int]]) -> bool:
    """Whether every value of ``t`` is a value of one of the ``finite`` tensors, not modified since: ``t``
    contiguous inside the contiguous memory of one of them, of the same dtype and device, whose version counter
    (shared by its views, bumped by every in-place change) is still the recorded one."""
    if not t.is_contiguous() or not finite:
        return False
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(
        part._version == version
        and part.is_contiguous()
        and part.dtype == t.dtype
        and part.device == t.device
        and part.data_ptr() <= start
        and end <= part.data_ptr() + part.numel() * part.element_size()
        for part, version in finite
    )


def size_problems(payload: Payload, reference: State) -> list[str]:
    """The size cap: no larger than sending ``reference`` in float32, plus 64 bytes per tensor."""
    cap = sum(t.numel() * 4 + 64 for t in reference.values())
    if payload.nbytes > cap:
        return [f"payload is {payload.nbytes} bytes, more than the {cap} of sending the state in float32"]
    return []


def check_layout(payload: Payload, reference: State) -> list[str]:
    """Problems with a payload's containers and declared sizes, found before any codec looks at it.

    The payload must be made of the right containers (:func:`~lightning_fl.compress.base.check_containers`:
    tensors in every part slot, int shapes, ...). A payload that crossed a network says what shape each tensor
    has; no tensor may declare more values than the whole reference state holds, so a hostile header cannot
    make the decoder allocate without bound.
    """
    problems = check_containers(payload)
    if problems:
        return problems
    total = sum(t.numel() for t in reference.values())
    for name, enc in payload.tensors.items():
        numel = math.prod(enc.shape)
        if numel > total:
            problems.append(f"{name}: declares {numel} values; the whole state has {total}")
    return problems


def screen_upload(
    payload: Payload | None, codec: Codec, reference: State, client: int
) -> tuple[State | None, list[str]]:
    """What the server does with one client's payload: the decoded upload, or ``None`` and why it was refused.

    In order: :func:`check_layout`, the size cap of :func:`check_upload`, the codec's own structure check
    (:meth:`~lightning_fl.compress.base.Codec.check_payload`), the float parts' finiteness
    (:func:`~lightning_fl.compress.base.non_finite_parts`), decoding (:func:`decode_upload`) and
    :func:`check_upload` (which does not sum again what decoding left in the checked parts' memory). Never raises
    for a malformed payload, and changes neither ``reference`` nor the codec's state: a refused upload leaves no
    trace.
    """
    if payload is None:
        return None, ["no payload"]
    problems = check_layout(payload, reference)
    if problems:
        return None, problems
    problems += size_problems(payload, reference)
    try:
        problems += codec.check_payload(payload, reference)
    except Exception as err:  # a codec's own check must not take the server down either
        problems.append(f"structure could not be checked ({type(err).__name__}: {err})")
    problems = problems or non_finite_parts(payload)
    if problems:
        return None, problems
    finite = [
        (t, t._version)
        for enc in payload.tensors.values()
        for t in enc.parts.values()
        if t.layout == torch.strided and t.is_floating_point()
    ]
    try:
        decoded = decode_upload(payload, codec, reference, client)
    except PayloadDecodeError as err:
        return None, [str(err)]
    problems = check_upload(decoded, reference, payload, finite)
    return (None, problems) if problems else (decoded, [])


def decode_upload(payload: Payload, codec: Codec, reference: State, client: int) -> State:
    """``codec.decode``, with any failure (or a result that is not a dict of named tensors) raised as
    :class:`~lightning_fl.compress.base.PayloadDecodeError`."""
    try:
        decoded = codec.decode(payload, reference, client)
    except Exception as err:  # a malformed payload must not take the server down
        raise PayloadDecodeError(f"could not be decoded ({type(err).__name__}: {err})") from err
    if not isinstance(decoded, dict) or not all(isinstance(n, str) for n in decoded):
        raise PayloadDecodeError(f"could not be decoded (the codec returned a {type(decoded).__name__})")
    return decoded


def upload_nbytes(payload: object) -> int:
    """The payload's bytes for the ledger (:attr:`Payload.nbytes`), counting only its tensors if it is malformed."""
    if not isinstance(payload, Payload) or not isinstance(payload.tensors, dict):
        return 0
    total = 0
    for enc in payload.tensors.values():
        if isinstance(enc, Encoded) and isinstance(enc.parts, dict):
            total += sum(t.numel() * t.element_size() for t in enc.parts.values() if isinstance(t, torch.Tensor))
    return total


def non_finite_rows(flats: torch.Tensor) -> list[int]:
    """Indices of the rows of ``flats`` (uploads, one per row) that hold a NaN or an Inf."""
    return [int(i) for i in torch.nonzero(~torch.isfinite(flats).all(dim=1)).flatten()]
