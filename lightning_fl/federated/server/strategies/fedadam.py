"""FedAdam: Reddi et al. (2021), "Adaptive Federated Optimization" (ICLR):
``v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2``."""

from __future__ import annotations

import torch

from lightning_fl.federated.server.strategies.fedopt import FedOpt


class FedAdam(FedOpt):
    """Adam on the server; arguments as :class:`~lightning_fl.federated.server.strategies.fedopt.FedOpt`."""

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return self.beta2 * v + (1 - self.beta2) * delta_sq
