"""Vectorised cohorts: several clients of a latent method trained together, as one batched computation.

With FLITE every client shares the frozen base and differs only by its latent, so C clients' forward and
backward passes are one computation over a batch of C latents: ``torch.func.vmap`` of ``torch.func.grad`` of the
module's own loss (``forward`` then ``compute_loss``, called through ``functional_call`` with each client's
trainable parameters), then each client's gradient clipping and optimiser step on stacked tensors. A step of the
mapped weights ``theta_pre + U V^T z`` becomes one matrix product for the whole cohort instead of C.

:func:`run_cohort` returns, per client, what :func:`~lightning_fl.federated.clients.client.run_client` returns: the same
batches (each client's loader, seeded from ``(seed, round, client)`` as sequentially, materialised before the
steps), the same number of local steps (epochs or ``local_steps``), the same logged ``train/loss`` and
``train/acc``, the same divergence checks, and the codec's encoding of its final state. Clients whose batches at a
step have different sizes (the last batch of an epoch of unequal clients) are vectorised in groups of equal size,
so nothing is padded. Results equal sequential training up to float32 rounding (the batched matrix products sum in
another order); ``tests/test_cohort.py`` bounds the difference.

What can be vectorised (:func:`cohort_problem` says why not, and the trainer then trains one client at a time):
a :class:`~lightning_fl.methods.recipe.TrainingRecipe` whose ``training_step`` is the recipe's own (the module
defines ``forward`` and ``compute_loss``), trained in 32-bit precision, with Adam or SGD (no scheduler), no
randomness in its forward pass (dropout), and, for FLITE, ``stored`` or ``dense`` factors.

The step loop (groups, gradients, logging, divergence checks, the cohort's optimiser) is
:func:`~lightning_fl.federated.clients.cohort_steps.train_cohort`, which the DP-SGD cohort
(:mod:`lightning_fl.federated.clients.dp_cohort`) runs too; the transport chooses between them and one client at a time.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from lightning_fl.errors import ConfigError
from lightning_fl.federated.clients.cohort_steps import clip_each, finish_cohort, start_cohort, train_cohort
from lightning_fl.federated.clients.local import (
    ClientJob,
    ClientResult,
    LocalTraining,
    client_loader,
    configure_optimizer,
    gradient_clip,
)
from lightning_fl.steps import batch_size


def cohort_problem(module: L.LightningModule, fabric: L.Fabric) -> str | None:
    """Why ``module``'s clients cannot train as a vectorised cohort under ``fabric`` (``None``: they can)."""
    from lightning_fl.methods.recipe import TrainingRecipe

    name = type(module).__name__
    if not isinstance(module, TrainingRecipe) or type(module).training_step is not TrainingRecipe.training_step:
        return f"{name} defines its own training_step (a cohort runs the recipe's: forward, then compute_loss)"
    precision = getattr(getattr(fabric.strategy, "precision", None), "precision", "32-true")
    if precision not in ("32-true", "32", 32):
        return f"the run's precision is {precision} (a cohort trains in 32-bit)"
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules()):
        return f"{name} uses dropout (a cohort's forward pass draws no random numbers)"
    mapping = getattr(module, "mapping", None)
    if mapping is not None and getattr(mapping, "mode", "stored") not in ("stored", "dense", "kronecker", "two_sided"):
        return f"its factors are {mapping.mode!r} (a cohort needs stored, dense, kronecker or two_sided factors)"
    optimizer, scheduler = configure_optimizer(module)
    if scheduler is not None:
        return f"{name} steps a learning-rate scheduler"
    if type(optimizer) not in (torch.optim.Adam, torch.optim.SGD):
        return f"its optimiser is {type(optimizer).__name__} (a cohort steps Adam or SGD)"
    if len(optimizer.param_groups) != 1:
        return f"its optimiser has {len(optimizer.param_groups)} parameter groups (a cohort supports one)"
    group = optimizer.param_groups[0]
    if group.get("maximize") or group.get("amsgrad") or group.get("differentiable"):
        return "its optimiser uses maximize, amsgrad or differentiable (not supported in a cohort)"
    return None


# On CPU a cohort trains slower than its clients one at a time once its activations outgrow the caches: each
# operation of the batched step then streams every client's activations through memory, where one client's stay
# in cache. Measured on this project's 2-core machine (python benchmarks/cohort.py --grid; docs/results-systems.md,
# "Vectorised cohorts"): every cohort within both limits trained at least 1.08x faster than one client at a time,
# and every measured cohort slower than that was outside them.
MAX_CLIENT_ACTIVATION = 110_000  # floats: the largest output of any layer for one client's batch
MAX_COHORT_ACTIVATION = 2_200_000  # floats: the same times the cohort's size


def largest_activation(module: L.LightningModule, x: torch.Tensor) -> int:
    """The most values any submodule of ``module`` outputs on the input ``x`` (without gradients; every
    submodule's mode left as it was)."""
    sizes = [x.numel()]

    def hook(_module, _inputs, output) -> None:
        if isinstance(output, torch.Tensor):
            sizes.append(output.numel())

    modes = {m: m.training for m in module.modules()}
    handles = [m.register_forward_hook(hook) for m in module.modules() if m is not module]
    try:
        module.eval()  # the same shapes; no statistics updated
        with torch.no_grad():
            module(x)
    finally:
        for handle in handles:
            handle.remove()
        for m, training in modes.items():
            m.training = training
    return max(sizes)


def cohort_too_large(module, datamodule, client: int, round: int, seed: int, cohort_size: int, fabric) -> str | None:
    """Why cohorts of ``cohort_size`` would train ``module``'s clients slower than one at a time on this CPU
    (``None``: they would not, or the device is not a CPU, where the rule was not measured): the largest
    activation of ``client``'s first batch, per client and per cohort, against the measured limits."""
    if fabric.device.type != "cpu":
        return None
    state = random.getstate(), np.random.get_state()  # the probe leaves the run's random state as it found it
    try:
        with torch.random.fork_rng(devices=[]):
            batch = next(iter(client_loader(datamodule, client, round, seed)), None)
            per_client = None if batch is None else largest_activation(module, batch[0].to(fabric.device))
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
    if per_client is None:  # no batch: the cohort says so in its own words
        return None
    if per_client <= MAX_CLIENT_ACTIVATION and per_client * cohort_size <= MAX_COHORT_ACTIVATION:
        return None
    return (
        f"a client's largest activation is {per_client:,} values ({per_client * cohort_size:,} for a cohort of "
        f"{cohort_size}; limits {MAX_CLIENT_ACTIVATION:,} and {MAX_COHORT_ACTIVATION:,}), where cohorts train "
        "slower on CPU than one client at a time (docs/results-systems.md, 'Vectorised cohorts')"
    )


def _client_batches(datamodule: Any, client: int, round: int, seed: int, local: LocalTraining):
    """The batches ``client`` trains on this round, drawn exactly as :func:`run_client` draws them, and the epoch
    of each (what ``self.current_epoch`` says in its step)."""
    loader = client_loader(datamodule, client, round, seed)
    batches: list = []
    epochs: list[int] = []
    for epoch in range(local.epochs if local.steps is None else 10**9):
        before = len(batches)
        for batch in loader:
            batches.append(batch)
            epochs.append(epoch)
            if local.steps is not None and len(batches) >= local.steps:
                return batches, epochs
        if len(batches) == before:
            break
    if not batches:
        raise ConfigError(f"client {client} has no training batches")
    return batches, epochs


def run_cohort(job: ClientJob, clients: list[int]) -> list[ClientResult]:
    """Train ``clients`` together for one round from ``global_state``; one result per client, in order. Each step
    vectorises the clients whose batches have the same shapes: per-client gradients by ``vmap`` of ``grad``, each
    client's gradient clipped as ``torch.nn.utils.clip_grad_norm_`` clips it alone."""
    module, datamodule, global_state, round, seed = job.module, job.datamodule, job.state, job.round, job.seed
    codec, local, fabric = job.codec, job.local, job.fabric
    if local.dp_sgd is not None:
        raise ValueError(
            "run_cohort trains without DP-SGD; a cohort under trainer.dp_sgd is "
            "lightning_fl.federated.clients.dp_cohort.run_cohort_dp_sgd"
        )
    trainable = module.trainable_parameters()
    names = list(trainable)
    if sorted(names) != sorted(global_state):
        raise ConfigError(
            f"{type(module).__name__}'s federated state is not its trainable parameters; train "
            "clients one at a time (trainer.client_batching: sequential)"
        )
    module.load_federated_state(global_state)
    optimizer, _ = configure_optimizer(module)
    clip = gradient_clip(module, local)
    if not all(m.training for m in module.modules()):
        module.train()
    drawn = [_client_batches(datamodule, c, round, seed, local) for c in clients]
    batches, epochs = [b for b, _ in drawn], [e for _, e in drawn]
    cohort = start_cohort(
        global_state, names, clients, optimizer, datamodule, fabric.device, epoch_of=lambda k, t: epochs[k][t]
    )

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
        logits = functional_call(module, p, (x,), strict=False)
        loss = module.compute_loss(logits, y)
        return loss, (loss, logits)

    if (mapping := getattr(module, "mapping", None)) is not None and hasattr(mapping, "materialise"):
        mapping.materialise()  # drawn here: no random numbers may be drawn inside vmap
    step_fn = vmap(grad(loss_fn, has_aux=True))
    accuracy_fn = vmap(module.train_accuracy)

    def groups(t: int) -> list[list[int]]:  # the clients at step t whose batches have the same shapes
        by_shape: dict[tuple, list[int]] = {}
        for k in range(len(clients)):
            if cohort.alive[k] and t < len(batches[k]):
                x, y = batches[k][t]
                by_shape.setdefault((tuple(x.shape), tuple(y.shape)), []).append(k)
        return list(by_shape.values())

    def gradients(t: int, members: list[int], params: dict[str, torch.Tensor]):
        x = torch.stack([batches[k][t][0] for k in members]).to(fabric.device)
        y = torch.stack([batches[k][t][1] for k in members]).to(fabric.device)
        grads, (losses, logits) = step_fn(params, x, y)
        return grads, losses, accuracy_fn(logits.detach(), y), [batch_size(batches[k][t]) for k in members]

    train_cohort(
        module,
        fabric,
        round,
        cohort,
        max(len(b) for b in batches),
        groups,
        gradients,
        lambda t, members, grads: clip_each(clip, grads),
    )
    return finish_cohort(module, cohort, global_state, codec, local, round, seed)
