"""A round as it travels through its stages (:mod:`lightning_fl.federated.server.round`): :class:`Round`, what each
sampled client sent (:class:`Entry`), the uploads kept at once (:class:`Rows`) and the round's sum (:class:`Total`);
and the operations on them that do not depend on the round's mechanisms: update norms, the clients' metric means, the
byte count, and the gathers that put every process's uploads on every process.
"""

from __future__ import annotations

import enum
import functools
import math
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_fl.federated.persistence.ledger import ByteLedger
from lightning_fl.federated.server.gate import UploadRejectedError
from lightning_fl.federated.server.state import State
from lightning_fl.federated.server.strategies.base import GroupedSums, RunningSum


class Status(enum.IntEnum):
    """What became of a client's reply in a round."""

    REJECTED = 0  # it came, and the gate or a stage left its upload out (or it held none)
    ACCEPTED = 1  # its upload goes on to the aggregate
    LOST = 2  # nothing came back (the node left, or the round's timeout passed)


REJECTED, ACCEPTED, LOST = Status.REJECTED, Status.ACCEPTED, Status.LOST


@dataclass
class Entry:
    """One sampled, available client in a round: what it sent and what became of it."""

    client: int
    weight: float = 0.0  # its sample count (the aggregation weight of a weighted strategy)
    status: Status = REJECTED
    up: int = 0  # upload bytes (the codec's payload)
    msg_up: int = -1  # the transport's message bytes (-1: not measured)
    msg_down: int = -1
    logged: dict[str, tuple[float, float]] = field(default_factory=dict)
    norm: float = math.nan  # the L2 norm of its update (float64), once computed
    staleness: int = 0  # rounds its reply is late (a late reply folded into this round on Flower)
    downloaded: bool = True  # this round sent it the global state (a late or busy client's was counted before)


@dataclass
class Rows:
    """Accepted uploads held at once: ``values`` float32 ``(n, D)``, row ``i`` from ``clients[i]``, in client order
    once the round has them all (``values`` may be a longer buffer while they arrive: only written rows are read).
    ``held``: the rows this process held at once (``fed/kept_rows``)."""

    values: torch.Tensor
    clients: list[int] = field(default_factory=list)
    held: int = 0

    def keep(self, index: list[int]) -> None:
        """Keep the rows at ``index`` (in that order), without copying when they are the first ones in order."""
        self.clients = [self.clients[i] for i in index]
        self.values = take(self.values, index)


@dataclass
class Total:
    """The round's sum as the server's stages and the strategy read it.

    ``total`` (float64 ``(D,)``) adds ``count`` uploads with weights summing to ``weight``; the strategy steps from
    :meth:`mean`. ``updates``: the sum is of updates ``x_k - x`` (central DP's clipped updates, a secure sum), not
    of uploads. ``released``: a mechanism released it, so the strategy steps from it whatever the number of uploads
    (skipping a round because few uploads arrived would reveal how many did). ``refused``: why a mechanism refuses to
    release it (distributed DP with fewer noise shares than its ``min_shares``): the strategy does not step.
    """

    total: torch.Tensor
    weight: float
    count: int
    updates: bool = False
    released: bool = False
    refused: str | None = None

    @classmethod
    def of(cls, running: RunningSum) -> Total:
        return cls(running.total, running.weight, running.count)

    def mean(self, current64: torch.Tensor) -> torch.Tensor:
        """The mean upload the strategy steps from (float64): ``total / weight``, plus the global state for updates."""
        if self.updates:
            return current64 + self.total / self.weight
        if not self.weight > 0:
            raise ValueError(f"Expected positive aggregation weights, got a total of {self.weight}")
        return self.total / self.weight


@dataclass
class Round:
    """One round's state as it passes the stages: who was sampled, each reply's :class:`Entry`, the accepted uploads
    (folded into ``running`` as they arrive, or kept as ``rows``), the round's :class:`Total`, and its metrics.

    ``counts`` holds what stages count (uploads attacked, updates left unclipped): summed over processes when several
    stream. ``downloads`` holds what a stage says a sampled client downloads this round (by default the global state
    in float32, ``full_bytes``).
    """

    index: int  # the round, 0-based
    seed: int  # the run's seed
    state: State  # the global state the clients start from
    names: list[str]  # its tensors' order in a flat row
    current: torch.Tensor  # the same, flat float32 (D,)
    fabric: Any
    datamodule: Any = None
    upload_policy: str = "drop"
    full_bytes: int = 0
    eligible: list[int] | None = None  # the clients that may be sampled (``None``: all; the clock's availability)
    sampled: list[int] = field(default_factory=list)
    away: list[int] = field(default_factory=list)  # sampled but unavailable (dropout)
    available: list[int] = field(default_factory=list)
    late: list[int] = field(default_factory=list)  # sampled, downloaded, but left out by the clock (late or offline)
    # downloaded this round, replying in a later one or never (FedBuff; a client lost and started again: twice)
    pending: list[int] = field(default_factory=list)
    pending_messages: list[tuple[int, int]] = field(default_factory=list)  # (client, bytes of a message it was sent)
    entries: dict[int, Entry] = field(default_factory=dict)
    rows: Rows | None = None  # ``None``: the round streams its uploads into ``running``
    running: GroupedSums | None = None
    total: Total | None = None
    folded: list[int] = field(default_factory=list)  # clients in the aggregate, in client order
    counts: Counter = field(default_factory=Counter)
    downloads: dict[int, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    #: Keys of ``metrics`` computed from what the clients sent or logged, outside any privacy mechanism (their logged
    #: means, update norms, the identity error, the uploads refused): what a private run keeps out of its exports.
    unprotected: set[str] = field(default_factory=set)

    @functools.cached_property
    def current64(self) -> torch.Tensor:
        """``current`` in float64, converted once per round (update norms, central DP's updates)."""
        return self.current.double()

    @functools.cached_property
    def layers(self) -> list[slice]:
        """Each tensor's slice of a flat row (per-layer clipping)."""
        out, start = [], 0
        for n in self.names:
            out.append(slice(start, start + self.state[n].numel()))
            start += self.state[n].numel()
        return out

    @property
    def streaming(self) -> bool:
        return self.rows is None

    def entry(self, client: int) -> Entry:
        return self.entries[client]

    @property
    def in_order(self) -> list[Entry]:
        """Every entry, in client order."""
        return [self.entries[c] for c in sorted(self.entries)]

    @property
    def answered(self) -> list[Entry]:
        """The entries of clients that replied (not lost), in client order."""
        return [e for e in self.in_order if e.status != LOST]

    def download_bytes(self, client: int) -> int:
        return self.downloads.get(client, self.full_bytes)

    def reject(self, entry: Entry, problems: list[str]) -> None:
        """Leave ``entry``'s upload out of the round under ``trainer.upload_policy``: warn, or raise."""
        entry.status = REJECTED
        message = f"round {self.index + 1}, client {entry.client}: upload rejected: {'; '.join(problems)}"
        if self.upload_policy == "raise":
            raise UploadRejectedError(message + " (trainer.upload_policy is 'raise'; use 'drop' to skip it)")
        warnings.warn(message + "; dropped from this round", stacklevel=4)


def take(t: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``t[index]``, without copying when ``index`` is the first ``len(index)`` rows in order (the usual round)."""
    return t[: len(index)] if index == list(range(len(index))) else t[index]


def update_norms(uploads: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each upload's change to the global state (one upload per row), in float64.

    A few rows at a time (about 2**19 values), so the float64 copies stay in cache instead of doubling the
    round's uploads in memory; every chunk is converted and differenced in place in one float64 work buffer
    (the values of ``uploads.double() - current.double()``, chunk for chunk, without two new tensors per chunk).
    ``current`` may be given in float64 already (:attr:`Round.current64`), saving its conversion.
    """
    here = current.to(torch.float64).unsqueeze(0)
    step = max(1, 2**19 // max(1, uploads.shape[1]))
    work = torch.empty(min(step, len(uploads)), uploads.shape[1], dtype=torch.float64)
    parts = []
    for i in range(0, len(uploads), step):
        chunk = uploads[i : i + step]
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


def record_bytes(ledger: ByteLedger, rnd: Round, aggregated: set[int], down: Callable[[int], int]) -> None:
    """Count a round's traffic: ``down(client)`` bytes to every sampled client (``rnd.away``: those unavailable;
    ``rnd.late``: those the clock left out; ``rnd.pending``: those whose reply comes in a later round) this round sent
    the global state, each reply's upload as aggregated or rejected (a late reply's in the round it arrives), and the
    transport's message bytes where it measured them (``rnd.pending_messages``: the pending clients')."""
    ledger.start_round()
    for e in rnd.in_order:
        if e.downloaded:
            ledger.record(e.client, "down", down(e.client))
        if e.status != LOST:
            ledger.record(e.client, "up" if e.client in aggregated else "rejected", e.up)
        for direction, size in (("up", e.msg_up), ("down", e.msg_down)):
            if size >= 0:
                ledger.record_message(e.client, direction, size)
    for c in rnd.away + rnd.late + rnd.pending:
        ledger.record(c, "down", down(c))
    for c, size in rnd.pending_messages:
        ledger.record_message(c, "down", size)


# ================================================================================ several processes
def gather_rows(fabric: L.Fabric, rnd: Round) -> None:
    """Every process's entries and decoded rows, on every process, in client order."""
    everyone: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(everyone, (rnd.entries, rnd.rows.clients))
    values = gather(fabric, rnd.rows.values)
    slots = len(rnd.rows.values)
    entries, placed = {}, {}
    for rank, (their_entries, their_rows) in enumerate(everyone):
        entries.update(their_entries)
        placed.update({c: rank * slots + i for i, c in enumerate(their_rows)})
    rnd.entries = entries
    clients = sorted(placed)
    rnd.rows = Rows(values[[placed[c] for c in clients]], clients, held=len(clients))


def combine_groups(fabric: L.Fabric, rnd: Round) -> None:
    """Several streaming processes: every process's entries, folded clients and counts, and the groups' sums added
    in group order (each broadcast once by the process that holds it), on every process."""
    mine = {g: (part.weight, part.count) for g, part in rnd.running.sums.items()}
    everyone: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(everyone, (rnd.entries, rnd.folded, dict(rnd.counts), mine))
    entries, folded, holders, counts = {}, [], {}, Counter()
    for rank, (their_entries, their_folded, their_counts, groups) in enumerate(everyone):
        entries.update(their_entries)
        folded += their_folded
        counts.update(their_counts)
        holders.update({g: (rank, weight, count) for g, (weight, count) in groups.items()})
    rnd.entries, rnd.folded, rnd.counts = entries, sorted(folded), counts
    total = RunningSum(len(rnd.current))
    for group in sorted(holders):
        rank, weight, count = holders[group]
        held = rank == fabric.global_rank
        part = fabric.to_device(rnd.running.sums[group].total if held else torch.empty_like(total.total))
        dist.broadcast(part, src=rank)
        total.merge(part.cpu(), weight, count)
    rnd.total = Total.of(total)


def gather(fabric: L.Fabric, t: torch.Tensor) -> torch.Tensor:
    """Every process's ``t`` (same shape everywhere), concatenated in rank order along the first dimension.

    ``torch.distributed.all_gather`` directly: no autograd is needed here, and Fabric's ``all_gather`` goes
    through a deprecated differentiable version that warns on every run.
    """
    if fabric.world_size == 1:
        return t
    mine = fabric.to_device(t).contiguous()
    parts = [torch.empty_like(mine) for _ in range(fabric.world_size)]
    dist.all_gather(parts, mine)
    return torch.cat(parts).cpu()


def rank_zeros(fabric: L.Fabric, cohort: list[int]) -> list[int]:
    """Rank 0's ``cohort`` on every process (a cohort each process drew from its own secure generator)."""
    return cohort if fabric.world_size == 1 else list(fabric.broadcast(cohort, src=0))
