"""The privacy accountant: the (epsilon, delta) a run has spent, from Google's ``dp-accounting``.

Every round of user-level DP-FedAvg releases one sampled Gaussian mechanism: the clients of the round are
sampled from the population, each one's update is clipped to ``S``, and the sum is noised with standard
deviation ``z S`` (``z`` the noise multiplier, our convention and Flower's, pfl-research's and McMahan et al.'s).
Adaptive clipping adds a second Gaussian query per round (the noised count of unclipped clients), composed in.

What a round's event is depends on how clients are sampled, and that fixes the neighbouring relation:

- ``poisson``: each client takes part independently with probability ``q = m / N``; neighbouring populations
  differ by adding or removing one client's data (``ADD_OR_REMOVE_ONE``). A clipped sum moves by at most ``S``,
  so the mechanism's noise multiplier is ``z``. RDP (Mironov, Talwar, Zhang 2019) or PLD accounting.
- ``fixed``: exactly ``m`` of ``N`` clients without replacement (``N`` public); neighbours replace one client's
  data (``REPLACE_ONE``), which moves a clipped sum by up to ``2 S``: the noise multiplier seen by the accountant
  is ``z / 2``. RDP only (Wang, Balle, Kasiviswanathan 2019, Theorem 27; PLD has no such event). At equal
  ``z`` this costs far more epsilon than Poisson sampling: the price of the stronger neighbouring relation.

A count query over ``sum_k (b_k - 1/2)`` (``b_k`` = 1 when client ``k`` was not clipped) moves by ``1/2``
(add/remove) or ``1`` (replace-one): its multiplier in the accountant's units is ``2 sigma_b`` or ``sigma_b``.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

from lightning_fl.errors import ConfigError

Sampling = Literal["fixed", "poisson"]
Method = Literal["rdp", "pld"]


#: The packages of the ``privacy`` extra, by module: what a message calls each.
EXTRA_PACKAGES = {"dp_accounting": "Google's dp-accounting", "opacus": "Opacus"}


def require_extra(key: str, *modules: str) -> None:
    """Refuse ``key`` in one line when a package of the ``privacy`` extra it needs (``modules``) is not installed: a
    mechanism checks when it is made, before any data is loaded or any base pretrained. Only looks the packages up
    (``importlib.util.find_spec``), so it costs no import."""
    missing = [EXTRA_PACKAGES.get(m, m) for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        are = "is" if len(missing) == 1 else "are"
        fix = "pip install 'lightning-fl[privacy]'"
        raise ConfigError(f"{key} needs {' and '.join(missing)}, which {are} not installed: {fix}")


def dp_accounting():
    """The ``dp_accounting`` package, or a one-line error naming the extra that installs it."""
    try:
        import dp_accounting
    except ImportError as err:  # pragma: no cover - the privacy extra is part of every install we document
        raise ConfigError("trainer.privacy needs Google's dp-accounting: pip install 'lightning-fl[privacy]'") from err
    # Its RDP code logs a warning through absl for every fractional order whose series it gives up on (those
    # orders are then left out of the minimum over orders, which only makes epsilon more conservative): one run
    # would print thousands of them.
    logging.getLogger("absl").setLevel(logging.ERROR)
    return dp_accounting


@dataclass(frozen=True)
class RoundEvent:
    """One round's release: the update sum's own noise multiplier (std / S) and, with adaptive clipping, the
    count query's standard deviation ``count_std`` (0: no count query). Together they are as private as one
    Gaussian query with multiplier ``(noise_multiplier^-2 + (2 count_std)^-2)^-1/2``. ``expected_clients``: the
    clients a round of another run expected, where it differs from the accountant's (a population's ledger composes
    the rounds of every run that drew on it); ``None``: the accountant's."""

    noise_multiplier: float
    count_std: float = 0.0
    expected_clients: float | None = None


class Accountant:
    """Privacy spent over the rounds composed so far.

    Args:
        num_clients: The population ``N``.
        expected_clients: ``m``: the clients sampled per round (``fixed``) or the expected number (``poisson``).
        sampling: ``fixed`` (``m`` without replacement, replace-one neighbours) or ``poisson`` (add/remove).
        method: ``rdp`` or ``pld`` (Poisson sampling only).
    """

    def __init__(
        self, num_clients: int, expected_clients: float, sampling: Sampling = "poisson", method: Method = "rdp"
    ):
        if sampling not in ("fixed", "poisson"):
            raise ConfigError(f"trainer.sampling must be 'fixed' or 'poisson', got {sampling!r}")
        if method not in ("rdp", "pld"):
            raise ConfigError(f"trainer.privacy.accountant must be 'rdp' or 'pld', got {method!r}")
        if method == "pld" and sampling == "fixed":
            raise ConfigError(
                "trainer.privacy.accountant 'pld' has no event for fixed-size sampling without replacement: use "
                "trainer.privacy.accountant rdp, or trainer.sampling poisson"
            )
        if not 0 < expected_clients <= num_clients:
            raise ConfigError(
                f"trainer.clients_per_round={expected_clients:g} must be in (0, data.num_clients={num_clients}]"
            )
        self.num_clients, self.expected_clients = num_clients, expected_clients
        self.sampling, self.method = sampling, method
        self.rounds: list[tuple[RoundEvent, int]] = []  # (event, how many rounds released it), in order

    # ------------------------------------------------------------------------------------------ events
    @property
    def relation(self) -> Any:
        dpa = dp_accounting()
        return (
            dpa.NeighboringRelation.REPLACE_ONE
            if self.sampling == "fixed"
            else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
        )

    def sensitivity_scale(self) -> float:
        """How many clip bounds one neighbour moves the clipped sum by (1 add/remove, 2 replace-one)."""
        return 2.0 if self.sampling == "fixed" else 1.0

    def dp_event(self, event: RoundEvent, count: int = 1) -> Any:
        """The dp-accounting event of ``count`` rounds that each release ``event``."""
        dpa = dp_accounting()
        scale = self.sensitivity_scale()
        if event.noise_multiplier <= 0:
            return dpa.NonPrivateDpEvent()
        inner = dpa.GaussianDpEvent(event.noise_multiplier / scale)
        if event.count_std > 0:  # the count of sum_k (b_k - 1/2) moves by scale / 2
            counting = dpa.GaussianDpEvent(event.count_std / (scale / 2))
            if self.method == "rdp":
                inner = dpa.ComposedDpEvent([inner, counting])
            else:  # PLD takes one Gaussian under a sampling event: two Gaussians on the same data are one, exactly
                both = (inner.noise_multiplier**-2 + counting.noise_multiplier**-2) ** -0.5
                inner = dpa.GaussianDpEvent(both)
        m = self.expected_clients if event.expected_clients is None else event.expected_clients
        if self.sampling == "poisson":
            sampled = dpa.PoissonSampledDpEvent(m / self.num_clients, inner)
        else:
            sampled = dpa.SampledWithoutReplacementDpEvent(self.num_clients, int(m), inner)
        return dpa.SelfComposedDpEvent(sampled, count) if count != 1 else sampled

    def _fresh(self) -> Any:
        dpa = dp_accounting()
        if self.method == "pld":
            return dpa.pld.PLDAccountant(neighboring_relation=self.relation)
        return dpa.rdp.RdpAccountant(neighboring_relation=self.relation)

    # ------------------------------------------------------------------------------------------ spending
    def compose(self, event: RoundEvent, count: int = 1) -> None:
        """Record ``count`` more rounds releasing ``event``."""
        if self.rounds and self.rounds[-1][0] == event:
            self.rounds[-1] = (event, self.rounds[-1][1] + count)
        else:
            self.rounds.append((event, count))

    @property
    def num_rounds(self) -> int:
        return sum(count for _, count in self.rounds)

    def epsilon(self, delta: float, extra: tuple[RoundEvent, int] | None = None) -> float:
        """Epsilon at ``delta`` of the rounds composed so far (and ``extra`` rounds, if given); ``inf`` if unbounded."""
        parts = [*self.rounds, *([extra] if extra is not None else [])]
        if not parts:
            return 0.0
        accountant = self._fresh()
        for event, count in parts:
            accountant.compose(self.dp_event(event, count))
        return float(accountant.get_epsilon(delta))

    def calibrate(self, target_epsilon: float, delta: float, rounds: int) -> float:
        """The noise multiplier ``z`` (std / S, effective over both queries with adaptive clipping) for which
        ``rounds`` rounds spend ``target_epsilon`` at ``delta``."""
        dpa = dp_accounting()
        scale = self.sensitivity_scale()

        def event(z_accountant: float):  # the search runs in the accountant's units (std / sensitivity)
            return self.dp_event(RoundEvent(z_accountant * scale), rounds)

        bracket = dpa.LowerEndpointAndGuess(0.01, 1.0)
        if self.method == "pld":  # PLD spends less than RDP: its z lies below RDP's (and PLD is slow at tiny z)
            rdp = Accountant(self.num_clients, self.expected_clients, self.sampling, "rdp")
            upper = rdp.calibrate(target_epsilon, delta, rounds) / scale
            bracket = dpa.ExplicitBracketInterval(0.25 * upper, upper)
        try:
            z = dpa.calibrate_dp_mechanism(self._fresh, event, target_epsilon, delta, bracket, tol=1e-4)
        except dpa.mechanism_calibration.NoBracketIntervalFoundError as err:
            raise ConfigError(
                f"trainer.privacy.target_epsilon={target_epsilon:g} at delta={delta:g} over {rounds} rounds cannot "
                "be met by any noise multiplier the search tried: raise target_epsilon or lower trainer.rounds"
            ) from err
        return float(z) * scale

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "num_clients": self.num_clients,
            "expected_clients": float(self.expected_clients),
            "sampling": self.sampling,
            "method": self.method,
            "rounds": [[e.noise_multiplier, e.count_std, count] for e, count in self.rounds],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = (self.num_clients, float(self.expected_clients), self.sampling, self.method)
        theirs = (state["num_clients"], float(state["expected_clients"]), state["sampling"], state["method"])
        if mine != theirs:
            raise ConfigError(
                f"the checkpoint's privacy accountant (clients, expected per round, sampling, method) {theirs} differs "
                f"from this run's {mine}: resume with the same data.num_clients, trainer.clients_per_round, "
                "trainer.sampling and trainer.privacy.accountant"
            )
        self.rounds = [(RoundEvent(float(z), float(c)), int(n)) for z, c, n in state["rounds"]]


def update_noise_multiplier(noise_multiplier: float, count_std: float) -> float:
    """Andrew et al. (2021), Theorem 1: the update sum's own multiplier ``z_update`` such that it and a count query
    with standard deviation ``count_std`` together are as private as one Gaussian query with ``noise_multiplier``:
    ``z_update^-2 + (2 count_std)^-2 = z^-2``."""
    if noise_multiplier == 0:
        return 0.0
    if count_std <= noise_multiplier / 2:
        raise ConfigError(
            f"trainer.privacy.adaptive.count_std={count_std:g} is too small for noise multiplier {noise_multiplier:g}: "
            f"the count query alone would spend more than the whole budget; it must exceed {noise_multiplier / 2:g}"
        )
    return (noise_multiplier**-2 - (2 * count_std) ** -2) ** -0.5


def gaussian_delta(noise_multiplier: float, epsilon: float) -> float:
    """Delta of a Gaussian mechanism (sensitivity 1, standard deviation ``noise_multiplier``) at ``epsilon``: the
    exact curve of Balle and Wang (2018), "Improving the Gaussian Mechanism for Differential Privacy" (ICML),
    Theorem 8: ``Phi(1/(2s) - eps s) - e^eps Phi(-1/(2s) - eps s)``."""
    from scipy.special import log_ndtr, ndtr

    s = noise_multiplier
    return float(ndtr(0.5 / s - epsilon * s) - math.exp(epsilon + log_ndtr(-0.5 / s - epsilon * s)))


def gaussian_epsilon_closed_form(noise_multiplier: float, delta: float) -> float:
    """Epsilon at ``delta`` of a Gaussian mechanism with sensitivity 1 and standard deviation ``noise_multiplier``
    (:func:`gaussian_delta` solved for epsilon by bisection). ``k`` such mechanisms on the same data compose to
    one with ``noise_multiplier / sqrt(k)``, exactly."""
    lo, hi = 0.0, 1.0
    while gaussian_delta(noise_multiplier, hi) > delta:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gaussian_delta(noise_multiplier, mid) > delta else (lo, mid)
    return hi


def gaussian_noise_multiplier(epsilon: float, delta: float) -> float:
    """The smallest standard deviation (sensitivity 1) for which one Gaussian mechanism is ``(epsilon, delta)``-DP:
    Balle and Wang's analytic Gaussian mechanism, by bisection on :func:`gaussian_delta` (decreasing in it)."""
    lo, hi = 1e-3, 1.0
    while gaussian_delta(hi, epsilon) > delta:
        lo, hi = hi, hi * 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if gaussian_delta(mid, epsilon) <= delta else (mid, hi)
    return hi
