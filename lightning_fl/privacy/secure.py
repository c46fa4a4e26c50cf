"""Secure aggregation's arithmetic: the clipping range, quantisation and modular sum of Flower's SecAgg+.

Bell, Bonawitz, Gascon, Lepoint, Raykova (2020), "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead" (CCS), as Flower 1.42 implements it (``flwr.server.workflow.SecAggPlusWorkflow`` with
``flwr.client.mod.secaggplus_mod``): each client maps every coordinate ``x`` of its update into
``[0, T]`` (``T`` the quantisation range) after clipping it to ``[-c, c]`` (``c`` the clipping range, per
coordinate), ``q = stochastic_round((clip(x, -c, c) + c) T / (2c))``, masks ``q`` with pairwise and private masks
modulo ``M`` (the modulus range), and the server, once the masks cancel, holds ``sum_i q_i mod M`` and nothing
else. The sum of the dequantised updates is ``(sum_i q_i - n T / 2) 2c / T`` for ``n`` clients, exact as long as
nothing wraps (``n T < M``).

Flower's own rounding draws from NumPy's global, unseeded generator, so two runs (or a simulation and a
deployment) never round alike. This module rounds with its own generator (the operating system's secure one by
default; with ``rounding_seed`` an integer, one seeded per ``(rounding seed, run seed, round, client)``) and gives
the client the values on Flower's grid (:meth:`SecureSum.on_grid`): with ``c`` and ``T`` powers of two, Flower's
quantisation maps them back to the same integers exactly (its rounding then has nothing to round), so with a
rounding seed an in-process secure sum equals a deployed one bit for bit (``tests/test_secure.py`` checks it
against Flower's ``quantize`` and its server's dequantisation).

The masking and the key agreement are Flower's, never ours; in process, where no party needs hiding from
another, the sum is taken directly (the masks would cancel).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_fl.errors import ConfigError
from lightning_fl.privacy.base import Randomness, check_noise_seed, flat_update, randomness
from lightning_fl.seeding import STREAM_SECURE_ROUNDING


def _power_of_two(value: float) -> bool:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        return False
    mantissa, _ = math.frexp(value)
    return mantissa == 0.5


class SecureSum:
    """SecAgg+'s quantisation and modular sum, with our own rounding (seeded or from the operating system).

    Args:
        clipping_range: ``c``: every coordinate of an update is clipped to ``[-c, c]`` (a power of two, e.g. 0.125).
        quantization_range: ``T``: coordinates are mapped to the integers ``0..T`` (a power of two, at most
            ``2^30``: Flower rounds into int32); the step is ``2c / T``.
        modulus_range: ``M``: the sum is taken modulo this (a power of two above ``T``, at most ``2^62``); at most
            ``(M - 1) // T`` clients can be summed without wrapping.
    """

    def __init__(self, clipping_range: float = 0.125, quantization_range: int = 2**22, modulus_range: int = 2**32):
        problems = []
        if not _power_of_two(clipping_range):
            problems.append(f"clipping_range must be a power of two (e.g. 0.125 or 1.0), got {clipping_range}")
        if not (
            isinstance(quantization_range, int)
            and _power_of_two(quantization_range)
            and 2 <= quantization_range <= 2**30
        ):
            problems.append(f"quantization_range must be a power of two in [2, 2^30], got {quantization_range}")
        if not (
            isinstance(modulus_range, int)
            and _power_of_two(modulus_range)
            and isinstance(quantization_range, int)
            and quantization_range < modulus_range <= 2**62
        ):
            problems.append(
                f"modulus_range must be a power of two above quantization_range, at most 2^62, got {modulus_range}"
            )
        if problems:
            raise ConfigError("trainer.secure_aggregation." + "; trainer.secure_aggregation.".join(problems))
        self.c, self.T, self.M = float(clipping_range), int(quantization_range), int(modulus_range)

    @property
    def step(self) -> float:
        """The quantisation step ``2c / T`` (exact: a power of two)."""
        return 2 * self.c / self.T

    @property
    def max_clients(self) -> int:
        """The most clients whose quantised updates sum without wrapping modulo ``M``."""
        return (self.M - 1) // self.T

    def quantize(self, update: torch.Tensor, generator: torch.Generator | Randomness) -> torch.Tensor:
        """``update`` (float64, any shape) clipped to ``[-c, c]`` and stochastically rounded to integers in
        ``[0, T]`` (int64): ``ceil(v)``, minus one with probability ``ceil(v) - v``, for ``v = (x + c) T / (2c)``;
        unbiased: the expected dequantised value is the clipped coordinate."""
        v = (update.double().clamp(-self.c, self.c) + self.c) * (self.T / (2 * self.c))
        up = torch.ceil(v)
        if isinstance(generator, Randomness):
            draw = generator.rand(v.shape, dtype=torch.float64)
        else:
            draw = torch.rand(v.shape, generator=generator, dtype=torch.float64)
        down = draw < (up - v)
        return (up - down.double()).to(torch.int64)

    def on_grid(self, quantized: torch.Tensor) -> torch.Tensor:
        """The float64 values a client hands Flower's ``secaggplus_mod`` so that its quantisation returns
        ``quantized`` exactly: ``q 2c / T - c``."""
        return quantized.double() * self.step - self.c

    def dequantize(self, quantized: torch.Tensor) -> torch.Tensor:
        """One client's quantised update back in ``[-c, c]`` (float64)."""
        return self.on_grid(quantized)

    def modular_sum(self, quantized: list[torch.Tensor]) -> torch.Tensor:
        """``sum_i q_i mod M`` (int64): what the server holds once the masks cancel."""
        total = torch.zeros_like(quantized[0], dtype=torch.int64)
        for q in quantized:
            total = torch.remainder(total + q, self.M)
        return total

    def range_problem(self, total: torch.Tensor, clients: int) -> str | None:
        """Why ``total`` cannot be the modular sum of ``clients`` uploads in ``[0, T]`` (``None``: it can): an honest
        sum never wraps, so it lies in ``[0, n T]`` (the check Flower's path makes, ``recover_sum``)."""
        if total.numel() and (int(total.min()) < 0 or int(total.max()) > clients * self.T):
            return (
                f"the secure sum lies outside [0, n T] = [0, {clients * self.T}] for its {clients} uploads (a "
                "client masked values outside [0, T]); the server cannot tell whose"
            )
        return None

    def recover(self, total: torch.Tensor, clients: int) -> torch.Tensor:
        """The sum of the ``clients`` dequantised updates from their modular sum (float64, exact)."""
        if clients > self.max_clients:
            raise ConfigError(
                f"trainer.secure_aggregation: {clients} clients would wrap the sum modulo modulus_range={self.M} "
                f"(at most {self.max_clients} with quantization_range={self.T}): raise modulus_range or lower "
                "quantization_range"
            )
        return (total - clients * (self.T // 2)).double() * self.step

    def __repr__(self) -> str:
        return f"SecureSum(clipping_range={self.c}, quantization_range={self.T}, modulus_range={self.M})"


class SecureAggregation(SecureSum):
    """``trainer.secure_aggregation``: the server learns only the sum of the round's updates: Flower's SecAgg+
    between the SuperNodes on Flower (:mod:`lightning_fl.flower.secure`), the same arithmetic in process.

    Every client uploads its update ``Delta = x_k - x`` (after any client stage: DistributedDP's clipping and noise
    share, LocalDP) clipped to ``[-c, c]`` per coordinate and quantised to integers in ``[0, T]`` with seeded
    stochastic rounding, as the int64 vector Flower's SecAgg+ masks (8 bytes per coordinate on the wire). The
    server folds the vectors into one sum modulo ``M`` and reads nothing else of them (their shape and type only,
    as Flower's workflow does); it recovers the exact sum of the dequantised updates and steps from their mean
    (``/ n``, or ``/ m`` under :class:`~lightning_fl.privacy.DistributedDP`). A secure round is sum-only: robust
    strategies, sample weights, per-update gates and server-side clipping (``CentralDP``) need single updates
    and are refused; the aggregate's own checks (finite, step norm) stay.

    Args:
        clipping_range: As :class:`SecureSum` (a power of two).
        quantization_range: As :class:`SecureSum` (a power of two).
        modulus_range: As :class:`SecureSum` (a power of two).
        rounding_seed: ``null`` (default): the stochastic rounding draws from the operating system's secure
            generator, as every noise does under ``noise_seed: null``; an integer seeds it (with the run's seed,
            the round and the client) for a reproducible simulation, a seed then public to whoever reads the run.
        num_shares: On Flower: how many nodes hold shares of each node's secrets (its neighbours on SecAgg+'s
            ring, itself included): an integer above 2, or a fraction of the round's nodes (``1.0``: every node,
            i.e. SecAgg). In process it has no effect.
        reconstruction_threshold: On Flower: how many of a node's share holders must answer to rebuild its
            secrets (an integer below ``num_shares``, or a fraction of it in (0, 1]); the round survives nodes
            that drop after their masked upload as long as every node keeps this many answering neighbours.
        stage_timeout: On Flower: seconds to wait for the replies of each of SecAgg+'s four stages (a node
            that has not answered by then has dropped).
    """

    def __init__(
        self,
        clipping_range: float = 0.125,
        quantization_range: int = 2**22,
        modulus_range: int = 2**32,
        rounding_seed: int | None = None,
        num_shares: int | float = 1.0,
        reconstruction_threshold: int | float = 0.67,
        stage_timeout: float = 120.0,
    ) -> None:
        super().__init__(clipping_range, quantization_range, modulus_range)
        self.rounding_seed = check_noise_seed(rounding_seed)
        problems = []
        number = (int, float)
        if (
            isinstance(num_shares, bool)
            or not isinstance(num_shares, number)
            or not math.isfinite(num_shares)
            or (num_shares <= 2 if isinstance(num_shares, int) else not 0 < num_shares <= 1)
        ):
            problems.append(f"num_shares must be an integer above 2 or a fraction in (0, 1], got {num_shares!r}")
        threshold = reconstruction_threshold
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, number)
            or not math.isfinite(threshold)
            or (threshold < 2 if isinstance(threshold, int) else not 0 < threshold <= 1)
        ):
            problems.append(
                f"reconstruction_threshold must be an integer of at least 2 or a fraction in (0, 1], got {threshold!r}"
            )
        elif isinstance(threshold, int) and isinstance(num_shares, int) and threshold >= num_shares:
            problems.append(f"reconstruction_threshold {threshold} must be below num_shares {num_shares}")
        if (
            isinstance(stage_timeout, bool)
            or not isinstance(stage_timeout, number)
            or not stage_timeout > 0
            or not math.isfinite(stage_timeout)
        ):
            problems.append(f"stage_timeout must be a number of seconds above 0, got {stage_timeout!r}")
        if problems:
            raise ConfigError("trainer.secure_aggregation." + "; trainer.secure_aggregation.".join(problems))
        self.num_shares, self.reconstruction_threshold = num_shares, threshold
        self.stage_timeout = float(stage_timeout)

    def problems(
        self, strategy: Any, privacy: Any, codec: Any, max_update_norm_ratio: float | None, attack: Any
    ) -> list[str]:
        """What in the run's settings needs single updates, which a secure round never shows the server."""
        from lightning_fl.compress.base import FP32

        out = []
        if not strategy.streams:
            out.append(
                f"trainer.strategy {strategy.name} needs single updates; use FedAvg, FedAvgM, FedAdam, FedYogi "
                "or FedAdagrad"
            )
        if strategy.weighted:
            out.append("set trainer.strategy.weighted false (client-declared weights cannot be checked in a sum)")
        if privacy is not None and privacy.central and not privacy.client_stage:
            out.append(
                f"trainer.privacy {type(privacy).__name__} clips each update on the server; use DistributedDP "
                "(each client clips and adds its noise share)"
            )
        if max_update_norm_ratio is not None:
            out.append("set trainer.max_update_norm_ratio null (it compares single updates)")
        if attack is not None:
            out.append(
                f"trainer.attack {type(attack).__name__} is simulated on single uploads at the server, which "
                "a secure round never shows it; remove trainer.attack"
            )
        if not isinstance(codec, FP32):
            out.append(
                f"trainer.codec {type(codec).__name__}: a secure upload is the quantised update itself; use FP32"
            )
        return [f"trainer.secure_aggregation: {p}" for p in out]

    # ------------------------------------------------------------------------------------------ the client
    def encode(self, state: dict, global_state: dict, client: int, round: int, seed: int) -> Any:
        """The client's secure upload: its update, clipped per coordinate and quantised (int64 ``(D,)``)."""
        from lightning_fl.compress.base import Encoded, Payload

        delta = flat_update(state, global_state)
        g = randomness(self.rounding_seed, seed, round, client, STREAM_SECURE_ROUNDING)
        return Payload({"secure": Encoded({"q": self.quantize(delta, g)}, (len(delta),), torch.int64)})

    # ------------------------------------------------------------------------------------------ the server
    def read(self, payload: Any, size: int) -> tuple[torch.Tensor | None, str | None]:
        """A secure upload's vector, or why it is malformed (only its structure is checked: the values are masked)."""
        try:
            ((name, encoded),) = payload.tensors.items()
            ((part, q),) = encoded.parts.items()
        except (AttributeError, ValueError):
            return None, "malformed secure upload: expected one vector"
        if (
            (name, part) != ("secure", "q")
            or not isinstance(q, torch.Tensor)
            or q.dtype != torch.int64
            or tuple(q.shape) != (size,)
        ):
            return None, f"malformed secure upload: expected an int64 vector of {size} values"
        return torch.remainder(q, self.M), None

    def __repr__(self) -> str:
        return f"SecureAggregation(clipping_range={self.c}, quantization_range={self.T}, modulus_range={self.M})"
