"""FedBuff simulated in process (:mod:`lightning_fl.federated.buffered`): an event loop over the clock's time.

:class:`BufferedRunner` stands where a :class:`~lightning_fl.federated.round.RoundRunner` stands (one
:meth:`~BufferedRunner.run` per server step, a trainer "round"). A client is trained as soon as it starts, from the
global state of that moment and through the transport and the upload gate exactly as in a round (seeds from
``(seed, server version, client)``); its update ``Delta_i`` (float32, flat) is kept until its finish time, the clock's
download, local steps and upload of its exact bytes (:meth:`~lightning_fl.federated.clock.Clock.timing`). Arrivals
come in order of finish time (ties: client order); when ``buffer_size`` replies are in the buffer the server steps,
and the freed slots start new clients from the new state. A new client is drawn uniformly (``STREAM_FEDBUFF``, by the
count of starts) from the clients neither in flight nor waiting in the buffer: so ``(version, client)`` names every
training once, and a slot with no such client waits for the next step.

The byte ledger counts a download when its client starts and an upload in the step whose buffer it joins (as
aggregated, or rejected by the gate). Everything the next step depends on (the clients in flight with their updates,
the clock, the server version, the count of starts) is in :meth:`~BufferedRunner.state_dict`, saved with the round
checkpoint, so a resumed run equals an uninterrupted one bit for bit.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import numpy as np
import torch

from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.federated.buffered import FedBuff
from lightning_fl.federated.clock import Clock
from lightning_fl.federated.collect import Uploads, entry_of
from lightning_fl.federated.ledger import ByteLedger
from lightning_fl.federated.round import RoundRunner, RoundSettings
from lightning_fl.federated.stages import NormGate, Stage, Step, WeightCap
from lightning_fl.federated.stages.clock import RoundClock
from lightning_fl.federated.state import State, flatten, unflatten
from lightning_fl.federated.strategies import Strategy
from lightning_fl.federated.uploads import ACCEPTED, REJECTED, Entry, Round, mean_over_clients
from lightning_fl.seeding import STREAM_FEDBUFF, derive_seed


@dataclass(eq=False)  # (one flight is itself only: its update is a tensor)
class Flight:
    """A client in flight (or, once arrived, in the buffer): when it started and finishes, what it sent."""

    client: int
    version: int  # the server version it downloaded
    finish_s: float  # simulated time of its arrival
    weight: float  # its sample count
    up: int  # upload bytes (the codec's payload)
    delta: torch.Tensor | None  # its upload minus the state it downloaded, float32 flat; None: refused by the gate
    norm: float = math.nan
    logged: dict[str, tuple[float, float]] = field(default_factory=dict)

    def saved(self) -> dict[str, Any]:
        return {**vars(self), "logged": {k: list(v) for k, v in self.logged.items()}}

    @classmethod
    def loaded(cls, d: dict[str, Any]) -> Flight:
        return cls(**{**d, "logged": {k: (float(v[0]), float(v[1])) for k, v in d["logged"].items()}})


class BufferedRunner:
    """Server steps of FedBuff (module docstring), with the interface the trainer's loop calls.

    Args:
        fabric: The run's process (one).
        buffered: FedBuff's settings.
        clock: The clients' speeds and links.
        strategy: The server's step from the mean upload (a linear strategy).
        collection: The transport, codec and local training of the run's rounds (its gate decodes every upload).
        ledger: Counts every client's bytes.
        upload_policy: What the gate does with a refused upload (``drop`` or ``raise``).
        screens: The per-reply stages (the weight cap) and the norm gate (absolute bound per update, relative bound
            over a step's buffer, the step's own check).
    """

    def __init__(self, fabric: L.Fabric, buffered: FedBuff, clock: Clock, strategy: Strategy, collection: Uploads,
                 ledger: ByteLedger, upload_policy: str, screens: list[Stage]) -> None:  # fmt: skip
        if fabric.world_size > 1:
            raise ConfigError(f"trainer.buffered simulates its clients in one process; this run has "
                              f"{fabric.world_size}: set trainer.devices 1 and trainer.num_nodes 1")  # fmt: skip
        self.fabric, self.buffered, self.clock, self.strategy = fabric, buffered, clock, strategy
        self.collection, self.ledger, self.upload_policy = collection, ledger, upload_policy
        self.replies = [s for s in screens if not isinstance(s, NormGate)]
        gate = next((s for s in screens if isinstance(s, NormGate)), NormGate(strategy))
        self.absolute = NormGate(strategy, gate.max_update_norm, None)  # per update, when it is trained
        self.gate = gate  # the relative bound over a step's buffer, and the step's check
        self.steps = RoundClock(clock, collection.codec, collection.local)  # a client's local steps
        self.in_flight: list[Flight] = []
        self.version, self.now_s, self.last_step_s, self.starts = 0, 0.0, 0.0, 0
        self.dropped: list[int] = []
        self.kept_rows = 0
        self.update_norms: list[tuple[float, int]] = []

    def process_of(self, client: int, world: int) -> int:
        return 0

    # ============================================================================ a server step
    def run(
        self, model: L.LightningModule, datamodule: Any, state: State, r: int, seed: int, count: int
    ) -> tuple[State, dict[str, float]]:
        """Server step ``r`` from global ``state``: new clients in the free slots (at the time of the last step),
        arrivals until ``buffer_size`` replies are in, and the step. ``count`` (a round's clients) is not used:
        ``concurrency`` clients train."""
        self.ledger.start_round()
        self.buffered.check_population(datamodule.num_clients)
        self._fill(model, datamodule, state, seed, [])
        buffer: list[Flight] = []
        while len(buffer) < self.buffered.buffer_size:
            arrival = min(self.in_flight, key=lambda f: (f.finish_s, f.client))
            self.in_flight.remove(arrival)
            self.now_s = arrival.finish_s
            buffer.append(arrival)
            if len(buffer) < self.buffered.buffer_size:
                self._fill(model, datamodule, state, seed, buffer)
        state, metrics = self._step(state, r, seed, buffer)
        # The freed slots start from the new state (at this step's time) when the next step begins: the run's last
        # step leaves no client trained for nothing.
        self.version = r + 1
        metrics["time/simulated_round_s"] = self.now_s - self.last_step_s
        self.last_step_s = self.now_s
        return state, {k: float(v) for k, v in {**metrics, **self.ledger.metrics()}.items()}

    def _step(self, state: State, r: int, seed: int, buffer: list[Flight]) -> tuple[State, dict[str, float]]:
        """The buffer's updates, discounted by staleness, summed in order of arrival (float64), as the strategy's
        mean upload ``current + Delta``; the norm gate's relative bound over the buffer and its check of the step."""
        names = sorted(state)
        current = flatten(state, names)
        rnd = Round(r, seed, state, names, current, self.fabric, upload_policy=self.upload_policy)
        for f in buffer:
            status = ACCEPTED if f.delta is not None else REJECTED
            rnd.entries[f.client] = Entry(f.client, f.weight, status, f.up, logged=f.logged, norm=f.norm)
        kept = [f for f in buffer if f.delta is not None]
        norms = torch.tensor([f.norm for f in kept], dtype=torch.float64)
        limits = self.gate.limits(norms)
        for f in list(kept):
            if problems := [f"update norm {f.norm:.4g} {why}" for limit, why in limits if f.norm > limit]:
                rnd.reject(rnd.entry(f.client), problems)
                kept.remove(f)
        for f in buffer:
            self.ledger.record(f.client, "up" if f in kept else "rejected", f.up)
        rnd.folded = [f.client for f in kept]
        stale = [r - f.version for f in buffer]
        step = Step(problem=self.strategy.problem(len(kept)))
        if step.accepted:
            total, weights = torch.zeros(len(current), dtype=torch.float64), 0.0
            for f in kept:
                w = f.weight if self.strategy.weighted else 1.0
                total.add_(f.delta.double(), alpha=w * self.buffered.weight(r - f.version))
                weights += w
            step.flat, step.metrics = self.strategy.step(r, current, rnd.current64 + total / weights)
            step.state = unflatten(step.flat, state, names)
        self.gate.on_step(rnd, step)
        if step.accepted:
            state = {n: t.to(state[n].device) for n, t in step.state.items()}
        else:
            warnings.warn(f"step {r + 1}: {step.problem}; the global state is unchanged", stacklevel=3)
        self.gate.end_round(rnd)
        self.dropped = [f.client for f in buffer if f not in kept]
        self.update_norms = sorted(((f.norm, f.client) for f in kept), reverse=True)
        metrics = {
            "fed/round": r + 1,
            "fed/clients": len(kept),
            "fed/dropped_clients": len(self.dropped),
            "fed/staleness_mean": float(np.mean(stale)),
            "fed/staleness_max": max(stale),
            "fed/round_skipped": float(not step.accepted),
            **mean_over_clients([f.logged for f in kept]),
            **rnd.metrics,
            **({f"strategy/{k}": v for k, v in step.metrics.items()} if step.accepted else {}),
        }
        return state, metrics

    # ============================================================================ the clients
    def _fill(self, model: Any, datamodule: Any, state: State, seed: int, buffer: list[Flight]) -> None:
        """Start clients in the free slots (drawn from those neither in flight nor in ``buffer``) from ``state``."""
        while len(self.in_flight) < self.buffered.concurrency:
            busy = {f.client for f in self.in_flight} | {f.client for f in buffer}
            free = [c for c in range(datamodule.num_clients) if c not in busy]
            if not free:
                return
            rng = np.random.default_rng(derive_seed(seed, self.starts, STREAM_FEDBUFF))
            self.starts += 1
            self.in_flight.append(self._train(model, datamodule, state, seed, free[int(rng.integers(len(free)))]))

    def _train(self, model: Any, datamodule: Any, state: State, seed: int, client: int) -> Flight:
        """Train ``client`` now from ``state`` (through the transport, as a round does), gate its upload, and time
        it: its download is counted now, its upload when it arrives."""
        names = sorted(state)
        full = 4 * sum(t.numel() for t in state.values())  # the global state in float32 (what FP32 encodes)
        rnd = Round(self.version, seed, state, names, flatten(state, names), self.fabric, datamodule,
                    self.upload_policy, full, [client], [], [client])  # fmt: skip
        self.ledger.record(client, "down", full)
        c = self.collection
        reply = next(iter(c.transport.replies(model, datamodule, state, [client], self.version, seed, codec=c.codec,
                                              local=c.local, fabric=self.fabric)))  # fmt: skip
        entry = entry_of(reply, rnd, self.replies)
        decoded = c.decode(rnd, reply, entry)
        row = None if decoded is None else self.absolute.on_upload(rnd, entry, flatten(decoded, names))
        delta = None if row is None else (row.double() - rnd.current64).float()
        steps = np.array([self.steps.steps(datamodule, client)])
        timing = self.clock.timing(seed, [client], steps, np.array([full]), np.array([entry.up]))
        return Flight(client, self.version, self.now_s + float(timing.finish_s[0]), entry.weight, entry.up, delta,
                      entry.norm, entry.logged)  # fmt: skip

    # ============================================================================ resume
    def state_dict(self) -> dict[str, Any]:
        """Everything the next step depends on (module docstring)."""
        return {"settings": repr(self.buffered), "version": self.version, "now_s": self.now_s,
                "last_step_s": self.last_step_s, "starts": self.starts,
                "in_flight": [f.saved() for f in self.in_flight]}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], where: str) -> None:
        if state["settings"] != repr(self.buffered):
            raise CheckpointError(
                f"cannot resume from {where}: it was written with trainer.buffered {state['settings']}, not "
                f"{self.buffered!r}; set the same, or start afresh"
            )
        self.version, self.now_s, self.last_step_s = int(state["version"]), state["now_s"], state["last_step_s"]
        self.starts, self.in_flight = int(state["starts"]), [Flight.loaded(f) for f in state["in_flight"]]


def runner_of(trainer: Any, collection: Uploads, stages: list[Stage], settings: RoundSettings) -> Any:
    """The trainer's runner: a :class:`BufferedRunner` under ``trainer.buffered``, else a round's."""
    if trainer.buffered is None:
        return RoundRunner(trainer.fabric, trainer.strategy, collection, stages, trainer.ledger, settings)
    screens = [s for s in stages if isinstance(s, WeightCap | NormGate)]
    return BufferedRunner(trainer.fabric, trainer.buffered, trainer.clock, trainer.strategy, collection,
                          trainer.ledger, trainer.upload_policy, screens)  # fmt: skip
