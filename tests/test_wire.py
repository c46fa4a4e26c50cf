"""The payload wire format: exact round trips for every codec; anything else is refused in one line."""

import contextlib
import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_fl.compress import FP32, PowerSGD, Quantize, TopK, wire
from lightning_fl.compress.base import Encoded, Payload
from lightning_fl.federated.server.gate import check_layout


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": torch.randn(8, 3, 3, 3, generator=g),
        "conv.bias": torch.randn(8, generator=g),
        "fc.weight": torch.randn(10, 32, generator=g),
        "scalar": torch.randn((), generator=g),
    }


CODECS = [FP32(), Quantize(8), Quantize(4), Quantize(2), Quantize(16), TopK(0.1), TopK(0.1, scope="tensor")]
CODECS.append(PowerSGD(2))


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_every_codec_round_trips_bit_for_bit(codec):
    reference, trained = state(0), state(1)
    payload = codec.encode(trained, reference, client=3)
    data = wire.dumps(payload)
    back = wire.loads(data)
    assert back.nbytes == payload.nbytes  # the ledger's number does not depend on the transport
    assert len(data) == payload.nbytes + wire.overhead(payload)
    for name, enc in payload.tensors.items():
        got = back.tensors[name]
        assert got.shape == enc.shape and got.dtype == enc.dtype and got.info == enc.info
        assert sorted(got.parts) == sorted(enc.parts)
        for part, t in enc.parts.items():
            assert got.parts[part].dtype == t.dtype and torch.equal(got.parts[part], t)
    a, b = codec.decode(payload, reference, 3), codec.decode(back, reference, 3)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_all_dtypes_and_empty_tensors():
    parts = {str(d).split(".")[-1]: torch.arange(6).to(d).reshape(2, 3) for d in wire.DTYPES.values()}
    parts["empty"] = torch.zeros(0, 4)
    payload = Payload({"t": Encoded(parts, (2, 3), torch.bfloat16, {"k": 1, "s": "x", "f": 0.5, "n": None})})
    back = wire.loads(wire.dumps(payload)).tensors["t"]
    assert back.dtype == torch.bfloat16 and back.info == {"k": 1, "s": "x", "f": 0.5, "n": None}
    for name, t in parts.items():
        assert back.parts[name].dtype == t.dtype and torch.equal(back.parts[name], t)


def forged(header: object, body: bytes = b"", version: int = wire.VERSION, magic: bytes = wire.MAGIC) -> bytes:
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<4sBI", magic, version, len(text)) + text + body


def entry(**changes):
    base = {
        "name": "w",
        "shape": [2],
        "dtype": "float32",
        "info": {},
        "parts": [{"name": "values", "dtype": "float32", "shape": [2]}],
    }
    return {"tensors": [{**base, **changes}]}


GOOD_BODY = torch.tensor([1.0, 2.0]).numpy().tobytes()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "too short"),
        (b"\x80\x04\x95pickle" + b"\0" * 20, "not a lightning_fl payload"),
        (forged(entry(), GOOD_BODY, version=9), "format version 9"),
        (forged(entry(), GOOD_BODY)[:-1], "needs 8 bytes but only 7 remain"),
        (forged(entry(), GOOD_BODY + b"x"), "1 bytes follow the last part"),
        (struct.pack("<4sBI", wire.MAGIC, 1, 10**9) + b"{}", "header length 1000000000"),
        (forged(b"{not json"), "header is not valid JSON"),
        (forged(b'{"tensors": [NaN]}'), "header is not valid JSON"),
        (forged([1, 2]), "expected a JSON object"),
        (forged({"tensors": {}}), "'tensors' must be list"),
        (forged(entry(dtype="object")), "dtype 'object' is not one of"),
        (forged(entry(shape=[-1])), "shape must be at most 8 non-negative integers"),
        (forged(entry(shape=[True])), "shape must be at most 8 non-negative integers"),
        (forged(entry(info={"x": [1]})), "info 'x' must be a number"),
        (forged(entry(name="")), "names must have 1..256 characters"),
        (forged({"tensors": [entry()["tensors"][0]] * 2}, GOOD_BODY * 2), "appears twice"),
        (forged(entry(parts=[{"name": "v", "dtype": "float32", "shape": [10**6, 10**6]}])), "needs"),
        (forged(entry(parts=[{"name": "v", "dtype": "float32", "shape": [10**12, 10**12]}])), "more than 2"),
        (forged(entry(parts=[{"name": "v", "dtype": "int8"}])), "missing 'shape'"),
        # three replies that took a server down before: deep nesting, and empty shapes too large to describe
        (forged(b"[" * 100_000 + b"]" * 100_000), "header nests JSON too deeply"),
        (forged(entry(shape=[0], parts=[{"name": "v", "dtype": "float32", "shape": [10**30, 0]}])), "more than 2"),
        (forged(entry(shape=[2**62, 2**62, 0])), "describes more than 2\\^48 elements"),
    ],
)
def test_malformed_bytes_are_refused_with_a_reason(data, message):
    with pytest.raises(wire.PayloadFormatError, match=message):
        wire.loads(data)


def test_a_valid_forgery_still_meets_the_gate():
    """Well-formed bytes declaring an enormous tensor are stopped before a codec allocates it."""
    payload = wire.loads(forged(entry(shape=[10**12]), GOOD_BODY))
    problems = check_layout(payload, {"w": torch.zeros(2)})
    assert problems == ["w: declares 1000000000000 values; the whole state has 2"]


def test_powersgd_refuses_factors_that_do_not_make_the_tensor():
    codec, reference = PowerSGD(1), {"w": torch.zeros(4, 4)}
    hostile = Payload({"w": Encoded({"p": torch.ones(100000, 1), "q": torch.ones(100000, 1)}, (4, 4))})
    with pytest.raises(ValueError, match="do not make"):
        codec.decode(hostile, reference, 0)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300))
def test_random_bytes_never_raise_anything_but_a_format_error(data):
    with contextlib.suppress(wire.PayloadFormatError):
        wire.loads(data)


@settings(max_examples=300, deadline=None)
@given(position=st.integers(0, 10**6), value=st.integers(0, 255), cut=st.integers(0, 10**6))
def test_corrupted_valid_payloads_parse_or_are_refused(position, value, cut):
    data = bytearray(wire.dumps(Quantize(4).encode(state(1), state(0), 0)))
    data[position % len(data)] = value
    data = data[: len(data) - cut % 8]
    try:
        payload = wire.loads(bytes(data))
    except wire.PayloadFormatError:
        return
    assert isinstance(payload, Payload)
