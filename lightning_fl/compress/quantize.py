"""Uniform affine integer quantisation per tensor (int16/int8/int4/int2) for uploads.

Each tensor is mapped to ``q = round((x - min) / scale)`` with ``scale = (max - min) / (2^b - 1)``,
``q`` in ``[0, 2^b - 1]``, and decoded as ``q * scale + min``: the error is at most ``scale / 2``
per value. The wire format is the packed integers (``ceil(n b / 8)`` bytes: int4 packs two values
per byte, low nibble first; int2 four per byte; int16 two bytes little-endian) plus the scale and
the zero point (``min``) as two float32: ``ceil(n b / 8) + 8`` bytes. A 1,280-float FLITE latent at
int4 is 648 bytes (the FLITE paper, arXiv 2607.18343, section 5.9).

``target`` says what is quantised: ``weights`` (default) the uploaded state itself; ``update`` its difference
from the state the server broadcast (``state - reference``, per tensor, the same uniform affine code and the same
bytes), which the server adds back to the broadcast state. The FLITE paper's full-weight ladder (its Table 5)
quantises the update of textbook FedAvg.
"""

from __future__ import annotations

import math

import torch

from lightning_fl.compress.base import Codec, Encoded, Layout, Payload, per_tensor_layout
from lightning_fl.errors import ConfigError

SUPPORTED_BITS = (2, 4, 8, 16)


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integers < 2**bits (int64, flat) into a uint8 tensor of ``ceil(n bits / 8)`` bytes."""
    if bits == 16:
        return torch.stack([q & 0xFF, q >> 8], dim=1).reshape(-1).to(torch.uint8)
    per_byte = 8 // bits
    pad = (-q.numel()) % per_byte
    q = torch.cat([q, q.new_zeros(pad)]).view(-1, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.int64) * bits  # value i of a byte sits at bits i*b..i*b+b-1
    return (q << shifts).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` integers (int64)."""
    p = packed.to(torch.int64)
    if bits == 16:
        pairs = p.view(-1, 2)
        return (pairs[:, 0] | (pairs[:, 1] << 8))[:n]
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int64) * bits
    return ((p.view(-1, 1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]


class Quantize(Codec):
    """Uniform affine per-tensor quantisation to ``bits`` in {16, 8, 4, 2}.

    Args:
        bits: Bits per value.
        target: ``weights`` (quantise the uploaded state) or ``update`` (quantise ``state - reference``, the
            difference from the broadcast state, and add it back to the reference on decoding).
    """

    def __init__(self, bits: int = 8, target: str = "weights") -> None:
        if bits not in SUPPORTED_BITS:
            raise ConfigError(f"codec.bits must be one of {SUPPORTED_BITS}, got {bits}")
        if target not in ("weights", "update"):
            raise ConfigError(f"codec.target must be 'weights' or 'update', got {target!r}")
        self.bits, self.target = bits, target

    def encode(self, state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], client: int) -> Payload:
        if self.target == "weights":
            return super().encode(state, reference, client)
        return Payload({name: self.encode_tensor(update(t, reference[name])) for name, t in state.items()})

    def decode(self, payload: Payload, reference: dict[str, torch.Tensor], client: int) -> dict[str, torch.Tensor]:
        decoded = super().decode(payload, reference, client)
        if self.target == "weights":
            return decoded
        return {  # in float64, so adding the broadcast state back loses nothing beyond the final rounding
            name: (reference[name].detach().cpu().to(torch.float64) + delta.to(torch.float64)).to(reference[name].dtype)
            for name, delta in decoded.items()
        }

    def encode_tensor(self, tensor: torch.Tensor) -> Encoded:
        x = tensor.detach().to(torch.float64).reshape(-1).cpu()
        if not torch.isfinite(x).all():
            raise ValueError("cannot quantise a tensor with NaN or Inf values")
        lo, hi = (x.min(), x.max()) if x.numel() else (x.new_zeros(()), x.new_zeros(()))
        levels = (1 << self.bits) - 1
        # scale and zero point are sent as float32, so quantise against exactly those values
        scale = ((hi - lo) / levels).to(torch.float32)
        zero = lo.to(torch.float32)
        s64, z64 = scale.to(torch.float64), zero.to(torch.float64)
        q = torch.zeros_like(x, dtype=torch.int64) if s64 == 0 else torch.round((x - z64) / s64).to(torch.int64)
        q = q.clamp_(0, levels)
        params = torch.stack([scale, zero])  # (2,) float32: scale, zero point
        info = {"bits": self.bits, "numel": x.numel()}
        return Encoded({"packed": pack_bits(q, self.bits), "params": params}, tuple(tensor.shape), tensor.dtype, info)

    def decode_tensor(self, encoded: Encoded) -> torch.Tensor:
        scale, zero = encoded.parts["params"].to(torch.float64)
        q = unpack_bits(encoded.parts["packed"], self.bits, encoded.info["numel"])
        return (q.to(torch.float64) * scale + zero).to(encoded.dtype).reshape(encoded.shape)

    def layout(self, reference: dict[str, torch.Tensor]) -> dict[str, Layout]:
        """Per state tensor: its shape and dtype, ``ceil(n b / 8)`` packed bytes and two float32 parameters."""

        def parts_and_info(t: torch.Tensor):
            n = t.numel()
            parts = {"packed": (torch.uint8, (math.ceil(n * self.bits / 8),)), "params": (torch.float32, (2,))}
            return parts, {"bits": self.bits, "numel": n}

        return per_tensor_layout(reference, parts_and_info)

    def __repr__(self) -> str:
        target = "" if self.target == "weights" else f", target={self.target!r}"
        return f"Quantize(bits={self.bits}{target})"


def update(state: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``state - reference`` in float64 on the CPU (exact for float32 inputs), shaped and typed like ``state``."""
    delta = state.detach().cpu().to(torch.float64) - reference.detach().cpu().to(torch.float64)
    return delta.to(state.dtype)
