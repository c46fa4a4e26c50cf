"""FedBuff's arrivals (``trainer.buffered``): an event loop over the clock's time, one server step per round
(the settings and the staleness rule: :mod:`lightning_fl.federated.arrivals.fedbuff`)."""

from __future__ import annotations

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
    finish_s: float  # simulated time of its arrival
    reply: Reply

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
        }

    @classmethod
    def loaded(cls, d: dict[str, Any]) -> Flight:
        payload = None if d["payload"] is None else wire.loads(d["payload"].numpy().tobytes())
        logged = {k: (float(v[0]), float(v[1])) for k, v in d["logged"].items()}
        reply = Reply(int(d["client"]), int(d["num_samples"]), payload, logged, d["failure"])
        return cls(int(d["client"]), int(d["version"]), float(d["finish_s"]), reply)


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
    training once, and a slot with no such client waits for the next round. Each arrival enters its round as a reply
    of staleness ``r - version``, discounted by ``s(tau)`` (module docstring), through every stage.

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
        started = self._fill(rnd, collection, model, [])
        buffer: list[Flight] = []
        while len(buffer) < self.buffered.buffer_size:
            arrival = min(self.in_flight, key=lambda f: (f.finish_s, f.client))
            self.in_flight.remove(arrival)
            self.now_s = arrival.finish_s
            buffer.append(arrival)
            if len(buffer) < self.buffered.buffer_size:
                started += self._fill(rnd, collection, model, buffer)
        self.buffer = buffer
        rnd.sampled = rnd.available = sorted(f.client for f in buffer)
        rnd.pending = sorted({f.client for f in self.in_flight} & set(started))  # downloaded now, arriving later
        stale = [rnd.index - f.version for f in buffer]
        rnd.metrics["fed/staleness_mean"] = float(np.mean(stale))
        rnd.metrics["fed/staleness_max"] = float(max(stale))
        rnd.metrics["time/simulated_round_s"] = self.now_s - self.last_step_s
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
        self.buffer = []
        needed = {f.version for f in self.in_flight}
        self.states = {v: s for v, s in self.states.items() if v in needed}

    def _fill(self, rnd: Round, collection: Delivery, model: Any, buffer: list[Flight]) -> list[int]:
        """Start clients in the free slots (drawn from those neither in flight nor in ``buffer``) from the round's
        state; the clients started."""
        started = []
        while len(self.in_flight) < self.buffered.concurrency:
            busy = {f.client for f in self.in_flight} | {f.client for f in buffer}
            free = [c for c in range(rnd.datamodule.num_clients) if c not in busy]
            if not free:
                break
            rng = np.random.default_rng(derive_seed(rnd.seed, self.starts, STREAM_FEDBUFF))
            self.starts += 1
            client = free[int(rng.integers(len(free)))]
            self.in_flight.append(self._train(rnd, collection, model, client))
            started.append(client)
        return started

    def _train(self, rnd: Round, collection: Delivery, model: Any, client: int) -> Flight:
        """Train ``client`` now from the round's state (through the transport, as a round does) and time it."""
        reply = next(iter(super().replies(rnd, collection, model, [client])))
        reply = replace(reply, payload=owned(reply.payload))  # (a codec may send a view of the module's weights)
        steps = np.array([local_steps(self.local, rnd.datamodule, client)])
        up = np.array([upload_nbytes(reply.payload)])
        timing = self.clock.timing(rnd.seed, [client], steps, np.array([rnd.full_bytes]), up)
        return Flight(client, rnd.index, self.now_s + float(timing.finish_s[0]), reply)

    def state_dict(self) -> dict[str, Any]:
        """Everything the next round depends on (the class docstring)."""
        return {
            "settings": repr(self.buffered),
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
            f"simulated time (trainer.clock): {elapsed:,.1f} s over the rounds; FedBuff, staleness up to {stale:.0f}"
        ]

    def __repr__(self) -> str:
        return f"Buffered({self.buffered!r})"
