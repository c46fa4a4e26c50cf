"""The step loop every vectorised cohort runs: plain (:func:`~lightning_fl.federated.clients.cohort.run_cohort`) and
under DP-SGD (:func:`~lightning_fl.federated.clients.dp_cohort.run_cohort_dp_sgd`).

A cohort's clients keep their trainable tensors stacked ``[C, ...]`` (one row per client). At each local step
:func:`train_cohort` takes the groups of clients that step together, asks the caller for each group's gradients
(plain per-client gradients, or per-record gradients), logs each client's loss and accuracy, drops a client whose
loss is not finite with the module's own message, has the caller transform the others' gradients (clipping; for
DP-SGD also noise and the division by the expected batch) and steps :class:`CohortOptimizer` on their rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch

from lightning_fl.context import StepContext, attached
from lightning_fl.errors import UserError
from lightning_fl.federated.clients.local import ClientResult, encode_upload
from lightning_fl.federated.server.state import State

Tensors = dict[str, torch.Tensor]


class CohortOptimizer:
    """Adam or SGD (the settings of the module's own optimiser) on stacked per-client tensors ``[C, ...]``,
    written as ``torch.optim``'s single-tensor implementations write them. Every client of a cohort takes its
    ``t``-th step at step ``t``, so the step count is one number. Not ``torch.optim`` itself over the stacked
    tensors: clients with fewer batches stop early, so a step updates a subset of the rows (``rows``), and a
    ``torch.optim`` step would move every row's moments (a zero gradient still decays Adam's and SGD's momentum)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Tensors) -> None:
        self.kind = type(optimizer)
        self.group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        if self.kind is torch.optim.Adam:
            self.state = {
                n: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)} for n, p in params.items()
            }
        else:
            self.state = {n: {"momentum_buffer": torch.zeros_like(p)} for n, p in params.items()}

    def step(self, t: int, params: Tensors, grads: Tensors, rows) -> None:
        """Step ``t`` (0-based): update ``params[name][rows]`` with ``grads[name]`` (one row per client in ``rows``;
        ``None``: every row)."""
        g = self.group
        for name, grad_ in grads.items():
            p, state = rows_of(params[name], rows), self.state[name]
            if g["weight_decay"] != 0:
                grad_ = grad_.add(p, alpha=g["weight_decay"])
            if self.kind is torch.optim.Adam:
                beta1, beta2 = g["betas"]
                m = rows_of(state["exp_avg"], rows).lerp(grad_, 1 - beta1)
                v = rows_of(state["exp_avg_sq"], rows).mul(beta2).addcmul(grad_, grad_.conj(), value=1 - beta2)
                step_size = g["lr"] / (1 - beta1 ** (t + 1))
                denom = (v.sqrt() / ((1 - beta2 ** (t + 1)) ** 0.5)).add(g["eps"])
                p = p.addcdiv(m, denom, value=-step_size)
                _set_rows(state, "exp_avg", rows, m)
                _set_rows(state, "exp_avg_sq", rows, v)
            else:  # SGD
                momentum, dampening = g["momentum"], g["dampening"]
                if momentum != 0:
                    buf = (
                        grad_.clone()
                        if t == 0
                        else rows_of(state["momentum_buffer"], rows).mul(momentum).add(grad_, alpha=1 - dampening)
                    )
                    _set_rows(state, "momentum_buffer", rows, buf)
                    grad_ = grad_.add(buf, alpha=momentum) if g["nesterov"] else buf
                p = p.add(grad_, alpha=-g["lr"])
            _set_rows(params, name, rows, p)


def clip_each(clip: float | None, grads: Tensors) -> Tensors:
    """Each client's gradients (one row per client) clipped as ``torch.nn.utils.clip_grad_norm_`` clips one client's,
    over all its trainable tensors (``clip``: ``None``: not clipped)."""
    if clip is None:
        return grads
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], dim=1).norm(dim=1)
    if not bool(torch.isfinite(norms).all()):
        raise RuntimeError(
            "The total norm of order 2.0 for gradients from `parameters` is non-finite, "
            "so it cannot be clipped (a client of the cohort)"
        )
    coef = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {n: g * coef.view(-1, *([1] * (g.dim() - 1))) for n, g in grads.items()}


def rows_of(t: torch.Tensor, rows) -> torch.Tensor:
    """``t``'s rows ``rows`` (a tensor of indices; ``None``: all of ``t``)."""
    return t if rows is None else t[rows]


def _set_rows(tensors: Tensors, name: str, rows, value: torch.Tensor) -> None:
    if rows is None:
        tensors[name] = value
    else:
        tensors[name][rows] = value


@dataclass
class Cohort:
    """What a cohort's training carries: its clients, every client's copy of the trainable tensors (stacked
    ``[C, ...]``), the cohort's optimiser, a result, the logged sums and an alive flag per client, and the epoch
    client ``k`` is in at step ``t`` (``epoch_of(k, t)``: what ``self.current_epoch`` says in its step)."""

    clients: list[int]
    params: Tensors
    optimizer: CohortOptimizer
    results: list[ClientResult]
    sums: list[dict[str, list[float]]]
    alive: list[bool]
    epoch_of: Callable[[int, int], int]
    #: A member whose loss is not finite fails (plain training); DP-SGD sets it false: its records' non-finite
    #: gradients are zeroed instead, and stopping would tell the server what one record holds.
    check_finite: bool = True


def start_cohort(global_state: State, names, clients: list[int], optimizer, datamodule: Any, device, epoch_of):
    """A :class:`Cohort` of ``clients``, each starting from ``global_state``'s tensors ``names``."""
    C = len(clients)
    params = {
        n: global_state[n].detach().to(device).unsqueeze(0).repeat(C, *([1] * global_state[n].dim())) for n in names
    }
    results = [ClientResult(c, int(datamodule.client_num_samples(c)), None) for c in clients]
    sums = [{"train/loss": [0.0, 0.0], "train/acc": [0.0, 0.0]} for _ in clients]
    return Cohort(clients, params, CohortOptimizer(optimizer, params), results, sums, [True] * C, epoch_of)


# (step, members, their rows of the trainable tensors) -> (gradients [M, ...], losses (M,), accuracies (M,), weights)
Gradients = Callable[[int, list[int], Tensors], tuple[Tensors, torch.Tensor, torch.Tensor, list[int]]]
# (step, members, their gradients) -> what the optimiser steps on
Transform = Callable[[int, list[int], Tensors], Tensors]


def train_cohort(
    module: L.LightningModule,
    fabric: L.Fabric,
    round: int,
    cohort: Cohort,
    steps: int,
    groups: Callable[[int], list[list[int]]],
    gradients: Gradients,
    transform: Transform,
) -> None:
    """``steps`` local steps of ``cohort``. At step ``t`` every group of ``groups(t)`` (lists of cohort indices
    ``k``, each trained as one batched computation) gets its gradients, losses, accuracies and batch weights from
    ``gradients``; a member with weight 0 (a DP-SGD client that drew no record) logs nothing and still steps. A
    member whose loss is not finite fails with the message its module's ``check_loss`` gives one client at a time
    and leaves the cohort before its gradients are transformed (not under DP-SGD: ``cohort.check_finite``); the
    others' gradients go through ``transform`` and the cohort's optimiser steps their rows."""
    C, device = len(cohort.clients), fabric.device
    for t in range(steps):
        for members in groups(t):
            rows = None if members == list(range(C)) else torch.tensor(members, device=device)  # None: every row
            grads, losses, accuracy, weights = gradients(
                t, members, {n: rows_of(p, rows) for n, p in cohort.params.items()}
            )
            keep = _log_and_check(module, fabric, round, cohort, t, members, losses, accuracy, weights)
            if not keep:
                continue
            if len(keep) < len(members):
                index = torch.tensor(keep, device=device)
                grads = {n: g[index] for n, g in grads.items()}
                members = [members[i] for i in keep]
                rows = torch.tensor(members, device=device)
            cohort.optimizer.step(t, cohort.params, transform(t, members, grads), rows)


def _log_and_check(module, fabric, round: int, cohort: Cohort, t: int, members, losses, accuracy, weights) -> list:
    """Add each member's loss and accuracy to its sums; the positions in ``members`` of those still training."""
    finite = torch.isfinite(losses).tolist()
    values = zip(losses.detach().float().tolist(), accuracy.float().tolist(), strict=True)
    keep = []
    for i, (k, (loss, acc)) in enumerate(zip(members, values, strict=True)):
        if weights[i] == 0:
            keep.append(i)
            continue
        if not finite[i] and cohort.check_finite:  # the message the module's own check gives, at this epoch and step
            context = StepContext(fabric, client=cohort.clients[k], round=round)
            context.current_epoch, context.global_step = cohort.epoch_of(k, t), t
            try:
                with attached(module, context):
                    module.check_loss(losses[i])
            except (UserError, FloatingPointError) as err:
                cohort.alive[k] = False
                cohort.results[k].failure = f"local training failed: {err}"
                continue
        for key, value in (("train/loss", loss), ("train/acc", acc)):
            cohort.sums[k][key][0] += value * weights[i]
            cohort.sums[k][key][1] += weights[i]
        keep.append(i)
    return keep


def finish_cohort(module, cohort: Cohort, global_state: State, codec, local, round: int, seed: int) -> list:
    """Each client's logged sums and the encoding of its trained row of the cohort's tensors (a failed client's as
    :func:`~lightning_fl.federated.clients.local.encode_upload` says: nothing, or under an upload stage a noised zero
    update); the module back at ``global_state``."""
    for k, result in enumerate(cohort.results):
        result.logged = {key: (s, w) for key, (s, w) in sorted(cohort.sums[k].items()) if w > 0}
        trained = {n: p[k].detach().clone() for n, p in cohort.params.items()} if result.failure is None else {}
        encode_upload(result, trained, global_state, codec, local, round, seed)
    module.load_federated_state(global_state)
    return cohort.results
