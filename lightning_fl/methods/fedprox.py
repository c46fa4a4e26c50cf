"""FedProx: Li et al. (2020), "Federated Optimization in Heterogeneous Networks" (MLSys).

Each client minimises its loss plus ``mu / 2 * ||w - w_global||^2`` over its trainable (federated)
parameters, which limits client drift under heterogeneous data. The anchor ``w_global`` is the state
the client received: this module records it in :meth:`FedProx.load_federated_state`, which the federated
trainer calls at the start of every client's local training. Under ``lightning.Trainer`` (no
federation) there is no anchor and the module trains like :class:`Classifier`.
"""

from __future__ import annotations

import torch

from lightning_fl.errors import ConfigError
from lightning_fl.methods.classifier import Classifier


class FedProx(Classifier):
    """A :class:`Classifier` whose clients add the FedProx proximal term.

    Args:
        mu: Proximal weight (the paper tunes it in {0.001, 0.01, 0.1, 1}).
        *args: As :class:`Classifier`.
        **kwargs: As :class:`Classifier`.
    """

    def __init__(self, *args, mu: float = 0.01, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if mu < 0:
            raise ConfigError(f"model.mu must be >= 0, got {mu}")
        self.mu = mu
        self._anchor: dict[str, torch.Tensor] = {}

    def load_federated_state(self, state: dict[str, torch.Tensor]) -> None:
        super().load_federated_state(state)
        self._anchor = {name: t.detach().clone() for name, t in state.items()}

    def proximal_term(self) -> torch.Tensor:
        params = dict(self.named_parameters())
        terms = [((params[n] - a.to(params[n])) ** 2).sum() for n, a in self._anchor.items()]
        return 0.5 * self.mu * torch.stack(terms).sum() if terms else torch.zeros((), device=self.device)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.mu > 0 and self._anchor:
            loss = loss + self.proximal_term()
        return loss
