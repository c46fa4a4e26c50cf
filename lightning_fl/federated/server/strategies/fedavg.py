"""FedAvg: McMahan et al. (2017), "Communication-Efficient Learning of Deep Networks from Decentralized Data".

The next global state is the mean of the clients' uploads, unweighted (the FLITE paper) or weighted by each
client's number of training samples (the FedAvg paper's ``n_k / n``).
"""

from __future__ import annotations

import torch

from lightning_fl.federated.server.strategies.base import Strategy


class FedAvg(Strategy):
    """Mean of the uploads.

    Args:
        weighted: Weight each upload by its client's sample count (``false``: every client counts once).
        min_clients: Fewest accepted uploads a round needs; with fewer the round keeps the global state.
    """

    linear = True

    def __init__(self, weighted: bool = False, min_clients: int = 1) -> None:
        super().__init__(min_clients)
        self.weighted = weighted

    def step(self, round, current, mean) -> tuple[torch.Tensor, dict[str, float]]:
        return mean, {}

    def __repr__(self) -> str:
        return f"FedAvg(weighted={self.weighted})"
