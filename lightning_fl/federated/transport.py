"""Transports: how a round's global state reaches the sampled clients and their uploads come back.

The round loop (:class:`~lightning_fl.federated.round.RoundRunner`) is the same for every transport; a
transport only turns ``(global state, clients, round)`` into one :class:`Reply` per client. :class:`InProcess`
calls :func:`~lightning_fl.federated.client.run_client` here (on each Fabric process for its share of the
clients); :class:`lightning_fl.flower.transport.FlowerTransport` sends Flower messages to SuperNodes and parses the
bytes they send back. The server decodes and gates every reply the same way, whichever way it came.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning as L

from lightning_fl.compress.base import Codec, Payload
from lightning_fl.federated.client import LocalTraining, run_client
from lightning_fl.federated.state import State


@dataclass
class Reply:
    """One sampled client's answer in one round.

    Args:
        client: The client id.
        num_samples: Its training samples (the aggregation weight).
        payload: The encoded upload; ``None`` when nothing usable arrived (``failure`` says why) or ``lost``.
        logged: What its ``training_step`` logged (per key: weighted sum, total weight).
        failure: Why the reply holds no upload (training diverged, malformed bytes, a refusal).
        lost: No reply at all (the node left, or the round's timeout passed): counted like an unavailable client.
        message_up: Bytes of the transport's reply message (``None`` in process: nothing travels).
        message_down: Bytes of the transport's instruction message to this client.
    """

    client: int
    num_samples: int = 0
    payload: Payload | None = None
    logged: dict[str, tuple[float, float]] = field(default_factory=dict)
    failure: str | None = None
    lost: bool = False
    message_up: int | None = None
    message_down: int | None = None


class Transport:
    """Base class: deliver a round to ``clients`` and yield their replies (each client exactly once)."""

    #: Whether clients run in this process tree, spread over the Fabric processes (each trains its share).
    spreads_over_processes = True

    def open(self, *, num_clients: int, fingerprint: str | None, seed: int) -> None:
        """Called once before the first round of a fit (a network transport finds its clients here)."""

    def finished_round(self, round: int, metrics: dict[str, float]) -> None:
        """Called after each round is logged and checkpointed (a network transport reports progress here)."""

    def replies(
        self,
        model: L.LightningModule,
        datamodule: Any,
        state: State,
        clients: Sequence[int],
        round: int,
        seed: int,
        *,
        codec: Codec,
        local: LocalTraining,
        fabric: L.Fabric,
    ) -> Iterator[Reply]:
        raise NotImplementedError


class InProcess(Transport):
    """Clients train here, one after another, with the server's module and data module (the simulation)."""

    def replies(self, model, datamodule, state, clients, round, seed, *, codec, local, fabric) -> Iterator[Reply]:
        for cid in clients:
            result = run_client(model, datamodule, state, cid, round, seed, codec=codec, local=local, fabric=fabric)
            yield Reply(cid, result.num_samples, result.payload, result.logged, result.failure)
