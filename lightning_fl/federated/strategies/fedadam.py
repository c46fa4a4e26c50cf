"""FedAdam: Reddi et al. (2021), "Adaptive Federated Optimization" (ICLR):
``v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2``."""

from __future__ import annotations

import torch

from lightning_fl.federated.strategies.fedopt import FedOpt


class FedAdam(FedOpt):
    """Adam on the server (see :mod:`lightning_fl.federated.strategies.fedopt`).

    Args:
        server_lr: Server learning rate (the paper's eta).
        tau: Adaptivity (the paper's tau), > 0.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        weighted: Weight uploads by client sample count in the mean.
        min_clients: Fewest accepted uploads a round needs; with fewer the round keeps the global state.
    """

    def __init__(
        self,
        server_lr: float = 0.1,
        tau: float = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.99,
        weighted: bool = False,
        min_clients: int = 1,
    ) -> None:
        super().__init__(server_lr, tau, beta1, beta2, weighted, min_clients)

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return self.beta2 * v + (1 - self.beta2) * delta_sq
