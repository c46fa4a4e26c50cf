"""Upload codecs: how a client's federated state becomes the bytes it sends, and back.

A :class:`Codec` encodes a dict of tensors into a :class:`Payload` of wire tensors (whose bytes are
what the ledger counts) and decodes it on the server. It also sees the reference state (the global
state the client started from), so update compressors (top-k, PowerSGD with error feedback) can
send ``state - reference``; codecs that send the state itself ignore it. Per-client memory such as
error-feedback residuals lives in the codec and is saved through :meth:`Codec.state_dict`.

Write your own by subclassing :class:`Codec` and implementing ``encode_tensor``/``decode_tensor``
(stateless, per tensor) or ``encode``/``decode`` (whole state, may use ``reference`` and ``client``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Encoded:
    """One encoded tensor: the ``parts`` travel on the wire; ``shape`` and ``dtype`` are known to both sides."""

    parts: dict[str, torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    info: dict[str, Any] = field(default_factory=dict)  # codec parameters both sides agreed on (not sent)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


@dataclass
class Payload:
    """Everything one client sends in one round: one :class:`Encoded` per state tensor."""

    tensors: dict[str, Encoded]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire, counted from the encoded tensors themselves."""
        return sum(e.nbytes for e in self.tensors.values())


class Codec:
    """Base class: identity behaviour per tensor is left to subclasses; see the module docstring."""

    _plugin_base = True  # not offered as a choice in CLI messages

    def encode(self, state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], client: int) -> Payload:
        return Payload({name: self.encode_tensor(t.detach()) for name, t in state.items()})

    def decode(self, payload: Payload, reference: dict[str, torch.Tensor], client: int) -> dict[str, torch.Tensor]:
        return {name: self.decode_tensor(enc) for name, enc in payload.tensors.items()}

    def encode_tensor(self, tensor: torch.Tensor) -> Encoded:
        raise NotImplementedError

    def decode_tensor(self, encoded: Encoded) -> torch.Tensor:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Per-client memory to checkpoint (none for stateless codecs)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but got state keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FP32(Codec):
    """Identity: every value sent as a 4-byte float."""

    def encode_tensor(self, tensor: torch.Tensor) -> Encoded:
        flat = tensor.to(torch.float32).reshape(-1).contiguous().cpu()
        return Encoded({"values": flat}, tuple(tensor.shape), tensor.dtype)

    def decode_tensor(self, encoded: Encoded) -> torch.Tensor:
        return encoded.parts["values"].reshape(encoded.shape).to(encoded.dtype)
