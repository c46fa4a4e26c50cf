"""Evaluation of the global model: the module's own validation/test steps, sharded over processes."""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Subset

from lightning_fl.context import StepContext, attached
from lightning_fl.steps import batch_size

log = logging.getLogger(__name__)
#: Seconds between two progress lines of a long evaluation (a language model generating answers on a CPU).
PROGRESS_EVERY_S = 20.0


def shard(loader: DataLoader, fabric: L.Fabric) -> DataLoader:
    """This process's share of ``loader``: every ``world_size``-th batch, so metrics sum over processes."""
    if fabric.world_size == 1:
        return loader
    n, bs = len(loader.dataset), loader.batch_size
    mine = [i for i in range(n) if (i // bs) % fabric.world_size == fabric.global_rank]
    return DataLoader(Subset(loader.dataset, mine), batch_size=bs, shuffle=False, num_workers=loader.num_workers)


def evaluate(
    model: L.LightningModule, datamodule: Any, stage: str, fabric: L.Fabric, limit_batches: int | None = None
) -> dict[str, float]:
    """Run ``validation_step`` (``stage='val'``) or ``test_step`` and the epoch end; metrics synchronised."""
    if limit_batches == 0:
        return {}
    loader = shard(datamodule.val_dataloader() if stage == "val" else datamodule.test_dataloader(), fabric)
    step = model.validation_step if stage == "val" else model.test_step
    epoch_end = model.on_validation_epoch_end if stage == "val" else model.on_test_epoch_end
    total = len(loader) if limit_batches is None else min(limit_batches, len(loader))
    started = last = time.perf_counter()
    model.eval()
    try:
        with attached(model, StepContext(fabric)) as context, torch.no_grad():
            for batch_idx, batch in enumerate(loader):
                if limit_batches is not None and batch_idx >= limit_batches:
                    break
                batch = fabric.to_device(batch)
                context.weight = batch_size(batch)
                with fabric.autocast():
                    step(batch, batch_idx)
                if time.perf_counter() - last >= PROGRESS_EVERY_S and fabric.is_global_zero:
                    last = time.perf_counter()
                    log.info("evaluating %s: batch %d/%d, %.0f s", stage, batch_idx + 1, total, last - started)
            context.phase = "epoch_end"
            epoch_end()
    finally:
        model.train()
    if last > started:  # (it printed a progress line: say when it ended)
        log.info("evaluated %s: %d batches in %.0f s", stage, total, time.perf_counter() - started)
    return context.reduce()
