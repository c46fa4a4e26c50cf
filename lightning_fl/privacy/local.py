"""Local differential privacy: each client clips and noises its own update before it leaves the client.

Trust model: the server is not trusted. Every upload is already a Gaussian mechanism's output, so whatever the
server (or anyone on the wire) does with it is post-processing. The price is noise on every client's update
instead of once on their sum: at the same epsilon the aggregate carries about ``sqrt(m)`` times the noise of
central DP with ``m`` clients per round (the contrast Flower's ``LocalDpMod`` offers against its server-side
wrappers).

One upload: ``Delta = state - global`` over the whole federated state, clipped to ``S``, plus ``N(0, (z S)^2)``
per coordinate; the client uploads ``global + noisy Delta`` through the codec (quantisation afterwards is
post-processing). Two uploads of a client with different data differ by at most ``2 S`` before noise (a
replace-one neighbour: the client's data is replaced, not removed, since the server sees that it took part),
so one upload is ``(epsilon, delta)``-DP for the ``z`` found by calibrating a Gaussian with sensitivity ``2 S``
(Flower's mod takes the sensitivity as ``S``). A client that uploads in ``k`` rounds has composed ``k`` such
releases, which together are exactly one Gaussian mechanism with ``sqrt(k)`` times less noise; the run reports
the worst client's total (no amplification by sampling: the server knows who was sampled). Both the calibration
and the totals use the exact curve of Balle and Wang (2018), tested against dp-accounting's PLD accountant.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_fl.errors import ConfigError
from lightning_fl.privacy.accountant import gaussian_epsilon_closed_form, gaussian_noise_multiplier
from lightning_fl.privacy.base import (
    Privacy,
    apply_update,
    check_noise_seed,
    clip,
    flat_update,
    positive,
    randomness,
    seeding,
)
from lightning_fl.seeding import STREAM_LOCAL_NOISE


class LocalDP(Privacy):
    """Each client clips its update to ``clip_norm`` and adds Gaussian noise before encoding it.

    Args:
        clip_norm: ``S``, the L2 bound of a client's update.
        epsilon: Epsilon of one upload at ``delta``; the noise is calibrated to it exactly (the analytic Gaussian
            mechanism). Give this or ``noise_multiplier``.
        noise_multiplier: ``z``: noise standard deviation over ``S``, instead of ``epsilon``.
        delta: Delta of one upload, and of a client's total.
        noise_seed: ``null`` (default): the noise from the operating system's secure generator; an integer seeds
            it (with the run's seed, the round and the client) for a reproducible simulation.
    """

    client_stage = True

    def __init__(
        self,
        clip_norm: float = 1.0,
        epsilon: float | None = None,
        noise_multiplier: float | None = None,
        delta: float = 1e-5,
        noise_seed: int | None = None,
    ) -> None:
        problems = positive("clip_norm", clip_norm) + positive("epsilon", epsilon, allow_none=True)
        problems += positive("noise_multiplier", noise_multiplier, allow_none=True)
        if (epsilon is None) == (noise_multiplier is None):
            problems.append(
                f"trainer.privacy LocalDP needs exactly one of epsilon and noise_multiplier, got epsilon={epsilon} "
                f"and noise_multiplier={noise_multiplier}"
            )
        if not 0 < delta < 1:
            problems.append(f"trainer.privacy.delta must be in (0, 1), got {delta}")
        if problems:
            raise ConfigError("; ".join(problems))
        self.clip_norm, self.epsilon_per_upload, self.delta = clip_norm, epsilon, delta
        self.noise_seed = check_noise_seed(noise_seed)
        self.z = noise_multiplier if noise_multiplier is not None else 2.0 * gaussian_noise_multiplier(epsilon, delta)
        self.uploads: dict[int, int] = {}  # client -> uploads so far (the worst client's total is reported)

    # ------------------------------------------------------------------------------------------ the client
    @property
    def clip_bound(self) -> float:
        return float(self.clip_norm)

    def privatize(self, state, global_state, client, round, seed) -> dict[str, torch.Tensor]:
        delta = flat_update(state, global_state)
        clipped, _, _ = clip(delta, self.clip_norm)
        g = randomness(self.noise_seed, seed, round, client, STREAM_LOCAL_NOISE)
        noisy = clipped + g.randn(delta.shape) * (self.z * self.clip_norm)
        return apply_update(global_state, noisy)

    # ------------------------------------------------------------------------------------------ accounting
    def end_round(self, round: int, participants: list[int]) -> dict[str, float]:
        for c in participants:
            self.uploads[c] = self.uploads.get(c, 0) + 1
        return {"privacy/epsilon": self.epsilon(), "privacy/noise_multiplier": self.z, "privacy/delta": self.delta}

    def epsilon(self) -> float:
        """The worst client's epsilon over its uploads so far (at ``delta`` per upload times uploads, composed)."""
        k = max(self.uploads.values(), default=0)
        if k == 0:
            return 0.0
        return gaussian_epsilon_closed_form(self.z / 2 / math.sqrt(k), self.delta)

    def guarantee(self, secure_sum: bool = False) -> str:
        return (
            "trust: local, each client noises its own upload (the server is not trusted); epsilon of the client "
            f"that uploaded most; neighbours: one client's data replaced\n{seeding(self.noise_seed)}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"noise_multiplier": self.z, "uploads": torch.tensor(sorted(self.uploads.items()), dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            raise ConfigError("the checkpoint was written without trainer.privacy: a LocalDP run cannot continue it")
        if not math.isclose(float(state["noise_multiplier"]), self.z, rel_tol=1e-9):
            raise ConfigError(
                f"the checkpoint's local noise multiplier is {float(state['noise_multiplier']):.6g}, this run's is "
                f"{self.z:.6g}: resume with the same trainer.privacy settings"
            )
        self.uploads = {int(c): int(n) for c, n in state["uploads"].tolist()}

    def __repr__(self) -> str:
        return f"LocalDP(clip_norm={self.clip_norm}, noise_multiplier={self.z:.4g}, delta={self.delta})"
