"""Rounds timed by the clock (``trainer.clock``): wait for all, or close at a deadline or at a target of reports
under over-selection; the late clients are left out before they train."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lightning_fl.federated.arrivals.base import Arrivals, local_steps
from lightning_fl.federated.arrivals.clock import Clock
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

    Args:
        clock: The clients' speeds and the round's rule.
        local: How clients train (their local steps).
        upload_bytes: One upload's bytes for a global state, from the codec's stated layout (before anyone trains).
        target: Reports that close a round under over-selection (``clients_per_round``); ``None``: all of them.
    """

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

    def sampled_count(self, target: int, num_clients: int) -> int:
        return self.clock.sampled_count(target, num_clients)

    def admit(self, rnd: Round) -> None:
        clients = list(rnd.available)
        stated = self.upload_bytes(rnd.state)
        up = rnd.full_bytes if stated is None else stated
        timing = self.clock.timing(
            rnd.seed,
            clients,
            steps=np.array([local_steps(self.local, rnd.datamodule, c) for c in clients], dtype=np.int64),
            down_bytes=np.array([rnd.download_bytes(c) for c in clients], dtype=np.int64),
            up_bytes=np.full(len(clients), up, dtype=np.int64),
            target=self.target,
        )
        rnd.available = [c for c, ok in zip(clients, timing.on_time, strict=True) if ok]
        rnd.late = [c for c, ok in zip(clients, timing.on_time, strict=True) if not ok]
        self.predicted = dict.fromkeys(rnd.available, up)
        rnd.metrics["time/simulated_round_s"] = timing.close_s
        rnd.metrics["fed/late_clients"] = float(len(rnd.late))
        if clients:  # the medians over the round's clients: where its time goes
            parts = (("download", timing.download_s), ("compute", timing.compute_s), ("upload", timing.upload_s))
            for part, values in parts:
                rnd.metrics[f"time/client_{part}_s"] = float(np.median(values))

    def end_round(self, rnd: Round) -> None:
        """Warn once if an upload's bytes differ from what the codec's layout said (the clock timed that)."""
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

    def summary(self, history: list[dict[str, float]]) -> list[str]:
        if "time/simulated_elapsed_s" not in history[-1]:
            return []
        late, elapsed = sum(h.get("fed/late_clients", 0.0) for h in history), history[-1]["time/simulated_elapsed_s"]
        return [
            f"simulated time (trainer.clock): {elapsed:,.1f} s over the rounds; {late:,.0f} late client(s) left out"
        ]

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
