"""A reply's way into a round (:mod:`lightning_fl.federated.round`): decoded and gated into an :class:`Entry`,
its declared weight capped, and a node's own DP-SGD plan passed to its accounting."""

from __future__ import annotations

import warnings

from lightning_fl.compress.base import Codec
from lightning_fl.federated.gate import screen_upload, upload_nbytes
from lightning_fl.federated.stages import Screening
from lightning_fl.federated.state import State
from lightning_fl.federated.strategies import Strategy
from lightning_fl.federated.transport import Reply, SecureRound
from lightning_fl.federated.uploads import ACCEPTED, LOST, REJECTED, Entry, RoundUploads


class Intake:
    """Turns replies into entries with the round's codec, upload policy and ``max_client_weight`` (``cap``)."""

    def __init__(self, codec: Codec, screening: Screening, strategy: Strategy, local, cap: float | None) -> None:
        self.codec, self.screening, self.strategy, self.local, self.cap = codec, screening, strategy, local, cap

    def reply(self, reply: Reply, state: State, r: int) -> tuple[Entry, State | None]:
        """A reply as an :class:`Entry`, and its decoded upload if it passed the gate (decode + checks)."""
        cid = reply.client
        self._plan(reply, r)
        entry = Entry(cid, self.weight(reply, r), REJECTED, logged=reply.logged)
        entry.msg_up = -1 if reply.message_up is None else reply.message_up
        entry.msg_down = -1 if reply.message_down is None else reply.message_down
        if reply.lost:
            entry.status = LOST
            return entry, None
        entry.up = upload_nbytes(reply.payload)
        if reply.failure:
            decoded, problems = None, [reply.failure]
        else:
            decoded, problems = screen_upload(reply.payload, self.codec, state, cid)
        if problems or decoded is None:
            self.screening.reject(r, cid, problems)
            return entry, None
        entry.status = ACCEPTED
        return entry, decoded

    def secure(self, uploads: RoundUploads, result: SecureRound, r: int) -> None:
        """A secure round's replies as entries, and the modular sum of the uploads it included: the server reads
        no upload (a deployment never shows it one; in process only their structure is checked)."""
        for reply in result.replies:
            self._plan(reply, r)
            entry = Entry(reply.client, float(reply.num_samples), REJECTED, logged=reply.logged)
            entry.msg_up = -1 if reply.message_up is None else reply.message_up
            entry.msg_down = -1 if reply.message_down is None else reply.message_down
            uploads.entries[entry.client] = entry
            if reply.lost:
                entry.status = LOST
                continue
            entry.up = reply.upload_bytes if reply.upload_bytes is not None else upload_nbytes(reply.payload)
            if reply.failure:
                self.screening.reject(r, entry.client, [reply.failure])
            elif result.problem is None and entry.client in result.included:
                entry.status = ACCEPTED
        if result.problem is not None:
            warnings.warn(f"round {r + 1}: secure aggregation failed: {result.problem}; the round has no aggregate",
                          stacklevel=3)  # fmt: skip
            return
        uploads.secure_total = result.total
        uploads.folded = list(result.included)

    def weight(self, reply: Reply, r: int) -> float:
        """A reply's sample count, capped at ``max_client_weight`` (warned) when a weighted strategy would use it."""
        weight, cap = float(reply.num_samples), self.cap
        if cap is not None and weight > cap and getattr(self.strategy, "weighted", False) and not reply.lost:
            warnings.warn(f"round {r + 1}, client {reply.client}: declared {reply.num_samples} samples; its weight "
                          f"is capped at trainer.max_client_weight={cap:g}", stacklevel=3)  # fmt: skip
            weight = float(cap)
        return weight

    def _plan(self, reply: Reply, r: int) -> None:
        """A node's own DP-SGD record count and batch size, for its client's accounting (warned about if unusable:
        the client's epsilon then comes from the server's data module)."""
        dp = getattr(self.local, "dp_sgd", None)
        if dp is None or reply.dp_sgd_plan is None:
            return
        problem = dp.report_plan(reply.client, *reply.dp_sgd_plan, self.local)
        if problem is not None:
            warnings.warn(f"round {r + 1}, client {reply.client}: {problem}; its record-level epsilon is accounted "
                          "with the server's data module", stacklevel=3)  # fmt: skip
