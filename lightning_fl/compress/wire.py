"""The wire format of a :class:`~lightning_fl.compress.base.Payload`: bytes a remote client sends, never unpickled.

A client on another machine (a Flower ClientApp) sends its encoded upload as one ``bytes`` value::

    b"LFLP" | version (1 byte) | header length (4 bytes, little-endian) | header (UTF-8 JSON) | part bytes

The JSON header lists, per state tensor, its shape, dtype and codec info, and per wire part its dtype and shape;
the part bytes follow in that order, little-endian. :func:`loads` trusts nothing: it checks the magic, the
version, the header's structure and types, every dtype against an allow-list, every size against the bytes
actually present, and refuses trailing bytes, so garbage or a hostile reply raises :class:`PayloadFormatError`
(one line saying what is wrong) and never executes anything. Only the part bytes are the codec's payload
(:attr:`Payload.nbytes`, what the byte ledger counts); the header is the transport's overhead. (safetensors, the
same layout, was measured against this format and adds more bytes and write time: docs/results-systems.md, "The wire
format against safetensors".)
"""

from __future__ import annotations

import json
import math
import struct
import sys

import torch

from lightning_fl.compress.base import Encoded, Payload, PayloadError

MAGIC = b"LFLP"
VERSION = 1
_PREFIX = struct.Struct("<4sBI")  # magic, version, header length

#: dtypes a payload may carry (by name, as on the wire).
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 1 << 20
MAX_NDIM = 8
MAX_NAME = 256
MAX_ELEMENTS = 1 << 48  # per tensor or part, counting a zero dimension as one (no real state comes near)


class PayloadFormatError(PayloadError):
    """Bytes that are not a well-formed payload."""


def dumps(payload: Payload) -> bytes:
    """Serialise ``payload`` (its parts as raw little-endian bytes behind a JSON header)."""
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
        raise RuntimeError("the payload wire format is little-endian; this host is not")
    tensors, chunks = [], []
    for name, enc in payload.tensors.items():
        parts = []
        for part, t in enc.parts.items():
            t = t.detach().contiguous().cpu()
            if t.dtype not in _NAMES:
                raise TypeError(f"{name}.{part}: dtype {t.dtype} cannot go on the wire (allowed: {', '.join(DTYPES)})")
            parts.append({"name": part, "dtype": _NAMES[t.dtype], "shape": list(t.shape)})
            chunks.append(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        if enc.dtype not in _NAMES:
            raise TypeError(f"{name}: dtype {enc.dtype} cannot go on the wire")
        tensors.append(
            {"name": name, "shape": list(enc.shape), "dtype": _NAMES[enc.dtype], "info": enc.info, "parts": parts}
        )
    header = json.dumps({"tensors": tensors}, separators=(",", ":"), allow_nan=False).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(header)) + header + b"".join(chunks)


def loads(data: bytes) -> Payload:
    """Parse bytes made by :func:`dumps`; anything else raises :class:`PayloadFormatError`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadFormatError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _PREFIX.size:
        raise PayloadFormatError(f"{len(data)} bytes are too short for a payload ({_PREFIX.size}-byte prefix)")
    magic, version, length = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise PayloadFormatError(f"not a lightning_fl payload (starts with {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise PayloadFormatError(f"payload format version {version}; this server reads version {VERSION}")
    if length > MAX_HEADER_BYTES or _PREFIX.size + length > len(data):
        raise PayloadFormatError(f"header length {length} does not fit the {len(data)} bytes received")
    try:
        header = json.loads(data[_PREFIX.size : _PREFIX.size + length].decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as err:
        raise PayloadFormatError(f"header is not valid JSON ({err})") from None
    except RecursionError:  # (a few bytes of "[[[[...": the parser's nesting limit, not a crash)
        raise PayloadFormatError("header nests JSON too deeply") from None
    entries = _field(header, "tensors", list, "header")
    body, offset = memoryview(data)[_PREFIX.size + length :], 0
    tensors: dict[str, Encoded] = {}
    for i, entry in enumerate(entries):
        name, dtype, shape, where = _described(entry, f"tensor {i}", "tensor", tensors)
        info = _info(_field(entry, "info", dict, where), where)
        parts: dict[str, torch.Tensor] = {}
        for spec in _field(entry, "parts", list, where):
            part, part_dtype, part_shape, at = _described(spec, where, f"{where} part", parts)
            nbytes = math.prod(part_shape) * _itemsize(part_dtype)
            if offset + nbytes > len(body):
                raise PayloadFormatError(f"{at} needs {nbytes} bytes but only {len(body) - offset} remain")
            raw = bytearray(body[offset : offset + nbytes])
            offset += nbytes
            if nbytes == 0:
                parts[part] = torch.empty(part_shape, dtype=part_dtype)
            else:
                parts[part] = torch.frombuffer(raw, dtype=torch.uint8).view(part_dtype).reshape(part_shape)
        tensors[name] = Encoded(parts, tuple(shape), dtype, info)
    if offset != len(body):
        raise PayloadFormatError(f"{len(body) - offset} bytes follow the last part")
    return Payload(tensors)


def overhead(payload: Payload) -> int:
    """Bytes :func:`dumps` adds to the payload's own (header and prefix)."""
    return len(dumps(payload)) - payload.nbytes


def _described(obj: object, where: str, kind: str, seen: dict) -> tuple[str, torch.dtype, list[int], str]:
    """A header entry's checked ``name``, ``dtype`` and ``shape`` (names unique in ``seen``), and where it is."""
    name = _name(_field(obj, "name", str, where), where)
    where = f"{kind} {name!r}"
    if name in seen:
        raise PayloadFormatError(f"{where} appears twice")
    dtype = _dtype(_field(obj, "dtype", str, where), where)
    return name, dtype, _shape(_field(obj, "shape", list, where), where), where


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _field(obj: object, key: str, kind: type, where: str):
    if not isinstance(obj, dict):
        raise PayloadFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise PayloadFormatError(f"{where}: missing {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PayloadFormatError(f"{where}: {key!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _name(value: str, where: str) -> str:
    if not value or len(value) > MAX_NAME:
        raise PayloadFormatError(f"{where}: names must have 1..{MAX_NAME} characters")
    return value


def _shape(value: list, where: str) -> list[int]:
    if len(value) > MAX_NDIM or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise PayloadFormatError(
            f"{where}: shape must be at most {MAX_NDIM} non-negative integers, got {_short(value)}"
        )
    # checked before torch sees it: even an empty tensor's size is computed from every dimension
    if math.prod(max(d, 1) for d in value) > MAX_ELEMENTS:
        limit = MAX_ELEMENTS.bit_length() - 1
        raise PayloadFormatError(f"{where}: shape {_short(value)} describes more than 2^{limit} elements")
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _dtype(value: str, where: str) -> torch.dtype:
    if value not in DTYPES:
        raise PayloadFormatError(f"{where}: dtype {value!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[value]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _info(value: dict, where: str) -> dict:
    for key, item in value.items():
        if not isinstance(item, (int, float, str, bool)) and item is not None:
            raise PayloadFormatError(f"{where}: info {key!r} must be a number, string, bool or null")
    return value
