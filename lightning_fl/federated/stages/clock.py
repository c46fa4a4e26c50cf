"""The clock as a round's stage: when the round's clients are known, it times each one
(:class:`~lightning_fl.federated.clock.Clock`) and leaves out those its rule closes the round on before they report.

It runs last at ``start``, after the compressed broadcast has said what each client downloads. A client it leaves out
is *late*: it downloaded (the ledger counts it), it does not train here (its report would come after the round closed)
and its upload never arrives, as with an unavailable client; the round's mechanisms see only the clients that report
in time. Under central DP that is the rule the docs state for clients that do not reply: the denominator stays the
expected number of clients, and a late client adds zero.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from lightning_fl.compress.base import Codec
from lightning_fl.federated.clock import Clock
from lightning_fl.federated.local import LocalTraining
from lightning_fl.federated.stages.base import Stage
from lightning_fl.federated.uploads import LOST, Round


class RoundClock(Stage):
    """``trainer.clock``: each round's simulated time (``time/simulated_round_s``) and its late clients.

    Args:
        clock: The clients' speeds and the round's rule.
        codec: The uploads' encoding: its stated layout gives each upload's bytes before the client trains.
        local: How clients train (their local steps).
        target: Reports that close a round under over-selection (``clients_per_round``); ``None``: all of them.
    """

    def __init__(self, clock: Clock, codec: Codec, local: LocalTraining, target: int | None = None) -> None:
        self.clock, self.codec, self.local, self.target = clock, codec, local, target
        self.predicted: dict[int, int] = {}
        self._warned = False

    def upload_bytes(self, rnd: Round) -> int:
        """The bytes of one upload, from the codec's layout (every built-in codec states it)."""
        layout = self.codec.layout(rnd.state)
        if layout is None:
            return rnd.full_bytes
        return sum(int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
                   for part in layout.values() for dtype, shape in part.parts.values())  # fmt: skip

    def steps(self, datamodule: Any, client: int) -> int:
        """The local steps ``client`` runs: ``local_steps``, or its batches times ``local_epochs``."""
        if self.local.steps is not None:
            return int(self.local.steps)
        return int(self.local.epochs) * len(datamodule.client_dataloader(client, seed=0))

    def start(self, rnd: Round) -> None:
        clients = list(rnd.available)
        up = self.upload_bytes(rnd)
        timing = self.clock.timing(
            rnd.seed,
            clients,
            steps=np.array([self.steps(rnd.datamodule, c) for c in clients], dtype=np.int64),
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
            for part, values in (("download", timing.download_s), ("compute", timing.compute_s),
                                 ("upload", timing.upload_s)):  # fmt: skip
                rnd.metrics[f"time/client_{part}_s"] = float(np.median(values))

    def end_round(self, rnd: Round) -> None:
        """Warn once if an upload's bytes differ from what the codec's layout said (the clock timed that)."""
        if self._warned:
            return
        for e in rnd.in_order:
            if e.status != LOST and e.client in self.predicted and e.up not in (0, self.predicted[e.client]):
                self._warned = True
                warnings.warn(f"trainer.clock timed each upload as {self.predicted[e.client]} bytes (the codec's "
                              f"layout), but client {e.client} sent {e.up}: the simulated times are off by that "
                              "difference", stacklevel=2)  # fmt: skip
                return

    def __repr__(self) -> str:
        return f"RoundClock({self.clock!r}, target={self.target})"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
