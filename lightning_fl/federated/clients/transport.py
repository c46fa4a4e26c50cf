"""Transports: how a round's global state reaches the sampled clients and their uploads come back.

The round loop (:class:`~lightning_fl.federated.server.round.RoundRunner`) is the same for every transport; a
transport only turns ``(global state, clients, round)`` into one :class:`Reply` per client. :class:`InProcess`
calls :func:`~lightning_fl.federated.clients.client.run_client` here (on each Fabric process for its share of the
clients); :class:`lightning_fl.flower.transport.FlowerTransport` sends Flower messages to SuperNodes and parses the
bytes they send back. The server decodes and gates every reply the same way, whichever way it came.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_fl.compress.base import Payload
from lightning_fl.errors import UserError
from lightning_fl.federated.clients.client import run_client
from lightning_fl.federated.clients.cohort import cohort_problem, cohort_too_large, run_cohort
from lightning_fl.federated.clients.dp_cohort import run_cohort_dp_sgd
from lightning_fl.federated.clients.local import ClientJob, ClientResult, LocalTraining
from lightning_fl.federated.clients.lockstep import lockstep_problem, run_lockstep
from lightning_fl.federated.server.state import State
from lightning_fl.federated.trainer.callbacks import Callback, Rounds


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
        upload_bytes: The upload's bytes when ``payload`` does not hold it (a secure round on Flower: the masked
            vector went into the sum); ``None``: the payload's.
        dp_sgd_plan: Under ``trainer.dp_sgd``, the record count and batch size the client's node trained with (a
            node with its own data reports them for the server's accountant); ``None``: the data module's.
        staleness: Rounds since the message this replies to was sent (0: this round's; more: a late reply a round
            left behind, run config ``quorum`` on Flower).
        reference: The global state a late reply was trained from (its upload is decoded against it); ``None``:
            this round's.
        discount: The staleness discount ``s(staleness)``: a late upload ``u`` enters the round as ``x + s (u -
            reference)``, ``x`` this round's global state.
        downloaded: Whether this round sent the client the global state (a late reply's download, or a busy
            client's, was counted in the round its message was sent).
    """

    client: int
    num_samples: int = 0
    payload: Payload | None = None
    logged: dict[str, tuple[float, float]] = field(default_factory=dict)
    failure: str | None = None
    lost: bool = False
    message_up: int | None = None
    message_down: int | None = None
    upload_bytes: int | None = None
    dp_sgd_plan: tuple[Any, Any] | None = None
    staleness: int = 0
    reference: State | None = None
    discount: float = 1.0
    downloaded: bool = True


@dataclass
class SecureRound:
    """A secure round as a transport gives it back: one reply per client (without its upload) and the sum of
    the uploads it included.

    Args:
        replies: One :class:`Reply` per client: lost, failed (``failure``), or answered.
        total: ``sum_i q_i mod M`` over the ``included`` clients' quantised uploads (int64 ``(D,)``); ``None``
            when none was included.
        included: The clients whose uploads are in ``total``, in client order.
        problem: Why the round has no sum at all (the secure aggregation failed as a whole), else ``None``.
        invalid: The sum of the ``included`` clients came back but cannot be theirs (off the grid, outside
            ``[0, n T]``): one of them masked something else (``problem`` says what).
    """

    replies: list[Reply] = field(default_factory=list)
    total: torch.Tensor | None = None
    included: list[int] = field(default_factory=list)
    problem: str | None = None
    invalid: bool = False


def reply_of(result: ClientResult, local: LocalTraining) -> Reply:
    """What reaches the server of a client's result: its payload and what else it releases
    (:meth:`~lightning_fl.federated.clients.local.ClientResult.released`)."""
    num_samples, logged, failure = result.released(local)
    return Reply(result.client, num_samples, result.payload, logged, failure)


class Transport(Callback):
    """Base class: deliver a round to ``clients`` and yield their replies (each client exactly once). The trainer
    calls it as a callback too: at the end of each round it calls :meth:`finished_round`."""

    #: Whether clients run in this process tree, spread over the Fabric processes (each trains its share).
    spreads_over_processes = True
    #: Whether :meth:`secure_round` is implemented (the server then sees only the sum of a round's uploads).
    sums_securely = False
    #: Whether clients train on their own time, one message at a time (:meth:`send`, :meth:`arrived`): FedBuff's
    #: arrivals are then the transport's real ones (:class:`~lightning_fl.federated.arrivals.sources.Delivered`).
    asynchronous = False

    def open(self, *, num_clients: int, fingerprint: str | None, seed: int) -> None:
        """Called once before the first round of a fit (a network transport finds its clients here)."""

    def finished_round(self, round: int, metrics: dict[str, float]) -> None:
        """Called after round ``round`` (1-based, as logged) is logged and checkpointed (a network transport reports
        progress here)."""

    def on_round_end(self, trainer: Rounds, round: int, metrics: dict[str, float]) -> None:
        self.finished_round(round, metrics)

    def silent_round(self, round: int, asked: list[int]) -> None:
        """Called when none of the ``asked`` clients of round ``round`` (1-based) replied: the round is not done
        (nothing aggregated, released, accounted or saved) and runs again after this returns. Raise to stop the run;
        a transport that never loses a reply never gets here (this one stops at once)."""
        raise UserError(f"round {round}: none of the clients asked ({asked[:8]}) replied")

    def round_metrics(self) -> dict[str, float]:
        """What the transport adds to the round's metrics once its replies are in (Flower's late replies)."""
        return {}

    def replies(self, job: ClientJob, clients: Sequence[int]) -> Iterator[Reply]:
        """Deliver ``job`` (the round's global state, and how its clients train and encode) to ``clients`` and yield
        their replies as they come."""
        raise NotImplementedError

    def secure_round(self, job: ClientJob, clients: Sequence[int]) -> SecureRound:
        """Deliver a secure round (``job.local.secure``): the replies and the modular sum of the uploads only."""
        raise NotImplementedError(f"{type(self).__name__} cannot run secure rounds")

    # ------------------------------------------------------------------------ asynchronous (``asynchronous``)
    def reachable(self) -> set[int]:
        """The clients a message can be sent to now."""
        raise NotImplementedError(f"{type(self).__name__} does not run clients asynchronously")

    def send(self, job: ClientJob, client: int) -> tuple[Any, int | None] | None:
        """Send ``client`` the work ``job`` and return at once: a ticket for its reply and the bytes of the message
        (``None`` if not measured); ``None`` when it cannot be sent."""
        raise NotImplementedError(f"{type(self).__name__} does not run clients asynchronously")

    def arrived(self, tickets: Sequence[Any]) -> list[tuple[Any, Reply]]:
        """The replies to ``tickets`` that have arrived, as ``(ticket, reply)``, waiting until at least one has
        (a lost one is a reply, ``lost``); raise when none comes within the transport's limit."""
        raise NotImplementedError(f"{type(self).__name__} does not run clients asynchronously")


class InProcess(Transport):
    """Clients train here with the server's module and data module (the simulation): one after another
    (:func:`~lightning_fl.federated.clients.client.run_client`, plain or DP-SGD); or, with ``batching`` (the trainer's
    ``client_batching``) ``vmap``, ``cohort_size`` at a time as one vectorised computation when the module allows it
    (:func:`~lightning_fl.federated.clients.cohort.run_cohort`, or under ``trainer.dp_sgd``
    :func:`~lightning_fl.federated.clients.dp_cohort.run_cohort_dp_sgd`); or, with ``lockstep``, ``cohort_size`` at a
    time stepping together and sharing the mapping's products
    (:func:`~lightning_fl.federated.clients.lockstep.run_lockstep`); otherwise one after another, said once in a
    warning."""

    def __init__(self, cohort_size: int = 0, batching: str = "vmap") -> None:
        self.cohort_size = 0 if batching == "sequential" else cohort_size  # (trainer.client_batching)
        self.lockstep = batching == "lockstep"
        self._checked: dict[int, str | None] = {}  # id(module) -> why it cannot train as a cohort

    def replies(self, job: ClientJob, clients: Sequence[int]) -> Iterator[Reply]:
        local = job.local
        if self.cohort_size > 0 and self._cohorts_possible(job, clients[0], local.dp_sgd is not None):
            train = run_lockstep if self.lockstep else run_cohort if local.dp_sgd is None else run_cohort_dp_sgd
            for start in range(0, len(clients), self.cohort_size):
                for result in train(job, list(clients[start : start + self.cohort_size])):
                    yield reply_of(result, local)
            return
        for cid in clients:
            yield reply_of(run_client(job, cid), local)

    sums_securely = True

    def secure_round(self, job: ClientJob, clients: Sequence[int]) -> SecureRound:
        """The clients train here; their quantised uploads are added modulo ``M`` (the masks of a deployment
        would cancel in this sum) and only their structure is read."""
        secure, size = job.local.secure, sum(t.numel() for t in job.state.values())
        out = SecureRound()
        for reply in self.replies(job, clients):
            if not reply.lost and not reply.failure:
                vector, reply.failure = secure.read(reply.payload, size)
                if vector is not None:
                    out.total = vector if out.total is None else torch.remainder(out.total + vector, secure.M)
                    bisect.insort(out.included, reply.client)  # client order, whatever the arrival
            out.replies.append(reply)
        return out

    def _cohorts_possible(self, job: ClientJob, client: int, local_dp: bool = False) -> bool:
        """Whether the job's module's clients train as cohorts: decided once per module, from what it is
        (:func:`cohort_problem`) and from its activations on ``client``'s first batch (:func:`cohort_too_large`)."""
        model, fabric = job.module, job.fabric
        if id(model) not in self._checked:
            if self.lockstep:  # each client's network runs alone: no activation limit
                problem = lockstep_problem(model, fabric) or ("it trains with DP-SGD" if local_dp else None)
            else:
                problem = cohort_problem(model, fabric) or cohort_too_large(
                    model, job.datamodule, client, job.round, job.seed, self.cohort_size, fabric
                )
            self._checked[id(model)] = problem
            if problem is not None:
                warnings.warn(
                    f"trainer.client_batching is {'lockstep' if self.lockstep else 'vmap'!r} but {problem}: its "
                    "clients train one at a time",
                    stacklevel=2,
                )
        return self._checked[id(model)] is None
