"""FedBuff, buffered asynchronous aggregation (``trainer.buffered``): its settings, its staleness rule, and what it
cannot be combined with.

Nguyen, Malik, Zhan, Yousefpour, Rabbat, Malek and Huba, "Federated Learning with Buffered Asynchronous Aggregation"
(AISTATS 2022). ``concurrency`` clients train at once, each from the global state it downloaded when it started; when
one finishes, another starts at once from the current state. The server keeps a buffer: when ``buffer_size`` updates
are in it, it steps with

    Delta = sum_i w_i s(tau_i) Delta_i / sum_i w_i

``Delta_i`` the client's upload minus the state it downloaded, ``tau_i`` its staleness (the server's version now minus
the version it downloaded), ``s`` the staleness discount and ``w_i`` 1 (or the client's sample count under a weighted
strategy): with ``w_i = 1`` the paper's ``(1/K) sum_i s(tau_i) Delta_i``. The strategy steps from ``current + Delta``
as a round's mean upload, so FedAvg moves to ``x + Delta`` and FedAvgM or FedAdam use ``Delta`` as their
pseudo-gradient. The buffer itself is the collection's arrival policy
:class:`~lightning_fl.federated.arrivals.Buffered`, fed in process by the clock's event loop and on Flower by the
nodes' real replies (:mod:`lightning_fl.federated.arrivals.sources`): its rounds run through the one
:class:`~lightning_fl.federated.server.round.RoundRunner` and every stage.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from lightning_fl.errors import ConfigError

STALENESS = ("sqrt", "constant", "polynomial")


def discount(staleness: str, exponent: float, tau: int) -> float:
    """The staleness discount ``s(tau)`` of an update ``tau`` server steps (or rounds) old, ``s(0) = 1``: ``sqrt``
    ``1 / sqrt(1 + tau)``, ``constant`` 1, ``polynomial`` ``(1 + tau) ** -exponent``. FedBuff's rule, and that of a
    late reply folded into a later round on Flower (:mod:`lightning_fl.flower.late`)."""
    if staleness == "constant":
        return 1.0
    return (1.0 + tau) ** -(0.5 if staleness == "sqrt" else float(exponent))


class FedBuff:
    """``trainer.buffered``: one server step (one of ``trainer.rounds``) every ``buffer_size`` client updates, with
    ``concurrency`` clients training at once (module docstring). In process it needs ``trainer.clock``: a client's
    time to finish is its download, local steps and upload on its own device and link; on Flower the replies arrive
    when they do.

    Args:
        concurrency: Clients training at once (the paper's C); at most the number of clients.
        buffer_size: Updates aggregated per server step (the paper's K); at most the number of clients.
        staleness: The discount ``s(tau)`` of an update ``tau`` server steps old: ``sqrt`` ``1 / sqrt(1 + tau)`` (the
            paper's choice), ``constant`` 1 (no discount), or ``polynomial`` ``(1 + tau) ** -exponent``.
        exponent: The exponent of ``polynomial`` (0.5 gives ``sqrt``).
    """

    def __init__(
        self,
        concurrency: int,
        buffer_size: int,
        staleness: Literal["sqrt", "constant", "polynomial"] = "sqrt",
        exponent: float = 0.5,
    ) -> None:
        self.concurrency, self.buffer_size, self.staleness, self.exponent = (
            concurrency,
            buffer_size,
            staleness,
            exponent,
        )
        if problems := self.problems():
            raise ConfigError("; ".join(problems))

    def problems(self) -> list[str]:
        """One line per impossible setting."""
        out = [
            f"trainer.buffered.{key} must be a whole number >= 1, got {value!r}"
            for key, value in (("concurrency", self.concurrency), ("buffer_size", self.buffer_size))
            if not isinstance(value, int) or isinstance(value, bool) or value < 1
        ]
        if self.staleness not in STALENESS:
            out.append(f"trainer.buffered.staleness must be one of {', '.join(STALENESS)}, got {self.staleness!r}")
        finite = isinstance(self.exponent, int | float) and not isinstance(self.exponent, bool)
        if not finite or not math.isfinite(self.exponent) or self.exponent < 0:
            out.append(f"trainer.buffered.exponent must be a finite number >= 0, got {self.exponent!r}")
        return out

    def weight(self, tau: int) -> float:
        """The discount ``s(tau)`` of an update ``tau`` server steps stale (``s(0) = 1``; :func:`discount`)."""
        return discount(self.staleness, self.exponent, tau)

    def check_population(self, num_clients: int) -> None:
        """Refuse a concurrency or buffer larger than the population (neither could ever fill)."""
        for key, value in (("concurrency", self.concurrency), ("buffer_size", self.buffer_size)):
            if value > num_clients:
                raise ConfigError(
                    f"trainer.buffered.{key} is {value} but the data has {num_clients} clients: set it "
                    f"to at most {num_clients}"
                )

    def __repr__(self) -> str:
        extra = f", exponent={self.exponent}" if self.staleness == "polynomial" else ""
        sizes = f"concurrency={self.concurrency}, buffer_size={self.buffer_size}"
        return f"FedBuff({sizes}, staleness={self.staleness!r}{extra})"


def stale_problems(a: dict[str, Any]) -> list[tuple[str, str]]:
    """What stale updates void among the trainer's arguments ``a``, whichever policy brings them (FedBuff's buffer,
    Flower's late replies at k of n): ``(key, why)`` for each argument set that assumes a synchronous cohort."""
    strategy = a["strategy"]
    rows = [
        (
            "secure_aggregation",
            a["secure_aggregation"] is not None,
            "trainer.secure_aggregation sums one cohort's uploads, and a stale update belongs to no cohort (it has its "
            "own base state and staleness)",
        ),
        (
            "privacy",
            a["privacy"] is not None,
            "trainer.privacy's accountant and fixed denominator assume that a round's uploads are that round's own "
            "sample (fixed or Poisson, clients_per_round of num_clients), each trained from its state; a stale update "
            "was drawn in another round and arrives when its client finishes, which no sampling rate describes",
        ),
        (
            "dp_sgd",
            a["dp_sgd"] is not None,
            "trainer.dp_sgd's per-client accounting counts each client in the round it is sampled, not in the round "
            "its stale update arrives",
        ),
        ("attack", a["attack"] is not None, "trainer.attack forges uploads from a synchronous round's cohort"),
        (
            "strategy",
            not strategy.streams,
            f"trainer.strategy {type(strategy).__name__} aggregates one cohort's uploads, and a stale update is a "
            "discounted step from another state: use FedAvg, FedAvgM, FedAdagrad, FedAdam or FedYogi",
        ),
        (
            "compressed_downloads",
            a["compressed_downloads"] is True,
            "trainer.compressed_downloads counts each client's catch-up from the rounds it downloaded, and a stale "
            "update's client downloaded another version than the round's",
        ),
    ]
    return [(key, why) for key, bad, why in rows if bad]


def unclocked(a: dict[str, Any]) -> str | None:
    """Why ``trainer.buffered`` cannot run in process as the trainer arguments ``a`` stand: no ``trainer.clock``
    (``None``: it can). Asked when the fit starts, before any work, not when the trainer is made: a Flower ServerApp
    gives the trainer its transport (the nodes' real arrivals, no clock needed) after the config has built it."""
    if a.get("buffered") is None or a["clock"] is not None or getattr(a["transport"], "asynchronous", False):
        return None
    return (
        "trainer.buffered needs trainer.clock in process: a client's time to finish (download, local steps, upload) "
        "decides when its update arrives; set trainer.clock lightning_fl.federated.Clock (on Flower the replies "
        "arrive when they do)"
    )


def buffered_problems(a: dict[str, Any]) -> list[str]:
    """What makes ``trainer.buffered`` impossible with the other trainer arguments ``a``: the first problem, in one
    line naming the key and the fix (docs/explanations/time.md says why each is refused)."""
    if a.get("buffered") is None:
        return []
    clock, transport = a["clock"], a["transport"]
    asynchronous = getattr(transport, "asynchronous", False)
    refused = [
        (
            transport is not None and not asynchronous,
            f"trainer.buffered runs in process or over a transport whose clients train on their own time (Flower's), "
            f"and trainer.transport {type(transport).__name__} runs synchronous rounds: remove trainer.buffered",
        ),
        (
            asynchronous and clock is not None,
            "trainer.clock times FedBuff's arrivals in process; over trainer.transport they arrive in real time: "
            "remove trainer.clock",
        ),
        *((True, f"{why}: remove trainer.{key} or trainer.buffered") for key, why in stale_problems(a)),
        (
            a["client_batching"] != "sequential",
            f"trainer.client_batching {a['client_batching']} trains a cohort at "
            "once; FedBuff starts one client at a time: set it to sequential",
        ),
        (
            a["sampling"] != "fixed" or a["dropout"] > 0,
            "trainer.sampling and trainer.dropout pick a synchronous "
            "round's cohort; FedBuff samples a client whenever a slot "
            "frees: set sampling fixed and dropout 0",
        ),
        (
            clock is not None and (clock.deadline_s is not None or clock.over_selection > 0),
            "trainer.clock.deadline_s and over_selection close synchronous rounds; FedBuff has none: remove them",
        ),
    ]
    return next(([line] for bad, line in refused if bad), [])
