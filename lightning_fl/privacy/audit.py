"""An empirical audit of a private run with canary clients (``trainer.privacy_audit``).

The accountant's epsilon is an upper bound proved for the mechanism as written. An audit measures what the
released states actually leak, so that a mechanism that does not do what the accountant assumes (less noise than
accounted, a clip that does not clip) is caught. Two measurements from one run, after

- Andrew, Chien, Hardt, Kairouz, Ramage, Sun, Thakurta (2024), "One-shot Empirical Privacy Estimation for
  Federated Learning" (ICLR): ``k`` canary clients, each a fixed random unit direction ``c_i`` in the space of the
  federated state; each is *inserted* with probability 1/2, and an inserted canary is sampled in every round with
  the rate of a real client (``m / N``) and then uploads ``S c_i`` (``S`` the clip bound of that round: an update at
  the bound). The score of a canary is the cosine between ``c_i`` and the released mean update of a round (its
  largest over the rounds: *every iterate*), or the released model's total update (*final model*). Scores of the
  canaries not inserted are what a random direction scores; those of the inserted ones are shifted by what the
  mechanism lets through. With a Gaussian fitted to each set, the estimate ``epsilon-hat`` is the epsilon at
  ``delta`` of telling the two Gaussians apart (their privacy curve, computed numerically), with a bootstrap
  confidence interval over the canaries. It is an estimate, not a bound.
- Steinke, Nasr, Jagielski (2023), "Privacy Auditing with One (1) Training Run" (NeurIPS): the auditor guesses
  "inserted" for the 10% highest every-iterate scores and "not inserted" for the 10% lowest (fixed in advance); if
  the mechanism were (epsilon, delta)-DP, ``v`` correct guesses of ``r`` would be at most as likely as under
  ``Binomial(r, e^eps / (1 + e^eps))``, up to a term in ``delta`` (their Theorem 5.2). The largest epsilon that
  this rejects at the chosen confidence is a **lower bound** that holds with that confidence. Even all ``r`` right
  rule out nothing above :func:`one_run_ceiling` (2.55 for 200 canaries, 4.17 for 1,000, about 8.25 at most at
  delta 1e-5): the report says whether the bound could contradict the accountant at all (``one_run_can_fail``).

Where the canaries enter (:mod:`lightning_fl.federated.server.stages.audit`): under central and
distributed DP their clipped updates join the round's clipped sum before the noise of the same release, so the
audited release is ``(sum + canaries + noise) / m``; under local DP each canary's upload goes through the
mechanism's own ``privatize`` (clip and noise), and an inserted canary is scored on its own uploads, a canary not
inserted on the uploads a replaced client would have sent in its place. The canaries never touch the model users
get: the stage scores the release with them added and the round goes on with the release without them (the same
bits as a run without the audit). Under DP-SGD alone (no ``trainer.privacy``) the canaries are records of the first
client to train (:class:`RecordCanaries`): each of its steps draws every inserted canary with the records' rate
and scores the step's noised gradient sum with the drawn canaries' gradients (``C c_i``) added; the white-box view
of every step, which the accountant's composition covers. What it does not cover: codecs and secure aggregation
(the canaries are added to the decoded sum), adaptive clipping's count (canaries are not counted), DP-SGD on
Flower (its steps run on the nodes) or in vectorised cohorts. Canary directions come from the OS (``seed`` null)
or a seed; the directions are kept in memory as float32 (``canaries x D x 4`` bytes, at most ``max_memory_mb``).
"""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_fl.errors import ConfigError
from lightning_fl.privacy.audit_estimates import (
    bootstrap_interval as bootstrap_interval,
)
from lightning_fl.privacy.audit_estimates import (
    gaussian_pair_epsilon as gaussian_pair_epsilon,
)
from lightning_fl.privacy.audit_estimates import (
    one_run_ceiling as one_run_ceiling,
)
from lightning_fl.privacy.audit_estimates import (
    one_run_lower_bound as one_run_lower_bound,
)
from lightning_fl.privacy.audit_estimates import (
    one_run_p_value as one_run_p_value,
)
from lightning_fl.privacy.audit_estimates import (
    one_shot_epsilon as one_shot_epsilon,
)


class PrivacyAudit:
    """Canary clients that measure what a private run leaks (module docstring); ``trainer.privacy_audit``.

    Args:
        canaries: How many canary clients (each inserted with probability 1/2).
        confidence: Of the bootstrap interval and of the one-run lower bound, in [0.5, 1).
        guess_fraction: The share of canaries guessed "inserted" (highest scores), and as many "not inserted"
            (lowest), for the one-run bound.
        seed: Of the canaries' directions and insertions, an integer >= 0 (``null``: the OS's randomness).
        max_memory_mb: The most memory the directions may take (``canaries x D x 4`` bytes).
    """

    def __init__(
        self,
        canaries: int = 1000,
        confidence: float = 0.95,
        guess_fraction: float = 0.1,
        seed: int | None = None,
        max_memory_mb: float = 1024.0,
    ) -> None:
        problems = [f"trainer.privacy_audit.canaries must be an integer >= 10, got {canaries!r}"] * (
            isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < 10
        )
        if not (isinstance(confidence, (int, float)) and 0.5 <= confidence < 1):  # (below 1/2 a bound says nothing)
            problems.append(f"trainer.privacy_audit.confidence must be in [0.5, 1), e.g. 0.95, got {confidence!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            problems.append(f"trainer.privacy_audit.seed must be an integer >= 0 or null, got {seed!r}")
        if not (isinstance(max_memory_mb, (int, float)) and math.isfinite(max_memory_mb) and max_memory_mb > 0):
            problems.append(f"trainer.privacy_audit.max_memory_mb must be a finite number > 0, got {max_memory_mb!r}")
        problems += [f"trainer.privacy_audit.guess_fraction must be in (0, 0.5], got {guess_fraction!r}"] * (
            not 0 < guess_fraction <= 0.5
        )
        if problems:
            raise ConfigError("; ".join(problems))
        self.canaries, self.confidence, self.guess_fraction = canaries, confidence, guess_fraction
        self.seed, self.max_memory_mb = seed, max_memory_mb

    def setup(self, dim: int, rate: float, seed: int | None = None) -> None:
        """Draw the canaries for a federated state of ``dim`` numbers, sampled at ``rate`` per round."""
        if self.canaries * dim * 4 > self.max_memory_mb * 2**20:
            raise ConfigError(
                f"trainer.privacy_audit: {self.canaries} canaries of {dim:,} numbers take "
                f"{self.canaries * dim * 4 / 2**20:,.0f} MiB, more than max_memory_mb={self.max_memory_mb:g}: lower "
                "canaries or raise max_memory_mb"
            )
        self.drawn_seed = seed if seed is not None else (self.seed if self.seed is not None else secrets.randbits(63))
        rng = np.random.default_rng(self.drawn_seed)
        directions = rng.standard_normal((self.canaries, dim), dtype=np.float32)
        self.directions = torch.from_numpy(directions / np.linalg.norm(directions, axis=1, keepdims=True))
        self.inserted = rng.random(self.canaries) < 0.5
        self.rate, self.rng = rate, rng
        self.every = torch.full((self.canaries,), -math.inf, dtype=torch.float64)  # max over rounds
        self.total = torch.zeros(dim, dtype=torch.float64)  # the audited releases, summed: the final model's
        self.rounds = 0

    def sampled(self) -> np.ndarray:
        """This round's canaries (indices): each with the real clients' rate (the draw is made for every canary, so
        an inserted one's rounds do not depend on which others are inserted)."""
        return np.flatnonzero(self.rng.random(self.canaries) < self.rate)

    def observe(self, release: torch.Tensor) -> None:
        """Score a round's audited release (float64 ``(D,)``, canaries included) against every canary."""
        self.total += release
        self.rounds += 1
        norm = float(release.norm())
        if norm > 0:
            scores = (self.directions @ release.float()).double() / norm
            self.every = torch.maximum(self.every, scores)

    def observe_each(self, indices: np.ndarray, uploads: torch.Tensor) -> None:
        """Score canary uploads seen one by one (local DP): canary ``indices[j]`` against its row ``uploads[j]``."""
        self.rounds += 1
        if len(indices):
            rows = self.directions[torch.from_numpy(indices)]
            scores = (rows * uploads.float()).sum(1).double() / uploads.double().norm(dim=1).clamp_min(1e-300)
            self.every[indices] = torch.maximum(self.every[indices], scores)

    def report(self, epsilon: float, delta: float) -> dict[str, Any]:
        """The estimates (and what they are next to: the accountant's ``epsilon`` at ``delta``)."""
        if not hasattr(self, "every"):
            seen = "no release was seen in this process (on Flower, DP-SGD's steps run on the nodes)"
            return {
                "canaries": self.canaries,
                "inserted": 0,
                "rounds": 0,
                "accountant_epsilon": epsilon,
                "delta": delta,
                "confidence": self.confidence,
                "problem": seen,
            }
        seen = torch.isfinite(self.every).numpy()
        inserted, absent = self.inserted & seen, ~self.inserted & seen
        every = self.every.numpy()
        out: dict[str, Any] = {
            "canaries": self.canaries,
            "inserted": int(self.inserted.sum()),
            "rounds": self.rounds,
            "accountant_epsilon": epsilon,
            "delta": delta,
            "confidence": self.confidence,
        }
        if min(inserted.sum(), absent.sum()) < 5:
            return {**out, "problem": "too few canaries were seen to estimate anything"}
        boot = np.random.default_rng(self.drawn_seed + 1)
        out["epsilon_hat_every_round"] = one_shot_epsilon(every[inserted], every[absent], delta)
        out["interval_every_round"] = bootstrap_interval(every[inserted], every[absent], delta, self.confidence, boot)
        if float(self.total.norm()) > 0 and bool(seen.all()):
            final = ((self.directions @ self.total.float()).double() / float(self.total.norm())).numpy()
            out["epsilon_hat_final_model"] = one_shot_epsilon(final[self.inserted], final[~self.inserted], delta)
        k = max(1, int(self.guess_fraction * int(seen.sum())))
        order = np.argsort(every[seen])
        truth = self.inserted[seen]
        correct = int(truth[order[-k:]].sum()) + int((~truth[order[:k]]).sum())
        out["one_run_guesses"], out["one_run_correct"] = 2 * k, correct
        out["one_run_lower_bound"] = one_run_lower_bound(int(seen.sum()), 2 * k, correct, delta, self.confidence)
        out["one_run_ceiling"] = one_run_ceiling(int(seen.sum()), 2 * k, delta, self.confidence)
        out["one_run_can_fail"] = bool(epsilon < out["one_run_ceiling"])
        out["violation"] = violation(out)
        return out

    def __repr__(self) -> str:
        return f"PrivacyAudit(canaries={self.canaries}, confidence={self.confidence}, seed={self.seed})"


def violation(report: dict[str, Any]) -> str | None:
    """Whether the audit contradicts the accountant: its lower bound above the accountant's epsilon (the guarantee
    is broken, at the audit's confidence), or the estimate's whole interval above it (the mechanism very likely
    leaks more than it accounts)."""
    epsilon = report["accountant_epsilon"]
    if report["one_run_lower_bound"] > epsilon:
        return (
            f"the one-run lower bound {report['one_run_lower_bound']:.3g} exceeds the accountant's epsilon "
            f"{epsilon:.4g}: the mechanism does not give the guarantee it accounts"
        )
    if report["interval_every_round"][0] > epsilon:
        return (
            f"the estimate's whole interval lies above the accountant's epsilon {epsilon:.4g}: the mechanism "
            "very likely leaks more than it accounts (less noise or a weaker clip than assumed)"
        )
    return None


class RecordCanaries:
    """The audit's canaries as records of one client under DP-SGD (``trainer.dp_sgd`` without ``trainer.privacy``):
    the first client to train is audited; at each of its steps every inserted canary is drawn with the records'
    Poisson rate ``q``, and a drawn canary's gradient (``C c_i``, at the clip bound) joins the step's noised,
    scaled gradient sum (``scale = C / B``), which is scored; the optimiser steps from the sum without them."""

    def __init__(self, audit: PrivacyAudit) -> None:
        self.audit, self.client = audit, None

    def step(self, client: int, gradient: torch.Tensor, q: float, scale: float) -> None:
        if self.client is None:
            self.client = client
            self.audit.setup(gradient.numel(), q)
        if client != self.client:
            return
        picked = self.audit.sampled()
        inserted = picked[self.audit.inserted[picked]]
        canaries = self.audit.directions[torch.from_numpy(inserted)].double().sum(0) * scale
        self.audit.observe(gradient.double() + canaries)


def audit_lines(report: dict[str, Any]) -> list[str]:
    """The run summary's lines for an audit ``report``."""
    what = report.get("level", "canary clients")
    head = f"privacy audit ({report['canaries']:,} {what}, {report['inserted']:,} inserted)"
    if "problem" in report:
        return [f"{head}: {report['problem']}"]
    lo, hi = report["interval_every_round"]
    conf = f"{report['confidence']:.0%}"
    lines = [
        f"{head}: epsilon-hat {report['epsilon_hat_every_round']:.3g} ({conf} interval {lo:.3g}-{hi:.3g}) from "
        f"every released {report.get('unit', 'round')} (Andrew et al. 2024: an estimate)"
    ]
    if "epsilon_hat_final_model" in report:
        lines[0] += f", {report['epsilon_hat_final_model']:.3g} from the final model"
    lines.append(
        f"  one-run lower bound {report['one_run_lower_bound']:.3g} at {conf} confidence ("
        f"{report['one_run_correct']} of {report['one_run_guesses']} guesses right; Steinke et al. 2023); "
        f"the accountant's epsilon {report['accountant_epsilon']:.4g} is an upper bound"
    )
    lines += [power_line(report)] if "one_run_ceiling" in report else []
    if report.get("violation"):
        lines.append(f"  warning: {report['violation']}")
    return lines


def power_line(report: dict[str, Any]) -> str:
    """What the one-run bound could show at most, and whether that can contradict the accountant."""
    ceiling, guesses, epsilon = report["one_run_ceiling"], report["one_run_guesses"], report["accountant_epsilon"]
    head = f"  the largest epsilon {guesses} guesses can show is {ceiling:.3g} (all right): "
    if report["one_run_can_fail"]:
        return head + f"the bound could contradict the accountant's {epsilon:.4g}"
    tail = f"the accountant's {epsilon:.4g} lies above it: this bound cannot contradict it (more canaries raise it)"
    return head + tail


def write_report(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=1, default=float) + "\n")
