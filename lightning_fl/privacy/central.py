"""User-level central differential privacy: McMahan, Ramage, Talwar, Zhang (2018), "Learning Differentially
Private Recurrent Language Models" (ICLR), with adaptive clipping from Andrew, Thakkar, McMahan, Ramaswamy (2021),
"Differentially Private Learning with Adaptive Clipping" (NeurIPS).

Trust model: the server is trusted to clip and noise (the clients' updates reach it in the clear); what leaves
the server (every global state, hence the final model) is differentially private with respect to any one
client's whole data. One round:

1. each accepted update ``Delta_k = x_k - x`` (decoded upload minus the global state, float64, over the whole
   federated state) is clipped to L2 norm ``S`` (``per_layer``: each tensor to ``S / sqrt(L)``);
2. the clipped updates are summed (a running float64 sum, client by client) and divided by a fixed
   denominator ``m``, the expected number of clients per round, never the number that arrived;
3. Gaussian noise ``N(0, (z S / m)^2)`` is added to every coordinate of that mean; the strategy then steps from
   ``x + noisy mean`` as from any mean (FedAvg takes it; FedAvgM and FedAdam treat it as a pseudo-gradient:
   post-processing, no extra privacy cost).

Adaptive clipping replaces a fixed ``S`` by one that follows the ``target_quantile`` of the update norms: with
``b_k = 1`` when ``||Delta_k|| <= S``, the server releases ``b = (sum_k (b_k - 1/2) + N(0, sigma_b^2)) / m + 1/2``
and sets ``S <- S exp(-eta (b - gamma))``. The count is a second Gaussian query; the update's own noise
multiplier is raised so both together spend what one query with ``z`` would (the paper's Theorem 1).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Literal

import torch

from lightning_fl.errors import ConfigError
from lightning_fl.privacy.accountant import Accountant, RoundEvent, require_extra, update_noise_multiplier
from lightning_fl.privacy.base import (
    Plan,
    Privacy,
    check_noise_seed,
    clip,
    neighbours,
    positive,
    randomness,
    seeding,
)
from lightning_fl.seeding import STREAM_CENTRAL_NOISE, STREAM_COUNT_NOISE

log = logging.getLogger(__name__)


class AdaptiveClipping:
    """Andrew et al. (2021): the clip bound follows a quantile of the update norms, from a noised count.

    Args:
        target_quantile: ``gamma``: the share of clients whose update should fall within the bound (0.5: the
            median norm).
        learning_rate: ``eta`` of the geometric update ``S <- S exp(-eta (b - gamma))``.
        count_std: ``sigma_b``, the standard deviation of the noise on the count; ``null``: the paper's
            ``m / 20`` for ``m`` expected clients per round.
    """

    def __init__(self, target_quantile: float = 0.5, learning_rate: float = 0.2, count_std: float | None = None):
        problems = []
        if not 0 < target_quantile < 1:
            problems.append(f"trainer.privacy.adaptive.target_quantile must be in (0, 1), got {target_quantile}")
        if not (math.isfinite(learning_rate) and learning_rate > 0):
            problems.append(f"trainer.privacy.adaptive.learning_rate must be > 0, got {learning_rate}")
        if count_std is not None and not (math.isfinite(count_std) and count_std > 0):
            problems.append(f"trainer.privacy.adaptive.count_std must be > 0 or null, got {count_std}")
        if problems:
            raise ConfigError("; ".join(problems))
        self.target_quantile, self.learning_rate, self.count_std = target_quantile, learning_rate, count_std

    def __repr__(self) -> str:
        return (
            f"AdaptiveClipping(target_quantile={self.target_quantile}, learning_rate={self.learning_rate}, "
            f"count_std={self.count_std})"
        )


class CentralDP(Privacy):
    """User-level DP-FedAvg: the server clips every update, sums them and adds Gaussian noise.

    Args:
        clip_norm: ``S``, the L2 bound of each client's update (over the whole federated state); with ``adaptive``
            its starting value.
        noise_multiplier: ``z``: noise standard deviation over ``S`` on the clipped sum (0: clipping only, no
            guarantee). Give this or ``target_epsilon``.
        target_epsilon: Calibrate ``z`` before round 1 so that ``trainer.rounds`` rounds spend this epsilon at
            ``delta`` (``inf``: ``z = 0``, clipping only).
        delta: The run's delta; ``null``: ``min(1e-5, N^-1.1)`` for ``N`` clients (below ``1 / N`` as it must be).
        max_epsilon: Stop the run, cleanly and with a checkpoint, before a round that would spend more.
        per_layer: Clip each tensor of the federated state to ``S / sqrt(L)`` (``L`` tensors) instead of the
            whole update to ``S``: the same bound overall, no tensor can use up another's share.
        adaptive: Adaptive clipping (:class:`AdaptiveClipping`); ``null``: ``S`` stays fixed.
        accountant: ``rdp`` or ``pld`` (``pld``: tighter, Poisson sampling only).
        noise_seed: ``null`` (default): the noise and each round's clients come from the operating system's
            secure generator. An integer seeds the noise (with the run's seed and the round), and the clients are
            drawn from the run's seed: a reproducible simulation whose guarantee assumes both seeds stay secret
            (anyone who knows them can recompute the noise and who was sampled).
    """

    central = True
    amplified = True
    #: What the next round is, in a budget-stop message (``None``: this run's next; a population's ledger says its own).
    scope: str | None = None
    #: The modules of the ``privacy`` extra it needs (checked when it is made): the accountant's.
    needs: tuple[str, ...] = ("dp_accounting",)

    def __init__(
        self,
        clip_norm: float = 1.0,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float | None = None,
        max_epsilon: float | None = None,
        per_layer: bool = False,
        adaptive: AdaptiveClipping | None = None,
        accountant: Literal["rdp", "pld"] = "rdp",
        noise_seed: int | None = None,
    ) -> None:
        require_extra(f"trainer.privacy {type(self).__name__}", *self.needs)
        problems = positive("clip_norm", clip_norm)
        problems += positive("noise_multiplier", noise_multiplier, allow_zero=True, allow_none=True)
        if target_epsilon != math.inf:  # inf: no noise (clipping only), the right end of a privacy-utility curve
            problems += positive("target_epsilon", target_epsilon, allow_none=True)
        problems += positive("max_epsilon", max_epsilon, allow_none=True)
        if (noise_multiplier is None) == (target_epsilon is None):
            problems.append(
                "trainer.privacy needs exactly one of noise_multiplier and target_epsilon, got "
                f"noise_multiplier={noise_multiplier} and target_epsilon={target_epsilon}"
            )
        if delta is not None and not 0 < delta < 1:
            problems.append(f"trainer.privacy.delta must be in (0, 1) or null, got {delta}")
        if accountant not in ("rdp", "pld"):
            problems.append(f"trainer.privacy.accountant must be 'rdp' or 'pld', got {accountant!r}")
        if problems:
            raise ConfigError("; ".join(problems))
        self.clip_norm, self.noise_multiplier, self.target_epsilon = clip_norm, noise_multiplier, target_epsilon
        self.delta, self.max_epsilon, self.per_layer, self.adaptive = delta, max_epsilon, per_layer, adaptive
        self.accountant_method, self.noise_seed = accountant, check_noise_seed(noise_seed)
        self.accountant: Accountant | None = None
        self.z: float | None = noise_multiplier  # the effective multiplier (calibrated when target_epsilon is set)
        self.bound = float(clip_norm)  # the current clip bound S (moves with adaptive clipping)

    # ------------------------------------------------------------------------------------------ setup
    def setup(self, plan: Plan) -> None:
        super().setup(plan)
        strategy = plan.strategy
        problems = []
        if not strategy.streams:
            problems.append(
                f"trainer.privacy CentralDP needs a strategy that steps from the round's mean (FedAvg, FedAvgM, "
                f"FedAdam, FedYogi, FedAdagrad); {strategy.name}'s sensitivity to one client is not bounded by the "
                "clip norm"
            )
        if plan.max_update_norm_ratio is not None:
            problems.append(
                "trainer.max_update_norm_ratio compares each update with the round's median, so one client's data "
                "decides whether another's is used, which the DP guarantee does not cover: set "
                "trainer.max_update_norm_ratio null with trainer.privacy CentralDP (or leave the key out: its "
                "default, auto, is off under it)"
            )
        if strategy.min_clients > 1:
            problems.append(
                f"trainer.strategy.min_clients={strategy.min_clients}: skipping a round because few uploads arrived "
                "would reveal how many did; with trainer.privacy CentralDP every round releases its noised sum, so "
                "set trainer.strategy.min_clients 1"
            )
        if problems:
            raise ConfigError("; ".join(problems))
        self.accountant = Accountant(plan.num_clients, plan.expected_clients, plan.sampling, self.accountant_method)
        if self.delta is None:
            self.delta = min(1e-5, plan.num_clients**-1.1)
        if self.adaptive is not None and self.adaptive.count_std is None:
            self.adaptive.count_std = plan.expected_clients / 20
        if self.target_epsilon is not None and self.z is None:
            self.z = 0.0 if self.target_epsilon == math.inf else self.calibrate(plan)
        if self.adaptive is not None and self.z > 0:
            update_noise_multiplier(self.z, self.adaptive.count_std)  # refuses a count noise too small for z

    def calibrate(self, plan: Plan) -> float:
        """The noise multiplier that spends ``target_epsilon`` over ``plan.rounds`` rounds (a search through the
        accountant, which takes tens of seconds for a large population under PLD: said in a line before and after)."""
        target = f"trainer.privacy.target_epsilon {self.target_epsilon:g} at delta {self.delta:.3g}"
        how = f"{self.accountant_method.upper()} accounting over {plan.rounds} rounds"
        log.info("calibrating the noise multiplier to %s (%s) ...", target, how)
        started = time.perf_counter()
        z = self.accountant.calibrate(self.target_epsilon, self.delta, plan.rounds)
        log.info("noise multiplier %.4g, calibrated in %.0f s", z, time.perf_counter() - started)
        return z

    def count_std(self) -> float:
        return self.adaptive.count_std if self.adaptive is not None else 0.0

    @property
    def update_multiplier(self) -> float:
        """The update sum's own noise multiplier (``z``, raised under adaptive clipping to pay for the count)."""
        if self.adaptive is None:
            return self.z
        return update_noise_multiplier(self.z, self.adaptive.count_std)

    def event(self) -> RoundEvent:
        """One round's release for the accountant: the update sum's own multiplier, and the count query's noise."""
        return RoundEvent(self.update_multiplier, self.count_std() if self.z > 0 else 0.0)

    # ------------------------------------------------------------------------------------------ a round
    def clip(self, delta: torch.Tensor, layers: list[slice] | None) -> tuple[torch.Tensor, float, bool]:
        """One client's update clipped to the current bound (see :func:`~lightning_fl.privacy.base.clip`)."""
        return clip(delta, self.bound, layers if self.per_layer else None)

    def release(self, total: torch.Tensor, unclipped: int, participants: int, round: int) -> tuple[torch.Tensor, dict]:
        """The noisy mean update ``(sum + N(0, (z S)^2)) / m`` of a round whose clipped updates sum to ``total``
        (float64 ``(D,)``); with adaptive clipping, the bound for the next round from the noised count of the
        ``unclipped`` among ``participants``."""
        plan, bound = self.plan, self.bound
        std = self.update_multiplier * bound
        g = randomness(self.noise_seed, plan.seed, round, STREAM_CENTRAL_NOISE)
        noise = g.randn(total.shape) * std if std > 0 else 0.0
        mean = (total + noise) / plan.expected_clients
        metrics = {"privacy/clip_norm": bound, "privacy/noise_std": std / plan.expected_clients}
        if self.adaptive is not None:
            g = randomness(self.noise_seed, plan.seed, round, STREAM_COUNT_NOISE)
            count_noise = float(g.randn(())) * self.adaptive.count_std
            within = (unclipped - participants / 2 + (count_noise if self.z > 0 else 0.0)) / plan.expected_clients + 0.5
            self.bound = bound * math.exp(-self.adaptive.learning_rate * (within - self.adaptive.target_quantile))
            metrics["privacy/unclipped_fraction"] = within
        return mean, metrics

    def end_round(self, round: int, participants: list[int]) -> dict[str, float]:
        self.accountant.compose(self.event())
        return {"privacy/epsilon": self.epsilon(), "privacy/noise_multiplier": self.z, "privacy/delta": self.delta}

    def epsilon(self) -> float:
        return self.accountant.epsilon(self.delta) if self.z > 0 else math.inf

    def guarantee(self, secure_sum: bool = False) -> str:
        trust = f"trust: central, the server clips and noises the sum; {neighbours(self.plan.sampling)}"
        return f"{trust}\n{seeding(self.noise_seed, cohorts=self.amplified)}"

    def stop_reason(self) -> str | None:
        if self.max_epsilon is None:
            return None
        after = self.accountant.epsilon(self.delta, (self.event(), 1)) if self.z > 0 else math.inf
        if after <= self.max_epsilon:
            return None
        what = self.scope or f"round {self.accountant.num_rounds + 1}"
        return (
            f"{what} would spend epsilon {after:.4g} at delta {self.delta:.3g}, more than trainer.privacy."
            f"max_epsilon={self.max_epsilon:g}"
        )

    # ------------------------------------------------------------------------------------------ state
    def rounds_accounted(self) -> int | None:
        return self.accountant.num_rounds

    def state_dict(self) -> dict[str, Any]:
        return {
            "noise_multiplier": self.z,
            "target_epsilon": self.target_epsilon,
            "clip_norm": self.bound,
            "delta": self.delta,
            "accountant": self.accountant.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_resume(state)
        self.z, self.bound = float(state["noise_multiplier"]), float(state["clip_norm"])
        self.accountant.load_state_dict(state["accountant"])

    def check_resume(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint's privacy ``state`` this run cannot continue (none, other noise, target or delta)."""
        if not state:
            raise ConfigError(
                "the checkpoint was written without trainer.privacy: a private run cannot continue a non-private "
                "one (its earlier rounds spent an unbounded budget)"
            )
        if self.noise_multiplier is not None and float(state["noise_multiplier"]) != float(self.noise_multiplier):
            raise ConfigError(
                f"the checkpoint's noise multiplier is {state['noise_multiplier']:g}, trainer.privacy.noise_multiplier "
                f"is {self.noise_multiplier:g}: resume with the same value"
            )
        if self.target_epsilon is not None and (saved := state.get("target_epsilon")) != self.target_epsilon:
            raise ConfigError(
                f"the checkpoint's noise was calibrated to trainer.privacy.target_epsilon={saved}, this run asks for "
                f"{self.target_epsilon}: resume with the same target (or set max_epsilon to stop earlier)"
            )
        if float(state["delta"]) != self.delta:
            raise ConfigError(
                f"the checkpoint's delta is {float(state['delta']):g}, this run's trainer.privacy.delta is "
                f"{self.delta:g}: resume with the same delta (a budget is spent at one delta)"
            )

    def __repr__(self) -> str:
        return f"CentralDP(clip_norm={self.clip_norm}, noise_multiplier={self.z}, delta={self.delta})"
