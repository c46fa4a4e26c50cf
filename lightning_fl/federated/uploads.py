"""A round's uploads as they travel through its stages (:mod:`lightning_fl.federated.round`), and the operations
on them that do not depend on the round's settings: update norms, the clients' metric means, the byte count,
and the gathers that put every process's uploads on every process.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_fl.federated.ledger import ByteLedger
from lightning_fl.federated.strategies.base import GroupedSums, RunningSum

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
    sum: RunningSum | SecureTotal | None = None
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


def record_bytes(
    ledger: ByteLedger, uploads: RoundUploads, away: list[int], aggregated: set[int], down: Callable[[int], int]
) -> None:
    """Count a round's traffic: ``down(client)`` bytes to every sampled client (``away``: those unavailable),
    each reply's upload as aggregated or rejected, and the transport's message bytes where it measured them."""
    ledger.start_round()
    for e in uploads.in_order:
        ledger.record(e.client, "down", down(e.client))
        if e.status != LOST:
            ledger.record(e.client, "up" if e.client in aggregated else "rejected", e.up)
        for direction, size in (("up", e.msg_up), ("down", e.msg_down)):
            if size >= 0:
                ledger.record_message(e.client, direction, size)
    for c in away:
        ledger.record(c, "down", down(c))


# ================================================================================ several processes
def gather_rows(fabric: L.Fabric, uploads: RoundUploads) -> None:
    """Every process's entries and decoded rows, on every process, in client order."""
    everyone: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(everyone, (uploads.entries, uploads.row_clients))
    rows_ = gather(fabric, uploads.rows)
    slots = len(uploads.rows)
    entries, placed = {}, {}
    for rank, (their_entries, their_rows) in enumerate(everyone):
        entries.update(their_entries)
        placed.update({c: rank * slots + i for i, c in enumerate(their_rows)})
    uploads.entries = entries
    uploads.row_clients = sorted(placed)
    uploads.rows = rows_[[placed[c] for c in uploads.row_clients]]


def combine_groups(fabric: L.Fabric, uploads: RoundUploads) -> None:
    """Several streaming processes: every process's entries and counts, and the groups' sums added in group
    order (each broadcast once by the process that holds it), on every process."""
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
