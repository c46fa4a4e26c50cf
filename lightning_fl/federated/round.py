"""One federated round on every process: sample, train the local clients, gate, gather, attack, aggregate.

:class:`RoundRunner` holds what a round needs (Fabric, strategy, codec, gate policy, availability, attack,
ledger) and turns a global state into the next one. Each process trains its share of the round's clients
(every ``world_size``-th, by client id); the uploads it accepted are gathered on every process, in client
order, so the strategy computes the same aggregate everywhere.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from lightning_fl.compress.base import FP32, Codec
from lightning_fl.federated.attacks import Attack
from lightning_fl.federated.client import LocalTraining
from lightning_fl.federated.gate import UploadRejectedError, non_finite_rows, screen_upload, upload_nbytes
from lightning_fl.federated.ledger import ByteLedger
from lightning_fl.federated.state import State, flatten, unflatten
from lightning_fl.federated.strategies import Strategy
from lightning_fl.federated.transport import InProcess, Transport
from lightning_fl.seeding import derive_seed

STREAM_DROPOUT = 15
REJECTED, ACCEPTED, LOST = 0, 1, 2  # what became of a client's reply


class RoundRunner:
    """Runs rounds with fixed settings (see :class:`~lightning_fl.federated.FederatedTrainer` for each one)."""

    def __init__(
        self,
        fabric: L.Fabric,
        strategy: Strategy,
        codec: Codec,
        local: LocalTraining,
        ledger: ByteLedger,
        upload_policy: str = "drop",
        dropout: float = 0.0,
        attack: Attack | None = None,
        identity: Callable[[list[State]], float] | None = None,
        progress: bool = False,
        transport: Transport | None = None,
        max_update_norm: float | None = None,
        max_update_norm_ratio: float | None = None,
    ) -> None:
        self.fabric, self.strategy, self.codec, self.local, self.ledger = fabric, strategy, codec, local, ledger
        self.upload_policy, self.dropout, self.attack = upload_policy, dropout, attack
        self.identity, self.progress = identity, progress
        self.transport = transport if transport is not None else InProcess()
        self.max_update_norm, self.max_update_norm_ratio = max_update_norm, max_update_norm_ratio
        #: Clients that answered the last round but were left out of its aggregate (rejected by the gate).
        self.dropped: list[int] = []

    def unavailable(self, seed: int, r: int, client: int) -> bool:
        """Whether ``client`` drops out of round ``r`` (seeded per client and round)."""
        if self.dropout == 0:
            return False
        return bool(np.random.default_rng(derive_seed(seed, r, client, STREAM_DROPOUT)).random() < self.dropout)

    def reject(self, r: int, client: int, problems: list[str]) -> None:
        """Apply the upload policy to a rejected upload: raise, or warn and leave it out."""
        message = f"round {r + 1}, client {client}: upload rejected: {'; '.join(problems)}"
        if self.upload_policy == "raise":
            raise UploadRejectedError(message + " (trainer.upload_policy is 'raise'; use 'drop' to skip it)")
        warnings.warn(message + "; dropped from this round", stacklevel=3)

    def run(
        self, model: L.LightningModule, datamodule: Any, state: State, r: int, seed: int, count: int
    ) -> tuple[State, dict[str, float]]:
        """Round ``r`` from global ``state`` with ``count`` sampled clients: the next global state and metrics."""
        names = sorted(state)
        sampled = self.strategy.sample(r, datamodule.num_clients, count, seed)
        away = [c for c in sampled if self.unavailable(seed, r, c)]
        available = [c for c in sampled if c not in away]
        ids, status, weights, flats, up, msg_up, msg_down, logged = self._train_mine(
            model, datamodule, state, names, available, r, seed
        )
        order = sorted((i for i in range(len(ids)) if ids[i] >= 0), key=lambda i: int(ids[i]))
        lost = [int(ids[i]) for i in order if status[i] == LOST]
        if lost:
            warnings.warn(f"round {r + 1}: no reply from client(s) {lost}; they miss this round", stacklevel=2)
        answered = [i for i in order if status[i] != LOST]
        keep = [i for i in order if status[i] == ACCEPTED]
        metrics = {
            "fed/round": float(r + 1),
            "fed/clients": float(len(sampled)),
            "fed/unavailable_clients": len(away),
            "fed/lost_clients": len(lost),
        }
        clients, uploads, num_samples = [int(ids[i]) for i in keep], rows(flats, keep), weights[keep]
        current = flatten(state, names)
        if self.attack is not None:
            uploads, attacked = self.attack.apply(r, current, uploads, clients, seed)
            metrics["fed/attacked_clients"] = len(attacked)
            bad = non_finite_rows(uploads)
            for i in bad:
                self.reject(r, clients[i], ["non-finite values"])
            good = [i for i in range(len(clients)) if i not in bad]
            clients, uploads, num_samples = [clients[i] for i in good], rows(uploads, good), num_samples[good]
        norms = update_norms(uploads, current)
        good = self._norm_gate(r, clients, norms)
        clients, num_samples, norms = [clients[i] for i in good], num_samples[good], norms[good]
        uploads = rows(uploads, good)
        aggregated_ids = set(clients)
        self.dropped = [int(ids[i]) for i in answered if int(ids[i]) not in aggregated_ids]
        metrics["fed/dropped_clients"] = len(self.dropped)
        # what the round aggregated: the metrics and the ledger's upload bytes leave dropped clients out
        metrics.update(mean_over_clients([logged[int(ids[i])] for i in answered if int(ids[i]) in aggregated_ids]))
        self._record_bytes(state, ids, order, status, up, msg_up, msg_down, away, aggregated_ids)
        state, aggregated = self._aggregate(r, state, names, current, uploads, num_samples, clients, norms)
        metrics.update(aggregated)
        metrics.update(self.ledger.metrics())
        return state, {k: float(v) for k, v in metrics.items()}

    def _norm_gate(self, r: int, clients: list[int], norms: torch.Tensor) -> list[int]:
        """Indices of the uploads whose update norm passes ``max_update_norm`` and ``max_update_norm_ratio``."""
        limits = self.norm_limits(norms)
        good = []
        for i, client in enumerate(clients):
            problems = [f"update norm {float(norms[i]):.4g} {why}" for limit, why in limits if float(norms[i]) > limit]
            if problems:
                self.reject(r, client, problems)
            else:
                good.append(i)
        return good

    def norm_limits(self, norms: torch.Tensor, relative: bool = True) -> list[tuple[float, str]]:
        """The update-norm bounds of a round whose uploads have ``norms``, each with the reason it names.

        ``relative``: include ``max_update_norm_ratio`` times the round's median (skipped when the median is 0).
        """
        limits = []
        if self.max_update_norm is not None:
            limits.append((self.max_update_norm, f"exceeds trainer.max_update_norm={self.max_update_norm:g}"))
        if relative and self.max_update_norm_ratio is not None and len(norms):
            median = float(norms.median())  # the lower median: an honest majority keeps it honest
            if median > 0:
                limits.append((
                    self.max_update_norm_ratio * median,
                    f"is more than trainer.max_update_norm_ratio={self.max_update_norm_ratio:g} times the round's "
                    f"median update norm {median:.4g}",
                ))  # fmt: skip
        return limits

    def _record_bytes(self, state, ids, order, status, up, msg_up, msg_down, away, aggregated) -> None:
        """Count the round's traffic: downloads to every sampled client, uploads aggregated or rejected."""
        down = FP32().encode(state, state, -1).nbytes
        self.ledger.start_round()
        for i in order:
            client = int(ids[i])
            self.ledger.record(client, "down", down)
            if status[i] != LOST:
                self.ledger.record(client, "up" if client in aggregated else "rejected", int(up[i]))
            for direction, sizes in (("up", msg_up), ("down", msg_down)):
                if sizes[i] >= 0:
                    self.ledger.record_message(client, direction, int(sizes[i]))
        for c in away:
            self.ledger.record(c, "down", down)

    def _train_mine(self, model, datamodule, state: State, names: list[str], available: list[int], r: int, seed: int):
        """Have this process's share of ``available`` trained (by the transport); gather what the round needs.

        Returns ids, status (rejected, accepted or lost), sample counts, flat uploads, upload bytes and the
        transport's message bytes up and down (-1: not measured), one row per slot on every process, and
        ``{client: logged values}``.
        """
        fabric = self.fabric
        spread = self.transport.spreads_over_processes
        # Each client trains on one process, always the same (client % processes): a codec's memory of a client
        # (error-feedback residuals) stays where the client trains. Rows are aggregated in client order.
        world = fabric.world_size if spread else 1
        share = [c for c in available if c % world == fabric.global_rank] if spread else available
        slots = max(1, max(sum(1 for c in available if c % world == k) for k in range(world)))
        ids = torch.full((slots,), -1, dtype=torch.int64)
        status = torch.full((slots,), REJECTED, dtype=torch.int64)
        weights = torch.zeros(slots, dtype=torch.float64)
        flats = torch.zeros(slots, sum(state[n].numel() for n in names), dtype=torch.float32)
        up = torch.zeros(slots, dtype=torch.int64)  # upload bytes (the codec's payload)
        msg_up = torch.full((slots,), -1, dtype=torch.int64)
        msg_down = torch.full((slots,), -1, dtype=torch.int64)
        logged: dict[int, dict[str, tuple[float, float]]] = {}
        show = self.progress and fabric.is_global_zero and sys.stderr.isatty()  # no bars in logs
        replies = self.transport.replies(
            model, datamodule, state, share, r, seed, codec=self.codec, local=self.local, fabric=fabric
        )
        if spread or fabric.is_global_zero:  # a network transport talks to clients from rank 0 only
            replies = tqdm(replies, total=len(share), desc=f"clients r{r + 1}", leave=False, disable=not show)
            for slot, reply in enumerate(replies):
                cid = reply.client
                ids[slot], weights[slot], logged[cid] = cid, float(reply.num_samples), reply.logged
                msg_up[slot] = -1 if reply.message_up is None else reply.message_up
                msg_down[slot] = -1 if reply.message_down is None else reply.message_down
                if reply.lost:
                    status[slot] = LOST
                    continue
                up[slot] = upload_nbytes(reply.payload)
                if reply.failure:
                    decoded, problems = None, [reply.failure]
                else:
                    decoded, problems = screen_upload(reply.payload, self.codec, state, cid)
                if problems or decoded is None:
                    self.reject(r, cid, problems)
                    continue
                status[slot] = ACCEPTED
                flatten(decoded, names, out=flats[slot])
        gathered = (self._gather(t) for t in (ids, status, weights, flats, up, msg_up, msg_down))
        return (*gathered, self._gather_logged(logged))

    def _aggregate(
        self, r, state, names, current, uploads, num_samples, clients, norms
    ) -> tuple[State, dict[str, float]]:
        """Apply the strategy; keep ``state`` when the round cannot be aggregated or its result is unusable.

        The aggregate passes the gate's checks before it becomes the global state: finite values, and a step
        within ``max_update_norm`` (and, for linear strategies, ``max_update_norm_ratio`` times the median).
        """
        problem = self.strategy.problem(len(clients))
        metrics: dict[str, float] = {}
        if problem is None:
            new_flat, extra = self.strategy.aggregate(r, current, uploads, num_samples, clients)
            step = float((new_flat.double() - current.double()).norm())
            # a server optimiser's step is not bounded by the clients' updates: only the absolute bound applies
            limits = self.norm_limits(norms, relative=self.strategy.linear)
            name = self.strategy.name
            if not bool(torch.isfinite(new_flat).all()):
                problem = f"aggregate refused: {name} produced non-finite values"
            elif too_far := [why for limit, why in limits if step > limit]:
                problem = f"aggregate refused: {name}'s step has norm {step:.4g}, which " + "; ".join(too_far)
            else:
                new_state = unflatten(new_flat, state, names)
                if self.identity is not None and self.fabric.is_global_zero:
                    metrics["fed/identity_error"] = self.identity([unflatten(u, state, names) for u in uploads])
                metrics.update({f"strategy/{k}": float(v) for k, v in extra.items()})
                state = {n: t.to(state[n].device) for n, t in new_state.items()}
            if problem is not None and len(clients):
                top = int(norms.argmax())
                problem += (
                    f"; the largest update came from client {clients[top]} (norm {float(norms[top]):.4g}, the "
                    f"round's median {float(norms.median()):.4g})"
                )
        if problem is not None:
            warnings.warn(f"round {r + 1}: {problem}; the global state is unchanged", stacklevel=3)
        metrics["fed/round_skipped"] = float(problem is not None)
        return state, metrics

    def _gather_logged(self, logged: dict[int, dict]) -> dict[int, dict]:
        """Every process's ``{client: logged values}``, merged."""
        if self.fabric.world_size == 1:
            return logged
        everyone: list[dict] = [{} for _ in range(self.fabric.world_size)]
        dist.all_gather_object(everyone, logged)
        return {c: values for part in everyone for c, values in part.items()}

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every process's ``t`` (same shape everywhere), concatenated in rank order along the first dimension.

        ``torch.distributed.all_gather`` directly: no autograd is needed here, and Fabric's ``all_gather`` goes
        through a deprecated differentiable version that warns on every run.
        """
        fabric = self.fabric
        if fabric.world_size == 1:
            return t
        mine = fabric.to_device(t).contiguous()
        parts = [torch.empty_like(mine) for _ in range(fabric.world_size)]
        dist.all_gather(parts, mine)
        return torch.cat(parts).cpu()


def rows(t: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``t[index]``, without copying when ``index`` is the first ``len(index)`` rows in order (the usual round)."""
    return t[: len(index)] if index == list(range(len(index))) else t[index]


def update_norms(uploads: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each upload's change to the global state (one upload per row), in float64.

    A few rows at a time (about 2**19 values), so the float64 copies stay in cache instead of doubling the
    round's uploads in memory.
    """
    here = current.double().unsqueeze(0)
    rows = max(1, 2**19 // max(1, uploads.shape[1]))
    parts = [(uploads[i : i + rows].double() - here).norm(dim=1) for i in range(0, len(uploads), rows)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def mean_over_clients(logged: list[dict[str, tuple[float, float]]]) -> dict[str, float]:
    """Each logged key's mean over every batch of every client (batch-size weighted), summed in client order."""
    keys = sorted({k for values in logged for k in values})
    out = {}
    for key in keys:
        pairs = [values.get(key, (0.0, 0.0)) for values in logged]
        total = float(torch.tensor([w for _, w in pairs], dtype=torch.float64).sum())
        if total > 0:
            out[key] = float(torch.tensor([s for s, _ in pairs], dtype=torch.float64).sum()) / total
    return out
