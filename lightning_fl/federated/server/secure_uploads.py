"""A round whose server sees only the sum of its uploads (``trainer.secure_aggregation``): the collection of a secure
round, and the record of who spoils its sums (:mod:`lightning_fl.federated.server.suspects`)."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import lightning as L
import torch

from lightning_fl.errors import ConfigError
from lightning_fl.federated.arrivals.base import job_of
from lightning_fl.federated.server.collect import Uploads, entry_of
from lightning_fl.federated.server.gate import upload_nbytes
from lightning_fl.federated.server.stages.base import Stage
from lightning_fl.federated.server.strategies import Strategy
from lightning_fl.federated.server.suspects import Suspects
from lightning_fl.federated.server.uploads import ACCEPTED, Round, Total


class SecureUploads(Uploads):
    """The sum of the round's uploads only (``trainer.secure_aggregation``): the transport runs the secure round
    (Flower's SecAgg+, or its arithmetic in process) and gives back each client's reply without its upload and the
    modular sum of those it included, from which the exact sum of their dequantised updates is recovered. The server
    reads no upload (a deployment never shows it one; in process only their structure is checked), so stages that
    read single uploads cannot run in such a round. One process (checked when the fit starts)."""

    sum_only = True

    @functools.cached_property
    def suspects(self) -> Suspects:
        """The record of valid and invalid sums, and the clients left out
        (:mod:`lightning_fl.federated.server.suspects`)."""
        return Suspects()

    def keeps_rows(self, strategy: Strategy, stages: list[Stage], fabric: L.Fabric) -> bool:
        return False

    def check(self, fabric: L.Fabric, stages: list[Stage]) -> None:
        """One process, a transport that sums securely, and no stage that reads single uploads."""
        if not self.transport.sums_securely or fabric.world_size > 1:
            raise ConfigError(
                "trainer.secure_aggregation runs in one process or on Flower (SecAgg+), not over several "
                "processes: set trainer.devices 1 and trainer.num_nodes 1, or remove the key"
            )
        if reading := [repr(s) for s in stages if s.needs_rows]:
            raise ConfigError(
                f"trainer.secure_aggregation shows the server no single upload, but {', '.join(reading)} "
                "reads every upload of a round: remove its setting"
            )

    def collect(self, rnd: Round, strategy: Strategy, stages: list[Stage], model: Any, datamodule: Any) -> None:
        self.arrivals.admit(rnd)
        secure, suspects = self.local.secure, self.suspects
        asked = [c for c in rnd.available if c not in suspects.left_out]
        result = self.transport.secure_round(job_of(rnd, self, model), asked)
        if result.problem is None and result.included:  # (Flower's path checked it already)
            result.problem = secure.range_problem(result.total, len(result.included))
            result.invalid = result.problem is not None
        note = suspects.record(result.included, not result.invalid) if result.included else None
        for reply in result.replies:
            entry = entry_of(reply, rnd, stages)
            if reply.lost:
                continue
            entry.up = reply.upload_bytes if reply.upload_bytes is not None else upload_nbytes(reply.payload)
            if reply.failure:
                rnd.reject(entry, [reply.failure])
            elif result.problem is None and entry.client in result.included:
                entry.status = ACCEPTED
        if result.problem is not None:
            warnings.warn(
                f"round {rnd.index + 1}: secure aggregation failed: {result.problem}; the round has no "
                f"aggregate{f'; {note}' if note else ''}",
                stacklevel=3,
            )
        else:
            rnd.folded = list(result.included)
        n = len(rnd.folded)
        total = secure.recover(result.total, n) if n else torch.zeros(len(rnd.current), dtype=torch.float64)
        rnd.total = Total(total, float(n), n, updates=True)
