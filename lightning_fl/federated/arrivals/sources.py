"""Where FedBuff's clients train and in what order their updates arrive: the sources of the one buffered policy
(:class:`~lightning_fl.federated.arrivals.Buffered`).

=================  =====================================================================================
source             a client starts ... / the next arrival is ...
=================  =====================================================================================
:class:`Clocked`   trained at once, here, through the in-process transport / the one the clock says
                   finishes first (its download, local steps and upload on its device and link)
:class:`Replayed`  trained at once, here / the next ``(client, version)`` of a recorded order (a Flower
                   run's ``arrived``, replayed in process to check it)
:class:`Delivered` sent to its node (:meth:`~lightning_fl.federated.clients.transport.Transport.send`:
                   Flower's SuperNodes) / the first whose reply the transport pulls
                   (:meth:`~lightning_fl.federated.clients.transport.Transport.arrived`); replies pulled
                   together come in client order
=================  =====================================================================================

The policy does the rest the same way whichever the source: which client starts in a free slot, the buffer, the
staleness and its discount, the stages, the ledger and the checkpoint.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from lightning_fl.compress.base import Encoded, Payload
from lightning_fl.errors import ConfigError, UserError
from lightning_fl.federated.arrivals.base import Delivery, local_steps
from lightning_fl.federated.arrivals.clock import Clock
from lightning_fl.federated.arrivals.work import aggregated, record_work, wasted_bytes, work_summary
from lightning_fl.federated.clients.local import ClientJob, LocalTraining
from lightning_fl.federated.clients.transport import Reply
from lightning_fl.federated.server.gate import upload_nbytes
from lightning_fl.federated.server.uploads import Round


class Source:
    """Base class: how a FedBuff client trains and when its update arrives (module docstring). ``flight`` is a
    :class:`~lightning_fl.federated.arrivals.buffered.Flight`."""

    def reachable(self, rnd: Round, collection: Delivery, free: list[int]) -> list[int]:
        """The clients of ``free`` (neither in flight nor in the buffer) a free slot may start now."""
        return free

    def wake(self, rnd: Round, free: list[int], in_flight: list[Any]) -> bool:
        """Whether a client of ``free`` can start before the next of ``in_flight`` arrives, time moved to then (a
        slot that waits for a client to come online)."""
        return False

    def start(self, flight: Any, job: ClientJob, rnd: Round, collection: Delivery) -> None:
        """Have ``flight.client`` train ``job`` (the state of ``flight.version``)."""
        raise NotImplementedError

    def next(self, in_flight: list[Any], collection: Delivery) -> Any:
        """The next flight of ``in_flight`` to arrive, its ``reply`` set (waiting for it if need be)."""
        raise NotImplementedError

    def step(self, rnd: Round, lost: list[Any]) -> None:
        """The buffer is full: add what the source measured to ``rnd.metrics``; ``lost`` the flights that left
        before replying in this step (logged as ``fed/lost_clients``, with a warning)."""
        rnd.metrics["fed/lost_clients"] = float(len(lost))
        if lost:
            warnings.warn(
                f"step {rnd.index + 1}: client(s) {sorted(f.client for f in lost)} left before replying; their slots "
                "started other clients",
                stacklevel=3,
            )

    def end_step(self, rnd: Round, buffer: list[Any], lost: list[Any]) -> None:
        """The step has aggregated ``buffer`` (``lost`` left before replying): what the source counts of it."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def summary(self, history: list[dict[str, float]]) -> list[str]:
        return []


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


def trained_here(job: ClientJob, client: int, collection: Delivery) -> Reply:
    """``client`` trained on ``job`` now, through the in-process transport, its payload its own."""
    reply = next(iter(collection.transport.replies(job, [client])))
    return replace(reply, payload=owned(reply.payload))  # (a codec may send a view of the module's weights)


class Clocked(Source):
    """Clients trained here, arriving when the clock says (``trainer.clock``): an event loop over its time. With
    ``clock.availability`` a slot starts only a client available at that moment (waiting for one to come online),
    and a client whose availability ends before its upload is in is lost when it leaves (not trained if it leaves
    before its local steps end); the work of every step's clients, and what of it was thrown away, is logged
    (``work/*``).

    Args:
        clock: The clients' speeds and links (and when they are available).
        local: How clients train (their local steps).
    """

    def __init__(self, clock: Clock, local: LocalTraining) -> None:
        self.clock, self.local = clock, local
        self.now_s, self.last_step_s = 0.0, 0.0

    def reachable(self, rnd: Round, collection: Delivery, free: list[int]) -> list[int]:
        if self.clock.availability is None:
            return free
        return self.clock.availability.available_clients(rnd.seed, free, self.now_s)

    def wake(self, rnd: Round, free: list[int], in_flight: list[Any]) -> bool:
        if self.clock.availability is None:
            return False
        online = self.clock.availability.first_on(rnd.seed, free, self.now_s)
        if math.isinf(online) and not in_flight:
            raise ConfigError(
                f"trainer.clock.availability: no client is available at or after {self.now_s:,.1f} simulated seconds "
                f"(server step {rnd.index + 1}): give trace intervals that last the run, or set repeat_s"
            )
        if online >= min((f.finish_s for f in in_flight), default=math.inf):
            return False
        self.now_s = online
        return True

    def start(self, flight: Any, job: ClientJob, rnd: Round, collection: Delivery) -> None:
        client = flight.client
        steps = np.array([local_steps(self.local, rnd.datamodule, client)])
        down = np.array([rnd.full_bytes])
        until = None
        if self.clock.availability is not None:
            until = np.array([self.clock.availability.until(rnd.seed, client, self.now_s) - self.now_s])
            work = self.clock.timing(rnd.seed, [client], steps, down, np.zeros(1), until_s=until)
            if work.offline[0] and until[0] < work.ready_s[0] + work.compute_s[0]:  # leaves before it trained
                flight.reply, flight.finish_s = Reply(client, lost=True), self.now_s + float(until[0])
                flight.compute_s = float(work.spent_s[0])
                return
        flight.reply = trained_here(job, client, collection)
        up = np.array([upload_nbytes(flight.reply.payload)])
        timing = self.clock.timing(rnd.seed, [client], steps, down, up, until_s=until)
        flight.compute_s = float(timing.spent_s[0])
        if timing.offline[0]:  # it left during its upload: its device trained, nothing arrives
            flight.reply, flight.finish_s = Reply(client, lost=True), self.now_s + float(until[0])
            return
        flight.finish_s = self.now_s + float(timing.finish_s[0])

    def next(self, in_flight: list[Any], collection: Delivery) -> Any:
        arrival = min(in_flight, key=lambda f: (f.finish_s, f.client))  # (ties: client order)
        self.now_s = arrival.finish_s
        return arrival

    def step(self, rnd: Round, lost: list[Any]) -> None:
        if self.clock.availability is None:
            super().step(rnd, lost)  # (none is ever lost)
        else:
            rnd.metrics["fed/offline_clients"] = float(len(lost))
        rnd.metrics["time/simulated_round_s"] = self.now_s - self.last_step_s
        self.last_step_s = self.now_s

    def end_step(self, rnd: Round, buffer: list[Any], lost: list[Any]) -> None:
        kept = aggregated(rnd)
        spent = [(f.client, f.compute_s) for f in buffer + lost]
        record_work(rnd, spent, kept, self.clock.power_w, wasted_bytes(rnd, kept) + rnd.full_bytes * len(lost))

    def state_dict(self) -> dict[str, Any]:
        return {"now_s": self.now_s, "last_step_s": self.last_step_s, "availability": repr(self.clock.availability)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("availability", "None") != repr(self.clock.availability):
            raise ValueError(
                f"it was written with trainer.clock.availability {state.get('availability', 'None')}, not "
                f"{self.clock.availability!r}; set the same, or start afresh"
            )
        self.now_s, self.last_step_s = float(state.get("now_s", 0.0)), float(state.get("last_step_s", 0.0))

    def summary(self, history: list[dict[str, float]]) -> list[str]:
        if "time/simulated_elapsed_s" not in history[-1]:
            return []
        elapsed = history[-1]["time/simulated_elapsed_s"]
        return [
            f"simulated time (trainer.clock): {elapsed:,.1f} s over the rounds",
            *work_summary(history, self.clock.power_w),
        ]


class Replayed(Source):
    """Clients trained here, arriving in a recorded order: each ``(client, version)`` of ``order`` is the next
    arrival (a run's ``Buffered.arrived``, e.g. a Flower deployment's, from its checkpoint). Given the order, the
    clients that start, the states they start from and every step are the recorded run's.

    Args:
        order: ``(client, server version it downloaded)`` per arrival, first to last.
    """

    def __init__(self, order: list[tuple[int, int]]) -> None:
        self.order = [(int(c), int(v)) for c, v in order]
        self.done = 0

    def start(self, flight: Any, job: ClientJob, rnd: Round, collection: Delivery) -> None:
        flight.reply = trained_here(job, flight.client, collection)

    def next(self, in_flight: list[Any], collection: Delivery) -> Any:
        if self.done >= len(self.order):
            raise ValueError(f"the recorded order has {len(self.order)} arrivals and the run needs more")
        client, version = self.order[self.done]
        arrival = next((f for f in in_flight if (f.client, f.version) == (client, version)), None)
        if arrival is None:
            flying = sorted((f.client, f.version) for f in in_flight)
            raise ValueError(
                f"arrival {self.done + 1} of the recorded order is client {client} from version {version}, which is "
                f"not in flight here (in flight: {flying}): the order is another run's"
            )
        self.done += 1
        return arrival

    def state_dict(self) -> dict[str, Any]:
        return {"replayed": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = int(state.get("replayed", 0))


class Delivered(Source):
    """Clients reached through a transport whose clients train on their own time (``Transport.asynchronous``:
    Flower's SuperNodes): a start sends the client its message, the next arrival is the first reply pulled
    (several pulled together: in client order). A flight restored from a checkpoint before its reply came is sent
    again by :class:`~lightning_fl.federated.arrivals.Buffered` (the same state, round and seed: the same upload)."""

    def __init__(self) -> None:
        self.pulls = 0  # pulls that brought replies (a flight's ``finish_s``: the pull it arrived in)

    def reachable(self, rnd: Round, collection: Delivery, free: list[int]) -> list[int]:
        served = collection.transport.reachable()
        return [c for c in free if c in served]

    def start(self, flight: Any, job: ClientJob, rnd: Round, collection: Delivery) -> None:
        sent = collection.transport.send(job, flight.client)
        if sent is None:  # (no node serves it now: it never trains)
            flight.reply, flight.finish_s = Reply(flight.client, lost=True), float(self.pulls)
            return
        flight.ticket, flight.msg_down = sent

    def next(self, in_flight: list[Any], collection: Delivery) -> Any:
        while not (ready := [f for f in in_flight if f.reply is not None]):
            waiting = {f.ticket: f for f in in_flight if f.ticket is not None}
            if not waiting:
                raise UserError("trainer.buffered: no client is in flight and none could be started")
            arrived = collection.transport.arrived(sorted(waiting))
            self.pulls += 1
            for ticket, reply in arrived:
                flight = waiting[ticket]
                flight.reply, flight.finish_s, flight.ticket = reply, float(self.pulls), None
        return min(ready, key=lambda f: (f.finish_s, f.client))

    def state_dict(self) -> dict[str, Any]:
        return {"pulls": self.pulls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pulls = int(state.get("pulls", 0))
