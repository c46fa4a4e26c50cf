"""The privacy audit's estimators (:mod:`lightning_fl.privacy.audit`): Andrew et al.'s one-shot epsilon-hat from the
canaries' scores with its bootstrap interval, and Steinke et al.'s one-run lower bound with its p-value and the largest
epsilon a number of guesses can show."""

from __future__ import annotations

import math

import numpy as np
from scipy import stats


def gaussian_pair_epsilon(mu0: float, sd0: float, mu1: float, sd1: float, delta: float) -> float:
    """Epsilon at ``delta`` of telling ``N(mu0, sd0^2)`` from ``N(mu1, sd1^2)``, both ways: the smallest epsilon
    whose hockey-stick divergence ``int (p - e^eps q)_+`` is at most ``delta`` for ``(p, q)`` either way round, by
    numerical integration (capped at 100)."""
    if not (sd0 > 0 and sd1 > 0):
        return math.inf if mu0 != mu1 else 0.0
    width = 14 * max(sd0, sd1)
    x = np.linspace(min(mu0, mu1) - width, max(mu0, mu1) + width, 8_001)
    dx = x[1] - x[0]
    log0, log1 = stats.norm.logpdf(x, mu0, sd0), stats.norm.logpdf(x, mu1, sd1)

    def divergence(eps: float) -> float:
        one = np.exp(log1) * np.clip(1 - np.exp(np.minimum(eps + log0 - log1, 50)), 0, None)
        other = np.exp(log0) * np.clip(1 - np.exp(np.minimum(eps + log1 - log0, 50)), 0, None)
        return max(float(one.sum()), float(other.sum())) * dx

    if divergence(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 100.0
    if divergence(hi) > delta:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if divergence(mid) <= delta else (mid, hi)
    return hi


def one_shot_epsilon(inserted: np.ndarray, absent: np.ndarray, delta: float) -> float:
    """Andrew et al.'s estimate: a Gaussian fitted to each set of scores, the epsilon between them."""
    return gaussian_pair_epsilon(
        float(np.mean(absent)),
        float(np.std(absent, ddof=1)),
        float(np.mean(inserted)),
        float(np.std(inserted, ddof=1)),
        delta,
    )


def bootstrap_interval(inserted, absent, delta, confidence, rng, resamples=200) -> tuple[float, float]:
    """A percentile bootstrap interval of :func:`one_shot_epsilon` (both sets resampled)."""
    draws = [
        one_shot_epsilon(rng.choice(inserted, len(inserted)), rng.choice(absent, len(absent)), delta)
        for _ in range(resamples)
    ]
    tail = (1 - confidence) / 2
    return float(np.quantile(draws, tail)), float(np.quantile(draws, 1 - tail))


def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The probability, were the run (eps, delta)-DP, of ``v`` or more correct guesses of ``r`` about ``m`` canaries
    each inserted with probability 1/2 (Steinke et al., Theorem 5.2): ``P[Binom(r, p) >= v] + 2 m delta alpha``,
    ``p = e^eps / (1 + e^eps)``, ``alpha = max_i P[v - i <= Binom(r, p) < v] / i``."""
    p = 1 / (1 + math.exp(-eps))
    tail = float(stats.binom.sf(v - 1, r, p))
    below = np.cumsum(stats.binom.pmf(v - np.arange(1, v + 1), r, p))  # P[v - i <= B < v], i = 1..v
    alpha = float(np.max(below / np.arange(1, v + 1))) if v > 0 else 0.0
    return min(1.0, tail + 2 * m * delta * alpha)


def one_run_lower_bound(m: int, r: int, v: int, delta: float, confidence: float) -> float:
    """The largest epsilon that ``v`` correct guesses of ``r`` rule out at ``confidence`` (0: none)."""
    if not 0.5 <= confidence < 1:
        raise ValueError(f"a lower bound's confidence must be in [0.5, 1), got {confidence!r}")
    level = 1 - confidence
    if r == 0 or one_run_p_value(m, r, v, 0.0, delta) >= level:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) < level and hi < 100:
        lo, hi = hi, hi * 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if one_run_p_value(m, r, v, mid, delta) < level else (lo, mid)
    return lo


def one_run_ceiling(m: int, r: int, delta: float, confidence: float) -> float:
    """The largest lower bound ``r`` guesses about ``m`` canaries can give (all right): no epsilon above it shows."""
    return one_run_lower_bound(m, r, r, delta, confidence)
