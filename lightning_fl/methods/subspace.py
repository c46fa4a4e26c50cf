"""Two-sided subspaces from public data: FLITE's latent with ``subspace: public``, and Fed-SB.

FLITE's two-sided family maps each ``m x n`` projection through ``theta + A C B^T``, its frozen ``A`` (``m x p``)
and ``B`` (``n x q``) drawn at random from a seed (:mod:`lightning_fl.mapping.two_sided`). LoRA-SB (Ponkshe, Singhal,
Gorbunov, Tumanov, Horvath and Vepakomma, "Initialization using Update Approximation is a Silver Bullet for Extremely
Efficient Low-Rank Fine-Tuning", arXiv 2411.19557) trains the same shape, an ``r x r`` matrix between frozen
adapters, with the adapters chosen from data: the truncated SVD of the first update full fine-tuning would take.
Its federated form, Fed-SB (Singhal, Ponkshe, Vartak and Vepakomma, "Fed-SB: A Silver Bullet for Extreme
Communication Efficiency and Performance in (Private) Federated LoRA Fine-Tuning", arXiv 2502.15436), averages the
``r x r`` matrices, exactly, since the adapters are shared.

Here the statistic is computed on **public** records only (the data module's ``public_groups()``; never a client's,
so choosing the subspace costs no privacy): per mapped weight, the first step Adam would take from the base,
``S = -lr sign(sum_i g_i)`` over ``records`` public records (LoRA-SB's estimate: an Adam step is the sign of the
gradient, times the learning rate), its SVD ``S = U diag(s) V^T``, and the parts ``A = U[:, :p]``, ``B = V[:, :q]``.
Every client computes the same parts from the same public records and base (the fingerprint hashes their bytes, so a
client that computed others refuses to train). The cost, once per run at set-up: a forward and backward pass of the
full model over the public records, with gradients for every mapped weight (SmolLM2's 210 projections: 106M
floats), and one SVD per weight.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from lightning_fl.errors import ConfigError
from lightning_fl.mapping.lowrank import LatentMapping

log = logging.getLogger(__name__)


def public_batches(datamodule: Any, records: int) -> list[Any]:
    """Training batches over the first ``records`` public records (the groups of ``public_groups()`` in order,
    unshuffled), as a client's loader forms them."""
    groups = datamodule.public_groups() if callable(getattr(datamodule, "public_groups", None)) else []
    if not groups:
        raise ConfigError(
            f"model.subspace is 'public' but data ({type(datamodule).__name__}) has no public records to compute it "
            "from: give the data a public split (InstructionTasks' public_per_task, InstructionFiles' public, "
            "FederatedTextDataModule's pretrain_plays)"
        )
    batches, taken = [], 0
    for group in groups:
        for batch in datamodule.windows_dataloader(group, seed=0):
            batches.append(batch)
            taken += len(batch[0])
            if taken >= records:
                return batches
    return batches


def public_statistic(
    network: nn.Module, names: list[str], forward: Any, loss: Any, batches: list[Any], lr: float
) -> dict[str, torch.Tensor]:
    """Per weight in ``names``: ``-lr sign(sum of the loss's gradients over batches)`` at the network's weights
    (module docstring). ``forward(x)`` gives the logits, ``loss(logits, y)`` the mean loss of a batch."""
    params = {name: network.get_parameter(name) for name in names}
    sums = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in params.items()}
    was = {name: p.requires_grad for name, p in params.items()}
    try:
        for p in params.values():
            p.requires_grad_(True)
        for x, y in batches:
            grads = torch.autograd.grad(loss(forward(x), y), list(params.values()))
            for name, g in zip(params, grads, strict=True):
                sums[name] += g.detach().float()
    finally:
        for name, p in params.items():
            p.requires_grad_(was[name])
    return {name: -lr * torch.sign(total) for name, total in sums.items()}


def svd_parts(statistic: torch.Tensor, p: int, q: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A, B, s)``: the statistic's top ``p`` left and top ``q`` right singular vectors (float64 SVD, columns
    orthonormal) and its singular values, descending."""
    u, s, vh = torch.linalg.svd(statistic.double(), full_matrices=False)
    return u[:, :p].float(), vh[:q].T.float(), s.float()


def use_public_subspace(
    mapping: LatentMapping, network: nn.Module, forward: Any, loss: Any, batches: list[Any], lr: float
) -> dict[str, torch.Tensor]:
    """Put the public statistic's top singular vectors in place of ``mapping``'s random two-sided parts; return each
    weight's singular values (Fed-SB starts its ``r x r`` matrix at their diagonal)."""
    started = time.perf_counter()
    records = sum(len(b[0]) for b in batches)
    count = len(mapping.layers)
    log.info("subspace: the public statistic of %d weight matrices over %d public records ...", count, records)
    statistic = public_statistic(network, mapping.names, forward, loss, batches, lr)
    parts, values = {}, {}
    for lay in mapping.layers:
        factor = mapping._two_sided[lay.index]
        left, right, s = svd_parts(statistic[lay.name].reshape(lay.shape), factor.p, factor.q)
        parts[lay.name], values[lay.name] = (left, right), s
    mapping.use_subspace(parts, f"public-sign-gradient:{records}")
    log.info("subspace: %d SVDs done in %.1f s", len(parts), time.perf_counter() - started)
    return values
