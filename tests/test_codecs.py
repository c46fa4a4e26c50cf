import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lightning_fl.compress import FP32, Quantize, pack_bits, unpack_bits
from lightning_fl.errors import ConfigError

values = arrays(np.float32, st.integers(1, 300), elements=st.floats(-1e4, 1e4, width=32))


@settings(max_examples=200, deadline=None)
@given(x=values, bits=st.sampled_from([2, 4, 8, 16]))
def test_quantize_round_trip_error_is_at_most_half_a_step_and_bytes_are_exact(x, bits):
    tensor = torch.from_numpy(x)
    codec = Quantize(bits)
    encoded = codec.encode_tensor(tensor)
    decoded = codec.decode_tensor(encoded)
    scale = float(encoded.parts["params"][0])
    assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype
    err = (decoded.double() - tensor.double()).abs().max().item()
    # half a step, plus the float32 rounding of the decoded value
    assert err <= scale / 2 + 4 * np.finfo(np.float32).eps * max(1.0, float(np.abs(x).max()))
    assert encoded.nbytes == math.ceil(tensor.numel() * bits / 8) + 8


@settings(max_examples=100, deadline=None)
@given(bits=st.sampled_from([2, 4, 8, 16]), n=st.integers(1, 50), data=st.data())
def test_pack_unpack_round_trip(bits, n, data):
    q = torch.tensor(data.draw(st.lists(st.integers(0, 2**bits - 1), min_size=n, max_size=n)), dtype=torch.int64)
    packed = pack_bits(q, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, n), q)


def test_int4_packs_two_values_per_byte_low_nibble_first():
    assert pack_bits(torch.tensor([1, 2, 15]), 4).tolist() == [0x21, 0x0F]


def test_flite_latent_sizes():
    z = torch.randn(1280)
    assert FP32().encode_tensor(z).nbytes == 5120
    assert Quantize(8).encode_tensor(z).nbytes == 1288
    assert Quantize(4).encode_tensor(z).nbytes == 648
    assert torch.equal(FP32().decode_tensor(FP32().encode_tensor(z)), z)


def test_constant_tensor_and_bad_input():
    codec = Quantize(4)
    x = torch.full((10,), 3.25)
    assert torch.equal(codec.decode_tensor(codec.encode_tensor(x)), x)
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode_tensor(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ConfigError, match=r"codec.bits must be one of \(2, 4, 8, 16\)"):
        Quantize(3)


def test_non_finite_names_every_bad_tensor_and_never_flags_finite_values():
    from lightning_fl.compress.base import non_finite

    big = torch.full((4,), 3e38)  # finite, but their sum overflows to inf: the exact count must clear them
    assert non_finite({"a": big, "b": -big[:1]}) == {}
    assert non_finite({"h": torch.full((3,), 60000.0, dtype=torch.float16)}) == {}
    plus, minus = torch.tensor([1.0, math.inf]), torch.tensor([-math.inf, 2.0, 3.0])  # inf - inf: a NaN sum
    assert non_finite({"p": plus, "m": minus, "ok": torch.ones(5)}) == {"m": 1, "p": 1}
    nan = torch.zeros(2, 3, dtype=torch.float64)
    nan[1, 2] = math.nan
    assert non_finite({"n": nan, "i": torch.tensor([1, 2]), "e": torch.zeros(0)}) == {"n": 1}
    assert non_finite({"a": torch.ones(3), "b": torch.tensor([0.0, -math.inf])}) == {"b": 1}
    # large tensors are summed where they lie, small ones together: a bad value is found in either
    from lightning_fl.compress.base import SUM_IN_PLACE

    large, small = torch.ones(SUM_IN_PLACE), torch.ones(7)
    assert non_finite({"l": large, "l16": large.half() * 60000, "s": small, "t": small}) == {}
    for bad in ("l", "s"):
        state = {"l": large.clone(), "m": large.clone(), "s": small.clone(), "t": small.clone()}
        state[bad][3] = math.nan
        assert non_finite(state) == {bad: 1}


def test_update_quantisation_codes_the_difference_from_the_broadcast_state():
    torch.manual_seed(0)
    reference = {"w": torch.randn(40, 30), "b": torch.randn(30)}
    state = {n: t + 1e-3 * torch.randn_like(t) for n, t in reference.items()}  # a small local update
    for bits in (8, 4):
        weights, update = Quantize(bits), Quantize(bits, target="update")
        payload = update.encode(state, reference, 0)
        assert payload.nbytes == weights.encode(state, reference, 0).nbytes  # the same bytes
        assert update.check_payload(payload, reference) == []  # the layout the gate checks is unchanged
        decoded = update.decode(payload, reference, 0)
        for n, t in state.items():
            delta = (t.double() - reference[n].double()).reshape(-1)
            step = (delta.max() - delta.min()).item() / (2**bits - 1)
            err = (decoded[n].double() - t.double()).abs().max().item()
            assert decoded[n].dtype == t.dtype and decoded[n].shape == t.shape
            assert err <= step / 2 + 4 * float(torch.finfo(torch.float32).eps) * t.abs().max().item()
            # quantising the weights themselves is far coarser for a small update
            weight_err = (weights.decode(weights.encode(state, reference, 0), reference, 0)[n] - t).abs().max()
            assert err < weight_err.item() / 50
    unchanged = {n: t.clone() for n, t in reference.items()}
    zero = Quantize(4, target="update")
    assert all(
        torch.equal(v, reference[n]) for n, v in zero.decode(zero.encode(unchanged, reference, 0), reference, 0).items()
    )
    assert (
        repr(Quantize(4, target="update")) == "Quantize(bits=4, target='update')"
        and repr(Quantize(4)) == "Quantize(bits=4)"
    )
    with pytest.raises(ConfigError, match=r"codec.target must be 'weights' or 'update', got 'delta'"):
        Quantize(4, target="delta")
