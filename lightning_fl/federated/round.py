"""One federated round as a pipeline: sample, train, then carry every reply through ordered stages.

:class:`RoundRunner` holds what a round needs (Fabric, strategy, codec, gate policy, availability, attack,
privacy, ledger) and turns a global state into the next one. The round's uploads travel as one
:class:`~lightning_fl.federated.uploads.RoundUploads` object through these stages (a reply's decoding and gate in
:mod:`~lightning_fl.federated.intake`, the attack, finiteness and norm gate and the server's stages in
:mod:`~lightning_fl.federated.stages`)::

    per client   decode + gate  ->  simulated attack  ->  finiteness  ->  norm gate  ->  clip (central DP)  ->  fold
    per round                                                               (relative bound: every norm first)
    server       aggregate (running sum, or rows)  ->  noise (central DP)  ->  strategy step  ->  aggregate check
                 ->  compressed broadcast (``trainer.compressed_downloads``: :mod:`lightning_fl.compress.downlink`)

**Streaming.** A linear strategy (FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad) only needs the round's mean: each
upload is folded into a float64 running sum as soon as its stages pass, in client-id order, and dropped, so a
round costs O(D) memory whatever the number of clients (local DP happens on the client, before encoding).
**Rows** are kept, as an ``(n, D)`` float32 matrix, when something needs every upload at once: a robust strategy
(Median, TrimmedMean, Krum), the relative norm gate (``max_update_norm_ratio``: the round's median norm is known
only when every upload has arrived), an attack that forges from the whole round (ALIE), the averaging identity
check (FLITE latents, a few thousand floats each), or clients spread over several processes with one running
sum (the fold must visit clients in client-id order to stay independent of their placement; each process decodes
its own share and the rows are gathered). For a linear strategy the rows never leave the round, so one such matrix
serves every round of a run. Either way the same operations run in the same order, so a streamed
FedAvg equals the all-rows mean bit for bit.

**Several processes stream** with ``fold_groups`` G > 1: client ``c`` is folded into running sum ``c % G`` (each
in client-id order) and the G sums are added in group order (:class:`~lightning_fl.federated.strategies.GroupedSums`).
Group ``g``'s clients train on process ``g % world_size``, which folds them as they arrive and, once, broadcasts
its sum in its turn: memory O(D) per group, and the same additions whatever the number of processes, so the
global state is that of one process with the same G, bit for bit.

Each process trains its share of the round's clients (by client id: every ``world_size``-th, or the clients of
its groups), so the global state does not depend on how clients are placed.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np
import torch
from tqdm.auto import tqdm

from lightning_fl.compress.base import FP32, Codec
from lightning_fl.compress.downlink import Downlink
from lightning_fl.federated.attacks import Attack
from lightning_fl.federated.client import LocalTraining
from lightning_fl.federated.intake import Intake
from lightning_fl.federated.ledger import ByteLedger
from lightning_fl.federated.stages import Aggregation, Screening
from lightning_fl.federated.state import State, flatten
from lightning_fl.federated.strategies import Strategy
from lightning_fl.federated.strategies.base import GroupedSums
from lightning_fl.federated.transport import InProcess, Transport
from lightning_fl.federated.uploads import (
    LOST,
    Entry,
    RoundUploads,
    combine_groups,
    gather_rows,
    mean_over_clients,
    record_bytes,
)
from lightning_fl.privacy.base import Privacy, layer_slices
from lightning_fl.seeding import STREAM_DROPOUT, derive_seed


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
        privacy: Privacy | None = None,
        sampling: str = "fixed",
        fold_groups: int = 1,
        max_client_weight: float | None = None,
        downlink: Downlink | None = None,
    ) -> None:
        self.fabric, self.strategy, self.codec, self.local, self.ledger = fabric, strategy, codec, local, ledger
        # secure aggregation: the round sees the modular sum of the uploads only
        self.secure = getattr(local, "secure", None)
        self.dropout, self.identity, self.progress = dropout, identity, progress
        self.transport = transport if transport is not None else InProcess()
        self.privacy, self.sampling, self.fold_groups = privacy, sampling, fold_groups
        #: Compressed downloads (``trainer.compressed_downloads``): the server's broadcast; ``None``: full states.
        self.downlink = downlink
        #: The stages an accepted upload passes before it is folded (attack, finiteness, norm gate).
        self.screening = Screening(upload_policy, attack, max_update_norm, max_update_norm_ratio)
        #: A reply's way to an entry: decode and gate, weight cap, a node's DP-SGD plan.
        self.intake = Intake(codec, self.screening, strategy, local, max_client_weight)
        #: The server's stages: aggregate, noise, strategy step, checks, broadcast.
        self.aggregation = Aggregation(fabric, strategy, self.screening, privacy, self.secure, downlink, identity)
        world = fabric.world_size
        if self.transport.spreads_over_processes and world > fold_groups > 1:
            warnings.warn(
                f"trainer.fold_groups is {fold_groups} but the run has {world} processes: {world - fold_groups} of "
                f"them train no client; set fold_groups to a multiple of {world}",
                stacklevel=2,
            )
        #: Clients that answered the last round but were left out of its aggregate (rejected by the gate).
        self.dropped: list[int] = []
        #: Rows of uploads the last round held at once on this process (0: it streamed into a running sum).
        self.kept_rows = 0
        self.update_norms: list[tuple[float, int]] = []
        self._rows: torch.Tensor | None = None  # the rows buffer a linear strategy reuses (:meth:`_row_buffer`)

    # ============================================================================ the round
    def unavailable(self, seed: int, r: int, client: int) -> bool:
        """Whether ``client`` drops out of round ``r`` (seeded per client and round)."""
        if self.dropout == 0:
            return False
        return bool(np.random.default_rng(derive_seed(seed, r, client, STREAM_DROPOUT)).random() < self.dropout)

    def sample(self, r: int, num_clients: int, count: int, seed: int) -> list[int]:
        """Round ``r``'s clients: ``count`` without replacement (``fixed``), or each with probability
        ``count / num_clients`` (``poisson``)."""
        if self.sampling == "poisson":
            return self.strategy.sample_poisson(r, num_clients, count / num_clients, seed)
        return self.strategy.sample(r, num_clients, count, seed)

    @property
    def keeps_rows(self) -> bool:
        """Whether a round keeps every upload as a row (see the module docstring) instead of streaming."""
        if self.secure is not None:
            return False
        spread = self.transport.spreads_over_processes and self.fabric.world_size > 1 and self.fold_groups == 1
        round_attack = (attack := self.screening.attack) is not None and not attack.per_client
        return (
            not self.strategy.streams
            or self.screening.max_update_norm_ratio is not None
            or round_attack
            or self.identity is not None
            or spread
        )

    def run(
        self, model: L.LightningModule, datamodule: Any, state: State, r: int, seed: int, count: int
    ) -> tuple[State, dict[str, float]]:
        """Round ``r`` from global ``state`` with ``count`` sampled clients: the next global state and metrics."""
        names = sorted(state)
        sampled = self.sample(r, datamodule.num_clients, count, seed)
        away = [c for c in sampled if self.unavailable(seed, r, c)]
        available = [c for c in sampled if c not in away]
        current = flatten(state, names)
        uploads = RoundUploads(current, not self.keeps_rows, layer_slices([state[n].numel() for n in names]))
        if uploads.streaming:
            uploads.sums = GroupedSums(len(current), self.fold_groups)
        self._collect(uploads, model, datamodule, state, names, available, r, seed)
        lost = [e.client for e in uploads.in_order if e.status == LOST]
        if lost:
            warnings.warn(f"round {r + 1}: no reply from client(s) {lost}; they miss this round", stacklevel=2)
        metrics = {
            "fed/round": float(r + 1),
            "fed/clients": float(len(sampled)),
            "fed/unavailable_clients": len(away),
            "fed/lost_clients": len(lost),
        }
        self.kept_rows = 0 if uploads.streaming else len(uploads.rows)
        metrics["fed/kept_rows"] = self.kept_rows  # uploads held at once (0: streamed into running sums)
        if not uploads.streaming:
            self.screening.round(uploads, r, seed)
            self._fold_rows(uploads)
        if uploads.sum is None and uploads.sums is not None:  # (several streaming processes have combined theirs)
            uploads.sum = uploads.sums.combine()
        if self.screening.attack is not None:
            metrics["fed/attacked_clients"] = uploads.attacked
        aggregated = set(uploads.folded)
        self.dropped = [e.client for e in uploads.answered if e.client not in aggregated]
        #: The aggregated clients' update norms of this round (for the collapse alarm), largest first.
        self.update_norms = sorted(((uploads.entry(c).norm, c) for c in aggregated
                                    if not math.isnan(uploads.entry(c).norm)), reverse=True)  # fmt: skip
        metrics["fed/dropped_clients"] = len(self.dropped)
        # what the round aggregated: the metrics and the ledger's upload bytes leave dropped clients out
        metrics.update(mean_over_clients([e.logged for e in uploads.answered if e.client in aggregated]))
        self._record_bytes(state, uploads, away, aggregated, r)
        state, outcome = self.aggregation(r, state, names, uploads)
        metrics.update(outcome)
        if self.privacy is not None:
            participants = uploads.folded if self.privacy.central else [e.client for e in uploads.answered if e.up]
            metrics.update(self.privacy.end_round(r, participants))
        if (dp_sgd := getattr(self.local, "dp_sgd", None)) is not None:  # every client asked to train has spent
            metrics.update(dp_sgd.end_round(available, datamodule, self.local))
        metrics.update(self.ledger.metrics())
        return state, {k: float(v) for k, v in metrics.items()}

    # ============================================================================ the replies
    def _collect(self, uploads: RoundUploads, model, datamodule, state: State, names, available, r: int, seed: int):
        """Have this process's share of ``available`` trained (by the transport) and take each reply through the
        per-client stages: streaming, fold it in client order; keeping rows, decode it into its row (and gather
        every process's rows and entries)."""
        fabric = self.fabric
        spread = self.transport.spreads_over_processes
        # Each client trains on one process, always the same: a codec's memory of a client (error-feedback
        # residuals) stays where the client trains.
        world = fabric.world_size if spread else 1
        share = [c for c in available if self.process_of(c, world) == fabric.global_rank] if spread else available
        if not uploads.streaming:
            slots = max(1, max(sum(1 for c in available if self.process_of(c, world) == k) for k in range(world)))
            uploads.rows = self._row_buffer(slots, len(uploads.current))
        show = self.progress and fabric.is_global_zero and sys.stderr.isatty()  # no bars in logs
        if self.secure is not None:  # (one process: checked when the fit starts)
            result = self.transport.secure_round(
                model, datamodule, state, available, r, seed, codec=self.codec, local=self.local, fabric=fabric
            )
            self.intake.secure(uploads, result, r)
            return
        replies = self.transport.replies(
            model, datamodule, state, share, r, seed, codec=self.codec, local=self.local, fabric=fabric
        )
        pending: dict[int, torch.Tensor | None] = {}  # streaming: processed replies waiting for their turn to fold
        order = iter(sorted(share))
        expected = next(order, None)
        if spread or fabric.is_global_zero:  # a network transport talks to clients from rank 0 only
            replies = tqdm(replies, total=len(share), desc=f"clients r{r + 1}", leave=False, disable=not show)
            for reply in replies:
                entry, decoded = self.intake.reply(reply, state, r)
                uploads.entries[entry.client] = entry
                if not uploads.streaming:
                    if decoded is not None:
                        flatten(decoded, names, out=uploads.rows[len(uploads.row_clients)])
                        uploads.row_clients.append(entry.client)
                    continue
                row = flatten(decoded, names) if decoded is not None else None
                pending[entry.client] = self.screening.client(uploads, entry, row, r, seed) if row is not None else None
                while expected is not None and expected in pending:  # fold in client order, whatever the arrival
                    if (ready := pending.pop(expected)) is not None:
                        self._fold(uploads, uploads.entry(expected), ready)
                    expected = next(order, None)
            for client in sorted(pending):  # a transport that never answered for some client: fold the rest
                if pending[client] is not None:
                    self._fold(uploads, uploads.entry(client), pending[client])
        if not uploads.streaming and fabric.world_size > 1:
            gather_rows(fabric, uploads)
        elif spread and fabric.world_size > 1:
            combine_groups(fabric, uploads)

    def _row_buffer(self, slots: int, size: int) -> torch.Tensor:
        """Room for ``slots`` uploads of ``size`` values, not initialised: only written rows are read.

        A linear strategy's rows never leave the round (they are folded into a running sum), so one buffer
        serves every round (no ``(n, D)`` matrix allocated and its pages faulted in, or zeroed, per round); a
        robust strategy may return a view of a row as the next global state, so it gets a new one each round.
        """
        if not self.strategy.streams:
            return torch.empty(slots, size, dtype=torch.float32)
        kept = self._rows
        if kept is None or len(kept) < slots or kept.shape[1] != size:
            kept = self._rows = torch.empty(slots, size, dtype=torch.float32)
        return kept[:slots]

    def process_of(self, client: int, world: int) -> int:
        """The process that trains ``client`` among ``world``: the one holding its fold group (``client %
        fold_groups``) when there are several groups, else every ``world``-th client (the same when ``world``
        divides ``fold_groups``)."""
        return (client % self.fold_groups) % world if self.fold_groups > 1 else client % world

    def _fold(self, uploads: RoundUploads, entry: Entry, row: torch.Tensor) -> None:
        """Add one upload to the running sum: as it is (weighted by its sample count for a weighted strategy), or
        under central DP its clipped update."""
        if self.privacy is not None and self.privacy.central:
            clipped, _, within = self.privacy.clip(row.double() - uploads.current64, uploads.layers)
            uploads.sums.add(entry.client, clipped, 1.0)
            uploads.unclipped += int(within)
        else:
            uploads.sums.add(entry.client, row, entry.weight if self.strategy.weighted else 1.0)
        uploads.folded.append(entry.client)

    def _fold_rows(self, uploads: RoundUploads) -> None:
        """The rows that passed the round's stages: folded in client order (linear strategies), or kept."""
        if self.strategy.streams:
            uploads.sums = GroupedSums(len(uploads.current), self.fold_groups)
            for client, row in zip(uploads.row_clients, uploads.rows, strict=True):
                self._fold(uploads, uploads.entry(client), row)
        else:
            uploads.folded = list(uploads.row_clients)

    def _record_bytes(self, state: State, uploads: RoundUploads, away: list[int], aggregated: set[int], r: int) -> None:
        """Count the round's traffic: downloads to every sampled client (the float32 state, or with compressed
        downloads the broadcasts it missed, :meth:`Downlink.download`), uploads aggregated or rejected."""
        full = FP32().encode(state, state, -1).nbytes
        down = (lambda c: full) if self.downlink is None else (lambda c: self.downlink.download(c, r, full))
        record_bytes(self.ledger, uploads, away, aggregated, down)
