"""A stand-in for Fabric that collects what a LightningModule logs during client training or evaluation.

A LightningModule logs through ``self._fabric.log_dict`` when ``_fabric`` is set, so setting it to
a :class:`LogSink` lets the module's own ``training_step``/``validation_step`` run unchanged outside
``lightning.Trainer``. Values logged in steps are averaged, weighted by batch size; values logged
in epoch-end hooks (already synchronised, e.g. torchmetrics) are kept as they are. Other attribute
lookups go to the real Fabric, so ``self.trainer.world_size`` and similar still work in a module.
With ``sync`` (and a Fabric), :meth:`LogSink.reduce` averages step values over all processes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class LogSink:
    def __init__(self, fabric: Any, client: int | None = None, round: int | None = None, sync: bool = True) -> None:
        self._fabric = fabric
        self.sync = sync and fabric is not None
        self.client_id, self.current_round = client, round
        self.phase = "step"
        self.weight = 1
        self.current_epoch = 0
        self.global_step = 0
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._epoch_end: dict[str, float] = {}

    def __getattr__(self, item: str) -> Any:
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
