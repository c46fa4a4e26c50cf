"""Rounds that proceed at k of n on Flower (run config ``quorum``), and the late replies folded into later rounds.

A synchronous round waits for every sampled node, so one slow node stalls the federation. With ``quorum`` k, a
round proceeds once k of the messages it sent have replied (or ``round-timeout`` passed); the messages still out
are remembered (message id -> client, round sent) with the global state they carried, one copy per round that still
has a message out. Every later round pulls their ids too. A reply that arrives ``tau`` rounds after its message was
sent is folded into the round it arrives in with FedBuff's staleness rule
(:mod:`lightning_fl.federated.arrivals.fedbuff`): decoded against the state it was trained from and entered as the
upload ``x + s(tau) (u - x_then)``, so the round's (weighted) mean steps by ``sum_i w_i s(tau_i) Delta_i / sum_i w_i``,
``tau = 0`` for the round's own replies.

A client whose message is still out is *busy*: it is sent nothing new (a node trains one message at a time); if it
is sampled, its entry in the round is its late reply when that arrives, else it is lost (no download counted: it
got none). A message out for more than ``max-staleness`` rounds is given up (counted as ``fed/stale_dropped``,
warned): its reply is never pulled and its client is free again. The byte ledger counts a download in the round its
message was sent and a late upload in the round it arrives. A resumed server starts with no message out: the replies
to messages sent before the restart are never pulled (the nodes' work is lost, the run stays exact).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

from lightning_fl.errors import ConfigError
from lightning_fl.federated import FederatedTrainer
from lightning_fl.federated.arrivals.fedbuff import STALENESS, discount, stale_problems
from lightning_fl.federated.clients.transport import Reply
from lightning_fl.federated.server.state import State
from lightning_fl.federated.trainer.arguments import TrainerArguments


@dataclass(frozen=True)
class Out:
    """A message a round proceeded without: to whom, in which round (0-based), its bytes."""

    client: int
    node: int
    round: int
    down: int


class LateReplies:
    """The messages rounds left behind and their replies (module docstring).

    Args:
        quorum: Replies a round waits for among the messages it sent (fewer when it sent fewer).
        max_staleness: Rounds a message may stay out; an older one is given up.
        staleness: The discount ``s(tau)``: ``sqrt``, ``constant`` or ``polynomial`` (FedBuff's).
        exponent: The exponent of ``polynomial``.
    """

    def __init__(self, quorum: int, max_staleness: int = 4, staleness: str = "sqrt", exponent: float = 0.5) -> None:
        self.quorum, self.max_staleness, self.staleness, self.exponent = quorum, max_staleness, staleness, exponent
        self.out: dict[str, Out] = {}  # message id -> what it was
        self.states: dict[int, State] = {}  # round -> the global state its messages carried (while any is out)
        self.round = -1
        self.stale: list[int] = []  # this round's late replies' staleness
        self.dropped = 0  # messages given up this round

    def start(self, round: int) -> set[int]:
        """Round ``round`` (0-based) begins (again, after a silent attempt): give up messages out for more than
        ``max_staleness`` rounds; the clients still busy."""
        if round != self.round:
            self.round, self.stale, self.dropped = round, [], 0
        old = sorted((o.client, i) for i, o in self.out.items() if round - o.round > self.max_staleness)
        for _, message_id in old:
            del self.out[message_id]
        if old:
            self.dropped += len(old)
            warnings.warn(
                f"round {round + 1}: client(s) {[c for c, _ in old]} did not reply within run config "
                f"'max-staleness' ({self.max_staleness} rounds): their messages are given up and they may "
                "be sampled again",
                stacklevel=3,
            )
        self._prune()
        return {o.client for o in self.out.values()}

    def waiting(self) -> list[str]:
        """The ids of the messages out, to pull with the round's own."""
        return sorted(self.out)

    def match(self, message_id: str | None, client: int | None) -> Out | None:
        """The message out that a reply answers (by the id it replies to; without one, an error the SuperLink sent
        for ``client``'s vanished node), taken off the list; ``None`` if it answers none."""
        if message_id is None:
            message_id = next((i for i, o in self.out.items() if o.client == client), None)
        return self.out.pop(message_id, None) if message_id is not None else None

    def left(self, round: int, state: State, messages: list[tuple[Any, int, int, int]]) -> None:
        """Remember ``(message, client, node, bytes)`` a round proceeded without, and the ``state`` they carried."""
        for message, client, node, down in messages:
            if message.metadata.message_id:  # (a message the SuperLink did not take gets no reply)
                self.out[message.metadata.message_id] = Out(client, node, round, down)
                if round not in self.states:  # a copy: the trainer may reuse the tensors
                    self.states[round] = {n: t.detach().clone() for n, t in state.items()}

    def reply(self, out: Out, reply: Reply) -> Reply:
        """A late reply as its round takes it: its staleness, discount and the state it was trained from. A reply to
        a message of this very round (sent by an attempt that was silent) is the round's own."""
        tau = self.round - out.round
        if tau == 0:
            return replace(reply, message_down=out.down)
        self.stale.append(tau)
        reference = self.states[out.round]  # (kept until the next round starts)
        return replace(
            reply,
            staleness=tau,
            reference=reference,
            discount=discount(self.staleness, self.exponent, tau),
            downloaded=False,
            message_down=None,
        )

    def lost(self, client: int) -> Reply:
        """A busy client's entry when no reply of its came: lost, its download counted only if its message is this
        round's (sent by an attempt that was silent), not again for an older one."""
        out = next((o for o in self.out.values() if o.client == client and o.round == self.round), None)
        return Reply(client, lost=True, message_down=out.down if out else None, downloaded=out is not None)

    def metrics(self) -> dict[str, float]:
        """``fed/stale_replies`` (late replies this round took: folded unless the gate rejects one),
        ``fed/staleness_max`` (the largest staleness among them, 0 if none), ``fed/stale_dropped`` (messages given up
        this round), ``fed/busy_clients`` (clients with a message out as the round ends)."""
        return {
            "fed/stale_replies": float(len(self.stale)),
            "fed/staleness_max": float(max(self.stale, default=0)),
            "fed/stale_dropped": float(self.dropped),
            "fed/busy_clients": float(len(self.out)),
        }

    def _prune(self) -> None:
        """Keep only the states of rounds that still have a message out."""
        needed = {o.round for o in self.out.values()}
        self.states = {r: s for r, s in self.states.items() if r in needed}


def late_replies(quorum: int, max_staleness: int, staleness: str, exponent: float) -> LateReplies | None:
    """The run config's late replies (``None`` when ``quorum`` is 0: a round waits for all)."""
    return LateReplies(quorum, max_staleness, staleness, exponent) if quorum else None


def quorum_problem(trainer: TrainerArguments) -> str | None:
    """What a round that proceeds at k of n and folds late replies voids in ``trainer``'s settings: the first, in one
    line naming the key and the fix (FedBuff refuses the same:
    :func:`~lightning_fl.federated.arrivals.fedbuff.stale_problems`).
    """
    problems = stale_problems(vars(trainer))
    return next((f"{why}: set run config 'quorum' 0 or remove trainer.{key}" for key, why in problems), None)


def quorum_unmet(trainer: FederatedTrainer, quorum: int, num_clients: int) -> str | None:
    """Why no round could meet ``quorum`` (``None``: one can): it asks for more replies than a round sends messages,
    the round's sample (``fixed`` sampling) or the whole federation (Poisson sampling or over-selection, whose
    rounds may send more than they expect)."""
    most, why = num_clients, f"data.num_clients={num_clients}"
    if trainer.sampling == "fixed" and trainer.clock is None:
        count = min(trainer._clients_per_round(num_clients), num_clients)
        if count < num_clients and trainer.clients_per_round:
            most, why = count, f"trainer.clients_per_round={trainer.clients_per_round}"
        elif count < num_clients:
            most, why = count, f"trainer.client_fraction={trainer.client_fraction:g} of {num_clients} clients"
    if quorum <= most:
        return None
    return (
        f"run config 'quorum' {quorum} is more than the {most} messages a round sends ({why}): no round could "
        "meet it; set quorum at most that, or 0 to wait for every reply"
    )


def check(quorum: int, max_staleness: int, staleness: str, exponent: float) -> None:
    """Refuse run config values that cannot be (one line each)."""
    whole = {"quorum": quorum, "max-staleness": max_staleness}
    for key, value in whole.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"run config {key!r} must be a whole number >= 0, got {value!r}")
    if staleness not in STALENESS:
        raise ConfigError(f"run config 'staleness' must be one of {', '.join(STALENESS)}, got {staleness!r}")
    if not isinstance(exponent, int | float) or isinstance(exponent, bool) or not 0 <= exponent < float("inf"):
        raise ConfigError(f"run config 'staleness-exponent' must be a finite number >= 0, got {exponent!r}")
