"""The one optimisation step loop: a federated client's local training and a base's centralised pretraining.

Both drive the module's own ``training_step`` through a Fabric (device, precision: autocast, and the gradient
scaler of ``16-mixed``), clip gradients by norm, step the optimiser and its per-step scheduler, and route the
module's ``self.log`` to a :class:`~lightning_fl.context.StepContext` (which the caller attaches). The callers
differ only in what surrounds the loop: a client counts epochs or steps of one round; pretraining evaluates, logs
and writes TensorBoard scalars after every epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch

from lightning_fl.context import StepContext
from lightning_fl.errors import ConfigError


def batch_size(batch: Any) -> int:
    """Number of samples in a batch (a tensor, a tuple/list starting with a tensor, or a dict of tensors)."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return len(batch[0])
    if isinstance(batch, dict):
        first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        if first is not None:
            return len(first)
    return 1


def train_steps(
    module: L.LightningModule,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loader: Iterable,
    fabric: L.Fabric,
    context: StepContext,
    *,
    epochs: int = 1,
    steps: int | None = None,
    clip: float | None = None,
    no_batches: str = "the data has no training batches",
    after_batch: Callable[[int, int], None] | None = None,
) -> int:
    """Train ``module`` for ``epochs`` over ``loader``, or for ``steps`` optimiser steps (cycling it); return the
    number of steps taken.

    ``optimizer`` is set up by ``fabric`` (its ``step`` runs the precision plugin's); ``scheduler`` (or ``None``)
    is stepped after every optimiser step; ``clip`` bounds the gradients' global L2 norm (non-finite gradients are
    not an error here: the loss's own check, or the upload gate, reports them). ``context`` receives each batch's
    size (the weight of what the step logs), the epoch and the step count; ``after_batch(epoch, batch)`` is called
    after every step. An epoch without batches raises :class:`ConfigError` with ``no_batches``.
    """
    taken = 0
    for epoch in range(epochs if steps is None else 10**9):
        context.current_epoch = epoch
        for batch_idx, batch in enumerate(loader):
            if fabric.device.type != "cpu":  # batches are made on the CPU
                batch = fabric.to_device(batch)
            context.weight = batch_size(batch)
            with fabric.autocast():
                out = module.training_step(batch, batch_idx)
            loss = out["loss"] if isinstance(out, dict) else out
            fabric.backward(loss)
            if clip is not None:
                fabric.clip_gradients(module, optimizer, max_norm=clip, error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
            taken += 1
            context.global_step = taken
            if after_batch is not None:
                after_batch(epoch, batch_idx)
            if steps is not None and taken >= steps:
                return taken
        if taken == 0:
            raise ConfigError(no_batches)
    return taken
