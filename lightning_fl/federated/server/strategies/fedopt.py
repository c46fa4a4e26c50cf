"""Adaptive server optimisers: Reddi et al. (2021), "Adaptive Federated Optimization" (ICLR), Algorithm 2.

Each round the server treats ``Delta_t = mean_k(x_k) - x_t`` (minus the pseudo-gradient ``x_t - mean``) as a
gradient step and applies a first moment and a per-coordinate second moment:

    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
    v_t = <rule>(v_{t-1}, Delta_t^2)        (FedAdagrad, FedAdam, FedYogi differ only here)
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

with ``m_{-1} = 0`` and ``v_{-1} = tau^2`` (the paper's ``v_{-1} >= tau^2``). As in the paper there is no bias
correction. ``tau`` bounds the per-coordinate step by ``eta |m| / tau`` and keeps the update finite.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_fl.errors import ConfigError
from lightning_fl.federated.server.strategies.base import Strategy


class FedOpt(Strategy):
    """Shared base of FedAdagrad, FedAdam and FedYogi; subclasses define :meth:`second_moment`.

    Args:
        server_lr: Server learning rate (the paper's eta).
        tau: Adaptivity (the paper's tau), > 0.
        beta1: First-moment decay.
        beta2: Second-moment decay (FedAdam, FedYogi).
        weighted: Weight uploads by client sample count in the mean.
        min_clients: Fewest accepted uploads a round needs; with fewer the round keeps the global state.
    """

    _plugin_base = True

    def __init__(
        self,
        server_lr: float = 0.1,
        tau: float = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.99,
        weighted: bool = False,
        min_clients: int = 1,
    ) -> None:
        super().__init__(min_clients)
        problems = []
        if not server_lr > 0:
            problems.append(f"trainer.strategy.server_lr must be > 0, got {server_lr}")
        if not tau > 0:
            problems.append(f"trainer.strategy.tau must be > 0, got {tau}")
        for key, value in (("beta1", beta1), ("beta2", beta2)):
            if not 0 <= value < 1:
                problems.append(f"trainer.strategy.{key} must be in [0, 1), got {value}")
        if problems:
            raise ConfigError("; ".join(problems))
        self.server_lr, self.tau, self.beta1, self.beta2, self.weighted = server_lr, tau, beta1, beta2, weighted
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        """``v_t`` from ``v_{t-1}`` and ``Delta_t^2``."""
        raise NotImplementedError

    def step(self, round, current, mean) -> tuple[torch.Tensor, dict[str, float]]:
        x = current.to(torch.float64)
        delta = mean - x
        if self.m is None:
            self.m = torch.zeros_like(x)
            self.v = torch.full_like(x, self.tau**2)
        self.m = self.beta1 * self.m + (1 - self.beta1) * delta
        self.v = self.second_moment(self.v, delta * delta)
        step = self.server_lr * self.m / (self.v.sqrt() + self.tau)
        return x + step, {"pseudo_grad_norm": float(delta.norm()), "step_norm": float(step.norm())}

    def state_dict(self) -> dict[str, Any]:
        return {} if self.m is None else {"m": self.m.clone(), "v": self.v.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m = state["m"].clone() if "m" in state else None
        self.v = state["v"].clone() if "v" in state else None

    def __repr__(self) -> str:
        return f"{self.name}(server_lr={self.server_lr}, tau={self.tau}, beta1={self.beta1}, beta2={self.beta2})"
