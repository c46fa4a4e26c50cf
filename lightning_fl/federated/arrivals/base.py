"""How a round's replies arrive: a policy of the collection (:mod:`lightning_fl.federated.server.collect`), the same
:class:`~lightning_fl.federated.server.round.RoundRunner` and the same stages for every policy.

==================  ===================================================================================
policy              who takes part in round ``r``, and whose reply the round takes
==================  ===================================================================================
:class:`WaitForAll` the strategy's sampled clients less the unavailable ones; every reply (the default)
:class:`Timed`      the same clients (over-selected: ``clock.over_selection``), timed by the clock; the
                    round closes at the deadline or at its target of reports, and the late ones are left
                    out before they train (``trainer.clock``)
k of n              Flower's rounds at ``quorum`` k (:mod:`lightning_fl.flower.late`): :class:`WaitForAll`
                    over a transport whose replies include the late replies of earlier rounds
:class:`Buffered`   FedBuff (``trainer.buffered``): the clients of round ``r`` are the first
                    ``buffer_size`` arrivals of clients trained asynchronously, each from the state it
                    downloaded when it started (:mod:`lightning_fl.federated.arrivals.fedbuff`)
==================  ===================================================================================

A reply trained from an older global state (a late reply on Flower, a stale FedBuff update) carries that state, its
staleness ``tau`` and its discount ``s(tau)``; the collection decodes it against that state and enters it as
``x + s(tau) (u - x_then)`` (:func:`~lightning_fl.federated.server.collect.rebased`), so a round's weighted mean steps
by FedBuff's ``sum_i w_i s(tau_i) Delta_i / sum_i w_i``. Every stage's hooks see every reply, whatever the policy.

The policy acts at three points of a round: :meth:`Arrivals.begin` picks the round's clients (before the stages'
``start``), :meth:`Arrivals.admit` leaves out those that report after the round closes (after the stages' ``start``,
so a compressed broadcast has said what each client downloads), and :meth:`Arrivals.replies` brings their replies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from lightning_fl.compress.base import Codec
from lightning_fl.federated.clients.local import ClientJob, LocalTraining
from lightning_fl.federated.clients.transport import Reply, Transport
from lightning_fl.federated.server.uploads import Round


class Delivery(Protocol):
    """What a policy uses of its collection (:class:`~lightning_fl.federated.server.collect.Uploads`): how clients are
    reached, how their uploads are encoded, how they train."""

    transport: Transport
    codec: Codec
    local: LocalTraining


def job_of(rnd: Round, collection: Delivery, model: Any) -> ClientJob:
    """Round ``rnd``'s work for its clients, as the collection delivers it."""
    return ClientJob(
        model, rnd.datamodule, rnd.state, rnd.index, rnd.seed, collection.codec, collection.local, rnd.fabric
    )


class Arrivals:
    """Base class, and the default policy: wait for every available client's reply (module docstring)."""

    #: What a checkpoint calls this policy's state (``None``: it has none).
    state_key: str | None = None
    #: Why a checkpoint without this policy's state cannot resume its run (``None``: it may).
    without: str | None = None

    def sampled_count(self, target: int, num_clients: int) -> int:
        """Clients to sample for ``target`` reports."""
        return target

    def begin(self, rnd: Round, draw: Callable[[Round], None], collection: Delivery, model: Any) -> None:
        """Pick round ``rnd``'s clients (``rnd.sampled``, ``rnd.away``, ``rnd.available``): ``draw`` samples them."""
        draw(rnd)

    def admit(self, rnd: Round) -> None:
        """Leave out of ``rnd.available`` the clients that report after the round closes (into ``rnd.late``)."""

    def replies(self, rnd: Round, collection: Delivery, model: Any, share: list[int]) -> Iterator[Reply]:
        """The replies of ``share`` (this process's clients of ``rnd.available``), as they come."""
        return collection.transport.replies(job_of(rnd, collection, model), share)

    def end_round(self, rnd: Round) -> None:
        """The round is aggregated; add what the policy measured to ``rnd.metrics``."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], completed: int) -> None:
        """Continue from ``state``, saved after round ``completed``; a ``ValueError`` says why it cannot."""

    def summary(self, history: list[dict[str, float]]) -> list[str]:
        """The run summary's lines of this policy, from every round's metrics."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


WaitForAll = Arrivals


def local_steps(local: LocalTraining, datamodule: Any, client: int) -> int:
    """The local steps ``client`` runs: ``local_steps``, or its batches times ``local_epochs``."""
    if local.steps is not None:
        return int(local.steps)
    return int(local.epochs) * len(datamodule.client_dataloader(client, seed=0))
