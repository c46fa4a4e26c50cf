"""FedAvgM: Hsu, Qi and Brown (2019), "Measuring the Effects of Non-Identical Data Distribution for Federated
Visual Classification".

Server momentum on the pseudo-gradient ``g_t = x_t - mean_k(x_k)``: ``v_t = beta v_{t-1} + g_t`` and
``x_{t+1} = x_t - eta v_t``. With ``momentum = 0`` and ``server_lr = 1`` it is FedAvg.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_fl.errors import ConfigError
from lightning_fl.federated.server.strategies.base import Strategy


class FedAvgM(Strategy):
    """FedAvg with server momentum.

    Args:
        server_lr: Server learning rate eta.
        momentum: Server momentum beta.
        weighted: Weight uploads by client sample count in the mean.
        min_clients: Fewest accepted uploads a round needs; with fewer the round keeps the global state.
    """

    linear = True  # x_{t+1} is an affine combination of this and earlier rounds' uploads

    def __init__(self, server_lr: float = 1.0, momentum: float = 0.9, weighted: bool = False, min_clients: int = 1):
        super().__init__(min_clients)
        problems = []
        if not server_lr > 0:
            problems.append(f"trainer.strategy.server_lr must be > 0, got {server_lr}")
        if not 0 <= momentum < 1:
            problems.append(f"trainer.strategy.momentum must be in [0, 1), got {momentum}")
        if problems:
            raise ConfigError("; ".join(problems))
        self.server_lr, self.momentum, self.weighted = server_lr, momentum, weighted
        self.velocity: torch.Tensor | None = None

    def step(self, round, current, mean) -> tuple[torch.Tensor, dict[str, float]]:
        x = current.to(torch.float64)
        grad = x - mean  # pseudo-gradient
        self.velocity = grad if self.velocity is None else self.momentum * self.velocity + grad
        return x - self.server_lr * self.velocity, {"pseudo_grad_norm": float(grad.norm())}

    def state_dict(self) -> dict[str, Any]:
        return {} if self.velocity is None else {"velocity": self.velocity.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.velocity = state["velocity"].clone() if "velocity" in state else None

    def __repr__(self) -> str:
        return f"FedAvgM(server_lr={self.server_lr}, momentum={self.momentum})"
