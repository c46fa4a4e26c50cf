"""What a LightningModule's ``self.log`` and ``self.trainer`` reach when our own loops run its steps.

Lightning lets a module run outside ``lightning.Trainer``: when its public ``fabric`` property is set,
``self.log``/``self.log_dict`` go to ``fabric.log_dict`` and ``self.trainer.<name>`` is looked up on that
object. Our loops (client training, federated evaluation, base pretraining) attach a :class:`StepContext`
there for the duration of a phase with :func:`attached`, so a user's ``training_step`` logs unchanged under
``lightning.Trainer`` and under ``FederatedTrainer``:

- values logged in steps are averaged, weighted by the batch size the loop sets in ``weight``;
- values logged in epoch-end hooks (already synchronised, e.g. torchmetrics) are kept as they are;
- ``self.trainer.client_id`` and ``self.trainer.current_round`` tell a module which client and round it
  trains (``None`` outside client training); other attributes come from the loop's Fabric, so
  ``self.trainer.world_size`` and similar still work.

With ``sync`` (and a Fabric), :meth:`StepContext.reduce` averages step values over all processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


class StepContext:
    """Collects what a module logs during one phase (a client's local training, an evaluation, an epoch).

    Args:
        fabric: The loop's Fabric (attribute look-ups the context does not answer go there), or ``None``.
        client: The client being trained, if any (``self.trainer.client_id`` in a module).
        round: The federated round, if any (``self.trainer.current_round``; 0-based).
        sync: Average step values over every process in :meth:`reduce`.
    """

    def __init__(self, fabric: Any, client: int | None = None, round: int | None = None, sync: bool = True) -> None:
        self._fabric = fabric
        self.sync = sync and fabric is not None
        self.client_id, self.current_round = client, round
        self.phase = "step"
        self.weight = 1
        self.current_epoch = 0
        self.global_step = 0
        #: Whether a step may stop training on a non-finite loss (a recipe's ``check_loss``). DP-SGD sets it false:
        #: a record's non-finite gradient is zeroed out of the step instead, since stopping would tell the server
        #: what one record holds.
        self.check_finite = True
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._epoch_end: dict[str, float] = {}

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") or self.__dict__.get("_fabric") is None:
            raise AttributeError(item)
        return getattr(self._fabric, item)

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: dict[str, Any], step: int | None = None) -> None:
        for key, value in metrics.items():
            value = float(value.detach().float()) if isinstance(value, torch.Tensor) else float(value)
            if self.phase == "step":
                self._sums[key] = self._sums.get(key, 0.0) + value * self.weight
                self._weights[key] = self._weights.get(key, 0.0) + self.weight
            else:
                self._epoch_end[key] = value

    def weighted(self, key: str) -> tuple[float, float]:
        """(weighted sum, total weight) of a step-logged value on this process."""
        return self._sums.get(key, 0.0), self._weights.get(key, 0.0)

    def step_values(self) -> dict[str, tuple[float, float]]:
        """Every step-logged key with its (weighted sum, total weight) on this process."""
        return {key: self.weighted(key) for key in sorted(self._sums)}

    def reduce(self) -> dict[str, float]:
        """Step values averaged over every process's batches; epoch-end values as logged."""
        keys = sorted(self._sums)
        if self.sync and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(everyone, keys)
            keys = sorted({k for ks in everyone for k in ks})
            pairs = torch.tensor(
                [[self._sums.get(k, 0.0), self._weights.get(k, 0.0)] for k in keys], dtype=torch.float64
            )
            pairs = self._fabric.all_reduce(self._fabric.to_device(pairs), reduce_op="sum").cpu()
        else:
            pairs = torch.tensor([[self._sums[k], self._weights[k]] for k in keys], dtype=torch.float64)
        out = {k: float(s / w) for k, (s, w) in zip(keys, pairs.tolist(), strict=True) if w > 0}
        out.update(self._epoch_end)
        return out


@contextlib.contextmanager
def attached(module: Any, context: StepContext) -> Iterator[StepContext]:
    """Route ``module``'s ``self.log`` and ``self.trainer`` to ``context`` (Lightning's public ``fabric`` property).

    The previous value is restored on exit, also when a step raises.
    """
    previous = module.fabric
    module.fabric = context
    try:
        yield context
    finally:
        module.fabric = previous
