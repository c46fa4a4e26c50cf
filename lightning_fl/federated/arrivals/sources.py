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

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from lightning_fl.compress.base import Encoded, Payload
from lightning_fl.errors import UserError
from lightning_fl.federated.arrivals.base import Delivery, local_steps
from lightning_fl.federated.arrivals.clock import Clock
from lightning_fl.federated.clients.local import ClientJob, LocalTraining
from lightning_fl.federated.clients.transport import Reply
from lightning_fl.federated.server.gate import upload_nbytes
from lightning_fl.federated.server.uploads import Round


class Source:
    """Base class: how a FedBuff client trains and when its update arrives (module docstring). ``flight`` is a
    :class:`~lightning_fl.federated.arrivals.buffered.Flight`."""

    def reachable(self, collection: Delivery, num_clients: int) -> set[int] | None:
        """The clients a free slot may start now (``None``: every client)."""
        return None

    def start(self, flight: Any, job: ClientJob, rnd: Round, collection: Delivery) -> None:
        """Have ``flight.client`` train ``job`` (the state of ``flight.version``)."""
        raise NotImplementedError

    def next(self, in_flight: list[Any], collection: Delivery) -> Any:
        """The next flight of ``in_flight`` to arrive, its ``reply`` set (waiting for it if need be)."""
        raise NotImplementedError

    def step(self, rnd: Round) -> None:
        """The buffer is full: add what the source measured to ``rnd.metrics``."""

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
    """Clients trained here, arriving when the clock says (``trainer.clock``): an event loop over its time.

    Args:
        clock: The clients' speeds and links.
        local: How clients train (their local steps).
    """

    def __init__(self, clock: Clock, local: LocalTraining) -> None:
        self.clock, self.local = clock, local
        self.now_s, self.last_step_s = 0.0, 0.0

    def start(self, flight: Any, job: ClientJob, rnd: Round, collection: Delivery) -> None:
        flight.reply = trained_here(job, flight.client, collection)
        steps = np.array([local_steps(self.local, rnd.datamodule, flight.client)])
        up = np.array([upload_nbytes(flight.reply.payload)])
        timing = self.clock.timing(rnd.seed, [flight.client], steps, np.array([rnd.full_bytes]), up)
        flight.finish_s = self.now_s + float(timing.finish_s[0])

    def next(self, in_flight: list[Any], collection: Delivery) -> Any:
        arrival = min(in_flight, key=lambda f: (f.finish_s, f.client))  # (ties: client order)
        self.now_s = arrival.finish_s
        return arrival

    def step(self, rnd: Round) -> None:
        rnd.metrics["time/simulated_round_s"] = self.now_s - self.last_step_s
        self.last_step_s = self.now_s

    def state_dict(self) -> dict[str, Any]:
        return {"now_s": self.now_s, "last_step_s": self.last_step_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.now_s, self.last_step_s = float(state.get("now_s", 0.0)), float(state.get("last_step_s", 0.0))

    def summary(self, history: list[dict[str, float]]) -> list[str]:
        if "time/simulated_elapsed_s" not in history[-1]:
            return []
        elapsed = history[-1]["time/simulated_elapsed_s"]
        return [f"simulated time (trainer.clock): {elapsed:,.1f} s over the rounds"]


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

    def reachable(self, collection: Delivery, num_clients: int) -> set[int] | None:
        return collection.transport.reachable()

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
