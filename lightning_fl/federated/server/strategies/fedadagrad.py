"""FedAdagrad: Reddi et al. (2021), "Adaptive Federated Optimization" (ICLR): ``v_t = v_{t-1} + Delta_t^2``."""

from __future__ import annotations

import torch

from lightning_fl.federated.server.strategies.fedopt import FedOpt


class FedAdagrad(FedOpt):
    """Adagrad on the server (see :mod:`lightning_fl.federated.server.strategies.fedopt`).

    Args:
        server_lr: Server learning rate (the paper's eta).
        tau: Adaptivity (the paper's tau), > 0.
        beta1: First-moment decay (0: plain Adagrad).
        weighted: Weight uploads by client sample count in the mean.
        min_clients: Fewest accepted uploads a round needs; with fewer the round keeps the global state.
    """

    def __init__(
        self,
        server_lr: float = 0.1,
        tau: float = 1e-3,
        beta1: float = 0.0,
        weighted: bool = False,
        min_clients: int = 1,
    ) -> None:
        super().__init__(server_lr, tau, beta1, 0.0, weighted, min_clients)

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return v + delta_sq
