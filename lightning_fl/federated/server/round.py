"""One federated round as a pipeline: sample the clients, collect their uploads, aggregate, and let every mechanism act
at its place as a stage.

:class:`RoundRunner` turns a global state into the next one. It is given the strategy, how the uploads arrive (a
collection, :mod:`lightning_fl.federated.server.collect`: one by one, or as a secure sum) and the run's stages
(:mod:`lightning_fl.federated.server.stages`: the norm gate, the simulated attack, central DP, the compressed
broadcast, the identity check, the accounting), and knows none of the mechanisms by name. A round, with the stages'
hooks::

    sample clients, drop the unavailable ones               start
    deliver the global state, collect the replies           on_reply; the upload gate (decode, layout, finite values)
      each accepted upload, streamed or kept as a row       on_upload (or on_rows, all at once)
      folded into the round's running sum                   on_fold
    the round's sum                                         on_aggregate
    the strategy's step (from the mean, or from the rows)   on_step: check, broadcast, measure
    count the bytes, account                                end_round

Each process trains its share of the round's clients (by client id), so the global state does not depend on how
clients are placed; every random stream derives from ``(seed, round, client)``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import numpy as np
import torch

from lightning_fl.compress.base import FP32
from lightning_fl.federated.persistence.ledger import ByteLedger
from lightning_fl.federated.server.collect import Uploads
from lightning_fl.federated.server.stages.base import Stage, Step
from lightning_fl.federated.server.state import State, flatten, unflatten
from lightning_fl.federated.server.strategies import Strategy
from lightning_fl.federated.server.uploads import LOST, Round, mean_over_clients, rank_zeros, record_bytes
from lightning_fl.seeding import STREAM_DROPOUT, derive_seed


@dataclass(frozen=True)
class RoundSettings:
    """Who takes part in a round and what happens to a refused upload (the trainer's arguments of these names).

    Args:
        sampling: ``fixed`` (``count`` clients without replacement) or ``poisson`` (each with probability
            ``count / num_clients``).
        dropout: Probability that a sampled client is unavailable (seeded per client and round).
        upload_policy: ``drop`` a refused upload from its round (warned), or ``raise``.
        secret_cohorts: Draw each round's clients from the operating system's secure generator (rank 0's, sent to
            every process), not from the run's seed: what a DP mechanism amplified by sampling needs when its
            ``noise_seed`` is null (:attr:`~lightning_fl.privacy.Privacy.amplified`).
        unprotected: What the round's metrics carry of the statistics computed from the clients' updates or logged
            by them (``Round.unprotected``): ``keep`` them (a run without privacy), ``withhold`` them (a private
            run's default), or ``label`` them ``unprotected/<key>`` (a private run's opt-in,
            ``trainer.unprotected_statistics``).
    """

    sampling: Literal["fixed", "poisson"] = "fixed"
    dropout: float = 0.0
    upload_policy: Literal["drop", "raise"] = "drop"
    secret_cohorts: bool = False
    unprotected: Literal["keep", "withhold", "label"] = "keep"


class RoundRunner:
    """Runs rounds with a fixed strategy, collection and stages.

    Args:
        fabric: The run's processes.
        strategy: The server algorithm (samples the clients; steps from the round's mean, or aggregates its rows).
        collection: How the uploads arrive, and when (:class:`~lightning_fl.federated.server.collect.Uploads`, or
            :class:`~lightning_fl.federated.server.secure_uploads.SecureUploads`; its arrival policy).
        stages: The run's mechanisms, in the order each hook runs them
            (:func:`~lightning_fl.federated.server.stages.round_stages`).
        ledger: Counts every client's bytes.
        settings: Sampling, dropout and the upload policy.
    """

    def __init__(
        self,
        fabric: L.Fabric,
        strategy: Strategy,
        collection: Uploads,
        stages: list[Stage],
        ledger: ByteLedger,
        settings: RoundSettings = RoundSettings(),
    ) -> None:
        self.fabric, self.strategy, self.collection, self.ledger = fabric, strategy, collection, ledger
        self.stages, self.settings = list(stages), settings
        collection.check(fabric, self.stages)
        world, groups = fabric.world_size, collection.fold_groups
        if collection.transport.spreads_over_processes and world > groups > 1:
            warnings.warn(
                f"trainer.fold_groups is {groups} but the run has {world} processes: {world - groups} of them "
                f"train no client; set fold_groups to a multiple of {world}",
                stacklevel=2,
            )
        #: Clients that answered the last round but were left out of its aggregate (rejected by the gate).
        self.dropped: list[int] = []
        #: Rows of uploads the last round held at once on this process (0: it streamed into a running sum).
        self.kept_rows = 0
        #: The last round's aggregated update norms (for the collapse alarm), largest first, with their clients.
        self.update_norms: list[tuple[float, int]] = []

    @property
    def unprotected(self) -> str:
        """What the rounds do with statistics from the clients' updates (``RoundSettings.unprotected``)."""
        return self.settings.unprotected

    # ============================================================================ who takes part
    def unavailable(self, seed: int, r: int, client: int) -> bool:
        """Whether ``client`` drops out of round ``r`` (seeded per client and round)."""
        dropout = self.settings.dropout
        return (
            dropout > 0
            and float(np.random.default_rng(derive_seed(seed, r, client, STREAM_DROPOUT)).random()) < dropout
        )

    def sample(self, r: int, num_clients: int, count: int, seed: int, pool: list[int] | None = None) -> list[int]:
        """Round ``r``'s clients: ``count`` without replacement (``fixed``), or each with probability
        ``count / num_clients`` (``poisson``); from the run's seed, or secret (``settings.secret_cohorts``).
        ``pool``: draw among these clients only (the available ones), ``fixed`` at most all of them."""
        drawn = None if self.settings.secret_cohorts else seed
        n = num_clients if pool is None else len(pool)
        if pool == []:
            cohort = []
        elif self.settings.sampling == "poisson":
            cohort = self.strategy.sample_poisson(r, n, count / num_clients, drawn)
        else:  # (more than the data holds: refused by the strategy's sample)
            cohort = self.strategy.sample(r, n, count if pool is None else min(count, n), drawn)
        cohort = cohort if pool is None else [pool[i] for i in cohort]
        return cohort if drawn is not None else rank_zeros(self.fabric, cohort)  # the same cohort on every process

    def draw(self, rnd: Round, count: int) -> None:
        """Round ``rnd``'s ``count`` sampled clients (among ``rnd.eligible``, if set), and which of them are
        unavailable (the default arrivals)."""
        rnd.sampled = self.sample(rnd.index, rnd.datamodule.num_clients, count, rnd.seed, rnd.eligible)
        rnd.away = [c for c in rnd.sampled if self.unavailable(rnd.seed, rnd.index, c)]
        rnd.available = [c for c in rnd.sampled if c not in rnd.away]

    def process_of(self, client: int, world: int) -> int:
        """The process that trains ``client`` among ``world`` (the collection's placement)."""
        return self.collection.process_of(client, world)

    # ============================================================================ the round
    def run(
        self, model: L.LightningModule, datamodule: Any, state: State, r: int, seed: int, count: int
    ) -> tuple[State, dict[str, float]]:
        """Round ``r`` from global ``state`` with ``count`` sampled clients: the next global state and metrics.

        A round in which none of the clients asked replied (a transport that can lose replies: Flower's nodes gone)
        is not a round: nothing is aggregated, released, accounted or saved; the transport is told
        (:meth:`~lightning_fl.federated.clients.transport.Transport.silent_round`, which stops the run after its limit)
        and the round runs again, with the same clients."""
        while (done := self._attempt(model, datamodule, state, r, seed, count)) is None:
            pass
        return done

    def _attempt(
        self, model: L.LightningModule, datamodule: Any, state: State, r: int, seed: int, count: int
    ) -> tuple[State, dict[str, float]] | None:
        names = sorted(state)
        full = FP32().encode(state, state, -1).nbytes  # a download of the global state in float32
        rnd = Round(
            r, seed, state, names, flatten(state, names), self.fabric, datamodule, self.settings.upload_policy, full
        )
        self.collection.arrivals.begin(rnd, lambda rnd: self.draw(rnd, count), self.collection, model)
        sampled, away, available = rnd.sampled, rnd.away, list(rnd.available)
        for stage in self.stages:
            stage.start(rnd)
        self.collection.collect(rnd, self.strategy, self.stages, model, datamodule)
        lost = [e.client for e in rnd.in_order if e.status == LOST]
        if available and len(lost) == len(available) == len(rnd.entries):  # (a late reply is a reply)
            self.collection.transport.silent_round(r + 1, available)
            return None
        if lost:
            warnings.warn(f"round {r + 1}: no reply from client(s) {lost}; they miss this round", stacklevel=2)
        aggregated = set(rnd.folded)
        self.kept_rows = 0 if rnd.streaming else rnd.rows.held
        self.dropped = [e.client for e in rnd.answered if e.client not in aggregated]
        self.update_norms = sorted(
            ((rnd.entry(c).norm, c) for c in aggregated if not math.isnan(rnd.entry(c).norm)), reverse=True
        )
        logged = mean_over_clients([e.logged for e in rnd.answered if e.client in aggregated])
        refused = {"fed/dropped_clients", "fed/aggregated_clients", "comm/rejected_bytes", "comm/cum_rejected_bytes"}
        rnd.unprotected.update({*logged, *refused})
        rnd.metrics = {
            "fed/round": float(r + 1),
            "fed/clients": float(len(sampled)),  # sampled this round, in every mode (FedBuff: drawn into free slots)
            "fed/aggregated_clients": float(len(aggregated)),  # uploads in its aggregate (late ones included)
            "fed/unavailable_clients": len(away),
            "fed/lost_clients": len(lost),
            "fed/kept_rows": self.kept_rows,  # uploads held at once (0: streamed into running sums)
            "fed/dropped_clients": len(self.dropped),
            # what the round aggregated: the metrics and the ledger's upload bytes leave dropped clients out
            **logged,
            **self.collection.transport.round_metrics(),
            **rnd.metrics,
        }
        record_bytes(self.ledger, rnd, aggregated, rnd.download_bytes)
        step = self._step(rnd)
        if step.accepted:
            state = {n: t.to(state[n].device) for n, t in step.state.items()}
        else:
            warnings.warn(f"round {r + 1}: {step.problem}; the global state is unchanged", stacklevel=2)
        rnd.metrics["fed/round_skipped"] = float(not step.accepted)
        for stage in self.stages:
            stage.end_round(rnd)
        self.collection.arrivals.end_round(rnd)
        rnd.metrics.update(self.ledger.metrics())
        return state, exported(rnd.metrics, rnd.unprotected, self.settings.unprotected)

    def _step(self, rnd: Round) -> Step:
        """The strategy's step from the round's sum (after the stages' ``on_aggregate``) or rows, through the stages'
        ``on_step``. A round whose sum no mechanism released keeps its state when the strategy cannot aggregate its
        number of uploads (``min_clients``), and a round whose sum a mechanism refuses (``Total.refused``) keeps it."""
        total = rnd.total
        if total is not None:  # (a robust strategy reads rows, not a sum)
            for stage in self.stages:
                total = stage.on_aggregate(rnd, total)
        released = total is not None and total.released
        if total is not None and total.refused is not None:
            step = Step(problem=total.refused)
        else:
            step = Step(problem=None if released else self.strategy.problem(len(rnd.folded)))
        if step.accepted:
            if self.strategy.streams:
                step.flat, step.metrics = self.strategy.step(rnd.index, rnd.current, total.mean(rnd.current64))
            else:
                weights = torch.tensor([rnd.entry(c).weight for c in rnd.folded], dtype=torch.float64)
                step.flat, step.metrics = self.strategy.aggregate(
                    rnd.index, rnd.current, rnd.rows.values, weights, list(rnd.folded)
                )
            step.state = unflatten(step.flat, rnd.state, rnd.names)
        for stage in self.stages:
            stage.on_step(rnd, step)
        if step.accepted:
            rnd.metrics.update({f"strategy/{k}": float(v) for k, v in step.metrics.items()})
        return step


def exported(metrics: dict[str, Any], unprotected: set[str], mode: str) -> dict[str, float]:
    """A round's ``metrics`` as the run logs, keeps and exports them: the ``unprotected`` keys (computed from what
    the clients sent or logged, outside any privacy mechanism) kept (``keep``), left out (``withhold``), or renamed
    ``unprotected/<key>`` (``label``: outside the privacy guarantee, as their name says wherever they go)."""
    out = {k: float(v) for k, v in metrics.items() if mode == "keep" or k not in unprotected}
    if mode == "label":
        out.update({f"unprotected/{k}": float(metrics[k]) for k in sorted(unprotected) if k in metrics})
    return out
