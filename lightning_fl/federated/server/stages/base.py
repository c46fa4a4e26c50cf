"""The interface of a round's mechanisms: a :class:`Stage` acts at the points of a round it names, and the round
(:class:`~lightning_fl.federated.server.round.RoundRunner`) calls every stage it is given, in order, at each point.

The round knows no mechanism by name: central DP, the norm gate, the simulated attack, the compressed broadcast, the
identity check and the accounting of local DP and DP-SGD are stages (:mod:`lightning_fl.federated.server.stages`); how
the uploads arrive (one by one, or as a secure sum) is the round's collection
(:mod:`lightning_fl.federated.server.collect`). pfl-research's ``Postprocessor`` (per user, then on the server) and
Flower's DP strategy wrappers (clip the replies, aggregate, add noise) are the same idea. The points, in a round's
order:

==============  ===============================================================  =================================
hook            when                                                             used by
==============  ===============================================================  =================================
``start``       the round's clients are sampled, none has trained                compressed broadcast (downloads)
``on_reply``    every reply, lost and failed ones included, as it arrives        weight cap, a node's DP-SGD plan
``on_upload``   an accepted upload (decoded, gated), before it is folded;       attack, norm gate
                streaming rounds call it per client in client order
``on_rows``     every accepted upload at once, when the round keeps rows         ALIE, the relative norm gate
                (a stage with ``needs_rows``); default: ``on_upload`` per row
``on_fold``     what an accepted upload adds to the round's running sum          central DP's clipping
``on_aggregate``  the round's :class:`~lightning_fl.federated.server.uploads.Total`,    central DP's noise
                before the strategy steps from it
``on_step``     the strategy's result (:class:`Step`): refuse it, replace the   aggregate check, broadcast,
                next state, or measure it                                        identity check
``end_round``   after the step                                                   accounting, norm metrics
==============  ===============================================================  =================================

A stage writes what it measures into ``rnd.metrics`` and counts into ``rnd.counts`` (summed over processes); it
leaves an upload out with ``rnd.reject(entry, problems)`` (the run's upload policy). Several processes run
``on_reply``, ``on_upload`` and ``on_fold`` for their own clients and every other hook alike on every process.

Around the rounds a stage owns its state and its report, as torchmetrics' metrics and pfl's postprocessors do: what
it keeps from round to round goes into the round checkpoint under its ``state_key`` (:meth:`Stage.state_dict`,
:meth:`Stage.load_state_dict`), and the run's summary prints its :meth:`Stage.summary` lines; :meth:`Stage.finish`
writes its files when the rounds end. The checkpoint and the summary iterate the stages; neither names one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from lightning_fl.federated.clients.transport import Reply
from lightning_fl.federated.server.state import State
from lightning_fl.federated.server.uploads import Entry, Round, Rows, Total


@dataclass
class Step:
    """The strategy's result in a round, as the stages see it after it steps.

    ``flat`` (float64 ``(D,)``) and ``state`` are the next global state; a stage may replace ``state`` (the compressed
    broadcast sends what clients apply). ``problem`` says why the round keeps its global state instead (the strategy
    could not aggregate, or a stage refused the result); ``flat`` is then ``None`` when the strategy did not step.
    """

    flat: torch.Tensor | None = None
    state: State | None = None
    problem: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the strategy's own (logged as ``strategy/*``)

    @property
    def accepted(self) -> bool:
        return self.problem is None


class Stage:
    """Base class of a round's mechanisms: every hook does nothing (see the module docstring for when each runs)."""

    #: The stage reads every accepted upload of the round at once (:meth:`on_rows`), so the round keeps them as rows
    #: instead of streaming them into a running sum.
    needs_rows: ClassVar[bool] = False

    def start(self, rnd: Round) -> None:
        """The round's clients are sampled (``rnd.sampled``, ``rnd.away``); none has trained yet."""

    def on_reply(self, rnd: Round, reply: Reply, entry: Entry) -> None:
        """A client's reply and the entry the round made of it (lost and failed replies included)."""

    def on_upload(self, rnd: Round, entry: Entry, row: torch.Tensor) -> torch.Tensor | None:
        """An accepted upload (flat float32): the row to go on with, or ``None`` after ``rnd.reject(entry, ...)``."""
        return row

    def on_rows(self, rnd: Round, rows: Rows) -> None:
        """Every accepted upload at once: keep the rows that go on (``rows.keep``), rejecting the others."""
        kept = []
        for i, client in enumerate(rows.clients):
            row = self.on_upload(rnd, rnd.entry(client), rows.values[i])
            if row is not None:
                rows.values[i] = row
                kept.append(i)
        rows.keep(kept)

    def on_fold(self, rnd: Round, entry: Entry, row: torch.Tensor) -> torch.Tensor:
        """What an accepted upload adds to the round's running sum (the upload itself by default)."""
        return row

    def on_aggregate(self, rnd: Round, total: Total) -> Total:
        """The round's sum, before the strategy steps from it."""
        return total

    def on_step(self, rnd: Round, step: Step) -> None:
        """The strategy's result: refuse it (set ``step.problem``), replace ``step.state``, or measure it."""

    def end_round(self, rnd: Round) -> None:
        """The round is aggregated (or kept its state); account for it."""

    # ============================================================================ around the rounds
    #: The round checkpoint's key for this stage's state (``None``: it keeps nothing from round to round).
    state_key: ClassVar[str | None] = None
    #: Why a checkpoint without this stage's state cannot resume its run (``None``: the stage then starts afresh).
    without: ClassVar[str | None] = None
    #: Why a run with this stage cannot resume from any checkpoint (``None``: it can).
    not_resumable: ClassVar[str | None] = None

    def state_dict(self) -> dict[str, Any]:
        """What the next round depends on (saved under :attr:`state_key` with every round checkpoint)."""
        return {}

    def load_state_dict(self, state: dict[str, Any], completed: int) -> None:
        """Continue from ``state``, saved after round ``completed``; a ``ValueError`` says why it cannot."""

    def summary(self, history: list[dict[str, float]]) -> list[str]:
        """The run summary's lines of this stage, from every round's metrics (``history[-1]``: the last round's)."""
        return []

    def finish(self, log_dir: Path, rank_zero: bool) -> None:
        """The rounds are over: write the stage's files into the run folder ``log_dir`` (from ``rank_zero``)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
