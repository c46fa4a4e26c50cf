"""What every privacy plug-in shares: the base class the trainer talks to, clipping, and the noise generators.

A privacy plug-in (``trainer.privacy``) acts at two places of a round: on a client, on its update before the
codec encodes it (:class:`~lightning_fl.privacy.LocalDP`), and on the server, where each decoded update is
clipped, the clipped updates are summed and the sum is noised (:class:`~lightning_fl.privacy.CentralDP`). It
owns its accountant and any adaptive state, and returns them from ``state_dict`` for the round checkpoints.

Random draws (noise, DP-SGD's record sampling, secure aggregation's rounding) come from a :class:`Randomness`
(:func:`randomness`). With ``noise_seed`` an integer it is a torch generator seeded by ``(noise_seed, run seed,
round[, client])``: a simulation that can be rerun and resumed exactly, whose noise anyone who knows the seed can
recompute (it then protects nothing). With ``noise_seed: null`` every draw comes from the operating system's
cryptographically secure generator (``os.urandom``), which is what a deployment needs: no seed to learn, no
generator state to reconstruct from its outputs (a Mersenne Twister seeded from the OS, as before, is neither).
Its Gaussians are each the sum of four independent draws, halved, the defence against floating-point attacks on
the noise's low bits that Holohan and Braghin (2021), "Secure Random Sampling in Differential Privacy" (ESORICS),
propose and Opacus' ``secure_mode`` uses; they are not the discretised Gaussian of Canonne, Kamath, Steinke
(2020), which removes floating point altogether.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from lightning_fl.errors import ConfigError
from lightning_fl.seeding import derive_seed


@dataclass(frozen=True)
class Plan:
    """What a privacy plug-in needs to know about the run before its first round.

    Args:
        num_clients: The population ``N``.
        expected_clients: Clients per round ``m`` (``fixed`` sampling) or its expectation ``q N`` (``poisson``).
        sampling: ``fixed`` or ``poisson`` (``trainer.sampling``).
        rounds: Rounds planned (``trainer.rounds``).
        seed: The run's seed.
        strategy: The server strategy.
        max_update_norm_ratio: The gate's relative bound (``None``: off).
    """

    num_clients: int
    expected_clients: float
    sampling: str
    rounds: int
    seed: int
    strategy: Any
    max_update_norm_ratio: float | None = None


class Privacy:
    """Base class of ``trainer.privacy`` plug-ins."""

    _plugin_base = True  # not offered as a choice in CLI messages
    #: The server clips each accepted update and noises their sum (the round folds clipped updates).
    central: ClassVar[bool] = False
    #: Each client transforms its update before encoding it (:meth:`privatize`: local DP, distributed noise).
    client_stage: ClassVar[bool] = False
    #: The accountant counts amplification by sampling, which assumes nobody can tell who was sampled: with
    #: ``noise_seed`` null the round then draws its clients from the operating system's secure generator.
    amplified: ClassVar[bool] = False
    #: Seed of the mechanism's draws (``None``: the operating system's secure generator).
    noise_seed: int | None = None
    #: What the round just accounted released, for the population's ledger (set by the round's privacy stage,
    #: :func:`lightning_fl.privacy.population.user_release`; ``None``: nothing).
    released: dict[str, Any] | None = None

    def setup(self, plan: Plan) -> None:
        """Check the run's other settings and prepare (calibrate noise, build the accountant) before round 1."""
        self.plan = plan
        if (problem := delta_problem("trainer.privacy.delta", getattr(self, "delta", None), plan.num_clients,
                                     "clients")) is not None:  # fmt: skip
            raise ConfigError(problem)
        if plan.strategy.weighted:
            name = type(self).__name__
            raise ConfigError(
                f"trainer.privacy {name} with trainer.strategy.weighted true: weights are client-declared sample "
                "counts, unbounded and outside the guarantee; set trainer.strategy.weighted false"
            )

    def stop_reason(self) -> str | None:
        """Why the next round must not run (a spent budget); ``None``: it may."""
        return None

    def refusal(self, shares: int) -> str | None:
        """Why a round whose sum carries ``shares`` uploads must not be released (the server releases nothing from
        it and charges nobody); ``None`` (default): it is released."""
        return None

    def privatize(self, state: dict[str, torch.Tensor], global_state: dict[str, torch.Tensor], client: int,
                  round: int, seed: int) -> dict[str, torch.Tensor]:  # fmt: skip
        """A client's stage: what it uploads instead of its trained ``state`` (default: ``state`` itself)."""
        return state

    def end_round(self, round: int, participants: list[int]) -> dict[str, float]:
        """Account for round ``round`` (0-based), whose uploads came from ``participants``; metrics to log."""
        return {}

    def guarantee(self, secure_sum: bool = False) -> str:
        """What the logged epsilon protects, for the run's summary: whom the mechanism trusts and the neighbouring
        relation its accountant uses (``secure_sum``: the server sees only each round's sum). ``""``: not said."""
        return ""

    def rounds_accounted(self) -> int | None:
        """How many rounds the accountant has composed (``None``: it keeps no per-round history); a resume checks it
        against the checkpoint's round."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ConfigError(f"{type(self).__name__} keeps no state but the checkpoint has {sorted(state)}")


def neighbours(sampling: str) -> str:
    """The neighbouring relation user-level accounting uses under ``sampling`` (:mod:`~lightning_fl.privacy.accountant`:
    the sampling event fixes it)."""
    if sampling == "poisson":
        return "neighbours: one client's data added or removed (poisson sampling)"
    return "neighbours: one client's data replaced (fixed-size sampling)"


def seeding(noise_seed: int | None, cohorts: bool = False) -> str:
    """How a mechanism's draws (and, ``cohorts``, the round's clients) are made, for a guarantee's line: a seeded
    guarantee holds only while its seeds stay secret."""
    what = "noise and cohorts" if cohorts else "noise"
    if noise_seed is None:
        return f"{what} from the operating system's secure generator"
    seeds = f"noise_seed {noise_seed} and the run's seed" if cohorts else f"noise_seed {noise_seed}"
    return f"{what} seeded by {seeds}: the guarantee assumes the seeds stay secret (noise_seed null for a deployment)"


def check_noise_seed(noise_seed: int | None) -> int | None:
    if noise_seed is not None and (isinstance(noise_seed, bool) or not isinstance(noise_seed, int) or noise_seed < 0):
        raise ConfigError(f"trainer.privacy.noise_seed must be an integer >= 0 or null, got {noise_seed!r}")
    return noise_seed


class Randomness:
    """Where a mechanism's random draws come from (:func:`randomness`): ``randn`` and ``rand`` as torch's functions
    of those names, ``normal(std, shape, dtype, device)`` as ``torch.normal(0, std, ...)``."""

    #: Draws from the operating system's cryptographically secure generator (nothing to seed, nothing to recompute).
    secure: ClassVar[bool] = False
    #: The torch generator behind the draws (``None`` for the secure source).
    generator: torch.Generator | None = None

    def randn(self, shape, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        raise NotImplementedError

    def rand(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def normal(self, std: float, shape, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        raise NotImplementedError


class SeededRandomness(Randomness):
    """A torch generator seeded with ``seed`` (on ``device``): reproducible draws, for simulations."""

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def randn(self, shape, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator, dtype=dtype)

    def rand(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, dtype=dtype)

    def normal(self, std: float, shape, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.normal(0, std, size=tuple(shape), device=device, generator=self.generator, dtype=dtype)


class SystemRandomness(Randomness):
    """The operating system's cryptographically secure generator (``os.urandom``): uniforms from 53 random bits,
    standard Gaussians by the Box-Muller transform in float64, each the sum of four halved (module docstring)."""

    secure = True

    @staticmethod
    def uniform(n: int) -> np.ndarray:
        """``n`` uniforms in (0, 1), float64: the top 53 bits of 64 secure random bits, centred in their cell."""
        bits = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)
        return (bits.astype(np.float64) + 0.5) * 2.0**-53

    @classmethod
    def standard_normal(cls, n: int) -> np.ndarray:
        """``n`` standard Gaussians (float64): Box-Muller on secure uniforms, the sum of four halved."""
        pairs = -(-4 * n // 2)
        u1, u2 = cls.uniform(pairs), cls.uniform(pairs)
        radius = np.sqrt(-2.0 * np.log(u1))
        draws = np.concatenate([radius * np.cos(2.0 * np.pi * u2), radius * np.sin(2.0 * np.pi * u2)])[: 4 * n]
        return draws.reshape(4, n).sum(axis=0) / 2.0

    def randn(self, shape, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (int(shape),)
        return torch.from_numpy(self.standard_normal(math.prod(shape))).reshape(shape).to(dtype)

    def rand(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (int(shape),)
        return torch.from_numpy(self.uniform(math.prod(shape))).reshape(shape).to(dtype)

    def normal(self, std: float, shape, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        return (self.randn(shape) * std).to(dtype=dtype, device=device)


def randomness(noise_seed: int | None, *parts: int, device: torch.device | str = "cpu") -> Randomness:
    """The source of one draw: a generator seeded by ``(noise_seed, *parts)`` (on ``device``), or the operating
    system's secure generator when ``noise_seed`` is ``None``."""
    if noise_seed is None:
        return SystemRandomness()
    return SeededRandomness(derive_seed(noise_seed, *parts) % 2**63, device)


def delta_problem(key: str, delta: float | None, population: int, what: str) -> str | None:
    """Why ``delta`` is too large for ``population`` members (``None``: it is not): with ``delta >= 1 / N`` a
    mechanism may release one member's data in the clear and still be (epsilon, delta)-DP, so a guarantee at that
    delta promises nothing (the usual rule asks for ``delta`` well below ``1 / N``)."""
    if delta is None or delta < 1 / population:
        return None
    return (
        f"{key}={delta:g} is not below 1 / {population:,} ({what}): at that delta a mechanism may publish one of "
        f"them in the clear; set {key} below {1 / population:.3g} (e.g. {min(1e-5, population**-1.1):.3g})"
    )


def positive(key: str, value: float | None, allow_zero: bool = False, allow_none: bool = False) -> list[str]:
    """A one-line problem if ``trainer.privacy.<key>`` is not a finite positive number (or 0 / null, if allowed)."""
    if value is None and allow_none:
        return []
    ok = value is not None and math.isfinite(value) and (value > 0 or (allow_zero and value == 0))
    if ok:
        return []
    want = ">= 0" if allow_zero else "> 0"
    return [f"trainer.privacy.{key} must be a finite number {want}{' or null' if allow_none else ''}, got {value}"]


def flat_update(state: dict[str, torch.Tensor], global_state: dict[str, torch.Tensor]) -> torch.Tensor:
    """A client's update ``state - global_state`` as one float64 CPU vector, tensors in name order."""
    return torch.cat([(state[n].detach().double() - global_state[n].detach().double()).reshape(-1).cpu()
                      for n in sorted(state)])  # fmt: skip


def apply_update(global_state: dict[str, torch.Tensor], update: torch.Tensor) -> dict[str, torch.Tensor]:
    """``global_state`` plus a flat float64 ``update`` (tensors in name order), in each tensor's dtype and device."""
    out, start = {}, 0
    for n in sorted(global_state):
        ref = global_state[n]
        part = update[start : start + ref.numel()].view(ref.shape)
        out[n] = (ref.detach().double().cpu() + part).to(dtype=ref.dtype, device=ref.device)
        start += ref.numel()
    return out


def layer_slices(sizes: list[int]) -> list[slice]:
    """Slices of a flat vector made of tensors of ``sizes`` values, in order."""
    out, start = [], 0
    for n in sizes:
        out.append(slice(start, start + n))
        start += n
    return out


def clip(delta: torch.Tensor, bound: float, layers: list[slice] | None = None) -> tuple[torch.Tensor, float, bool]:
    """``delta`` scaled to L2 norm at most ``bound``: the clipped vector, the norm before, whether it was within.

    With ``layers`` each slice is clipped to ``bound / sqrt(L)`` on its own (``L`` slices), so the whole vector
    still has norm at most ``bound``; "within" then means every slice was. ``delta`` is float64 ``(D,)``.
    """
    norm = float(delta.norm())
    if layers is None:
        factor = min(1.0, bound / norm) if norm > 0 else 1.0
        return (delta * factor if factor < 1.0 else delta), norm, norm <= bound
    each = bound / math.sqrt(len(layers))
    out, within = delta.clone(), True
    for part in layers:
        n = float(delta[part].norm())
        if n > each:
            out[part] *= each / n
            within = False
    return out, norm, within
