"""Malformed uploads, generated: every codec's server side refuses them with a typed error and changes nothing.

For each codec, Hypothesis builds payloads that are not what the codec's ``encode`` makes: random and damaged
wire bytes (parsed by :func:`lightning_fl.compress.wire.loads`), forged wire headers, and in-process payloads
with junk in every slot. Each goes through :func:`lightning_fl.federated.server.gate.screen_upload`, what the server
runs on every reply; it must end in a :class:`~lightning_fl.compress.wire.PayloadFormatError` or a non-empty
problem list found before decoding, and neither the global state nor the codec's per-client memory may change.
"""

import copy
import json
import os
import struct
import types
import warnings

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from helpers import round_runner
from lightning_fl.compress import FP32, Codec, PayloadDecodeError, PowerSGD, Quantize, TopK, wire
from lightning_fl.compress.base import Encoded, Payload, non_finite_parts
from lightning_fl.federated.clients.transport import Reply, Transport
from lightning_fl.federated.server.gate import UploadRejectedError, check_layout, decode_upload, screen_upload

CODECS = {
    "fp32": FP32,
    "int8": lambda: Quantize(8),
    "int4": lambda: Quantize(4),
    "int2": lambda: Quantize(2),
    "int16": lambda: Quantize(16),
    "topk": lambda: TopK(0.2),
    "topk-tensor": lambda: TopK(0.2, scope="tensor"),
    "topk-no-ef": lambda: TopK(0.2, error_feedback=False),
    "powersgd": lambda: PowerSGD(2),
    "powersgd-no-ef-cold": lambda: PowerSGD(2, error_feedback=False, warm_start=False),
}
CLIENT = 1


def make_state(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A small federated state: a conv and a linear weight (matrices for PowerSGD), a bias, a scalar, a counter."""
    g = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": scale * torch.randn(4, 2, 3, 3, generator=g),
        "fc.weight": scale * torch.randn(5, 6, generator=g),
        "fc.bias": scale * torch.randn(5, generator=g),
        "scale": scale * torch.randn((), generator=g),
        "steps": torch.randint(0, 100, (), generator=g),
    }


_SETUPS: dict[str, tuple] = {}


def setup(name: str):
    """The codec (with per-client memory after two rounds), the reference state and one honest upload."""
    if name not in _SETUPS:
        codec, reference = CODECS[name](), make_state(0)
        for r in (1, 2):
            trained = {n: t + 0.1 * r if t.is_floating_point() else t for n, t in reference.items()}
            trained["fc.weight"] = trained["fc.weight"] + torch.randn(5, 6, generator=torch.Generator().manual_seed(r))
            honest = codec.encode(trained, reference, CLIENT)
        _SETUPS[name] = (codec, reference, honest, wire.dumps(honest))
    return _SETUPS[name]


def clone_payload(payload: Payload) -> Payload:
    return Payload(
        {
            n: Encoded({p: t.clone() for p, t in e.parts.items()}, tuple(e.shape), e.dtype, dict(e.info))
            for n, e in payload.tensors.items()
        }
    )


def snapshot(obj):
    """A deep copy of tensors in nested dicts, to compare bit for bit later."""
    return copy.deepcopy(obj)


def bitwise_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    return a == b


# ------------------------------------------------------------------------------------------ junk and mutations
_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 2**40), st.floats(), st.text(max_size=6), st.binary(max_size=6)
)
JUNK = st.one_of(
    _leaf,
    st.lists(st.floats(-2, 2), max_size=5),
    st.tuples(st.integers(-2, 5), st.integers(-2, 5)),
    st.recursive(_leaf, lambda inner: st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6),
    st.just(np.zeros(3, np.float32)),
    st.just(object()),
)
OTHER_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


OBJECT_KINDS = (
    "payload",
    "tensors",
    "entry",
    "parts",
    "part-junk",
    "part-changed",
    "part-non-finite",
    "shape",
    "dtype",
    "info",
    "missing-tensor",
    "extra-tensor",
    "renamed-tensor",
    "missing-part",
    "extra-part",
    "renamed-part",
    "key-type",
)
HEADER_OPS = (
    "rename-tensor",
    "drop-tensor",
    "duplicate-tensor",
    "extra-tensor",
    "tensor-shape",
    "tensor-dtype",
    "info",
    "rename-part",
    "drop-part",
    "extra-part",
    "part-dtype",
    "part-shape",
    "not-an-object",
)


def junk_for_tensor(draw, t: torch.Tensor):
    """Something in a tensor's slot that is not a tensor: the tensor's values as a list, or any junk."""
    return draw(st.one_of(JUNK, st.just(t.tolist()), st.just(t.numpy()), st.just({"values": t}), st.just([t])))


def other_shape(draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape different from ``shape`` (sometimes with the same number of values)."""
    candidates = [(*shape, 1), (1, *shape), (sum(shape) + 1,), ()]
    if shape:
        candidates += [shape[:-1], (*shape[:-1], shape[-1] + 1), tuple(reversed(shape)), (shape[0] * 2, *shape[1:])]
    return draw(st.sampled_from([c for c in candidates if tuple(c) != tuple(shape)]))


def changed_part(draw, t: torch.Tensor) -> torch.Tensor:
    """The part with another dtype, shape, device or layout (so never the same tensor)."""
    how = draw(st.sampled_from(["dtype", "shape", "meta", "sparse"]))
    if how == "dtype":
        return t.to(draw(st.sampled_from([d for d in OTHER_DTYPES if d != t.dtype])))
    if how == "meta":
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    if how == "sparse" and t.ndim >= 1 and t.dtype != torch.bool:
        return t.to_sparse()
    shape = other_shape(draw, tuple(t.shape))
    n = int(np.prod(shape))
    flat = t.reshape(-1)
    return torch.cat([flat, flat.new_zeros(max(0, n - flat.numel()))])[:n].reshape(shape)


def mutate_object(draw, payload: Payload):
    """An in-process payload (or something in its place) with one slot broken; returns (kind, candidate)."""
    names = sorted(payload.tensors)
    name = draw(st.sampled_from(names))
    enc = payload.tensors[name]
    part = draw(st.sampled_from(sorted(enc.parts)))
    kind = draw(st.sampled_from(OBJECT_KINDS))
    if kind == "payload":
        return kind, draw(st.one_of(JUNK, st.just(payload.tensors), st.just(wire.dumps(payload)), st.just(enc)))
    if kind == "tensors":
        payload.tensors = draw(st.one_of(JUNK, st.just(list(payload.tensors.values()))))
    elif kind == "entry":
        payload.tensors[name] = draw(st.one_of(JUNK, st.just(enc.parts), st.just(enc.parts[part])))
    elif kind == "parts":
        enc.parts = draw(st.one_of(JUNK, st.just(list(enc.parts.values())), st.just(enc.parts[part])))
    elif kind == "part-junk":
        enc.parts[part] = junk_for_tensor(draw, enc.parts[part])
    elif kind == "part-changed":
        enc.parts[part] = changed_part(draw, enc.parts[part])
    elif kind == "part-non-finite":  # every codec sends some floats; none sends a NaN or an Inf
        name, part = draw(
            st.sampled_from(
                [
                    (n, p)
                    for n in names
                    for p, t in payload.tensors[n].parts.items()
                    if t.is_floating_point() and t.numel()
                ]
            )
        )
        t = payload.tensors[name].parts[part].reshape(-1)
        t[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    elif kind == "shape":
        enc.shape = draw(
            st.one_of(
                _leaf,
                st.lists(st.floats(-2, 2), min_size=1, max_size=3),
                st.tuples(st.integers(0, 3), st.text(max_size=2)),
                st.just({"shape": list(enc.shape)}),
                st.just(np.array(enc.shape)),
                st.just(torch.tensor(enc.shape)),
                st.just(tuple(-d - 1 for d in enc.shape) or (-1,)),
                st.just((*enc.shape, True)),
                st.just(tuple(float(d) for d in enc.shape) or (1.0,)),
                st.just(other_shape(draw, tuple(enc.shape))),
                st.just(torch.Size(other_shape(draw, tuple(enc.shape)))),
            )
        )
    elif kind == "dtype":
        other = st.sampled_from([d for d in OTHER_DTYPES if d != enc.dtype])
        enc.dtype = draw(st.one_of(JUNK, st.just(str(enc.dtype)), other))
    elif kind == "info":
        info = dict(enc.info)
        key = draw(st.sampled_from(sorted(info) or ["extra"]))
        value = info.get(key)
        changed = draw(
            st.one_of(
                st.just(None if value is not None else 0),
                st.just(bool(value) if isinstance(value, int) else True),
                st.just(float(value) if isinstance(value, int) else 0.5),
                st.just(value + 1 if isinstance(value, int) else "x"),
                st.just(str(value)),
            )
        )
        how = draw(st.sampled_from(["change", "extra", "drop", "junk"]))
        if how == "junk":
            enc.info = draw(st.one_of(st.none(), st.lists(st.integers(), max_size=2), st.just({1: 2}), st.just(info)))
            if enc.info == info:
                enc.info = {**info, 7: 1}
        elif how == "drop" and info:
            del info[key]
            enc.info = info
        elif how == "extra" or not info:
            enc.info = {**info, draw(st.text(min_size=1, max_size=4).filter(lambda k: k not in info)): 1}
        else:
            info[key] = changed
            enc.info = info
    elif kind == "missing-tensor":
        del payload.tensors[name]
    elif kind == "extra-tensor":
        extra = draw(st.text(min_size=1, max_size=8).filter(lambda n: n not in payload.tensors))
        payload.tensors[extra] = draw(st.one_of(st.just(clone_payload(payload).tensors[name]), JUNK))
    elif kind == "renamed-tensor":
        payload.tensors[name + draw(st.sampled_from(["_", ".x", " "]))] = payload.tensors.pop(name)
    elif kind == "missing-part":
        del enc.parts[part]
    elif kind == "extra-part":
        extra = draw(st.text(min_size=1, max_size=8).filter(lambda p: p not in enc.parts))
        enc.parts[extra] = draw(st.one_of(st.just(torch.zeros(0)), st.just(enc.parts[part].clone()), JUNK))
    elif kind == "renamed-part":
        enc.parts[part.upper() if part != part.upper() else part + "_"] = enc.parts.pop(part)
    else:  # key-type
        if draw(st.booleans()):
            payload.tensors[draw(st.sampled_from([0, None, b"w", 1.5]))] = payload.tensors.pop(name)
        else:
            enc.parts[draw(st.sampled_from([0, None, b"p", 1.5]))] = enc.parts.pop(part)
    return kind, payload


def forge_header(draw, data: bytes):
    """The honest bytes with their JSON header changed in one way (and the body kept); returns (kind, bytes)."""
    length = struct.unpack_from("<I", data, 5)[0]
    header, body = json.loads(data[9 : 9 + length]), data[9 + length :]
    entries = header["tensors"]
    i = draw(st.integers(0, len(entries) - 1))
    entry = entries[i]
    spec = entry["parts"][draw(st.integers(0, len(entry["parts"]) - 1))]
    empty_part = {"name": "extra", "dtype": "float32", "shape": [0]}
    op = draw(st.sampled_from(HEADER_OPS))
    if op == "rename-tensor":
        entry["name"] += "_"
    elif op == "drop-tensor":
        del entries[i]
    elif op == "duplicate-tensor":
        entries.append(copy.deepcopy(entry))
    elif op == "extra-tensor":
        entries.append({"name": "extra~", "shape": [0], "dtype": "float32", "info": {}, "parts": [empty_part]})
    elif op == "tensor-shape":
        entry["shape"] = list(other_shape(draw, tuple(entry["shape"])))
    elif op == "tensor-dtype":
        entry["dtype"] = draw(st.sampled_from([d for d in wire.DTYPES if d != entry["dtype"]]))
    elif op == "info":
        info = entry["info"]
        if info and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(info)))
            info[key] = draw(st.sampled_from([info[key] + 1, float(info[key]), True, str(info[key]), None]))
        else:
            info["extra"] = draw(st.sampled_from([0, "x", None, 1.5]))
    elif op == "rename-part":
        spec["name"] += "_"
    elif op == "drop-part":
        entry["parts"].remove(spec)
    elif op == "extra-part":
        entry["parts"].append(empty_part)
    elif op == "part-dtype":
        spec["dtype"] = draw(st.sampled_from([d for d in wire.DTYPES if d != spec["dtype"]]))
    elif op == "part-shape":
        spec["shape"] = list(other_shape(draw, tuple(spec["shape"])))
    else:
        entries[i] = draw(st.sampled_from([[entry], "entry", None, 3]))
    text = json.dumps(header).encode()
    return f"header-{op}", struct.pack("<4sBI", wire.MAGIC, wire.VERSION, len(text)) + text + body


@st.composite
def malformed(draw, name: str):
    """(kind, candidate, must_reject, over_the_wire): bytes for the wire parser, or an in-process payload (or
    whatever stands in its place)."""
    _, _, honest, data = setup(name)
    # in-process payloads are about half of the cases, forged headers a fifth, damaged bytes the rest
    family = draw(
        st.sampled_from(
            ["random-bytes", "truncated", "header-flip", "body-flip", "trailing"] + ["forged"] * 3 + ["object"] * 7
        )
    )
    if family == "random-bytes":
        prefix = draw(st.sampled_from([b"", wire.MAGIC, struct.pack("<4sB", wire.MAGIC, wire.VERSION)]))
        return family, prefix + draw(st.binary(max_size=200)), True, True
    if family == "truncated":
        return family, data[: draw(st.integers(0, len(data) - 1))], True, True
    if family == "trailing":
        return family, data + draw(st.binary(min_size=1, max_size=16)), True, True
    head = 9 + struct.unpack_from("<I", data, 5)[0]
    if family in ("header-flip", "body-flip"):
        lo, hi = (0, head - 1) if family == "header-flip" else (head, len(data) - 1)
        position, bit = draw(st.integers(lo, hi)), draw(st.integers(0, 7))
        flipped = bytearray(data)
        flipped[position] ^= 1 << bit
        # a flipped header is never a valid upload; a flipped value in the body may well be one
        return family, bytes(flipped), family == "header-flip", True
    if family == "forged":
        kind, forged = forge_header(draw, data)
        return kind, forged, True, True
    kind, candidate = mutate_object(draw, clone_payload(honest))
    return f"object-{kind}", candidate, True, False


# ------------------------------------------------------------------------------------------------- the tests
FUZZ_EXAMPLES = int(os.environ.get("LIGHTNING_FL_FUZZ_EXAMPLES", "200"))  # per codec; raise it for a longer fuzz


@pytest.mark.parametrize("name", sorted(CODECS))
@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data())
def test_malformed_uploads_are_refused_and_change_nothing(name, data):
    codec, reference, _, _ = setup(name)
    kind, candidate, must_reject, over_the_wire = data.draw(malformed(name), label="case")
    event(kind)
    reference_before, memory_before = snapshot(reference), snapshot(codec.state_dict())
    if over_the_wire:
        try:
            candidate, refusal = wire.loads(candidate), None
        except wire.PayloadFormatError as err:
            refusal = str(err)
        if refusal is not None:
            assert refusal and "\n" not in refusal  # one line saying what is wrong
            event("refused by the wire parser")
            return
    decoded, problems = screen_upload(candidate, codec, reference, CLIENT)
    assert isinstance(problems, list) and all(isinstance(p, str) and p for p in problems)
    # the structure checks are complete: nothing malformed gets as far as failing inside a codec
    assert not any(p.startswith(("could not be decoded", "structure could not be checked")) for p in problems)
    if must_reject:
        assert problems and decoded is None, f"{kind} was accepted"
        # found before decoding: by the codec-independent layout check, the codec's own structure check or the
        # float parts' finiteness
        assert (
            check_layout(candidate, reference)
            or codec.check_payload(candidate, reference)
            or non_finite_parts(candidate)
        )
    event("refused by the gate" if problems else "accepted (values changed, structure intact)")
    if not problems:
        assert all(torch.isfinite(decoded[n]).all() and decoded[n].shape == reference[n].shape for n in reference)
    assert bitwise_equal(reference, reference_before)
    assert bitwise_equal(codec.state_dict(), memory_before)


@pytest.mark.parametrize("name", sorted(CODECS))
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 1e3]), rounds=st.integers(1, 3))
def test_honest_uploads_pass_in_process_and_over_the_wire(name, seed, scale, rounds):
    codec, reference = CODECS[name](), make_state(seed, scale)
    for r in range(rounds):
        trained = make_state(seed + 1 + r, scale)
        payload = codec.encode(trained, reference, CLIENT)
        assert codec.check_payload(payload, reference) == []
        expected = codec.decode(payload, reference, CLIENT)
        for candidate in (payload, wire.loads(wire.dumps(payload))):
            decoded, problems = screen_upload(candidate, codec, reference, CLIENT)
            assert problems == []
            assert all(bitwise_equal(decoded[n], expected[n]) for n in reference)


def test_decode_failures_are_typed_and_a_codec_without_a_layout_still_checks_containers():
    class Sign(Codec):  # states no layout: only the containers are checked before decoding
        def encode_tensor(self, tensor):
            return Encoded({"sign": (tensor >= 0).reshape(-1)}, tuple(tensor.shape), tensor.dtype)

        def decode_tensor(self, encoded):
            return encoded.parts["sign"].to(encoded.dtype).mul(2).sub(1).reshape(encoded.shape)

    codec, reference = Sign(), {"w": torch.zeros(2, 3)}
    payload = codec.encode(reference, reference, 0)
    assert screen_upload(payload, codec, reference, 0)[1] == []
    payload.tensors["w"].parts["sign"] = torch.ones(5, dtype=torch.bool)  # cannot be shaped (2, 3)
    with pytest.raises(PayloadDecodeError, match="could not be decoded"):
        decode_upload(payload, codec, reference, 0)
    assert screen_upload(payload, codec, reference, 0)[1][0].startswith("could not be decoded (RuntimeError")
    payload.tensors["w"].parts["sign"] = [True] * 6
    assert screen_upload(payload, codec, reference, 0)[1] == ["w.sign: expected a tensor, got list"]


# ------------------------------------------------------------------------------ a whole round on the server
class Scripted(Transport):
    """Replies with a fixed payload per client (the honest encode where none is given)."""

    def __init__(self, payloads: dict[int, object]) -> None:
        self.payloads = payloads

    def replies(self, job, clients):
        state, codec = job.state, job.codec
        for cid in clients:
            trained = {n: t + cid + 1 for n, t in state.items()}
            payload = self.payloads.get(cid, codec.encode(trained, state, cid))
            yield Reply(cid, 10, payload)


def run_round(codec, payloads, policy="drop"):
    fabric = types.SimpleNamespace(global_rank=0, world_size=1, is_global_zero=True)
    transport = Scripted(payloads)
    runner = round_runner(fabric, transport, codec, upload_policy=policy)
    state = {"w": torch.randn(3, 4, generator=torch.Generator().manual_seed(0)), "b": torch.zeros(4)}
    before = snapshot(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new_state, metrics = runner.run(None, types.SimpleNamespace(num_clients=3), state, 0, 0, 3)
    assert bitwise_equal(state, before)  # the round never writes into the global state it was given
    return before, new_state, metrics, [str(w.message) for w in caught]


@pytest.mark.parametrize("codec", [FP32(), Quantize(4), TopK(0.5), PowerSGD(1)], ids=repr)
def test_a_round_drops_non_tensor_uploads_instead_of_crashing(codec):
    honest = codec.encode({"w": torch.ones(3, 4), "b": torch.ones(4)}, {"w": torch.zeros(3, 4), "b": torch.zeros(4)}, 0)
    as_list = clone_payload(honest)
    enc = next(iter(as_list.tensors.values()))
    part = sorted(enc.parts)[0]
    enc.parts[part] = enc.parts[part].tolist()  # what once crashed the server
    none_part = clone_payload(honest)
    next(iter(none_part.tensors.values())).parts[part] = None
    _, _, metrics, messages = run_round(codec, {1: as_list, 2: none_part})
    assert metrics["fed/dropped_clients"] == 2 and metrics["fed/round_skipped"] == 0
    assert len(messages) == 2 and "client 1: upload rejected: " in messages[0] and "client 2: " in messages[1]
    assert "expected a tensor, got list" in messages[0] and "expected a tensor, got NoneType" in messages[1]
    before, after, metrics, _ = run_round(codec, {0: as_list, 1: None, 2: {"w": [1.0]}})
    assert metrics["fed/round_skipped"] == 1 and bitwise_equal(after, before)  # nothing accepted: state kept
    with pytest.raises(UploadRejectedError, match="client 1: upload rejected: .*expected a tensor, got list"):
        run_round(codec, {1: as_list}, policy="raise")


@pytest.mark.parametrize("codec", [FP32(), Quantize(8), TopK(1.0), PowerSGD(1)], ids=repr)
def test_a_nan_meant_for_an_integer_tensor_is_refused_before_a_cast_hides_it(codec):
    reference = {"steps": torch.tensor(3), "w": torch.zeros(2, 2)}
    payload = codec.encode({"steps": torch.tensor(4), "w": torch.ones(2, 2)}, reference, 0)
    part = next(t for e in payload.tensors.values() for t in e.parts.values() if t.is_floating_point())
    part.view(-1)[0] = float("nan")
    decoded, problems = screen_upload(payload, codec, reference, 0)
    assert decoded is None and any("non-finite values" in p for p in problems)


@pytest.mark.parametrize(("codec", "summed"), [(FP32(), 110), (Quantize(8), 2 * 2 + 110)], ids=repr)
def test_the_server_sums_each_value_of_an_upload_once_for_finiteness(codec, summed, monkeypatch):
    """FP32's decoded tensors are views of its parts: checked before decoding, not summed again after; 8-bit
    uploads have their float parameters (2 per tensor) checked before decoding and the decoded floats after."""
    import lightning_fl.compress.base as base
    import lightning_fl.federated.server.gate as gate

    seen = []

    def counting(tensors):
        seen.append(sum(t.numel() for t in tensors.values() if t.is_floating_point()))
        return base.non_finite.__wrapped__(tensors)

    counting.__wrapped__ = base.non_finite
    monkeypatch.setattr(base, "non_finite", counting)
    monkeypatch.setattr(gate, "non_finite", counting)
    reference = {"w": torch.zeros(10, 10), "b": torch.zeros(10)}
    payload = codec.encode({"w": torch.ones(10, 10), "b": torch.ones(10)}, reference, 0)
    decoded, problems = screen_upload(payload, codec, reference, 0)
    assert problems == [] and decoded is not None
    assert sum(seen) == summed


class _DecodesInPlace(FP32):
    """A codec whose decoding changes its parts in place (here into infinities) and returns views of them."""

    def decode_tensor(self, encoded: Encoded) -> torch.Tensor:
        return encoded.parts["values"].mul_(float("inf")).reshape(encoded.shape)


def test_a_part_changed_by_decoding_is_checked_again():
    reference = {"w": torch.zeros(4)}
    codec = _DecodesInPlace()
    decoded, problems = screen_upload(codec.encode({"w": torch.ones(4)}, reference, 0), codec, reference, 0)
    assert decoded is None and problems == ["w: 4 non-finite values"]


@pytest.mark.parametrize(("key", "value"), [("numel", 6.0), ("numel", "6"), ("bits", 8.0), ("bits", None)])
def test_quantize_info_must_match_in_type_too(key, value):
    """``6.0 == 6`` in Python, but a float count would fail inside the decoder: info is compared with its types."""
    codec, reference = Quantize(8), {"w": torch.zeros(2, 3)}
    payload = codec.encode({"w": torch.ones(2, 3)}, reference, 0)
    payload.tensors["w"].info[key] = value
    for candidate in (payload, wire.loads(wire.dumps(payload))):
        decoded, problems = screen_upload(candidate, codec, reference, 0)
        assert decoded is None and problems == ["w: info is not {'bits': 8, 'numel': 6}"]
