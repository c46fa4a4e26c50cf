"""One federated round as a pipeline: sample, train, then carry every reply through ordered stages.

:class:`RoundRunner` holds what a round needs (Fabric, strategy, codec, gate policy, availability, attack,
privacy, ledger) and turns a global state into the next one. The round's uploads travel as one
:class:`RoundUploads` object through these stages::

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

import functools
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from lightning_fl.compress.base import FP32, Codec
from lightning_fl.compress.downlink import Downlink
from lightning_fl.federated.attacks import Attack
from lightning_fl.federated.client import LocalTraining
from lightning_fl.federated.gate import UploadRejectedError, non_finite_rows, screen_upload, upload_nbytes
from lightning_fl.federated.ledger import ByteLedger
from lightning_fl.federated.state import State, flatten, unflatten
from lightning_fl.federated.strategies import Strategy
from lightning_fl.federated.strategies.base import GroupedSums, RunningSum
from lightning_fl.federated.transport import InProcess, Reply, SecureRound, Transport
from lightning_fl.privacy.base import Privacy, layer_slices
from lightning_fl.seeding import STREAM_DROPOUT, derive_seed

REJECTED, ACCEPTED, LOST = 0, 1, 2  # what became of a client's reply


@dataclass
class Entry:
    """One sampled, available client in a round: what it sent and what became of it."""

    client: int
    weight: float = 0.0  # its sample count (the aggregation weight of a weighted strategy)
    status: int = REJECTED
    up: int = 0  # upload bytes (the codec's payload)
    msg_up: int = -1  # the transport's message bytes (-1: not measured)
    msg_down: int = -1
    logged: dict[str, tuple[float, float]] = field(default_factory=dict)
    norm: float = math.nan  # the L2 norm of its update (float64), once computed


@dataclass
class RoundUploads:
    """A round's uploads as they travel through the stages.

    ``entries`` has one :class:`Entry` per client that answered or was lost (by client id). Accepted uploads
    are either folded into ``sums`` (streaming; one running sum per fold group) or kept as ``rows`` (float32
    ``(n, D)``, one per entry of ``row_clients``) and folded at the end of the round (linear strategies); ``sum``
    is the groups' combined sum the server stages read. ``unclipped`` counts the folded updates central DP left
    unscaled.
    """

    current: torch.Tensor  # the global state the clients started from, flat float32 (D,)
    streaming: bool
    layers: list[slice] = field(default_factory=list)  # each tensor's slice of a flat row (per-layer clipping)
    entries: dict[int, Entry] = field(default_factory=dict)
    sums: GroupedSums | None = None
    sum: RunningSum | None = None
    rows: torch.Tensor | None = None
    row_clients: list[int] = field(default_factory=list)
    folded: list[int] = field(default_factory=list)  # clients in the aggregate, in client order
    unclipped: int = 0
    attacked: int = 0
    secure_total: torch.Tensor | None = None  # secure aggregation: the modular sum of the quantised updates (int64)

    def entry(self, client: int) -> Entry:
        return self.entries[client]

    @functools.cached_property
    def current64(self) -> torch.Tensor:
        """``current`` in float64, converted once per round (update norms, central DP's updates)."""
        return self.current.double()

    @property
    def in_order(self) -> list[Entry]:
        """Every entry, in client order."""
        return [self.entries[c] for c in sorted(self.entries)]

    @property
    def answered(self) -> list[Entry]:
        """The entries of clients that replied (not lost), in client order."""
        return [e for e in self.in_order if e.status != LOST]


@dataclass
class SecureTotal:
    """A secure round's sum of the dequantised updates (float64 ``(D,)``, exact) and how many it adds."""

    total: torch.Tensor
    count: int


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
        self.upload_policy, self.dropout, self.attack = upload_policy, dropout, attack
        self.identity, self.progress = identity, progress
        self.transport = transport if transport is not None else InProcess()
        self.max_update_norm, self.max_update_norm_ratio = max_update_norm, max_update_norm_ratio
        self.privacy, self.sampling, self.fold_groups = privacy, sampling, fold_groups
        self.max_client_weight = max_client_weight
        #: Compressed downloads (``trainer.compressed_downloads``): the server's broadcast; ``None``: full states.
        self.downlink = downlink
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

    def reject(self, r: int, client: int, problems: list[str]) -> None:
        """Apply the upload policy to a rejected upload: raise, or warn and leave it out."""
        message = f"round {r + 1}, client {client}: upload rejected: {'; '.join(problems)}"
        if self.upload_policy == "raise":
            raise UploadRejectedError(message + " (trainer.upload_policy is 'raise'; use 'drop' to skip it)")
        warnings.warn(message + "; dropped from this round", stacklevel=3)

    @property
    def keeps_rows(self) -> bool:
        """Whether a round keeps every upload as a row (see the module docstring) instead of streaming."""
        if self.secure is not None:
            return False
        spread = self.transport.spreads_over_processes and self.fabric.world_size > 1 and self.fold_groups == 1
        round_attack = self.attack is not None and not self.attack.per_client
        return (
            not self.strategy.streams
            or self.max_update_norm_ratio is not None
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
            self._round_stages(uploads, r, seed)
        if uploads.sum is None and uploads.sums is not None:  # (several streaming processes have combined theirs)
            uploads.sum = uploads.sums.combine()
        if self.attack is not None:
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
        state, outcome = self._aggregate(r, state, names, uploads)
        metrics.update(outcome)
        if self.privacy is not None:
            participants = uploads.folded if self.privacy.central else [e.client for e in uploads.answered if e.up]
            metrics.update(self.privacy.end_round(r, participants))
        if (dp_sgd := getattr(self.local, "dp_sgd", None)) is not None:  # every client asked to train has spent
            metrics.update(dp_sgd.end_round(available, datamodule, self.local))
        metrics.update(self.ledger.metrics())
        return state, {k: float(v) for k, v in metrics.items()}

    # ============================================================================ per-client stages
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
            self._receive_secure(uploads, result, r)
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
                entry, decoded = self._receive(reply, state, r)
                uploads.entries[entry.client] = entry
                if not uploads.streaming:
                    if decoded is not None:
                        flatten(decoded, names, out=uploads.rows[len(uploads.row_clients)])
                        uploads.row_clients.append(entry.client)
                    continue
                row = flatten(decoded, names) if decoded is not None else None
                pending[entry.client] = self._client_stages(uploads, entry, row, r, seed) if row is not None else None
                while expected is not None and expected in pending:  # fold in client order, whatever the arrival
                    if (ready := pending.pop(expected)) is not None:
                        self._fold(uploads, uploads.entry(expected), ready)
                    expected = next(order, None)
            for client in sorted(pending):  # a transport that never answered for some client: fold the rest
                if pending[client] is not None:
                    self._fold(uploads, uploads.entry(client), pending[client])
        if not uploads.streaming and fabric.world_size > 1:
            self._gather_rows(uploads)
        elif spread and fabric.world_size > 1:
            self._combine_groups(uploads)

    def _row_buffer(self, slots: int, size: int) -> torch.Tensor:
        """Room for ``slots`` uploads of ``size`` values, not initialised: a row is written before it is read,
        and only the written ones are read (:attr:`RoundUploads.row_clients`).

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

    def _receive(self, reply: Reply, state: State, r: int) -> tuple[Entry, State | None]:
        """A reply as an :class:`Entry`, and its decoded upload if it passed the gate (decode + checks)."""
        cid = reply.client
        self._take_plan(reply, r)
        entry = Entry(cid, self._weight(reply, r), REJECTED, logged=reply.logged)
        entry.msg_up = -1 if reply.message_up is None else reply.message_up
        entry.msg_down = -1 if reply.message_down is None else reply.message_down
        if reply.lost:
            entry.status = LOST
            return entry, None
        entry.up = upload_nbytes(reply.payload)
        if reply.failure:
            decoded, problems = None, [reply.failure]
        else:
            decoded, problems = screen_upload(reply.payload, self.codec, state, cid)
        if problems or decoded is None:
            self.reject(r, cid, problems)
            return entry, None
        entry.status = ACCEPTED
        return entry, decoded

    def _receive_secure(self, uploads: RoundUploads, result: SecureRound, r: int) -> None:
        """A secure round's replies as entries, and the modular sum of the uploads it included: the server reads
        no upload (a deployment never shows it one; in process only their structure is checked)."""
        for reply in result.replies:
            self._take_plan(reply, r)
            entry = Entry(reply.client, float(reply.num_samples), REJECTED, logged=reply.logged)
            entry.msg_up = -1 if reply.message_up is None else reply.message_up
            entry.msg_down = -1 if reply.message_down is None else reply.message_down
            uploads.entries[entry.client] = entry
            if reply.lost:
                entry.status = LOST
                continue
            entry.up = reply.upload_bytes if reply.upload_bytes is not None else upload_nbytes(reply.payload)
            if reply.failure:
                self.reject(r, entry.client, [reply.failure])
            elif result.problem is None and entry.client in result.included:
                entry.status = ACCEPTED
        if result.problem is not None:
            warnings.warn(f"round {r + 1}: secure aggregation failed: {result.problem}; the round has no aggregate",
                          stacklevel=3)  # fmt: skip
            return
        uploads.secure_total = result.total
        uploads.folded = list(result.included)

    def _weight(self, reply: Reply, r: int) -> float:
        """A reply's sample count, capped at ``max_client_weight`` (warned) when a weighted strategy would use it."""
        weight, cap = float(reply.num_samples), self.max_client_weight
        if cap is not None and weight > cap and getattr(self.strategy, "weighted", False) and not reply.lost:
            warnings.warn(f"round {r + 1}, client {reply.client}: declared {reply.num_samples} samples; its weight "
                          f"is capped at trainer.max_client_weight={cap:g}", stacklevel=3)  # fmt: skip
            weight = float(cap)
        return weight

    def _take_plan(self, reply: Reply, r: int) -> None:
        """A node's own DP-SGD record count and batch size, for its client's accounting (warned about if unusable:
        the client's epsilon then comes from the server's data module)."""
        dp = getattr(self.local, "dp_sgd", None)
        if dp is None or reply.dp_sgd_plan is None:
            return
        problem = dp.report_plan(reply.client, *reply.dp_sgd_plan, self.local)
        if problem is not None:
            warnings.warn(f"round {r + 1}, client {reply.client}: {problem}; its record-level epsilon is accounted "
                          "with the server's data module", stacklevel=3)  # fmt: skip

    def _client_stages(self, uploads: RoundUploads, entry: Entry, row: torch.Tensor, r: int, seed: int):
        """One accepted upload through the simulated attack, the finiteness check and the absolute norm gate:
        the row to fold, or ``None`` (rejected, ``entry.status`` says so)."""
        if self.attack is not None:
            forged, attacked = self.attack.apply(r, uploads.current, row.unsqueeze(0), [entry.client], seed)
            if attacked:
                row = forged[0]
                uploads.attacked += 1
            if not bool(torch.isfinite(row).all()):
                self._refuse(r, entry, ["non-finite values"])
                return None
        entry.norm = float(update_norms(row.unsqueeze(0), uploads.current64)[0])
        problems = [f"update norm {entry.norm:.4g} {why}" for limit, why in self.norm_limits() if entry.norm > limit]
        if problems:
            self._refuse(r, entry, problems)
            return None
        return row

    def _refuse(self, r: int, entry: Entry, problems: list[str]) -> None:
        self.reject(r, entry.client, problems)
        entry.status = REJECTED

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

    # ============================================================================ per-round stages (rows kept)
    def _round_stages(self, uploads: RoundUploads, r: int, seed: int) -> None:
        """The kept rows through the attack (which may forge from all of them), the finiteness check and the norm
        gate (with the round's median norm); then fold them in client order (linear strategies) or keep them."""
        clients = list(uploads.row_clients)
        rows_ = rows(uploads.rows, list(range(len(clients))))
        current = uploads.current
        if self.attack is not None:
            rows_, attacked = self.attack.apply(r, current, rows_, clients, seed)
            uploads.attacked = len(attacked)
            bad = set(non_finite_rows(rows_))
            for i in sorted(bad):
                self._refuse(r, uploads.entry(clients[i]), ["non-finite values"])
            good = [i for i in range(len(clients)) if i not in bad]
            clients, rows_ = [clients[i] for i in good], rows(rows_, good)
        norms = update_norms(rows_, uploads.current64)
        limits = self.norm_limits(norms)
        good = []
        for i, client in enumerate(clients):
            entry = uploads.entry(client)
            entry.norm = float(norms[i])
            problems = [f"update norm {entry.norm:.4g} {why}" for limit, why in limits if entry.norm > limit]
            if problems:
                self._refuse(r, entry, problems)
            else:
                good.append(i)
        uploads.row_clients, uploads.rows = [clients[i] for i in good], rows(rows_, good)
        if self.strategy.streams:
            uploads.sums = GroupedSums(len(current), self.fold_groups)
            for client, row in zip(uploads.row_clients, uploads.rows, strict=True):
                self._fold(uploads, uploads.entry(client), row)
        else:
            uploads.folded = list(uploads.row_clients)

    def norm_limits(self, norms: torch.Tensor | None = None, relative: bool = True) -> list[tuple[float, str]]:
        """The update-norm bounds of a round whose uploads have ``norms``, each with the reason it names.

        ``relative``: include ``max_update_norm_ratio`` times the round's median (skipped when the median is 0 or
        ``norms`` is not given).
        """
        limits = []
        if self.max_update_norm is not None:
            limits.append((self.max_update_norm, f"exceeds trainer.max_update_norm={self.max_update_norm:g}"))
        if relative and self.max_update_norm_ratio is not None and norms is not None and len(norms):
            median = float(norms.median())  # the lower median: an honest majority keeps it honest
            if median > 0:
                limits.append((
                    self.max_update_norm_ratio * median,
                    f"is more than trainer.max_update_norm_ratio={self.max_update_norm_ratio:g} times the round's "
                    f"median update norm {median:.4g}",
                ))  # fmt: skip
        return limits

    # ============================================================================ server stages
    def _aggregate(self, r: int, state: State, names: list[str], uploads: RoundUploads) -> tuple[State, dict]:
        """Aggregate, noise (central DP), step the strategy; keep ``state`` when the round cannot be aggregated or
        its result is unusable.

        The aggregate passes the gate's checks before it becomes the global state: finite values, and a step
        within ``max_update_norm`` (and, for linear strategies, ``max_update_norm_ratio`` times the median).
        Under central DP every round releases its noised sum (even of no upload): skipping a round because few
        uploads arrived would reveal how many did; refusing a non-finite or too large noised result is
        post-processing.
        """
        strategy, current = self.strategy, uploads.current
        central = self.privacy is not None and self.privacy.central
        folded = uploads.folded
        # (a secure round never sees an update, so it has no update norms)
        norms = torch.tensor([uploads.entry(c).norm for c in folded if self.secure is None], dtype=torch.float64)
        metrics: dict[str, float] = {}
        problem = None if central else strategy.problem(len(folded))
        if self.secure is not None:  # the exact sum of the dequantised updates, from the modular sum
            n = len(folded)
            total = (
                self.secure.recover(uploads.secure_total, n) if n else torch.zeros(len(current), dtype=torch.float64)
            )
            uploads.sum = SecureTotal(total, n)
        if problem is None:
            if self.secure is not None and not central:
                new_flat, extra = strategy.step(r, current, current.double() + uploads.sum.total / len(folded))
            elif central:
                mean, released = self.privacy.release(uploads.sum.total, uploads.unclipped, len(folded), r)
                if self.fabric.world_size > 1:  # noise from the OS differs per process: rank 0's release holds
                    mean, released, self.privacy.bound = self.fabric.broadcast((mean, released, self.privacy.bound))
                metrics.update(released)
                new_flat, extra = strategy.step(r, current, current.double() + mean)
            elif strategy.streams:
                new_flat, extra = strategy.step(r, current, uploads.sum.mean())
            else:
                weights = torch.tensor([uploads.entry(c).weight for c in folded], dtype=torch.float64)
                new_flat, extra = strategy.aggregate(r, current, uploads.rows, weights, list(folded))
            step = float((new_flat.double() - current.double()).norm())
            # a server optimiser's step is not bounded by the clients' updates: only the absolute bound applies
            limits = self.norm_limits(norms, relative=strategy.linear)
            name = strategy.name
            if not bool(torch.isfinite(new_flat).all()):
                problem = f"aggregate refused: {name} produced non-finite values"
            elif too_far := [why for limit, why in limits if step > limit]:
                problem = f"aggregate refused: {name}'s step has norm {step:.4g}, which " + "; ".join(too_far)
            else:
                if self.downlink is None:
                    new_state = unflatten(new_flat, state, names)
                else:  # the step, compressed with the server's error feedback: what every client applies
                    delta = (new_flat.to(torch.float64) - current.to(torch.float64)).to(torch.float32)
                    new_state, payload = self.downlink.broadcast(unflatten(delta, state, names, typed=False), state)
                    metrics["comm/broadcast_bytes"] = float(payload.nbytes)
                if self.identity is not None and self.fabric.is_global_zero and len(folded):
                    metrics["fed/identity_error"] = self.identity([unflatten(u, state, names) for u in uploads.rows])
                metrics.update({f"strategy/{k}": float(v) for k, v in extra.items()})
                state = {n: t.to(state[n].device) for n, t in new_state.items()}
            if problem is not None and len(norms):
                top = int(norms.argmax())
                problem += (
                    f"; the largest update came from client {folded[top]} (norm {float(norms[top]):.4g}, the "
                    f"round's median {float(norms.median()):.4g})"
                )
        if problem is not None:
            warnings.warn(f"round {r + 1}: {problem}; the global state is unchanged", stacklevel=3)
            if self.downlink is not None:  # nothing changed: nothing to broadcast
                self.downlink.skip()
                metrics["comm/broadcast_bytes"] = 0.0
        metrics["fed/round_skipped"] = float(problem is not None)
        if len(norms):  # of the accepted updates, before any clipping: what a clip bound is chosen from
            metrics["fed/update_norm_median"] = median = float(norms.median())
            if median > 0:  # the largest over the median: the gate ratio under which this round refuses nothing
                metrics["fed/update_norm_max_ratio"] = float(norms.max()) / median
        return state, metrics

    # ============================================================================ bookkeeping
    def _record_bytes(self, state: State, uploads: RoundUploads, away: list[int], aggregated: set[int], r: int) -> None:
        """Count the round's traffic: downloads to every sampled client (the float32 state, or with compressed
        downloads the broadcasts it missed, :meth:`Downlink.download`), uploads aggregated or rejected."""
        full = FP32().encode(state, state, -1).nbytes

        def down(client: int) -> int:
            return full if self.downlink is None else self.downlink.download(client, r, full)

        self.ledger.start_round()
        for e in uploads.in_order:
            self.ledger.record(e.client, "down", down(e.client))
            if e.status != LOST:
                self.ledger.record(e.client, "up" if e.client in aggregated else "rejected", e.up)
            for direction, size in (("up", e.msg_up), ("down", e.msg_down)):
                if size >= 0:
                    self.ledger.record_message(e.client, direction, size)
        for c in away:
            self.ledger.record(c, "down", down(c))

    def _gather_rows(self, uploads: RoundUploads) -> None:
        """Every process's entries and decoded rows, on every process, in client order."""
        fabric = self.fabric
        everyone: list[Any] = [None] * fabric.world_size
        dist.all_gather_object(everyone, (uploads.entries, uploads.row_clients))
        rows_ = self._gather(uploads.rows)
        slots = len(uploads.rows)
        entries, placed = {}, {}
        for rank, (their_entries, their_rows) in enumerate(everyone):
            entries.update(their_entries)
            placed.update({c: rank * slots + i for i, c in enumerate(their_rows)})
        uploads.entries = entries
        uploads.row_clients = sorted(placed)
        uploads.rows = rows_[[placed[c] for c in uploads.row_clients]]

    def _combine_groups(self, uploads: RoundUploads) -> None:
        """Several streaming processes: every process's entries and counts, and the groups' sums added in group
        order (each broadcast once by the process that holds it), on every process."""
        fabric = self.fabric
        mine = {g: (part.weight, part.count) for g, part in uploads.sums.sums.items()}
        everyone: list[Any] = [None] * fabric.world_size
        dist.all_gather_object(everyone, (uploads.entries, uploads.folded, uploads.unclipped, uploads.attacked, mine))
        entries, folded, holders = {}, [], {}
        uploads.unclipped = uploads.attacked = 0
        for rank, (their_entries, their_folded, unclipped, attacked, groups) in enumerate(everyone):
            entries.update(their_entries)
            folded += their_folded
            uploads.unclipped += unclipped
            uploads.attacked += attacked
            holders.update({g: (rank, weight, count) for g, (weight, count) in groups.items()})
        uploads.entries, uploads.folded = entries, sorted(folded)
        total = RunningSum(len(uploads.current))
        for group in sorted(holders):
            rank, weight, count = holders[group]
            held = rank == fabric.global_rank
            part = fabric.to_device(uploads.sums.sums[group].total if held else torch.empty_like(total.total))
            dist.broadcast(part, src=rank)
            total.merge(part.cpu(), weight, count)
        uploads.sum = total

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
    round's uploads in memory; every chunk is converted and differenced in place in one float64 work buffer
    (the values of ``uploads.double() - current.double()``, chunk for chunk, without two new tensors per chunk).
    ``current`` may be given in float64 already (:attr:`RoundUploads.current64`), saving its conversion.
    """
    here = current.to(torch.float64).unsqueeze(0)
    rows = max(1, 2**19 // max(1, uploads.shape[1]))
    work = torch.empty(min(rows, len(uploads)), uploads.shape[1], dtype=torch.float64)
    parts = []
    for i in range(0, len(uploads), rows):
        chunk = uploads[i : i + rows]
        diff = work[: len(chunk)]
        parts.append(diff.copy_(chunk).sub_(here).norm(dim=1))
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
