"""Distributed differential privacy: every client adds its share of the central mechanism's noise.

Central DP (:class:`~lightning_fl.privacy.CentralDP`) has the server add ``N(0, (z S)^2)`` to the clipped sum.
Under secure aggregation the server only ever sees the sum, so it cannot add noise after seeing it; instead each
of the ``m`` expected clients clips its update to ``S`` and adds ``N(0, (z S)^2 / m)`` per coordinate before it
uploads. When ``n`` shares reach the sum it carries ``N(0, (z S)^2 n / m)``: the central mechanism's noise exactly
when ``n = m``, less when clients drop out. The server sums the uploads and divides by the fixed ``m`` (as
central DP does), adding nothing.

Accounting: each round is composed with the noise its sum carried from the shares other than the protected
client's own, over the round's sampling event (the same events as central DP). Under ``fixed`` sampling
(replace-one neighbours: the protected client takes part in both worlds, with its share) that is all ``n``
shares, multiplier ``z sqrt(n / m)``: equal to central DP's ``z`` and epsilon when every expected share arrives,
less noise and more epsilon when clients drop out (a dropped client takes its share with it), nothing spent in a
round where no share arrived. Under ``poisson`` sampling (add/remove neighbours) the protected client's share
exists in one world only, so only the other ``n - 1`` count: ``z sqrt((n - 1) / m)``, and ``target_epsilon``
calibrates ``z`` for ``n = m`` with that one share left out (a round with at most one share is accounted as not
private). This is the analysis of the noise in the released sum, as Kairouz, Liu, Steinke (2021), "The
Distributed Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation" (ICML) account it, made
conservative for add/remove neighbours.

This is the continuous-share version (Gaussian shares in floating point), not the discrete Gaussian of Kairouz
et al.: once secure aggregation quantises and wraps the sum modulo a power of two, the continuous analysis holds
only up to the quantisation step and as long as nothing wraps (docs/privacy.md).

Trust: without secure aggregation the server sees every upload, each carrying only ``1 / sqrt(m)`` of the noise:
against the server this protects no more than local DP with ``z / sqrt(m)``; what the server releases is as
private as under central DP. Its purpose is to run under secure aggregation, where the server sees the sum only.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from lightning_fl.errors import ConfigError
from lightning_fl.privacy.accountant import RoundEvent
from lightning_fl.privacy.base import Plan, apply_update, clip, flat_update, layer_slices, noise_generator
from lightning_fl.privacy.central import CentralDP
from lightning_fl.seeding import STREAM_DISTRIBUTED_NOISE


class DistributedDP(CentralDP):
    """User-level DP with the noise drawn by the clients: each clips its update and adds a ``1 / m`` share of the
    central noise's variance; the server sums and divides by ``m``.

    Args:
        clip_norm: ``S``, the L2 bound each client clips its update to (no adaptive clipping: the server sees no
            update to count).
        noise_multiplier: ``z`` of the sum's noise when all ``m`` expected shares arrive. Give this or
            ``target_epsilon``.
        target_epsilon: Calibrate ``z`` (for ``n = m`` shares a round) to spend this over ``trainer.rounds``.
        delta: As :class:`~lightning_fl.privacy.CentralDP`.
        max_epsilon: As :class:`~lightning_fl.privacy.CentralDP`.
        per_layer: As :class:`~lightning_fl.privacy.CentralDP`.
        accountant: As :class:`~lightning_fl.privacy.CentralDP`.
        noise_seed: Seed of each client's share, with the run's seed, the round and the client; ``null``: each
            client's operating system.
    """

    central = True  # the server folds the (already clipped, already noised) updates and divides by m
    client_stage = True  # every client clips and adds its share before encoding

    def __init__(
        self,
        clip_norm: float = 1.0,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float | None = None,
        max_epsilon: float | None = None,
        per_layer: bool = False,
        accountant: Literal["rdp", "pld"] = "rdp",
        noise_seed: int | None = 0,
    ) -> None:
        super().__init__(clip_norm, noise_multiplier, target_epsilon, delta, max_epsilon, per_layer, None,
                         accountant, noise_seed)  # fmt: skip

    def setup(self, plan: Plan) -> None:
        super().setup(plan)
        if self.target_epsilon is not None and self.noise_multiplier is None and self.z > 0:
            # calibrated as central DP's z for the sum; the sum's noise then counts the planned shares only
            self.z *= math.sqrt(plan.expected_clients / self.counted_shares(plan.expected_clients))

    def counted_shares(self, arrived: float) -> float:
        """How many of the ``arrived`` shares protect one client (all of them under replace-one neighbours; all but
        its own under add/remove)."""
        return arrived if self.plan.sampling == "fixed" else max(arrived - 1, 0)

    def sum_multiplier(self, arrived: float) -> float:
        """The noise multiplier (std / S) of a sum of ``arrived`` shares, as the accountant counts it."""
        return self.z * math.sqrt(self.counted_shares(arrived) / self.plan.expected_clients)

    def event(self) -> RoundEvent:
        """A planned round's release (every expected share arrives): for ``max_epsilon``."""
        return RoundEvent(self.sum_multiplier(self.plan.expected_clients))

    # ------------------------------------------------------------------------------------------ the client
    def share_std(self) -> float:
        """The standard deviation of one client's noise share per coordinate: ``z S / sqrt(m)``."""
        return self.z * self.bound / math.sqrt(self.plan.expected_clients)

    def privatize(self, state, global_state, client, round, seed) -> dict[str, torch.Tensor]:
        delta = flat_update(state, global_state)
        sizes = [global_state[n].numel() for n in sorted(global_state)]
        clipped, _, _ = clip(delta, self.bound, layer_slices(sizes) if self.per_layer else None)
        std = self.share_std()
        if std > 0:
            g = noise_generator(self.noise_seed, seed, round, client, STREAM_DISTRIBUTED_NOISE)
            clipped = clipped + torch.randn(delta.shape, generator=g, dtype=torch.float64) * std
        return apply_update(global_state, clipped)

    # ------------------------------------------------------------------------------------------ the server
    def clip(self, delta: torch.Tensor, layers: list[slice] | None) -> tuple[torch.Tensor, float, bool]:
        """Nothing: the client clipped its update before adding its share (clipping the noised update again would
        change the noise), and under secure aggregation the server sees no single update."""
        return delta, float(delta.norm()), True

    def release(self, total: torch.Tensor, unclipped: int, participants: int, round: int) -> tuple[torch.Tensor, dict]:
        """The mean update ``sum / m``: the noise is already in the sum, ``n = participants`` shares of it."""
        m = self.plan.expected_clients
        std = self.z * self.bound * math.sqrt(participants / m)
        return total / m, {"privacy/clip_norm": self.bound, "privacy/noise_std": std / m,
                           "privacy/noise_shares": float(participants)}  # fmt: skip

    def end_round(self, round: int, participants: list[int]) -> dict[str, float]:
        n = len(participants)
        z_sum = self.sum_multiplier(n)
        if n > 0 or self.plan.sampling == "poisson":  # fixed sampling, no share: no client's data was released
            self.accountant.compose(RoundEvent(z_sum))
        spent = self.accountant.epsilon(self.delta) if self.accountant.rounds else 0.0
        return {"privacy/epsilon": spent, "privacy/noise_multiplier": self.z, "privacy/delta": self.delta,
                "privacy/round_noise_multiplier": z_sum}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "distributed": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and not state.get("distributed"):
            raise ConfigError("the checkpoint was written with trainer.privacy CentralDP: resume it with CentralDP")
        super().load_state_dict({k: v for k, v in state.items() if k != "distributed"})

    def __repr__(self) -> str:
        return f"DistributedDP(clip_norm={self.clip_norm}, noise_multiplier={self.z}, delta={self.delta})"
