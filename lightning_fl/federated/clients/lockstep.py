"""Lockstep cohorts: FLITE clients that step together and share only the mapping's matrix products.

A FLITE client with ``stored`` factors spends most of its excess over a full-weight client reading ``U``: every step
forms ``theta_pre + U (V^T z)`` (one pass over ``U``, ``P x r`` floats) and its backward forms ``U^T g`` (a second
pass). On the cross-device CNN ``U`` is 51 MB, so each step streams 103 MB through memory for a few hundred kFLOPs of
arithmetic (docs/results-systems.md, "The latent client step on small CNNs"). Clients of a round share ``U``: here
``C`` clients take their ``t``-th steps together, the mapping forms all their weights with one matrix product per
layer (``theta_pre + [c_1 ... c_C]^T U^T``) and all their latents' gradients with another (``[g_1 ... g_C]^T U``), so
``U`` is read twice per step for the cohort instead of twice per client. Each client's network runs alone, one
client after another, on its own weights (forward, loss, backward to the mapped weights), so its activations stay
in the caches: what a ``vmap`` cohort loses on CPU for large images (:mod:`lightning_fl.federated.clients.cohort`) is
not lost here.

Everything else is the vectorised cohort's (:func:`~lightning_fl.federated.clients.cohort_steps.train_cohort`): the same
batches (each client's loader, seeded from ``(seed, round, client)``), the same steps, logging, divergence checks,
per-client clipping and optimiser (Adam or SGD on stacked rows), and the codec's encoding of each final state.
Results equal one client at a time up to float32 rounding (matrix products sum in another order than the
matrix-vector products of one client); ``tests/test_lockstep.py`` bounds the difference.

For ``stored`` and ``dense`` factors (the others never form ``U``); :func:`lockstep_problem` says why not otherwise.
A step holds every client's mapped weights and their gradients (``2 C sum_l P_l`` floats: 160 MB for 50 clients of
the cross-device CNN), so ``cohort_size`` bounds the memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import lightning as L
import torch
from torch.func import functional_call

from lightning_fl.errors import ConfigError
from lightning_fl.federated.clients.cohort import _client_batches, cohort_problem
from lightning_fl.federated.clients.cohort_steps import clip_each, finish_cohort, start_cohort, train_cohort
from lightning_fl.federated.clients.local import ClientJob, ClientResult, configure_optimizer, gradient_clip
from lightning_fl.steps import batch_size

Tensors = dict[str, torch.Tensor]


def lockstep_problem(module: L.LightningModule, fabric: L.Fabric) -> str | None:
    """Why ``module``'s clients cannot train in lockstep under ``fabric`` (``None``: they can)."""
    mapping = getattr(module, "mapping", None)
    if mapping is None or not hasattr(module, "mapped_base"):
        return f"{type(module).__name__} is not a latent method (lockstep cohorts share the mapping's products)"
    if mapping.mode not in ("stored", "dense"):
        return f"its factors are {mapping.mode!r} (lockstep cohorts share U's products: stored or dense factors)"
    if not any(p is mapping.latent for p in module.trainable_parameters().values()):
        return "its latent does not train"
    return cohort_problem(module, fabric)


@contextlib.contextmanager
def supplied(mapping: torch.nn.Module, weights: Tensors) -> Iterator[None]:
    """Within the block, ``mapping.weights()`` of the trained latent returns ``weights`` (the mapped weights made
    for the cohort) instead of forming them again."""
    own = mapping.weights

    def given(base: Tensors, z: torch.Tensor | None = None) -> Tensors:
        return weights if z is None else own(base, z)

    mapping.weights = given
    try:
        yield
    finally:
        del mapping.weights  # the class's method again


def mapped_rows(mapping: torch.nn.Module, base: Tensors, latents: torch.Tensor) -> Tensors:
    """Every client's mapped weights, one row per client: ``{name: (C, P_l)}`` for the latents ``(C, D)``."""
    out = {}
    for lay, z in zip(mapping.layers, torch.split(latents, [lay.latent_dim for lay in mapping.layers], 1), strict=True):
        theta = base[lay.name].reshape(-1)
        u = getattr(mapping, f"u_{lay.index}").to(theta.dtype)
        coeff = z.to(theta.dtype) if mapping.mode == "dense" else z @ getattr(mapping, f"v_{lay.index}").to(z.dtype)
        out[lay.name] = torch.addmm(theta, coeff, u.T)
    return out


def latent_rows(mapping: torch.nn.Module, grads: Tensors, dtype: torch.dtype) -> torch.Tensor:
    """The latents' gradients ``(C, D)`` from the mapped weights' gradients ``{name: (C, P_l)}``: ``g U V^T``."""
    parts = []
    for lay in mapping.layers:
        coeff = grads[lay.name] @ getattr(mapping, f"u_{lay.index}").to(grads[lay.name].dtype)
        if mapping.mode != "dense":
            coeff = coeff @ getattr(mapping, f"v_{lay.index}").to(coeff.dtype).T
        parts.append(coeff.to(dtype))
    return torch.cat(parts, 1)


def run_lockstep(job: ClientJob, clients: list[int]) -> list[ClientResult]:
    """Train ``clients`` in lockstep for one round from ``global_state``; one result per client, in order."""
    module, datamodule, global_state, round, seed = job.module, job.datamodule, job.state, job.round, job.seed
    codec, local, fabric = job.codec, job.local, job.fabric
    if local.dp_sgd is not None:
        raise ValueError("run_lockstep trains without DP-SGD; train DP-SGD clients one at a time or as a vmap cohort")
    trainable = module.trainable_parameters()
    names = list(trainable)
    if sorted(names) != sorted(global_state):
        raise ConfigError(
            f"{type(module).__name__}'s federated state is not its trainable parameters; train "
            "clients one at a time (trainer.client_batching: sequential)"
        )
    mapping = module.mapping
    latent = next(n for n, p in trainable.items() if p is mapping.latent)
    others = [n for n in names if n != latent]
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
    mapping.materialise()
    base = {n: w.detach() for n, w in module.mapped_base().items()}
    shapes = {lay.name: lay.shape for lay in mapping.layers}

    def groups(t: int) -> list[list[int]]:  # every client still training that has a t-th batch
        members = [k for k in range(len(clients)) if cohort.alive[k] and t < len(batches[k])]
        return [members] if members else []

    def gradients(t: int, members: list[int], params: Tensors):
        with torch.no_grad():
            weights = mapped_rows(mapping, base, params[latent])
        mapped_grads = {n: torch.empty_like(w) for n, w in weights.items()}
        other_grads = {n: torch.empty_like(params[n]) for n in others}
        losses, accuracies = [], []
        for i, k in enumerate(members):
            x, y = (v.to(fabric.device) for v in batches[k][t])
            given = {n: w[i].view(shapes[n]).requires_grad_() for n, w in weights.items()}
            own = {n: params[n][i].detach().requires_grad_() for n in others}
            with supplied(mapping, given):
                logits = functional_call(module, own, (x,), strict=False) if own else module(x)
            loss = module.compute_loss(logits, y)
            found = torch.autograd.grad(loss, [*given.values(), *own.values()])
            for n, g in zip(given, found[: len(given)], strict=True):
                mapped_grads[n][i] = g.reshape(-1)
            for n, g in zip(own, found[len(given) :], strict=True):
                other_grads[n][i] = g
            losses.append(loss.detach())
            accuracies.append(module.train_accuracy(logits.detach(), y))
        grads = {latent: latent_rows(mapping, mapped_grads, params[latent].dtype), **other_grads}
        return grads, torch.stack(losses), torch.stack(accuracies), [batch_size(batches[k][t]) for k in members]

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
