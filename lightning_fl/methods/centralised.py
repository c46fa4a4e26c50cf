"""A plain, collective-free training loop for a Classifier, used to pretrain bases inside other runs.

``lightning.Trainer`` cannot run nested inside a process that is part of a process group (its
``prepare_data`` barrier creates a new group on one rank only), and one rank of a federated run
must pretrain the base while the others wait. This loop drives the module's own ``make_optimizer`` and the
warm-up/cosine schedule through the federated clients' step loop (:func:`lightning_fl.steps.train_steps`) on a
Fabric of one device, with torchmetrics synchronisation switched off; it evaluates, logs and writes TensorBoard
scalars after every epoch.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from lightning.fabric.strategies import SingleDeviceStrategy

from lightning_fl.context import StepContext, attached
from lightning_fl.methods.schedules import warmup_cosine_factor
from lightning_fl.steps import train_steps

log = logging.getLogger(__name__)
PROGRESS = ("train/loss", "val/acc", "val/loss")  # what the progress lines show
HEARTBEAT_SECONDS = 60.0  # the longest silence inside an epoch


def resolve_device(accelerator: str) -> torch.device:
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device("cpu")


def train_classifier(
    model: L.LightningModule,
    datamodule: object,
    epochs: int,
    accelerator: str = "auto",
    precision: str | None = None,
    log_dir: str | Path | None = None,
    label: str = "pretraining",
) -> dict[str, float]:
    """Train ``model`` on ``datamodule.train_dataloader()`` for ``epochs``; return the final validation metrics.

    Progress goes to the log as ``<label> epoch e/E: <metrics>`` every tenth of the run, and as
    ``<label> epoch e/E: batch b/B`` at most once a minute inside a long epoch.

    ``model`` is a :class:`~lightning_fl.methods.Classifier` (or has its ``make_optimizer`` and a ``recipe`` with
    ``warmup_epochs``, ``schedule`` and ``grad_clip``); this module does not import it, the classifier imports
    this module to pretrain its base.
    """
    device = resolve_device(accelerator)
    fabric = step_fabric(device, precision)
    model.to(device)
    for metric in model.modules():  # this process trains alone: never wait for others in compute()
        if isinstance(metric, torchmetrics.Metric):
            metric.sync_on_compute = False
            metric._to_sync = False
    loader = datamodule.train_dataloader()
    total = epochs * len(loader)
    warmup = round(model.recipe.warmup_epochs * len(loader))
    optimizer = model.make_optimizer([p for p in model.parameters() if p.requires_grad])
    schedule = model.recipe.schedule
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine_factor(step, warmup, total, schedule)
    )
    optimizer = fabric.setup_optimizers(optimizer)
    writer = None
    if log_dir is not None:
        from torch.utils.tensorboard import SummaryWriter  # here, not at import: most processes never write one

        writer = SummaryWriter(str(log_dir))
    metrics: dict[str, float] = {}
    last_line = time.monotonic()

    def heartbeat(epoch: int, batch_idx: int) -> None:
        nonlocal last_line
        if time.monotonic() - last_line >= HEARTBEAT_SECONDS:
            last_line = time.monotonic()
            log.info("%s epoch %d/%d: batch %d/%d", label, epoch + 1, epochs, batch_idx + 1, len(loader))

    try:
        for epoch in range(epochs):
            model.train()
            with attached(model, StepContext(None, sync=False)) as sink:  # one epoch's metrics
                train_steps(
                    model,
                    optimizer,
                    scheduler,
                    loader,
                    fabric,
                    sink,
                    clip=model.recipe.grad_clip,
                    after_batch=lambda _, b, e=epoch: heartbeat(e, b),
                )
            metrics = sink.reduce()
            metrics.update(evaluate_classifier(model, datamodule.val_dataloader(), device, fabric=fabric))
            if (epoch + 1) % max(1, epochs // 10) == 0 or epoch + 1 == epochs:  # a line every tenth of the run
                shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()) if k in PROGRESS)
                log.info("%s epoch %d/%d: %s", label, epoch + 1, epochs, shown)
                last_line = time.monotonic()
            if writer is not None:
                for key, value in metrics.items():
                    writer.add_scalar(key, value, epoch + 1)
    finally:
        if writer is not None:
            writer.close()
    return metrics


def step_fabric(device: torch.device, precision: str | None) -> L.Fabric:
    """A Fabric on ``device`` alone (no process group: it may run inside one) with ``precision``'s autocast and,
    for ``16-mixed`` on a GPU, its gradient scaler (on a CPU, Fabric runs ``16-mixed`` as ``bf16-mixed``)."""
    if precision not in (None, "32", "32-true", "bf16-mixed", "16-mixed"):
        raise ValueError(f"model.pretraining.precision must be 32-true, bf16-mixed or 16-mixed, got {precision!r}")
    precision = "32-true" if precision in (None, "32") else precision
    return L.Fabric(strategy=SingleDeviceStrategy(device), precision=precision, loggers=[])


@torch.no_grad()
def evaluate_classifier(
    model: L.LightningModule, loader, device: torch.device, precision: str | None = None, fabric: L.Fabric | None = None
) -> dict:
    """The module's own validation step and epoch end, collected without a trainer, under ``fabric``'s autocast
    (default: :func:`step_fabric` of ``device`` and ``precision``, as training uses)."""
    fabric = fabric if fabric is not None else step_fabric(device, precision)
    model.eval()
    try:
        with attached(model, StepContext(None, sync=False)) as sink:
            for batch_idx, (x, y) in enumerate(loader):
                sink.weight = len(y)
                with fabric.autocast():
                    model.validation_step((x.to(device), y.to(device)), batch_idx)
            sink.phase = "epoch_end"
            model.on_validation_epoch_end()
    finally:
        model.train()
    return sink.reduce()
