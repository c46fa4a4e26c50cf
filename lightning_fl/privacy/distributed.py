"""Distributed differential privacy: every client adds its share of the central mechanism's noise.

Central DP (:class:`~lightning_fl.privacy.CentralDP`) has the server add ``N(0, (z S)^2)`` to the clipped sum.
Under secure aggregation the server only ever sees the sum, so it cannot add noise after seeing it; instead each
of the ``m`` expected clients clips its update to ``S`` and adds ``N(0, (z S)^2 / m)`` per coordinate before it
uploads. When ``n`` shares reach the sum it carries ``N(0, (z S)^2 n / m)``: the central mechanism's noise exactly
when ``n = m``, less when clients drop out. The server sums the uploads and divides by the fixed ``m`` (as
central DP does), adding nothing.

Accounting, against the server: it sees which nodes take part in a round (their messages, SecAgg+'s key
exchange), so sampling hides nobody from it and amplification by sampling does not apply. Each round a client
takes part in is an unamplified Gaussian mechanism on its data: its neighbour is another update of the same client
(replace-one: it takes part in both worlds, with its own noise share), which moves the sum by up to ``2 S``, while
the sum carries the noise of the ``n`` shares that arrived, standard deviation ``z S sqrt(n / m)``: a multiplier
of ``mu = z sqrt(n / m) / 2`` in units of the sensitivity. A client's rounds compose to one Gaussian with
``mu = (sum_i mu_i^-2)^-1/2``, whose epsilon is Balle and Wang's exact curve (as :class:`~lightning_fl.privacy.LocalDP`
reports its clients'); the run reports the worst client's (``privacy/epsilon``). ``target_epsilon`` calibrates
``z`` so that a client taking part in the expected number of rounds, ``ceil(rounds m / N)``, spends it when every
expected share arrives; a client sampled more often spends more (reported). A round where a client's share does not
arrive spends nothing of its budget; a dropped share leaves the others' rounds less noise (a larger epsilon for
them). ``max_epsilon`` stops the run before any client could exceed it: the stop predicts the next round with the
fewest shares a released sum can carry, ``min_shares`` (default 1: one client's share alone, the worst that Poisson
sampling, dropouts or a rejected upload can leave), and a round whose sum carries fewer than ``min_shares`` (but
some) is not released: the global state stays, no client is charged (:meth:`DistributedDP.refusal`). Predicting
with all ``m`` shares let a client overshoot: z = 4, m = 4, cap 5, three full rounds then one with its share alone
reached 6.07. A refused sum was still formed by the server (in process, and on Flower once SecAgg+ unmasks it): with
``min_shares`` above 1 the cap holds for everything released and against a server that discards what it refuses,
not against one that keeps it; against such a server only ``min_shares`` 1 holds. Someone who sees only the released
models, not who took part, would also get amplification by sampling (what :class:`~lightning_fl.privacy.CentralDP`
accounts) if the cohorts stay secret from them; this class does not claim it. Kairouz, Liu, Steinke (2021), "The
Distributed Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation" (ICML) analyse the same
released sum.

This is the continuous-share version (Gaussian shares in floating point), not the discrete Gaussian of Kairouz
et al.: once secure aggregation quantises and wraps the sum modulo a power of two, the continuous analysis holds
only up to the quantisation step and as long as nothing wraps (docs/privacy.md).

Trust: without secure aggregation the server sees every upload, each carrying only ``1 / sqrt(m)`` of the noise:
against the server this protects no more than local DP with ``z / sqrt(m)``; what the server releases is as
private as under central DP. Its purpose is to run under secure aggregation, where the server sees the sum only.

``m`` comes from the plan, which on Flower a node builds from the server's messages. A node therefore draws its
share for the cohort it checked (:meth:`DistributedDP.for_cohort`): ``min(m, the nodes of its SecAgg+ round, its
pinned max-cohort)`` (:func:`lightning_fl.flower.pins.noise_cohort`), so a server that states a larger federation
cannot shrink it. A smaller checked cohort adds more noise than the accountant (the plan's ``m``) counts on: the
reported epsilon is then an upper bound.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from lightning_fl.errors import ConfigError
from lightning_fl.privacy.accountant import gaussian_epsilon_closed_form, gaussian_noise_multiplier
from lightning_fl.privacy.base import Plan, apply_update, clip, flat_update, layer_slices, randomness, seeding
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
        target_epsilon: Calibrate ``z`` so that a client taking part in the expected number of rounds, with every
            expected share arriving, spends this (module docstring).
        delta: As :class:`~lightning_fl.privacy.CentralDP`.
        max_epsilon: As :class:`~lightning_fl.privacy.CentralDP`; it bounds the worst client's epsilon.
        per_layer: As :class:`~lightning_fl.privacy.CentralDP`.
        noise_seed: ``null`` (default): each client's share from its operating system's secure generator; an
            integer seeds it (with the run's seed, the round and the client) for a reproducible simulation.
        min_shares: The fewest noise shares a released sum may carry: ``max_epsilon``'s stop predicts the next round
            with this many, and a round whose sum carries fewer (but at least one) is refused, nothing released and
            nobody charged. 1 (default): every round is released, and the stop assumes a share may arrive alone;
            ``m``: the stop assumes every share arrives, and a round any share misses is refused.
    """

    amplified = False  # the server sees who takes part (module docstring)
    central = True  # the server folds the (already clipped, already noised) updates and divides by m
    client_stage = True  # every client clips and adds its share before encoding
    needs = ()  # (its epsilon has a closed form: no accountant)

    def __init__(
        self,
        clip_norm: float = 1.0,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float | None = None,
        max_epsilon: float | None = None,
        per_layer: bool = False,
        noise_seed: int | None = None,
        min_shares: int = 1,
    ) -> None:
        if isinstance(min_shares, bool) or not isinstance(min_shares, int) or min_shares < 1:
            raise ConfigError(f"trainer.privacy.min_shares must be an integer >= 1, got {min_shares!r}")
        super().__init__(
            clip_norm, noise_multiplier, target_epsilon, delta, max_epsilon, per_layer, None, "rdp", noise_seed
        )
        self.min_shares = min_shares
        #: Per client, the sum of ``mu_i^-2`` over the rounds its share reached the sum (module docstring).
        self.precision: dict[int, float] = {}
        #: The cohort a client draws its share for, when it checked a smaller one than the plan's ``m``
        #: (:meth:`for_cohort`); ``None``: the plan's.
        self.share_cohort: float | None = None

    def setup(self, plan: Plan) -> None:
        super().setup(plan)
        if self.min_shares > plan.expected_clients:
            raise ConfigError(
                f"trainer.privacy.min_shares={self.min_shares} is above the {plan.expected_clients:g} clients a round "
                "(trainer.clients_per_round): nearly every round would be refused; set min_shares at most that"
            )

    def expected_rounds(self, plan: Plan) -> int:
        """The rounds a client takes part in on average: ``ceil(rounds m / N)`` (at least 1)."""
        return max(1, math.ceil(plan.rounds * plan.expected_clients / plan.num_clients - 1e-9))

    def calibrate(self, plan: Plan) -> float:
        """``z`` for which ``expected_rounds`` rounds of ``m`` shares, ``mu = z / 2`` each, spend ``target_epsilon``."""
        return 2.0 * math.sqrt(self.expected_rounds(plan)) * gaussian_noise_multiplier(self.target_epsilon, self.delta)

    def sum_multiplier(self, arrived: float) -> float:
        """The noise multiplier (std / S) of a sum of ``arrived`` shares."""
        return self.z * math.sqrt(arrived / self.plan.expected_clients)

    def client_epsilon(self, precision: float) -> float:
        """The epsilon of a client whose rounds add up to ``precision = sum_i mu_i^-2`` (0: nothing released)."""
        if precision == 0:
            return 0.0
        return math.inf if math.isinf(precision) else gaussian_epsilon_closed_form(precision**-0.5, self.delta)

    def epsilon(self) -> float:
        """The worst client's epsilon so far."""
        return self.client_epsilon(max(self.precision.values(), default=0.0))

    def stop_reason(self) -> str | None:
        if self.max_epsilon is None:
            return None
        fewest = self.sum_multiplier(self.min_shares) / 2  # one more round released with the fewest shares it may
        worst = max(self.precision.values(), default=0.0)
        after = self.client_epsilon(worst + (fewest**-2 if fewest > 0 else math.inf))
        if after <= self.max_epsilon:
            return None
        shares = "its share alone" if self.min_shares == 1 else f"{self.min_shares} shares (min_shares)"
        return (
            f"a client taking part in the next round could spend epsilon {after:.4g} at delta {self.delta:.3g} if "
            f"the sum carries {shares}, more than trainer.privacy.max_epsilon={self.max_epsilon:g}"
        )

    def refusal(self, shares: int) -> str | None:
        """Why a round whose sum carries ``shares`` noise shares is not released: fewer than ``min_shares`` (but
        some) carry less noise than the budget stop assumed. ``None``: it is released."""
        if not 0 < shares < self.min_shares:
            return None
        return (
            f"its sum carries {shares} noise share(s), fewer than trainer.privacy.min_shares={self.min_shares} "
            "(less noise than the budget stop assumed): nothing is released and no client is charged"
        )

    def guarantee(self, secure_sum: bool = False) -> str:
        seen = (
            "the server sees only their sum (secure aggregation)"
            if secure_sum
            else "without secure aggregation the server sees each upload, with 1/sqrt(m) of the noise"
        )
        return (
            f"trust: distributed, each client adds a share of the noise and {seen}; epsilon of the client whose "
            "shares reached most sums, not amplified by sampling (the server sees who takes part); neighbours: "
            f"one client's data replaced\n{seeding(self.noise_seed)}"
        )

    # ------------------------------------------------------------------------------------------ the client
    def share_std(self) -> float:
        """The standard deviation of one client's noise share per coordinate: ``z S / sqrt(m)``."""
        m = self.plan.expected_clients if self.share_cohort is None else self.share_cohort
        return self.z * self.bound / math.sqrt(m)

    def for_cohort(self, cohort: float) -> DistributedDP:
        """This mechanism for a client that checked its round's cohort: its share is drawn for ``min(m, cohort)``
        clients, never for more than the plan's ``m`` (a Flower node counts the nodes of the round's SecAgg+ key
        sharing, :func:`~lightning_fl.flower.pins.noise_cohort`). A copy: the accounting stays the plan's."""
        if not cohort >= 1:
            raise ValueError(f"a noise share is for a cohort of at least 1 client, got {cohort!r}")
        mine = copy.copy(self)
        mine.share_cohort = min(float(self.plan.expected_clients), float(cohort))
        return mine

    def privatize(self, state, global_state, client, round, seed) -> dict[str, torch.Tensor]:
        delta = flat_update(state, global_state)
        sizes = [global_state[n].numel() for n in sorted(global_state)]
        clipped, _, _ = clip(delta, self.bound, layer_slices(sizes) if self.per_layer else None)
        std = self.share_std()
        if std > 0:
            g = randomness(self.noise_seed, seed, round, client, STREAM_DISTRIBUTED_NOISE)
            clipped = clipped + g.randn(delta.shape) * std
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
        return total / m, {
            "privacy/clip_norm": self.bound,
            "privacy/noise_std": std / m,
            "privacy/noise_shares": float(participants),
        }

    def end_round(self, round: int, participants: list[int]) -> dict[str, float]:
        """Each client whose share reached the sum has released one more Gaussian, ``mu = z sqrt(n / m) / 2``."""
        z_sum = self.sum_multiplier(len(participants))
        mu = z_sum / 2
        for c in participants:
            self.precision[c] = self.precision.get(c, 0.0) + (mu**-2 if mu > 0 else math.inf)
        return {
            "privacy/epsilon": self.epsilon(),
            "privacy/noise_multiplier": self.z,
            "privacy/delta": self.delta,
            "privacy/round_noise_multiplier": z_sum,
        }

    def rounds_accounted(self) -> int | None:
        return None  # (a precision per client, no accountant history)

    def state_dict(self) -> dict[str, Any]:
        spent = torch.tensor([[c, p] for c, p in sorted(self.precision.items())], dtype=torch.float64).reshape(-1, 2)
        return {
            "distributed": 2,
            "noise_multiplier": self.z,
            "target_epsilon": self.target_epsilon,
            "clip_norm": self.bound,
            "delta": self.delta,
            "precision": spent,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and not state.get("distributed"):
            raise ConfigError("the checkpoint was written with trainer.privacy CentralDP: resume it with CentralDP")
        if state and state.get("distributed") != 2:
            raise ConfigError(
                "the checkpoint's DistributedDP accounted with amplification by sampling (an earlier version), which "
                "does not hold against a server that sees who takes part: start the run afresh"
            )
        self.check_resume(state)
        self.z, self.bound = float(state["noise_multiplier"]), float(state["clip_norm"])
        self.precision = {int(c): float(p) for c, p in state["precision"].tolist()}

    def __repr__(self) -> str:
        return (
            f"DistributedDP(clip_norm={self.clip_norm}, noise_multiplier={self.z}, delta={self.delta}, "
            f"min_shares={self.min_shares})"
        )
