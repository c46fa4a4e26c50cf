"""A client's local training under record-level DP-SGD (:class:`~lightning_fl.privacy.DPSGD`).

:func:`train_dp_sgd` replaces the plain local loop of :func:`~lightning_fl.federated.clients.client.run_client` when
``trainer.dp_sgd`` is set: Poisson-sampled batches of the client's records, per-record gradients, then Opacus'
``DPOptimizer`` (clipping, noise, scaling) around the module's own optimiser. The two engines differ only in how
each trainable parameter's ``grad_sample`` is obtained: Opacus' hooks around the module's ``training_step``
(``opacus``), or ``torch.func`` (``functorch``); the step itself is the same object's. A vectorised cohort's
DP-SGD, which clips and noises many clients' gradients at once, is :mod:`lightning_fl.federated.clients.dp_cohort`. See
:mod:`lightning_fl.privacy.dpsgd` for the guarantee and the accounting.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from torch.func import functional_call, grad, vmap

from lightning_fl.context import StepContext
from lightning_fl.errors import ConfigError
from lightning_fl.federated.clients.dp_engines import (
    batchnorm_problem as batchnorm_problem,
)
from lightning_fl.federated.clients.dp_engines import (
    choose_engine as choose_engine,
)
from lightning_fl.federated.clients.dp_engines import (
    functorch_problem as functorch_problem,
)
from lightning_fl.federated.clients.dp_engines import (
    opacus_problem as opacus_problem,
)
from lightning_fl.privacy.base import Randomness
from lightning_fl.privacy.dpsgd import DPSGD, ClientPlan


class PoissonBatches:
    """A client's records sampled for DP-SGD: at each step every record is taken independently with
    probability ``q`` (``rand(n) < q`` from ``sampling``, the draw of Opacus' ``DPDataLoader``). Yields the
    collated batch, or ``None`` when no record was drawn.

    Reads the records from the loader the data module made: a ``torch`` ``DataLoader`` (its ``dataset`` and
    ``collate_fn``) or :class:`~lightning_fl.data.datamodule.InMemoryBatches` (the same transform per batch).
    """

    def __init__(self, loader: Any, q: float, sampling: Randomness) -> None:
        from lightning_fl.data.datamodule import InMemoryBatches

        self.q, self.sampling = q, sampling
        if isinstance(loader, InMemoryBatches):
            self.n = len(loader.positions)
            self._take = lambda idx: (
                loader.transform.batch(loader.images[loader.positions[idx]]),
                loader.targets[loader.positions[idx]],
            )
        elif isinstance(loader, torch.utils.data.DataLoader):
            dataset, collate = loader.dataset, loader.collate_fn
            self.n = len(dataset)
            self._take = lambda idx: collate([dataset[i] for i in idx.tolist()])
        else:
            raise ConfigError(
                f"trainer.dp_sgd samples records from the client's dataset, but the data module's "
                f"client loader is a {type(loader).__name__}: return a torch DataLoader"
            )

    def __iter__(self) -> Iterator[Any]:
        while True:
            idx = (self.sampling.rand(self.n) < self.q).nonzero().reshape(-1)
            yield self._take(idx) if len(idx) else None


def train_dp_sgd(
    module: L.LightningModule,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loader: Any,
    fabric: L.Fabric,
    context: StepContext,
    plan: ClientPlan,
    dp: DPSGD,
    generators: tuple[Randomness, Randomness],
    engine: str,
) -> None:
    """``plan.steps`` DP-SGD steps of ``module`` (its state set, ``context`` attached) on ``loader``'s records: at
    each step the ``engine`` sets every trainable parameter's ``grad_sample`` (its per-record gradients, ``[records,
    *shape]``) and Opacus' ``DPOptimizer`` clips each record's gradient, sums them, adds the noise (from the second
    generator), divides by the expected batch size and steps ``optimizer``."""

    sampling, noise = generators
    records = PoissonBatches(loader, plan.q, sampling)
    if records.n != plan.records:
        raise ConfigError(
            f"trainer.dp_sgd: client {context.client_id}'s loader holds {records.n} records but the data module's "
            f"client_num_samples says {plan.records}; the sampling rate and the accountant need them equal"
        )
    batches = iter(records)
    per_epoch = -(-plan.records // plan.batch_size)  # the batches of an epoch: what current_epoch counts
    dp_optimizer = dp_optimizer_for(optimizer, plan, dp.max_grad_norm, noise)
    grad_samples = _opacus_grad_samples if engine == "opacus" else _functorch_grad_samples
    context.check_finite = False  # a non-finite loss stops nothing: its records' gradients are zeroed below
    try:
        with grad_samples(module, fabric, context) as fill:
            for t in range(plan.steps):
                batch = next(batches)
                context.current_epoch, context.global_step = t // per_epoch, t
                if batch is None:  # nobody drawn: the step is the noise alone (Opacus' empty-batch rule)
                    for p in dp_optimizer.params:
                        p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
                else:
                    fill(fabric.to_device(batch) if fabric.device.type != "cpu" else batch, t)
                    zero_non_finite_records(dp_optimizer)
                dp_optimizer.step()
                if dp.canaries is not None:  # the privacy audit scores the step's noised gradient (not changing it)
                    gradient = torch.cat([p.grad.detach().reshape(-1).cpu() for p in dp_optimizer.params])
                    dp.canaries.step(context.client_id, gradient, plan.q, dp.max_grad_norm / plan.batch_size)
                dp_optimizer.zero_grad(set_to_none=True)
                if scheduler is not None:
                    scheduler.step()
    finally:  # the parameters as they were: the module trains the next client (maybe with the other engine)
        context.check_finite = True
        for p in dp_optimizer.params:
            for name in ("grad_sample", "summed_grad"):
                if hasattr(p, name):
                    delattr(p, name)


def finite_records(grads: list[torch.Tensor]) -> torch.Tensor:
    """Which records' gradients are finite in every tensor: ``grads`` holds one tensor per trainable parameter,
    records along the first dimension; a boolean vector, one entry per record."""
    return torch.stack([torch.isfinite(g.flatten(1)).all(1) for g in grads]).all(0)


def keep_rows(keep: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g`` with the entries along its leading dimensions (``keep``'s shape) set to zero where ``keep`` is false."""
    return torch.where(keep.view(*keep.shape, *([1] * (g.dim() - keep.dim()))), g, g.new_zeros(()))


def zero_non_finite_records(dp_optimizer: Any) -> None:
    """Replace by zero the per-record gradient of every record whose gradient holds a NaN or an infinity (in any
    trainable tensor), before Opacus clips them. The step stays a Gaussian mechanism on the clipped sum (a zero
    gradient is clipped like any other), so a non-finite record changes the step by at most ``C`` like any record,
    where its NaN would have turned the whole sum, and the client's upload, into NaN: a failure the server sees."""
    grads = dp_optimizer.grad_samples
    if not grads or len(grads[0]) == 0:
        return
    finite = finite_records(grads)
    if bool(finite.all()):
        return
    for p, g in zip(dp_optimizer.params, grads, strict=True):
        p.grad_sample = keep_rows(finite, g)


def dp_optimizer_for(optimizer: torch.optim.Optimizer, plan: ClientPlan, max_grad_norm: float, noise: Randomness):
    """Opacus' ``DPOptimizer`` around ``optimizer``: with a seeded ``noise`` it draws from that generator (the
    simulation, reproducible); with the operating system's secure source it draws its noise from there."""
    from opacus.optimizers import DPOptimizer

    kwargs = {
        "noise_multiplier": plan.z,
        "max_grad_norm": max_grad_norm,
        "expected_batch_size": plan.batch_size,
        "loss_reduction": "mean",
    }
    if not noise.secure:
        return DPOptimizer(optimizer, generator=noise.generator, **kwargs)

    class SecureNoiseDPOptimizer(DPOptimizer):
        """``DPOptimizer`` whose ``add_noise`` draws from the secure source (Opacus' own secure mode needs
        torchcsprng, which current torch does not build); the rest of its step is Opacus'."""

        def add_noise(self) -> None:
            from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

            std = self.noise_multiplier * self.max_grad_norm
            for p in self.params:
                _check_processed_flag(p.summed_grad)
                reference = p.summed_grad
                draw = noise.normal(std, reference.shape, reference.dtype, reference.device) if std > 0 else 0.0
                p.grad = (reference + draw).view_as(p)
                _mark_as_processed(p.summed_grad)

    return SecureNoiseDPOptimizer(optimizer, **kwargs)


Fill = Callable[[Any, int], None]  # (batch on the device, step) -> every trainable parameter's grad_sample set


@contextlib.contextmanager
def _opacus_grad_samples(module: L.LightningModule, fabric: L.Fabric, context: StepContext) -> Iterator[Fill]:
    """Per-record gradients by Opacus' ``GradSampleModule``: its hooks fill ``grad_sample`` during the backward
    pass of the module's own ``training_step``."""
    from opacus import GradSampleModule

    # Opacus' backward hooks forbid in-place activations on a hooked layer's output: off while it trains (the
    # same values), restored after.
    in_place = [m for m in module.modules() if getattr(m, "inplace", False) is True]
    for m in in_place:
        m.inplace = False
    wrapped = GradSampleModule(module, batch_first=True, loss_reduction="mean", strict=True)

    def fill(batch: Any, t: int) -> None:
        context.weight = len(batch[0]) if isinstance(batch, (list, tuple)) else 1
        out = module.training_step(batch, t)
        fabric.backward(out["loss"] if isinstance(out, dict) else out)

    try:
        with warnings.catch_warnings():  # torch notes that the first layer's hook fires without input gradients
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield fill
    finally:
        wrapped._close()  # hooks and per-record attributes off: the module trains the next client as it was
        for m in in_place:
            m.inplace = True


@contextlib.contextmanager
def _functorch_grad_samples(module: L.LightningModule, fabric: L.Fabric, context: StepContext) -> Iterator[Fill]:
    """Per-record gradients by ``torch.func``: ``vmap`` over the batch's records of ``grad`` of the module's
    ``forward`` then ``compute_loss`` on one record, set as each trainable parameter's ``grad_sample``; the step
    logs ``train/loss`` and ``train/acc`` as the recipe's ``training_step`` does."""
    trainable = module.trainable_parameters()
    if (mapping := getattr(module, "mapping", None)) is not None and hasattr(mapping, "materialise"):
        mapping.materialise()  # no random numbers may be drawn inside vmap

    def one_record(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
        logits = functional_call(module, params, (x.unsqueeze(0),), strict=False)
        loss = module.compute_loss(logits, y.unsqueeze(0))
        return loss, (loss, logits.squeeze(0))

    per_record = vmap(grad(one_record, has_aux=True), in_dims=(None, 0, 0), randomness="different")

    def fill(batch: Any, t: int) -> None:
        x, y = batch
        grads, (losses, logits) = per_record({n: p.detach() for n, p in trainable.items()}, x, y)
        loss = losses.mean()
        module.check_loss(loss)  # (a no-op under DP-SGD's context: a non-finite record is zeroed, never fatal)
        context.weight = len(y)
        context.log("train/loss", loss)
        context.log("train/acc", module.train_accuracy(logits.detach(), y))
        for n, p in trainable.items():
            p.grad_sample = grads[n]

    yield fill
