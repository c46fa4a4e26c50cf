"""Upload codecs: how a client's federated state becomes the bytes it sends, and back.

A :class:`Codec` encodes a dict of tensors into a :class:`Payload` of wire tensors (whose bytes are
what the ledger counts) and decodes it on the server. It also sees the reference state (the global
state the client started from), so update compressors (top-k, PowerSGD with error feedback) can
send ``state - reference``; codecs that send the state itself ignore it. Per-client memory such as
error-feedback residuals lives in the codec and is saved through :meth:`Codec.state_dict`.

Write your own by subclassing :class:`Codec` and implementing ``encode_tensor``/``decode_tensor``
(stateless, per tensor) or ``encode``/``decode`` (whole state, may use ``reference`` and ``client``).

The server trusts no payload: before decoding it asks :meth:`Codec.check_payload` whether the payload has
the structure the codec produces. A codec states that structure with :meth:`Codec.layout` (per encoded
tensor: shape, dtype, info and each part's dtype and shape, all derived from the reference state); the base
check compares every payload with it, so :meth:`Codec.decode` only ever sees what ``encode`` could have made.

Kept as one file: it is one contract, the :class:`Codec`, the :class:`Payload` it produces and the checks
(:class:`Layout`, :func:`check_layout_of`, :func:`non_finite`) by which the server holds a payload to what
``encode`` could have made; a codec's author learns both sides here, and the gate, the transports and every codec
import these names from this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_fl.compress.client_state import import_files


class PayloadError(ValueError):
    """A payload that is not what the codec sends: malformed bytes, a wrong structure, or one it cannot decode."""


class PayloadDecodeError(PayloadError):
    """A codec failed to decode a payload (the server rejects the upload instead of failing)."""


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


@dataclass(frozen=True)
class Layout:
    """The structure of one encoded tensor as a codec produces it (what :meth:`Codec.check_payload` expects).

    Args:
        shape: The :attr:`Encoded.shape` the encoded tensor declares.
        dtype: The :attr:`Encoded.dtype` it declares.
        parts: Every wire part by name: its dtype and shape (no other part may appear).
        info: The exact :attr:`Encoded.info`.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    info: dict[str, Any] = field(default_factory=dict)


def check_containers(payload: object) -> list[str]:
    """Problems with the containers of ``payload``, whatever the codec: a :class:`Payload` whose ``tensors`` map
    names to :class:`Encoded`, each with a dict of named tensors as ``parts``, a shape of non-negative ints, a
    ``torch.dtype`` and a dict ``info``. A payload that passes can be measured (:attr:`Payload.nbytes`) and
    compared with a :class:`Layout`; nothing here looks at the values.
    """
    if not isinstance(payload, Payload):
        return [f"expected a Payload, got {type(payload).__name__}"]
    if not isinstance(payload.tensors, dict):
        return [f"the payload's tensors must be a dict, got {type(payload.tensors).__name__}"]
    problems = []
    for name, enc in payload.tensors.items():
        if not isinstance(name, str):
            problems.append(f"tensor names must be strings, got {type(name).__name__}")
            continue
        at = _label(name)
        if not isinstance(enc, Encoded):
            problems.append(f"{at}: expected an Encoded tensor, got {type(enc).__name__}")
            continue
        if not isinstance(enc.parts, dict):
            problems.append(f"{at}: parts must be a dict, got {type(enc.parts).__name__}")
        else:
            for part, t in enc.parts.items():
                if not isinstance(part, str):
                    problems.append(f"{at}: part names must be strings, got {type(part).__name__}")
                elif not isinstance(t, torch.Tensor):
                    problems.append(f"{at}.{_label(part)}: expected a tensor, got {type(t).__name__}")
        shape = enc.shape
        if not isinstance(shape, (tuple, list)):
            problems.append(f"{at}: shape must be a tuple of non-negative ints, got {type(shape).__name__}")
        elif not all(_is_count(d) for d in shape):
            bad = next(d for d in shape if not _is_count(d))
            got = bad if isinstance(bad, int) and not isinstance(bad, bool) else f"a {type(bad).__name__}"
            problems.append(f"{at}: shape must be a tuple of non-negative ints, got {got} in it")
        if not isinstance(enc.dtype, torch.dtype):
            problems.append(f"{at}: dtype must be a torch.dtype, got {type(enc.dtype).__name__}")
        if not isinstance(enc.info, dict) or not all(isinstance(k, str) for k in enc.info):
            problems.append(f"{at}: info must be a dict with string keys")
    return problems


def check_layout_of(payload: Payload, expected: dict[str, Layout]) -> list[str]:
    """Problems of a payload whose containers are sound (:func:`check_containers`) against the ``expected``
    structure: the same tensor names, and for each the declared shape, dtype and info, and exactly the expected
    parts, each a strided CPU tensor of the expected dtype and shape. Whether float parts are finite is
    :func:`non_finite_parts`' question, asked by whoever decodes (the upload gate, a client applying a broadcast).
    """
    problems = []
    got = payload.tensors
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or extra:
        problems.append(f"tensors differ (missing {_few(missing)}, unexpected {_few(extra)})")
    for name in sorted(set(expected) & set(got)):
        want, enc, at = expected[name], got[name], _label(name)
        if tuple(enc.shape) != tuple(want.shape):
            problems.append(f"{at}: declares shape {_shape(enc.shape)}, expected {tuple(want.shape)}")
        if enc.dtype != want.dtype:
            problems.append(f"{at}: declares dtype {enc.dtype}, expected {want.dtype}")
        if not _same_info(enc.info, want.info):
            problems.append(f"{at}: info is not {want.info}")
        missing, extra = sorted(set(want.parts) - set(enc.parts)), sorted(set(enc.parts) - set(want.parts))
        if missing or extra:
            problems.append(f"{at}: parts differ (missing {_few(missing)}, unexpected {_few(extra)})")
        for part in sorted(set(want.parts) & set(enc.parts)):
            (dtype, shape), t, where = want.parts[part], enc.parts[part], f"{at}.{_label(part)}"
            if t.layout != torch.strided or t.device.type != "cpu":
                problems.append(f"{where}: expected a dense CPU tensor, got {t.layout} on {t.device}")
            elif t.dtype != dtype:
                problems.append(f"{where}: expected dtype {dtype}, got {t.dtype}")
            elif tuple(t.shape) != tuple(shape):
                problems.append(f"{where}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    return problems


def non_finite_parts(payload: Payload) -> list[str]:
    """How many NaN or infinite values each float part of ``payload`` (its containers sound:
    :func:`check_containers`) holds, as problems, in one pass (:func:`non_finite`). Asked before decoding: cast
    to an integer state tensor a NaN would pass as a number."""
    parts = {
        f"{_label(name)}.{_label(part)}": t
        for name, enc in sorted(payload.tensors.items())
        for part, t in sorted(enc.parts.items())
        if t.layout == torch.strided
    }
    return [f"{where}: {count} non-finite values" for where, count in non_finite(parts).items()]


#: Tensors of at least this many values are summed where they lie by :func:`non_finite`; smaller ones are
#: concatenated first (one call for many small tensors costs less than one call each).
SUM_IN_PLACE = 2**14


def non_finite(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """How many NaN or infinite values each floating-point tensor of ``tensors`` holds (only those with any).

    One pass of sums (a sum is several times cheaper than ``isfinite``, :func:`_total`), then, only if the total
    is not finite, one count per tensor to name them. A sum is finite only if every value is (a NaN or an
    infinity propagates, ``inf - inf`` is NaN); a sum of finite values that overflows only sends the check to the
    exact per-tensor count, which then finds nothing.
    """
    floats = {n: t for n, t in tensors.items() if t.is_floating_point() and t.numel()}
    if not floats or bool(torch.isfinite(_total(list(floats.values())))):
        return {}
    counts = {n: int((~torch.isfinite(t.detach())).sum()) for n, t in floats.items()}
    return {n: c for n, c in counts.items() if c}


def _total(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The float64 sum of the sums of ``tensors``: the small ones concatenated and summed at once (they cost far
    more per call than per value), each large one summed where it lies (copying it would cost more than summing
    it), each sum in float32 (float64 for float64 values: half-precision values do not overflow); one scalar, so
    reading it is one device synchronisation."""
    small = [t.detach().reshape(-1) for t in tensors if t.numel() < SUM_IN_PLACE]
    parts = [t.detach() for t in tensors if t.numel() >= SUM_IN_PLACE]
    if small:
        parts.append(torch.cat(small) if len(small) > 1 else small[0])
    sums = [t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32) for t in parts]
    return torch.stack([s.to(torch.float64) for s in sums]).sum()


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _same_info(got: dict, want: dict) -> bool:
    """Equal keys and values of the same type (``True`` is not ``1``, ``1.0`` is not ``1``)."""
    return set(got) == set(want) and all(type(got[k]) is type(want[k]) and got[k] == want[k] for k in want)


def _label(name: str) -> str:
    return name if len(name) <= 80 else name[:77] + "..."


def _shape(shape: tuple | list) -> str:
    text = str(tuple(shape))
    return text if len(text) <= 80 else text[:77] + "..."


def _few(names: list[str]) -> list[str]:
    return [_label(n) for n in names[:5]] + (["..."] if len(names) > 5 else [])


class Codec:
    """Base class: identity behaviour per tensor is left to subclasses; see the module docstring."""

    _plugin_base = True  # not offered as a choice in CLI messages

    def encode(self, state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], client: int) -> Payload:
        return Payload({name: self.encode_tensor(t.detach()) for name, t in state.items()})

    def decode(self, payload: Payload, reference: dict[str, torch.Tensor], client: int) -> dict[str, torch.Tensor]:
        return {name: self.decode_tensor(enc) for name, enc in payload.tensors.items()}

    def layout(self, reference: dict[str, torch.Tensor]) -> dict[str, Layout] | None:
        """The structure :meth:`encode` produces for a state laid out like ``reference`` (``None``: not stated).

        Every codec here states it; a codec of your own should too, so the server can refuse a malformed
        upload before decoding it. Without it :meth:`check_payload` checks only the containers, and a payload
        that the codec then fails to decode is still rejected (:class:`PayloadDecodeError`).
        """
        return None

    def check_payload(self, payload: Payload, reference: dict[str, torch.Tensor]) -> list[str]:
        """Problems with ``payload``'s structure, found before it is decoded (empty: decode may trust it).

        The base checks the containers (:func:`check_containers`) and compares the payload with
        :meth:`layout`; a codec whose payloads must satisfy more (top-k's positions) adds its own checks.
        Never raises for any ``payload``: a malformed one is described, not executed.
        """
        problems = check_containers(payload)
        if problems:
            return problems
        expected = self.layout(reference)
        return check_layout_of(payload, expected) if expected is not None else []

    def encode_tensor(self, tensor: torch.Tensor) -> Encoded:
        raise NotImplementedError

    def decode_tensor(self, encoded: Encoded) -> torch.Tensor:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Per-client memory to checkpoint (none for stateless codecs)."""
        return {}

    def client_stores(self) -> dict[str, Any]:
        """The codec's per-client state, as :class:`~lightning_fl.compress.client_state.ClientStateStore` objects
        saved under the same keys of :meth:`state_dict` (none for stateless codecs). The trainer gives them a
        memory budget and a folder, gathers them from every process for a checkpoint, and keeps on each process
        the clients it trains."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but got state keys {sorted(state)}")

    # -- the per-client state's life in a run (the trainer calls these; a stateless codec has nothing to do)
    def attach_client_state(self, folder: Path, budget_bytes: int) -> None:
        """Keep at most ``budget_bytes`` of each per-client store in memory and the rest under ``folder/<key>``."""
        for name, store in self.client_stores().items():
            store.attach(folder / name, budget_bytes)

    def gathered_state_dict(self, gather: Callable[[Any], list[Any]] | None = None) -> dict[str, Any]:
        """:meth:`state_dict` with every process's per-client entries (each process holds the clients it trains):
        ``gather(obj)`` returns every process's ``obj`` (a collective, called the same way on every process);
        ``None`` in one process."""
        state = self.state_dict()
        for name in self.client_stores() if gather is not None else ():
            state[name] = {c: entry for part in gather(state[name]) for c, entry in part.items()}
        return state

    def load_client_state(
        self, state: dict[str, Any], source: Path | None = None, keep: Callable[[int], bool] | None = None
    ) -> None:
        """:meth:`load_state_dict` from a checkpoint: first the client files it names from ``source`` (the run
        folder of a checkpoint written elsewhere) into the stores' own folders; then, with ``keep``, only the
        clients this process trains."""
        stores = self.client_stores()
        for name, store in stores.items() if source is not None else ():
            if store.file_backed:
                import_files(state.get(name, {}), source / "client_state" / name, store.folder)
        self.load_state_dict(state)
        for store in stores.values() if keep is not None else ():
            store.retain(keep)

    def client_state_saved(self, pin: bool = False) -> None:
        """The last :meth:`gathered_state_dict` is in a saved checkpoint: the files it superseded can go (kept if
        ``pin``: that checkpoint is kept for good)."""
        for store in self.client_stores().values():
            store.committed(pin=pin)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FP32(Codec):
    """Identity: every value sent as a 4-byte float."""

    def encode_tensor(self, tensor: torch.Tensor) -> Encoded:
        flat = tensor.to(torch.float32).reshape(-1).contiguous().cpu()
        return Encoded({"values": flat}, tuple(tensor.shape), tensor.dtype)

    def decode_tensor(self, encoded: Encoded) -> torch.Tensor:
        return encoded.parts["values"].reshape(encoded.shape).to(encoded.dtype)

    def layout(self, reference: dict[str, torch.Tensor]) -> dict[str, Layout]:
        """Per state tensor: its shape and dtype, and its values flattened as float32."""
        return per_tensor_layout(reference, lambda t: ({"values": (torch.float32, (t.numel(),))}, {}))


def per_tensor_layout(
    reference: dict[str, torch.Tensor],
    parts_and_info: Callable[[torch.Tensor], tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, Any]]],
) -> dict[str, Layout]:
    """The layout of a per-tensor codec (the base :meth:`Codec.encode`): one entry per state tensor, declaring
    its shape and dtype, with the parts and info ``parts_and_info`` gives for that tensor."""
    layout = {}
    for name, t in reference.items():
        parts, info = parts_and_info(t)
        layout[name] = Layout(tuple(t.shape), t.dtype, parts, info)
    return layout
