"""How a round's uploads reach the server: each on its own (:class:`Uploads`), or only as their sum
(:class:`~lightning_fl.federated.server.secure_uploads.SecureUploads`, secure aggregation).

:class:`Uploads` has the round's share of clients trained by the transport and takes each reply through its way in:
an :class:`~lightning_fl.federated.server.uploads.Entry`, the stages' ``on_reply``, the upload gate (decode, layout,
finite values), then the stages' per-upload hooks. **Streaming**: each accepted upload is folded (the stages'
``on_fold``) into a float64 running sum as soon as its turn in client-id order comes, and dropped: O(D) memory whatever
the number of clients. **Rows**: when a stage reads every upload at once (``needs_rows``), the strategy needs them all
(Median, TrimmedMean, Krum), or one running sum spans several processes (the fold must visit clients in client-id order
to stay independent of their placement), the uploads are kept as an ``(n, D)`` float32 matrix, gathered from every
process, passed to the stages' ``on_rows``, then folded in client order (linear strategies) or kept. Either way the
same operations run in the same order, so a streamed FedAvg equals the all-rows mean bit for bit.

**Several processes stream** with ``fold_groups`` G > 1: client ``c`` is folded into running sum ``c % G`` (each in
client-id order) and the G sums are added in group order
(:class:`~lightning_fl.federated.server.strategies.GroupedSums`). Group ``g``'s clients train on process ``g %
world_size``, which folds them as they arrive and, once, broadcasts its sum in its turn: memory O(D) per group, and the
same additions whatever the number of processes, so the global state is that of one process with the same G, bit for
bit.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import lightning as L
import torch
from tqdm.auto import tqdm

from lightning_fl.compress.base import Codec
from lightning_fl.federated.arrivals.base import Arrivals, WaitForAll
from lightning_fl.federated.clients.local import LocalTraining
from lightning_fl.federated.clients.transport import Reply, Transport
from lightning_fl.federated.server.gate import screen_upload, upload_nbytes
from lightning_fl.federated.server.stages.base import Stage
from lightning_fl.federated.server.state import State, flatten
from lightning_fl.federated.server.strategies import Strategy
from lightning_fl.federated.server.strategies.base import GroupedSums
from lightning_fl.federated.server.uploads import (
    ACCEPTED,
    LOST,
    REJECTED,
    Entry,
    Round,
    Rows,
    Total,
    combine_groups,
    gather_rows,
)


def entry_of(reply: Reply, rnd: Round, stages: list[Stage]) -> Entry:
    """A reply as the round's entry (its sample count as weight, its message bytes), after the stages' ``on_reply``;
    ``LOST`` when nothing came back."""
    entry = Entry(
        reply.client,
        float(reply.num_samples),
        REJECTED,
        logged=reply.logged,
        staleness=reply.staleness,
        downloaded=reply.downloaded,
    )
    entry.msg_up = -1 if reply.message_up is None else reply.message_up
    entry.msg_down = -1 if reply.message_down is None else reply.message_down
    for stage in stages:
        stage.on_reply(rnd, reply, entry)
    if reply.lost:
        entry.status = LOST
    rnd.entries[entry.client] = entry
    return entry


def rebased(upload: State, then: State, now: State, discount: float) -> State:
    """A late upload ``u``, trained from ``then``, as the equivalent upload of a round at ``now``: ``now + s (u -
    then)`` (float64 arithmetic, back to each tensor's dtype), so the round's weighted mean steps by FedBuff's
    ``sum_i w_i s(tau_i) Delta_i / sum_i w_i`` (:mod:`lightning_fl.federated.arrivals.fedbuff`)."""
    return {n: (now[n].double() + discount * (upload[n].double() - then[n].double())).to(now[n].dtype) for n in now}


class Uploads:
    """Every upload on its own (module docstring), delivered by ``transport``.

    Args:
        transport: How the round reaches its clients (in process, Flower).
        codec: Their uploads' encoding (decoded here).
        local: How they train.
        fold_groups: Running sums a linear strategy folds into (client ``c`` into sum ``c % fold_groups``).
        progress: A bar over the round's clients on a terminal.
        arrivals: Whose replies a round takes, and when (:mod:`lightning_fl.federated.arrivals`); default: every
            available client's.
    """

    #: The server sees single uploads (stages may read them).
    sum_only = False

    def __init__(
        self,
        transport: Transport,
        codec: Codec,
        local: LocalTraining,
        fold_groups: int = 1,
        progress: bool = False,
        arrivals: Arrivals | None = None,
    ) -> None:
        self.transport, self.codec, self.local = transport, codec, local
        self.fold_groups, self.progress = fold_groups, progress
        self.arrivals = arrivals if arrivals is not None else WaitForAll()
        self._buffer: torch.Tensor | None = None  # the rows a linear strategy reuses round after round

    def process_of(self, client: int, world: int) -> int:
        """The process that trains ``client`` among ``world``: the one holding its fold group (``client %
        fold_groups``) when there are several groups, else every ``world``-th client (the same when ``world``
        divides ``fold_groups``)."""
        return (client % self.fold_groups) % world if self.fold_groups > 1 else client % world

    def check(self, fabric: L.Fabric, stages: list[Stage]) -> None:
        """Refuse a run these uploads cannot serve (any run can receive single uploads)."""

    def keeps_rows(self, strategy: Strategy, stages: list[Stage], fabric: L.Fabric) -> bool:
        """Whether a round keeps every upload as a row (module docstring) instead of streaming."""
        spread = self.transport.spreads_over_processes and fabric.world_size > 1 and self.fold_groups == 1
        return not strategy.streams or any(stage.needs_rows for stage in stages) or spread

    def collect(self, rnd: Round, strategy: Strategy, stages: list[Stage], model: Any, datamodule: Any) -> None:
        """Have this process's share of ``rnd.available`` trained and bring every reply in: the round's entries,
        the folded clients and its :class:`~lightning_fl.federated.server.uploads.Total` (or, for a robust strategy,
        rows)."""
        fabric = rnd.fabric
        self.arrivals.admit(rnd)
        spread = self.transport.spreads_over_processes
        # Each client trains on one process, always the same: a codec's memory of a client (error-feedback
        # residuals) stays where the client trains.
        world = fabric.world_size if spread else 1
        mine = [c for c in rnd.available if self.process_of(c, world) == fabric.global_rank]
        share = mine if spread else rnd.available
        if self.keeps_rows(strategy, stages, fabric):
            slots = max(1, max(sum(1 for c in rnd.available if self.process_of(c, world) == k) for k in range(world)))
            rnd.rows = Rows(self._row_buffer(strategy, slots, len(rnd.current)), held=slots)
        else:
            rnd.running = GroupedSums(len(rnd.current), self.fold_groups)
        replies = self.arrivals.replies(rnd, self, model, share)
        if spread or fabric.is_global_zero:  # a network transport talks to clients from rank 0 only
            show = self.progress and fabric.is_global_zero and sys.stderr.isatty()  # no bars in logs
            bar = tqdm(replies, total=len(share), desc=f"clients r{rnd.index + 1}", leave=False, disable=not show)
            self._take(rnd, strategy, stages, bar if show else progress_lines(replies, len(share), rnd.index), share)
        if rnd.rows is not None:
            if fabric.world_size > 1:
                gather_rows(fabric, rnd)
            rnd.rows.keep(list(range(len(rnd.rows.clients))))  # the rows written, no more
            for stage in stages:
                stage.on_rows(rnd, rnd.rows)
            if strategy.streams:  # a linear strategy's rows are folded in client order, then dropped
                rnd.running = GroupedSums(len(rnd.current), self.fold_groups)
                for client, row in zip(rnd.rows.clients, rnd.rows.values, strict=True):
                    self._fold(rnd, strategy, stages, rnd.entry(client), row)
            else:
                rnd.folded = list(rnd.rows.clients)
        elif spread and fabric.world_size > 1:
            combine_groups(fabric, rnd)
        if rnd.total is None and rnd.running is not None:  # (several streaming processes have combined theirs)
            rnd.total = Total.of(rnd.running.combine())

    def _take(self, rnd: Round, strategy: Strategy, stages: list[Stage], replies, share: list[int]) -> None:
        """Each reply into its entry, and its upload into its row, or through the per-upload stages and folded in
        client order whatever the order of arrival."""
        pending: dict[int, torch.Tensor | None] = {}  # streaming: screened uploads waiting for their turn to fold
        order = iter(sorted(share))
        expected = next(order, None)
        for reply in replies:
            entry = entry_of(reply, rnd, stages)
            decoded = self.decode(rnd, reply, entry)
            if rnd.rows is not None:
                if decoded is not None and len(rnd.rows.clients) == len(rnd.rows.values):  # a late reply, beyond
                    rnd.rows.values = torch.cat([rnd.rows.values, rnd.rows.values[:1]])  # the round's own: a row more
                    rnd.rows.held += 1
                if decoded is not None:
                    flatten(decoded, rnd.names, out=rnd.rows.values[len(rnd.rows.clients)])
                    rnd.rows.clients.append(entry.client)
                continue
            row = flatten(decoded, rnd.names) if decoded is not None else None
            for stage in stages:
                if row is None:
                    break
                row = stage.on_upload(rnd, entry, row)
            pending[entry.client] = row
            while expected is not None and expected in pending:
                if (ready := pending.pop(expected)) is not None:
                    self._fold(rnd, strategy, stages, rnd.entry(expected), ready)
                expected = next(order, None)
        for client in sorted(pending):  # a transport that never answered for some client: fold the rest
            if pending[client] is not None:
                self._fold(rnd, strategy, stages, rnd.entry(client), pending[client])

    def decode(self, rnd: Round, reply: Reply, entry: Entry) -> State | None:
        """A reply's upload decoded if it passes the gate (layout, dtype, size, finite values); else ``None``.

        A late reply (``reply.reference``: the state it was trained from) is decoded against that state and enters
        the round as :func:`rebased`."""
        if reply.lost:
            return None
        entry.up = upload_nbytes(reply.payload)
        reference = rnd.state if reply.reference is None else reply.reference
        if reply.failure:
            decoded, problems = None, [reply.failure]
        else:
            decoded, problems = screen_upload(reply.payload, self.codec, reference, reply.client)
        if problems or decoded is None:
            rnd.reject(entry, problems)
            return None
        entry.status = ACCEPTED
        return decoded if reply.reference is None else rebased(decoded, reply.reference, rnd.state, reply.discount)

    @staticmethod
    def _fold(rnd: Round, strategy: Strategy, stages: list[Stage], entry: Entry, row: torch.Tensor) -> None:
        """Add what the upload contributes (the stages' ``on_fold``) to the running sum, weighted by its sample
        count for a weighted strategy."""
        for stage in stages:
            row = stage.on_fold(rnd, entry, row)
        rnd.running.add(entry.client, row, entry.weight if strategy.weighted else 1.0)
        rnd.folded.append(entry.client)

    def _row_buffer(self, strategy: Strategy, slots: int, size: int) -> torch.Tensor:
        """Room for ``slots`` uploads of ``size`` values, not initialised: only written rows are read.

        A linear strategy's rows never leave the round (they are folded into a running sum), so one buffer
        serves every round (no ``(n, D)`` matrix allocated and its pages faulted in, or zeroed, per round); a
        robust strategy may return a view of a row as the next global state, so it gets a new one each round.
        """
        if not strategy.streams:
            return torch.empty(slots, size, dtype=torch.float32)
        kept = self._buffer
        if kept is None or len(kept) < slots or kept.shape[1] != size:
            kept = self._buffer = torch.empty(slots, size, dtype=torch.float32)
        return kept[:slots]


#: Seconds between two lines saying how far a long round is (no bar: a log, a CI run, or the bars off).
PROGRESS_EVERY_S = 20.0
log = logging.getLogger(__name__)


def progress_lines(replies: Iterable[Any], total: int, index: int) -> Iterator[Any]:
    """``replies`` as they come, with a line every :data:`PROGRESS_EVERY_S` seconds saying how many of the round's
    ``total`` clients have replied (a language model's round can take minutes on a CPU)."""
    started = last = time.perf_counter()
    for done, reply in enumerate(replies, start=1):
        yield reply
        if (now := time.perf_counter()) - last >= PROGRESS_EVERY_S and done < total:
            last = now
            log.info("round %d: %d/%d clients replied, %.0f s", index + 1, done, total, now - started)
