"""Secure aggregation's arithmetic (lightning_fl.privacy.secure) against Flower's own SecAgg+ code: our seeded
quantisation survives Flower's quantisation unchanged, and the server's dequantisation of the modular sum gives
our exact sum back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fl.errors import ConfigError
from lightning_fl.privacy.secure import SecureSum


def updates(n, size, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g, dtype=torch.float64) * scale for _ in range(n)]


def test_flowers_quantisation_maps_our_grid_values_back_to_our_integers_exactly():
    from flwr.common.secure_aggregation.quantization import quantize

    secure = SecureSum(clipping_range=0.25, quantization_range=2**22)
    for k, x in enumerate(updates(5, 10_000, 0.2)):  # some coordinates beyond c: clipped
        y = secure.quantize(x, torch.Generator().manual_seed(k))
        assert int(y.min()) >= 0 and int(y.max()) <= secure.T and (x.abs() > 0.25).any()
        for state in (0, 1):  # whatever Flower's unseeded rounding draws, it has nothing left to round
            np.random.seed(state)
            (theirs,) = quantize([secure.on_grid(y).numpy()], secure.c, secure.T)
            assert np.array_equal(theirs.astype(np.int64), y.numpy())


def test_the_servers_dequantisation_of_the_modular_sum_gives_our_exact_sum():
    from flwr.common.secure_aggregation.quantization import dequantize

    secure, n = SecureSum(clipping_range=0.5, quantization_range=2**20, modulus_range=2**32), 7
    ys = [secure.quantize(x, torch.Generator().manual_seed(k)) for k, x in enumerate(updates(n, 5_000, 0.3))]
    total = secure.modular_sum(ys)
    ours = secure.recover(total, n)
    torch.testing.assert_close(ours, sum(secure.dequantize(y) for y in ys), rtol=0, atol=1e-12)
    # Flower's server (SecAggPlusWorkflow's unmask stage), each client weighted 1 (its factor T): a mean
    (mean,) = dequantize([total.numpy()], secure.c, secure.T)
    mean = (mean + -(n - 1) * secure.c) * (secure.T / (n * secure.T))
    exact = total - n * (secure.T // 2)
    assert np.array_equal(np.rint(mean * n / secure.step).astype(np.int64), exact.numpy())
    np.testing.assert_allclose(mean * n, ours.numpy(), rtol=0, atol=1e-9)


def test_the_rounding_is_unbiased_seeded_and_clips_to_the_range():
    secure = SecureSum(clipping_range=1.0, quantization_range=2**4)  # a coarse step (1/8): rounding is visible
    x = torch.tensor([0.3, -0.77, 2.0, -5.0, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([secure.dequantize(secure.quantize(x, g)) for _ in range(20_000)])
    torch.testing.assert_close(draws.mean(0), x.clamp(-1, 1), rtol=0, atol=4e-3)
    assert set(torch.unique(draws[:, 0]).tolist()) == {0.25, 0.375}  # the two grid points around 0.3
    assert torch.equal(secure.quantize(x, torch.Generator().manual_seed(3)),
                       secure.quantize(x, torch.Generator().manual_seed(3)))  # fmt: skip


def test_a_sum_that_would_wrap_is_refused_and_settings_must_be_powers_of_two():
    secure = SecureSum(clipping_range=1.0, quantization_range=2**8, modulus_range=2**10)
    assert secure.max_clients == 3
    ys = [torch.full((4,), 200, dtype=torch.int64)] * 4  # 800 > 2^10: wraps
    assert int(secure.modular_sum(ys)[0]) == 800 % 1024
    with pytest.raises(ConfigError, match="4 clients would wrap the sum modulo modulus_range=1024"):
        secure.recover(secure.modular_sum(ys), 4)
    with pytest.raises(ConfigError, match="clipping_range must be a power of two"):
        SecureSum(clipping_range=0.3)
    with pytest.raises(ConfigError, match="modulus_range must be a power of two above quantization_range"):
        SecureSum(quantization_range=2**20, modulus_range=2**20)
