"""Rounds timed by the clock (``trainer.clock``): wait for all, or close at a deadline or at a target of reports
under over-selection; the late clients are left out before they train. With the clock's availability, a round
samples the clients available when it starts, and those that go offline before they report are lost."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lightning_fl.errors import ConfigError
from lightning_fl.federated.arrivals.base import Arrivals, Delivery, local_steps
from lightning_fl.federated.arrivals.clock import Clock
from lightning_fl.federated.arrivals.work import aggregated, record_work, wasted_bytes, work_summary
from lightning_fl.federated.clients.local import LocalTraining
from lightning_fl.federated.server.state import State
from lightning_fl.federated.server.uploads import LOST, Round


class Timed(Arrivals):
    """``trainer.clock``: each round's simulated time (``time/simulated_round_s``) and its late clients.

    When the round's clients are known and the stages have said what each downloads, the clock times each one
    (:class:`~lightning_fl.federated.arrivals.clock.Clock`) and leaves out those its rule closes the round on before
    they report. A client left out is *late*: it downloaded (the ledger counts it), it does not train here (its report
    would come after the round closed) and its upload never arrives, as with an unavailable client; the round's
    mechanisms see only the clients that report in time. Under central DP that is the rule the docs state for clients
    that do not reply: the denominator stays the expected number of clients, and a late client adds zero.

    With ``clock.availability`` the rounds follow one simulated time (``now_s``, saved with the round checkpoint): a
    round starts when the previous one closed (or, if no client is available then, when the first one comes online:
    ``time/availability_wait_s``, part of the round's time), samples among the clients available at its start, and
    loses those whose availability ends before their upload is in (``fed/offline_clients``: downloaded, no upload,
    like a late client). Each round logs the work its clients spent and what of it was thrown away (``work/*``,
    :mod:`lightning_fl.federated.arrivals.work`).

    Args:
        clock: The clients' speeds and the round's rule.
        local: How clients train (their local steps).
        upload_bytes: One upload's bytes for a global state, from the codec's stated layout (before anyone trains).
        target: Reports that close a round under over-selection (``clients_per_round``); ``None``: all of them.
    """

    state_key = "clock"

    def __init__(
        self,
        clock: Clock,
        local: LocalTraining,
        upload_bytes: Callable[[State], int | None],
        target: int | None = None,
    ) -> None:
        self.clock, self.local, self.upload_bytes, self.target = clock, local, upload_bytes, target
        self.predicted: dict[int, int] = {}
        self.warned = False
        self.now_s = 0.0  # simulated time when the next round may start (with availability)
        self.start_s, self.spent_s = 0.0, []

    @property
    def without(self) -> str | None:
        if self.clock.availability is None:
            return None
        return (
            "it was written without trainer.clock.availability (no simulated time was saved); remove "
            "trainer.clock.availability, or start afresh"
        )

    def sampled_count(self, target: int, num_clients: int) -> int:
        return self.clock.sampled_count(target, num_clients)

    def begin(self, rnd: Round, draw: Callable[[Round], None], collection: Delivery, model: Any) -> None:
        """Sample among the clients available when the round starts (waiting for one to come online)."""
        availability = self.clock.availability
        if availability is None:
            draw(rnd)
            return
        everyone = list(range(rnd.datamodule.num_clients))
        availability.check_population(len(everyone))
        self.start_s = availability.first_on(rnd.seed, everyone, self.now_s)
        if math.isinf(self.start_s):
            raise ConfigError(
                f"trainer.clock.availability: no client is available at or after {self.now_s:,.1f} simulated seconds "
                f"(round {rnd.index + 1}): give trace intervals that last the run, or set repeat_s"
            )
        rnd.eligible = availability.available_clients(rnd.seed, everyone, self.start_s)
        draw(rnd)
        rnd.metrics["fed/available_clients"] = float(len(rnd.eligible))
        rnd.metrics["time/availability_wait_s"] = self.start_s - self.now_s

    def admit(self, rnd: Round) -> None:
        clients = list(rnd.available)
        stated = self.upload_bytes(rnd.state)
        up = rnd.full_bytes if stated is None else stated
        availability, until = self.clock.availability, None
        if availability is not None:
            until = np.array([availability.until(rnd.seed, c, self.start_s) - self.start_s for c in clients])
        timing = self.clock.timing(
            rnd.seed,
            clients,
            steps=np.array([local_steps(self.local, rnd.datamodule, c) for c in clients], dtype=np.int64),
            down_bytes=np.array([rnd.download_bytes(c) for c in clients], dtype=np.int64),
            up_bytes=np.full(len(clients), up, dtype=np.int64),
            target=self.target,
            until_s=until,
        )
        rnd.available = [c for c, ok in zip(clients, timing.on_time, strict=True) if ok]
        rnd.late = [c for c, ok in zip(clients, timing.on_time, strict=True) if not ok]
        self.predicted = dict.fromkeys(rnd.available, up)
        self.spent_s = [(c, float(s)) for c, s in zip(clients, timing.spent_s, strict=True)]
        offline = int(timing.offline.sum())
        rnd.metrics["time/simulated_round_s"] = (self.start_s - self.now_s) + timing.close_s
        rnd.metrics["fed/late_clients"] = float(len(rnd.late) - offline)
        if availability is not None:
            rnd.metrics["fed/offline_clients"] = float(offline)
            self.now_s = self.start_s + timing.close_s
        if clients:  # the medians over the round's clients: where its time goes
            parts = (("download", timing.download_s), ("compute", timing.compute_s), ("upload", timing.upload_s))
            for part, values in parts:
                rnd.metrics[f"time/client_{part}_s"] = float(np.median(values))

    def end_round(self, rnd: Round) -> None:
        """Log the round's work (``work/*``), and warn once if an upload's bytes differ from what the codec's layout
        said (the clock timed that)."""
        kept = aggregated(rnd)
        record_work(rnd, self.spent_s, kept, self.clock.power_w, wasted_bytes(rnd, kept))
        if self.warned:
            return
        for e in rnd.in_order:
            if e.status != LOST and e.client in self.predicted and e.up not in (0, self.predicted[e.client]):
                self.warned = True
                warnings.warn(
                    f"trainer.clock timed each upload as {self.predicted[e.client]} bytes (the codec's layout), but "
                    f"client {e.client} sent {e.up}: the simulated times are off by that difference",
                    stacklevel=2,
                )
                return

    def state_dict(self) -> dict[str, Any]:
        """The simulated time the next round starts from, with availability (without it, none: rounds start at 0)."""
        if self.clock.availability is None:
            return {}
        return {"availability": repr(self.clock.availability), "now_s": self.now_s}

    def load_state_dict(self, state: dict[str, Any], completed: int) -> None:
        saved = state.get("availability")
        if saved is not None and saved != repr(self.clock.availability):
            raise ValueError(
                f"it was written with trainer.clock.availability {saved}, not {self.clock.availability!r}; set the "
                "same, or start afresh"
            )
        self.now_s = float(state.get("now_s", 0.0))

    def summary(self, history: list[dict[str, float]]) -> list[str]:
        if "time/simulated_elapsed_s" not in history[-1]:
            return []
        late, elapsed = sum(h.get("fed/late_clients", 0.0) for h in history), history[-1]["time/simulated_elapsed_s"]
        line = f"simulated time (trainer.clock): {elapsed:,.1f} s over the rounds; {late:,.0f} late client(s) left out"
        if self.clock.availability is not None:
            offline = sum(h.get("fed/offline_clients", 0.0) for h in history)
            line += f", {offline:,.0f} gone offline ({self.clock.availability!r})"
        return [line, *work_summary(history, self.clock.power_w)]

    def __repr__(self) -> str:
        return f"Timed({self.clock!r}, target={self.target})"


def layout_bytes(codec: Any) -> Callable[[State], int | None]:
    """One upload's bytes under ``codec``'s stated layout for a global state (``None``: it states none)."""

    def nbytes(state: State) -> int | None:
        layout = codec.layout(state)
        if layout is None:
            return None
        return sum(
            int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
            for part in layout.values()
            for dtype, shape in part.parts.values()
        )

    return nbytes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
