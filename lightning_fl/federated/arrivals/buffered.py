"""FedBuff's arrivals (``trainer.buffered``): an event loop over the clock's time, one server step per round
(the settings and the staleness rule: :mod:`lightning_fl.federated.arrivals.fedbuff`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from lightning_fl.compress import wire
from lightning_fl.compress.base import Encoded, Payload
from lightning_fl.errors import ConfigError
from lightning_fl.federated.arrivals.base import Arrivals, Delivery, local_steps
from lightning_fl.federated.arrivals.clock import Clock
from lightning_fl.federated.arrivals.fedbuff import FedBuff
from lightning_fl.federated.arrivals.work import aggregated, record_work, wasted_bytes, work_summary
from lightning_fl.federated.clients.local import LocalTraining
from lightning_fl.federated.clients.transport import Reply
from lightning_fl.federated.server.gate import upload_nbytes
from lightning_fl.federated.server.state import State
from lightning_fl.federated.server.uploads import Round
from lightning_fl.seeding import STREAM_FEDBUFF, derive_seed


@dataclass(eq=False)  # (one flight is itself only: its reply holds tensors)
class Flight:
    """A FedBuff client in flight (or, once arrived, in the buffer): when it started and finishes, what it sent."""

    client: int
    version: int  # the server version (round) whose state it downloaded
    finish_s: float  # simulated time of its arrival (lost: of its leaving)
    reply: Reply
    compute_s: float = 0.0  # compute seconds its device spent (lost: before it left)
    lost: bool = False  # it goes offline at ``finish_s``, before its upload is in (``trainer.clock.availability``)

    def saved(self) -> dict[str, Any]:
        reply = self.reply
        payload = None
        if reply.payload is not None:  # (the wire's bytes: a checkpoint is read with weights_only)
            payload = torch.frombuffer(bytearray(wire.dumps(reply.payload)), dtype=torch.uint8)
        return {
            "client": self.client,
            "version": self.version,
            "finish_s": self.finish_s,
            "num_samples": reply.num_samples,
            "payload": payload,
            "logged": {k: list(v) for k, v in reply.logged.items()},
            "failure": reply.failure,
            "compute_s": self.compute_s,
            "lost": self.lost,
        }

    @classmethod
    def loaded(cls, d: dict[str, Any]) -> Flight:
        payload = None if d["payload"] is None else wire.loads(d["payload"].numpy().tobytes())
        logged = {k: (float(v[0]), float(v[1])) for k, v in d["logged"].items()}
        reply = Reply(int(d["client"]), int(d["num_samples"]), payload, logged, d["failure"])
        extra = float(d.get("compute_s", 0.0)), bool(d.get("lost", False))
        return cls(int(d["client"]), int(d["version"]), float(d["finish_s"]), reply, *extra)


def owned(payload: Any) -> Any:
    """``payload`` with every part copied (one kept while other clients train); anything else as it is."""
    if not isinstance(payload, Payload) or not isinstance(payload.tensors, dict):
        return payload
    tensors = {}
    for name, enc in payload.tensors.items():
        if isinstance(enc, Encoded) and isinstance(enc.parts, dict):
            parts = {k: t.clone() if isinstance(t, torch.Tensor) else t for k, t in enc.parts.items()}
            enc = Encoded(parts, enc.shape, enc.dtype, dict(enc.info))
        tensors[name] = enc
    return Payload(tensors)


class Buffered(Arrivals):
    """FedBuff (``trainer.buffered``): an event loop over the clock's time, one server step per round.

    A client is trained as soon as it starts, from the global state of that moment and through the transport (seeds
    from ``(seed, server version, client)``); its reply is kept until its finish time, the clock's download, local
    steps and upload of its exact bytes (:meth:`~lightning_fl.federated.arrivals.clock.Clock.timing`). Arrivals come in
    order of finish time (ties: client order); the round's clients are the first ``buffer_size`` arrivals, and the freed
    slots start new clients from the round's state. A new client is drawn uniformly (``STREAM_FEDBUFF``, by the count
    of starts) from the clients neither in flight nor waiting in the buffer: so ``(version, client)`` names every
    training once (unless the client was lost and comes back within the step), and a slot with no such client waits
    for the next round. Each arrival enters its round as a reply of staleness ``r - version``, discounted by
    ``s(tau)`` (module docstring), through every stage.

    With ``clock.availability`` a new client is drawn among those also available at that moment, a free slot with
    none waits until one comes online, and a client whose availability ends before its upload is in is lost when it
    leaves (it is not trained if it leaves before its local steps end): its slot frees then, and its work is thrown
    away (``fed/offline_clients``, ``work/*``).

    The byte ledger counts a download in the round its client starts and an upload in the round it arrives.
    Everything the next round depends on (the clients in flight with their replies and the states they started from,
    the clock, the count of starts) is in :meth:`state_dict`, saved with the round checkpoint, so a resumed run equals
    an uninterrupted one bit for bit.

    Args:
        buffered: FedBuff's settings.
        clock: The clients' speeds and links.
        local: How clients train (their local steps).
    """

    state_key = "buffered"
    without = (
        "it was written with synchronous rounds (no FedBuff clients in flight); remove trainer.buffered, or start "
        "afresh"
    )

    def __init__(self, buffered: FedBuff, clock: Clock, local: LocalTraining) -> None:
        self.buffered, self.clock, self.local = buffered, clock, local
        self.in_flight: list[Flight] = []
        self.states: dict[int, State] = {}  # version -> the global state its clients started from (while in flight)
        self.now_s, self.last_step_s, self.starts = 0.0, 0.0, 0
        self.buffer: list[Flight] = []
        self.lost: list[Flight] = []  # the step's clients that went offline

    def begin(self, rnd: Round, draw: Callable[[Round], None], collection: Delivery, model: Any) -> None:
        """New clients in the free slots (at the time of the last step), then arrivals until ``buffer_size`` are in:
        the round's clients. ``draw`` is not used: a slot draws its client when it frees."""
        if rnd.fabric.world_size > 1:
            raise ConfigError(
                f"trainer.buffered simulates its clients in one process; this run has {rnd.fabric.world_size}: set "
                "trainer.devices 1 and trainer.num_nodes 1"
            )
        self.buffered.check_population(rnd.datamodule.num_clients)
        self.states[rnd.index] = {n: t.detach().clone() for n, t in rnd.state.items()}  # (the trainer's may move)
        self.lost = []
        started = self._fill(rnd, collection, model, [])
        buffer: list[Flight] = []
        while len(buffer) < self.buffered.buffer_size:
            arrival = min(self.in_flight, key=lambda f: (f.finish_s, f.client), default=None)
            online = self._next_online(rnd, buffer)
            if arrival is None or online < arrival.finish_s:  # a free slot's client comes online first
                self._never(rnd, online)
                self.now_s = online
                started += self._fill(rnd, collection, model, buffer)
                continue
            self.in_flight.remove(arrival)
            self.now_s = arrival.finish_s
            if arrival.lost:
                self.lost.append(arrival)
            else:
                buffer.append(arrival)
            if len(buffer) < self.buffered.buffer_size:
                started += self._fill(rnd, collection, model, buffer)
        self.buffer = buffer
        rnd.sampled = rnd.available = sorted(f.client for f in buffer)
        for f in buffer:  # (a start of this step that arrived is an entry that downloaded now)
            if f.version == rnd.index:
                started.remove(f.client)
        rnd.pending = sorted(started)  # downloaded now, arriving later (or never: lost)
        stale = [rnd.index - f.version for f in buffer]
        rnd.metrics["fed/staleness_mean"] = float(np.mean(stale))
        rnd.metrics["fed/staleness_max"] = float(max(stale))
        rnd.metrics["time/simulated_round_s"] = self.now_s - self.last_step_s
        if self.clock.availability is not None:
            rnd.metrics["fed/offline_clients"] = float(len(self.lost))
        self.last_step_s = self.now_s

    def replies(self, rnd: Round, collection: Delivery, model: Any, share: list[int]) -> Iterator[Reply]:
        """The buffer's replies in order of arrival; a stale one with the state it was trained from and its
        discount."""
        for f in self.buffer:
            tau = rnd.index - f.version
            if tau == 0:
                yield f.reply
            else:
                then = {n: t.to(rnd.state[n].device) for n, t in self.states[f.version].items()}
                yield replace(
                    f.reply,
                    staleness=tau,
                    reference=then,
                    discount=self.buffered.weight(tau),
                    downloaded=False,
                )

    def end_round(self, rnd: Round) -> None:
        kept = aggregated(rnd)
        spent = [(f.client, f.compute_s) for f in self.buffer + self.lost]
        nbytes = wasted_bytes(rnd, kept) + rnd.full_bytes * len(self.lost)
        record_work(rnd, spent, kept, self.clock.power_w, nbytes)
        self.buffer = []
        needed = {f.version for f in self.in_flight}
        self.states = {v: s for v, s in self.states.items() if v in needed}

    def _fill(self, rnd: Round, collection: Delivery, model: Any, buffer: list[Flight]) -> list[int]:
        """Start clients in the free slots (drawn from those neither in flight nor in ``buffer``) from the round's
        state; the clients started."""
        started = []
        while len(self.in_flight) < self.buffered.concurrency:
            free = self._free(rnd, buffer)
            if self.clock.availability is not None:
                free = self.clock.availability.available_clients(rnd.seed, free, self.now_s)
            if not free:
                break
            rng = np.random.default_rng(derive_seed(rnd.seed, self.starts, STREAM_FEDBUFF))
            self.starts += 1
            client = free[int(rng.integers(len(free)))]
            self.in_flight.append(self._train(rnd, collection, model, client))
            started.append(client)
        return started

    def _free(self, rnd: Round, buffer: list[Flight]) -> list[int]:
        """The clients neither in flight nor in ``buffer``."""
        busy = {f.client for f in self.in_flight + buffer}
        return [c for c in range(rnd.datamodule.num_clients) if c not in busy]

    def _next_online(self, rnd: Round, buffer: list[Flight]) -> float:
        """When a free slot's client comes online (``inf``: no slot is free, or every client is always available)."""
        if self.clock.availability is None or len(self.in_flight) >= self.buffered.concurrency:
            return math.inf
        return self.clock.availability.first_on(rnd.seed, self._free(rnd, buffer), self.now_s)

    def _never(self, rnd: Round, online: float) -> None:
        if math.isinf(online):
            raise ConfigError(
                f"trainer.clock.availability: no client is available at or after {self.now_s:,.1f} simulated seconds "
                f"(server step {rnd.index + 1}): give trace intervals that last the run, or set repeat_s"
            )

    def _train(self, rnd: Round, collection: Delivery, model: Any, client: int) -> Flight:
        """Train ``client`` now from the round's state (through the transport, as a round does) and time it; a
        client that goes offline before its local steps end is not trained (it is lost)."""
        steps = np.array([local_steps(self.local, rnd.datamodule, client)])
        down = np.array([rnd.full_bytes])
        until = None
        if self.clock.availability is not None:
            until = np.array([self.clock.availability.until(rnd.seed, client, self.now_s) - self.now_s])
            work = self.clock.timing(rnd.seed, [client], steps, down, np.zeros(1), until_s=until)
            if work.offline[0] and until[0] < work.download_s[0] + work.compute_s[0]:
                lost = Reply(client)
                return Flight(client, rnd.index, self.now_s + float(until[0]), lost, float(work.spent_s[0]), True)
        reply = next(iter(super().replies(rnd, collection, model, [client])))
        reply = replace(reply, payload=owned(reply.payload))  # (a codec may send a view of the module's weights)
        up = np.array([upload_nbytes(reply.payload)])
        timing = self.clock.timing(rnd.seed, [client], steps, down, up, until_s=until)
        spent = float(timing.spent_s[0])
        if timing.offline[0]:  # it left during its upload: its device trained, nothing arrives
            return Flight(client, rnd.index, self.now_s + float(until[0]), Reply(client), spent, True)
        return Flight(client, rnd.index, self.now_s + float(timing.finish_s[0]), reply, spent)

    def state_dict(self) -> dict[str, Any]:
        """Everything the next round depends on (the class docstring)."""
        return {
            "settings": repr(self.buffered),
            "availability": repr(self.clock.availability),
            "now_s": self.now_s,
            "last_step_s": self.last_step_s,
            "starts": self.starts,
            "in_flight": [f.saved() for f in self.in_flight],
            "states": {str(v): {n: t.detach().cpu() for n, t in s.items()} for v, s in self.states.items()},
        }

    def load_state_dict(self, state: dict[str, Any], completed: int) -> None:
        if state.get("settings") != repr(self.buffered):
            raise ValueError(
                f"it was written with trainer.buffered {state.get('settings')}, not {self.buffered!r}; set the same, "
                "or start afresh"
            )
        if state.get("availability", "None") != repr(self.clock.availability):
            raise ValueError(
                f"it was written with trainer.clock.availability {state.get('availability', 'None')}, not "
                f"{self.clock.availability!r}; set the same, or start afresh"
            )
        self.now_s, self.last_step_s = float(state["now_s"]), float(state["last_step_s"])
        self.starts = int(state["starts"])
        self.in_flight = [Flight.loaded(f) for f in state["in_flight"]]
        self.states = {int(v): dict(s) for v, s in state["states"].items()}

    def summary(self, history: list[dict[str, float]]) -> list[str]:
        if "time/simulated_elapsed_s" not in history[-1]:
            return []
        stale = max((h["fed/staleness_max"] for h in history if "fed/staleness_max" in h), default=0.0)
        elapsed = history[-1]["time/simulated_elapsed_s"]
        return [
            f"simulated time (trainer.clock): {elapsed:,.1f} s over the rounds; FedBuff, staleness up to {stale:.0f}",
            *work_summary(history, self.clock.power_w),
        ]

    def __repr__(self) -> str:
        return f"Buffered({self.buffered!r})"
