"""Introducing SuperNodes to a run: each new node is asked once which client it serves (a ``query`` message that also
carries the run's config), and the server waits for the answers while the nodes show progress.

On a busy machine a ClientApp takes long to start (interpreter, Flower, torch, Lightning, the run's build), so no
fixed wait fits every load. The wait for the answers ends when every node asked has answered, or when
``hello-timeout`` seconds pass *without progress*; progress is a node answering or a new node joining, and each
sign of it starts the window again. A node whose answer is still out when the wait ends is not asked again (its
question stays queued on the node, and asking again would only queue another ClientApp behind it): its answer is
pulled whenever the server next looks (every round), and the node joins from then on. Flower itself answers for a
node that left (``NODE_UNAVAILABLE``) or whose ClientApp stopped sending heartbeats (``CLIENT_APP_CRASHED``): the
first is forgotten, the second asked again.

The advice a wait's end gives names the setting to raise as the engine in use spells it: a run config key on a
deployment (``flwr run --run-config``), an option of ``python -m lightning_fl.flower`` on the simulation engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from flwr.app import Message
from flwr.serverapp import Grid

from lightning_fl.flower.grid import exchange

HELLO_TIMEOUT = 300.0  # seconds without progress (a node answering or joining) before the wait for answers ends
WAIT_FOR_NODES = 60.0  # seconds since the last node joined before round 1 starts without a node for every client
LOOK_AGAIN = 2.0  # seconds between looks at which nodes are connected while waiting for answers
ENGINES = ("deployment", "simulation")


def setting(engine: str, key: str) -> str:
    """How a user sets ``key`` (a run config key's name) on ``engine``: ``run config 'hello-timeout'`` on a
    deployment, ``--hello-timeout`` on the simulation engine's command."""
    return f"--{key}" if engine == "simulation" else f"run config {key!r}"


class Hellos:
    """The questions out to nodes that have not said which client they serve yet (node id -> message id), and the
    wait for their answers.

    Args:
        grid: The ServerApp's grid.
        ask: Makes the question for a node (its ``query`` message).
    """

    def __init__(self, grid: Grid, ask: Callable[[int], Message]) -> None:
        self.grid, self.ask = grid, ask
        self.out: dict[int, str] = {}  # node -> id of its question still out
        self.overdue: set[int] = set()  # nodes whose question outlived a whole window: not waited for again

    def ask_new(self, nodes: Iterable[int]) -> bool:
        """Ask each of ``nodes`` not asked yet; whether the SuperLink took any question (one it did not take is
        asked again next time, and is no progress)."""
        new = [n for n in sorted(set(nodes)) if n not in self.out]
        if not new:
            return False
        messages = [self.ask(n) for n in new]
        taken = {n: i for n, i in zip(new, self.grid.push_messages(messages), strict=True) if i}
        self.out.update(taken)
        return bool(taken)

    def forget(self, node: int) -> None:
        self.out.pop(node, None)
        self.overdue.discard(node)

    def collect(
        self,
        window: float,
        connected: Callable[[], set[int]],
        answer: Callable[[Message], None],
        wanted: Callable[[int], bool],
    ) -> None:
        """Pull the answers: every answer in now, then (``window`` > 0) wait for those still out until each is in
        or ``window`` seconds pass without progress. ``connected()`` lists the nodes now connected (new ones are
        asked, departed ones forgotten), ``answer(reply)`` takes each answer, ``wanted(node)`` says whether a node
        still needs one. Questions that outlive the wait are overdue: pulled, never waited for, again."""
        last = time.monotonic()
        look = last + LOOK_AGAIN
        while True:
            waiting = {n: i for n, i in self.out.items() if n not in self.overdue} if window > 0 else {}
            left = window - (time.monotonic() - last)
            slice_ = max(0.0, min(left, look - time.monotonic())) if waiting else 0.0
            got = exchange(self.grid, [], slice_, pending=list(self.out.values())) if self.out else []
            by_id = {i: n for n, i in self.out.items()}
            for reply in got:
                node = by_id.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
                if node in self.out:
                    self.forget(node)
                    answer(reply)
            if got:
                last = time.monotonic()
            if window <= 0 or not waiting:
                return
            if time.monotonic() >= look:  # nodes that joined or left meanwhile
                look = time.monotonic() + LOOK_AGAIN
                now = connected()
                for node in [n for n in self.out if n not in now]:
                    self.forget(node)
                if self.ask_new(n for n in now if wanted(n)):
                    last = time.monotonic()
            if not set(self.out) - self.overdue:
                return
            if time.monotonic() - last >= window:
                self.overdue |= set(self.out)
                return
