"""FedYogi: Reddi et al. (2021), "Adaptive Federated Optimization" (ICLR), after Yogi (Zaheer et al. 2018):
``v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)``: ``v`` moves towards ``Delta^2`` by at most
``(1 - beta2) Delta^2`` per round, so a burst of large updates raises it more slowly than Adam would."""

from __future__ import annotations

import torch

from lightning_fl.federated.server.strategies.fedopt import FedOpt


class FedYogi(FedOpt):
    """Yogi on the server; arguments as :class:`~lightning_fl.federated.server.strategies.fedopt.FedOpt`."""

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.beta2) * delta_sq * torch.sign(v - delta_sq)
