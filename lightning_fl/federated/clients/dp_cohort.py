"""DP-SGD for a vectorised cohort (``trainer.client_batching: vmap`` with ``trainer.dp_sgd``).

Every client's Poisson batches are drawn as :func:`~lightning_fl.federated.clients.client.run_client` draws them; its
per-record gradients come from ``torch.func`` with a second ``vmap`` over the clients (each client's batch padded
to the step's largest, the padding masked out of the clipped sum). Then Opacus' ``DPOptimizer`` step for many
clients at once: each record's gradient clipped, the clipped gradients summed, each client's noise drawn from its
own generator in ``DPOptimizer``'s order (parameter by parameter), the sum divided by its expected batch size, and
the cohort's optimiser steps. One client at a time, :mod:`lightning_fl.federated.clients.dp_client` hands the same step
to ``DPOptimizer`` itself; this is the one vectorised copy. Equal to training the clients one at a time up to
float32 rounding (``tests/test_dpsgd.py``). The step loop is the plain cohort's
(:func:`~lightning_fl.federated.clients.cohort_steps.train_cohort`).
"""

from __future__ import annotations

import torch
from torch.func import functional_call, grad, vmap

from lightning_fl.errors import ConfigError
from lightning_fl.federated.clients.cohort_steps import finish_cohort, start_cohort, train_cohort
from lightning_fl.federated.clients.dp_client import (
    PoissonBatches,
    batchnorm_problem,
    finite_records,
    functorch_problem,
    keep_rows,
)
from lightning_fl.federated.clients.local import ClientJob, ClientResult, client_loader, configure_optimizer


def run_cohort_dp_sgd(job: ClientJob, clients: list[int]) -> list[ClientResult]:
    """Train ``clients`` together for one round under ``local.dp_sgd``; one result per client, in order."""
    module, datamodule, global_state, round, seed = job.module, job.datamodule, job.state, job.round, job.seed
    codec, local, fabric = job.codec, job.local, job.fabric
    dp = local.dp_sgd
    for problem in (batchnorm_problem(module), functorch_problem(module)):
        if problem is not None:
            raise ConfigError(problem if problem.startswith("trainer.") else f"trainer.dp_sgd in a cohort: {problem}")
    trainable = module.trainable_parameters()
    module.load_federated_state(global_state)
    optimizer, _ = configure_optimizer(module)
    name_of = {id(p): n for n, p in trainable.items()}
    ordered = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]  # DPOptimizer's order
    if not all(m.training for m in module.modules()):
        module.train()
    if (mapping := getattr(module, "mapping", None)) is not None and hasattr(mapping, "materialise"):
        mapping.materialise()
    device = fabric.device
    plans, draws, noises = [], [], []
    for c in clients:  # each client's loader seeded and its batches drawn as it would be alone
        plan = dp.client_plan(datamodule, c, local)
        sampling, noise = dp.generators(seed, round, c, fabric.device)
        records = PoissonBatches(client_loader(datamodule, c, round, seed), plan.q, sampling)
        if records.n != plan.records:
            raise ConfigError(
                f"trainer.dp_sgd: client {c}'s loader holds {records.n} records but the data "
                f"module's client_num_samples says {plan.records}"
            )
        stream = iter(records)
        plans.append(plan)
        draws.append([next(stream) for _ in range(plan.steps)])
        noises.append(noise)
    sizes = [[0 if b is None else len(b[1]) for b in drawn] for drawn in draws]  # records drawn, per client and step
    per_epoch = [-(-plan.records // plan.batch_size) for plan in plans]  # (what current_epoch counts, as alone)
    cohort = start_cohort(
        global_state, list(trainable), clients, optimizer, datamodule, device, epoch_of=lambda k, t: t // per_epoch[k]
    )
    cohort.check_finite = False  # a record's non-finite gradient is zeroed (below), never a client's failure

    def one_record(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
        logits = functional_call(module, p, (x.unsqueeze(0),), strict=False)
        loss = module.compute_loss(logits, y.unsqueeze(0))
        return loss, (loss, logits.squeeze(0))

    per_record = vmap(vmap(grad(one_record, has_aux=True), in_dims=(None, 0, 0)), in_dims=(0, 0, 0))
    accuracy = vmap(module.train_accuracy)

    def groups(t: int) -> list[list[int]]:  # one group: the clients still training (their batches padded)
        active = [k for k in range(len(clients)) if cohort.alive[k] and t < plans[k].steps]
        return [active] if active else []

    def gradients(t: int, members: list[int], params: dict[str, torch.Tensor]):
        """Per-record gradients ``[M, width, ...]`` (width: the step's largest batch), each client's mean loss
        and accuracy over its own records, and its record count."""
        drawn, counts = [draws[k][t] for k in members], [sizes[k][t] for k in members]
        width, M = max(counts), len(members)
        if width == 0:  # nobody drew a record: every member's step is the noise alone
            zeros = torch.zeros(M, device=device)
            return {n: torch.zeros((M, 0, *trainable[n].shape), device=device) for n in trainable}, zeros, zeros, counts
        pad = next(b for b in drawn if b is not None)
        filler_x, filler_y = pad[0][:1], pad[1][:1]
        xs, ys = [], []
        for b, size in zip(drawn, counts, strict=True):
            x = filler_x.expand(width, *filler_x.shape[1:]) if b is None else b[0]
            y = filler_y.expand(width, *filler_y.shape[1:]) if b is None else b[1]
            if size and size < width:
                x = torch.cat([x, filler_x.expand(width - size, *filler_x.shape[1:])])
                y = torch.cat([y, filler_y.expand(width - size, *filler_y.shape[1:])])
            xs.append(x)
            ys.append(y)
        x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
        grads, (losses, logits) = per_record(params, x, y)
        zero = losses.new_zeros(())
        mean_loss = torch.stack([losses[i, :size].mean() if size else zero for i, size in enumerate(counts)])
        acc = torch.stack(
            [
                accuracy(logits[i, :size].detach().unsqueeze(0), y[i, :size].unsqueeze(0))[0] if size else zero
                for i, size in enumerate(counts)
            ]
        )
        return grads, mean_loss, acc, counts

    def clipped_noised_scaled(t: int, members: list[int], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """DPOptimizer's clip_and_accumulate, add_noise and scale_grad for each member at once."""
        width = grads[ordered[0]].shape[1]
        mask = (torch.arange(width).unsqueeze(0) < torch.tensor([sizes[k][t] for k in members]).unsqueeze(1)).to(device)
        if width:  # a record's (or a padding record's) non-finite gradient is zero, as one client alone zeroes it
            finite = finite_records([grads[n].flatten(0, 1) for n in ordered]).view(len(members), width)
            grads = {n: keep_rows(finite, g) for n, g in grads.items()}
        flat = [grads[n].flatten(2) for n in ordered]  # (M, width, numel)
        norms = torch.stack([g.norm(2, dim=-1) for g in flat], dim=2).norm(2, dim=2)  # (M, width)
        factor = (dp.max_grad_norm / (norms + 1e-6)).clamp(max=1.0) * mask
        stepped = {}
        for n in ordered:
            summed = torch.einsum("ki,ki...->k...", factor.to(grads[n].dtype), grads[n])
            noise = [
                noises[k].normal(plans[k].z * dp.max_grad_norm, trainable[n].shape, summed.dtype, device)
                if plans[k].z > 0
                else torch.zeros_like(summed[0])
                for k in members
            ]
            stepped[n] = summed + torch.stack(noise)  # client k's generator draws parameter by parameter, in order
        batch = torch.tensor([plans[k].batch_size for k in members], dtype=torch.float32, device=device)
        return {n: g / batch.view(-1, *([1] * (g.dim() - 1))).to(g.dtype) for n, g in stepped.items()}

    steps = max(plan.steps for plan in plans)
    train_cohort(module, fabric, round, cohort, steps, groups, gradients, clipped_noised_scaled)
    return finish_cohort(module, cohort, global_state, codec, local, round, seed)
