"""FedBuff's arrivals (``trainer.buffered``): clients kept training in ``concurrency`` slots, one server step per
``buffer_size`` arrivals (the settings and the staleness rule: :mod:`lightning_fl.federated.arrivals.fedbuff`; where
the clients train and when they arrive, in process by the clock or on Flower's nodes:
:mod:`lightning_fl.federated.arrivals.sources`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from lightning_fl.compress import wire
from lightning_fl.errors import ConfigError
from lightning_fl.federated.arrivals.base import Arrivals, Delivery
from lightning_fl.federated.arrivals.clock import Clock
from lightning_fl.federated.arrivals.fedbuff import FedBuff
from lightning_fl.federated.arrivals.sources import Clocked, Source, owned
from lightning_fl.federated.clients.local import ClientJob, LocalTraining
from lightning_fl.federated.clients.transport import Reply
from lightning_fl.federated.server.state import State
from lightning_fl.federated.server.uploads import Round
from lightning_fl.seeding import STREAM_FEDBUFF, derive_seed

__all__ = ["Buffered", "Flight", "owned"]


@dataclass(eq=False)  # (one flight is itself only: its reply holds tensors)
class Flight:
    """A FedBuff client in flight (or, once arrived, in the buffer): the version it started from, when it arrives
    (the source's order), what it sent (``None`` until it arrives), and how its source reaches it."""

    client: int
    version: int  # the server version (round) whose state it downloaded
    finish_s: float = 0.0  # its arrival in the source's order: simulated seconds, or the pull it came in
    reply: Reply | None = None
    ticket: Any = None  # the transport's handle while its message is out (not saved: a restart sends it again)
    msg_down: int | None = None  # the bytes of the message that sent it the state (a transport's)
    compute_s: float = 0.0  # compute seconds its device spent (the clock's; lost: before it left)

    def saved(self) -> dict[str, Any]:
        reply = self.reply if self.reply is not None else Reply(self.client)
        payload = None
        if reply.payload is not None:  # (the wire's bytes: a checkpoint is read with weights_only)
            payload = torch.frombuffer(bytearray(wire.dumps(reply.payload)), dtype=torch.uint8)
        return {
            "client": self.client,
            "version": self.version,
            "finish_s": self.finish_s,
            "arrived": self.reply is not None,
            "num_samples": reply.num_samples,
            "payload": payload,
            "logged": {k: list(v) for k, v in reply.logged.items()},
            "failure": reply.failure,
            "lost": reply.lost,
            "message_up": reply.message_up,
            "compute_s": self.compute_s,
        }

    @classmethod
    def loaded(cls, d: dict[str, Any]) -> Flight:
        flight = cls(
            int(d["client"]), int(d["version"]), float(d["finish_s"]), compute_s=float(d.get("compute_s", 0.0))
        )
        if d.get("arrived", True):
            payload = None if d["payload"] is None else wire.loads(d["payload"].numpy().tobytes())
            logged = {k: (float(v[0]), float(v[1])) for k, v in d["logged"].items()}
            up = d.get("message_up")
            flight.reply = Reply(
                flight.client, int(d["num_samples"]), payload, logged, d["failure"], bool(d.get("lost", False)), up
            )
        return flight


class Buffered(Arrivals):
    """FedBuff (``trainer.buffered``): one server step per round, from the first ``buffer_size`` arrivals.

    A client starts in a free slot from the global state of that moment (seeds from ``(seed, server version,
    client)``), through its ``source``: trained here and timed by the clock (:class:`~.sources.Clocked`, the
    default), or sent to its node on Flower (:class:`~.sources.Delivered`). The round's clients are the first
    ``buffer_size`` arrivals in the source's order (the clock's finish times, ties in client order; on Flower the
    order replies are pulled in), and after each arrival the freed slots start new clients from the round's state. A
    new client is drawn uniformly (``STREAM_FEDBUFF``, by the count of starts) from the clients neither in flight nor
    waiting in the buffer (and, on Flower, served by a node): so ``(version, client)`` names every training once, no
    client ever has two trainings out, and a slot with no such client waits for the next round. Each arrival enters
    its round as a reply of staleness ``r - version``, discounted by ``s(tau)`` (module docstring), through every
    stage. Given the same order of arrivals (``arrived``), every source starts the same clients from the same states:
    a Flower run replayed in process (:class:`~.sources.Replayed`) reaches the same global state.

    With ``clock.availability`` (in process) a new client is drawn among those also available at that moment, a
    free slot with none waits until one comes online, and a client whose availability ends before its upload is in
    is lost when it leaves (it is not trained if it leaves before its local steps end): its slot frees then, and its
    work is thrown away (``fed/offline_clients``, ``work/*``). A client lost and back online within the step may
    train twice from the same version.

    The byte ledger counts a download in the round its client starts and an upload in the round it arrives.
    Everything the next round depends on (the clients in flight with the replies already in and the states they
    started from, the source's clock, the count of starts, the order of arrivals) is in :meth:`state_dict`, saved
    with the round checkpoint, so a resumed run in process equals an uninterrupted one bit for bit; on Flower a
    resumed server sends the flights still out again (the same state, round and seed: the same upload; their
    downloads were counted when first sent).

    Args:
        buffered: FedBuff's settings.
        clock: The clients' speeds and links (in process); ``None`` with a ``source`` of its own.
        local: How clients train (their local steps).
        source: Where clients train and in what order they arrive; default: in process, by ``clock``.
    """

    state_key = "buffered"
    without = (
        "it was written with synchronous rounds (no FedBuff clients in flight); remove trainer.buffered, or start "
        "afresh"
    )

    def __init__(
        self, buffered: FedBuff, clock: Clock | None, local: LocalTraining, source: Source | None = None
    ) -> None:
        if source is None and clock is None:
            raise ValueError("Buffered needs a clock or a source")
        self.buffered, self.clock, self.local = buffered, clock, local
        self.source = source if source is not None else Clocked(clock, local)
        self.in_flight: list[Flight] = []
        self.states: dict[int, State] = {}  # version -> the global state its clients started from (while in flight)
        self.starts = 0
        self.buffer: list[Flight] = []
        self.lost: list[Flight] = []  # the step's flights that left before replying
        #: ``(client, version)`` of every arrival the steps took, first to last (what :class:`~.sources.Replayed`
        #: replays).
        self.arrived: list[tuple[int, int]] = []

    def begin(self, rnd: Round, draw: Callable[[Round], None], collection: Delivery, model: Any) -> None:
        """New clients in the free slots, then arrivals until ``buffer_size`` are in: the round's clients. ``draw``
        is not used: a slot draws its client when it frees."""
        if rnd.fabric.world_size > 1:
            raise ConfigError(
                f"trainer.buffered runs its server in one process; this run has {rnd.fabric.world_size}: set "
                "trainer.devices 1 and trainer.num_nodes 1"
            )
        self.buffered.check_population(rnd.datamodule.num_clients)
        self.states[rnd.index] = {n: t.detach().clone() for n, t in rnd.state.items()}  # (the trainer's may move)
        for flight in self.in_flight:  # restored before its reply came (a server that restarted): sent again
            if flight.reply is None and flight.ticket is None:
                self.source.start(flight, self._job(rnd, collection, model, flight.version), rnd, collection)
        started = self._fill(rnd, collection, model, [])
        buffer: list[Flight] = []
        lost: list[Flight] = []
        while len(buffer) < self.buffered.buffer_size:
            if len(self.in_flight) < self.buffered.concurrency and self.source.wake(
                rnd, self._free(rnd, buffer), self.in_flight
            ):  # a free slot's client comes online before the next arrival
                started += self._fill(rnd, collection, model, buffer)
                continue
            if not self.in_flight:
                raise ConfigError(
                    "trainer.buffered has no client in flight and none to start: every client is in the buffer "
                    f"(buffer_size {self.buffered.buffer_size}) or unreachable"
                )
            arrival = self.source.next(self.in_flight, collection)
            self.in_flight.remove(arrival)
            (lost if arrival.reply.lost else buffer).append(arrival)
            if len(buffer) < self.buffered.buffer_size:
                started += self._fill(rnd, collection, model, buffer)
        self.buffer = buffer
        self.arrived += [(f.client, f.version) for f in buffer]
        rnd.sampled = sorted(started)  # the clients drawn into a free slot during this step
        rnd.available = sorted(f.client for f in buffer)
        # downloaded now, arriving later or lost on the way (a lost client may have started again since)
        flying = sorted((f for f in self.in_flight + lost if f.version == rnd.index), key=lambda f: f.client)
        rnd.pending = [f.client for f in flying]
        rnd.pending_messages = [(f.client, f.msg_down) for f in flying if f.msg_down is not None]
        stale = [rnd.index - f.version for f in buffer]
        rnd.metrics["fed/staleness_mean"] = float(np.mean(stale))
        rnd.metrics["fed/staleness_max"] = float(max(stale))
        rnd.metrics["fed/in_flight"] = float(len(self.in_flight))
        self.lost = lost
        self.source.step(rnd, lost)

    def replies(self, rnd: Round, collection: Delivery, model: Any, share: list[int]) -> Iterator[Reply]:
        """The buffer's replies in order of arrival; a stale one with the state it was trained from and its
        discount."""
        for f in self.buffer:
            tau = rnd.index - f.version
            if tau == 0:  # (a transport's reply carries the bytes of the message it answers)
                yield f.reply
            else:
                then = {n: t.to(rnd.state[n].device) for n, t in self.states[f.version].items()}
                yield replace(
                    f.reply,
                    staleness=tau,
                    reference=then,
                    discount=self.buffered.weight(tau),
                    downloaded=False,
                    message_down=None,
                )

    def end_round(self, rnd: Round) -> None:
        self.source.end_step(rnd, self.buffer, self.lost)
        self.buffer, self.lost = [], []
        needed = {f.version for f in self.in_flight}
        self.states = {v: s for v, s in self.states.items() if v in needed}

    def _job(self, rnd: Round, collection: Delivery, model: Any, version: int) -> ClientJob:
        """The work of a client that starts from ``version``'s state."""
        state = rnd.state if version == rnd.index else self.states[version]
        return ClientJob(
            model, rnd.datamodule, state, version, rnd.seed, collection.codec, collection.local, rnd.fabric
        )

    def _fill(self, rnd: Round, collection: Delivery, model: Any, buffer: list[Flight]) -> list[int]:
        """Start clients in the free slots (drawn from those neither in flight nor in ``buffer``) from the round's
        state; the clients started."""
        started = []
        while len(self.in_flight) < self.buffered.concurrency:
            free = self.source.reachable(rnd, collection, self._free(rnd, buffer))
            if not free:
                break
            rng = np.random.default_rng(derive_seed(rnd.seed, self.starts, STREAM_FEDBUFF))
            self.starts += 1
            flight = Flight(free[int(rng.integers(len(free)))], rnd.index)
            self.source.start(flight, self._job(rnd, collection, model, rnd.index), rnd, collection)
            self.in_flight.append(flight)
            started.append(flight.client)
        return started

    def _free(self, rnd: Round, buffer: list[Flight]) -> list[int]:
        """The clients neither in flight nor in ``buffer``."""
        busy = {f.client for f in self.in_flight + buffer}
        return [c for c in range(rnd.datamodule.num_clients) if c not in busy]

    def state_dict(self) -> dict[str, Any]:
        """Everything the next round depends on (the class docstring)."""
        return {
            "settings": repr(self.buffered),
            **self.source.state_dict(),
            "starts": self.starts,
            "in_flight": [f.saved() for f in self.in_flight],
            "states": {str(v): {n: t.detach().cpu() for n, t in s.items()} for v, s in self.states.items()},
            "arrived": torch.tensor(self.arrived, dtype=torch.int64).reshape(-1, 2),
        }

    def load_state_dict(self, state: dict[str, Any], completed: int) -> None:
        if state.get("settings") != repr(self.buffered):
            raise ValueError(
                f"it was written with trainer.buffered {state.get('settings')}, not {self.buffered!r}; set the same, "
                "or start afresh"
            )
        self.source.load_state_dict(state)
        self.starts = int(state["starts"])
        self.in_flight = [Flight.loaded(f) for f in state["in_flight"]]
        self.states = {int(v): dict(s) for v, s in state["states"].items()}
        arrived = state.get("arrived")
        self.arrived = [] if arrived is None else [(int(c), int(v)) for c, v in arrived.tolist()]

    def summary(self, history: list[dict[str, float]]) -> list[str]:
        stale = max((h["fed/staleness_max"] for h in history if "fed/staleness_max" in h), default=0.0)
        timing = self.source.summary(history)
        if timing:
            return [f"{timing[0]}; FedBuff, staleness up to {stale:.0f}", *timing[1:]]
        steps = sum(1 for h in history if h.get("round", 0) >= 1)
        return [f"FedBuff: {steps} server steps, staleness up to {stale:.0f}"]

    def __repr__(self) -> str:
        return f"Buffered({self.buffered!r})"
