"""A round's mechanisms as stages (:class:`Stage`; the hooks and when they run: :mod:`.base`), and the one place
that turns a run's settings into the mechanisms its rounds run: :func:`round_stages` (the stages, in order),
:func:`round_arrivals` (how the uploads arrive), :func:`round_collection` (one by one, or as a secure sum),
:func:`round_downlink` (the compressed broadcast) and :func:`record_canaries` (the audit inside DP-SGD's steps).
Nothing else in the package names a mechanism's class."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import lightning as L

from lightning_fl.compress.downlink import Downlink
from lightning_fl.federated.arrivals import Arrivals, Buffered, Timed, WaitForAll, layout_bytes
from lightning_fl.federated.arrivals.sources import Delivered
from lightning_fl.federated.clients.local import LocalTraining
from lightning_fl.federated.server.stages.audit import CentralCanaries, LocalCanaries, RecordCanaryReport
from lightning_fl.federated.server.stages.base import Stage, Step
from lightning_fl.federated.server.stages.privacy import CentralPrivacy, ClientPrivacy, RecordPrivacy
from lightning_fl.federated.server.stages.screening import NormGate, SimulatedAttack, WeightCap
from lightning_fl.federated.server.stages.server import CompressedBroadcast, IdentityCheck
from lightning_fl.federated.server.state import State
from lightning_fl.federated.trainer.arguments import TrainerArguments
from lightning_fl.privacy.audit import RecordCanaries

if TYPE_CHECKING:
    from lightning_fl.federated.server.collect import Uploads

__all__ = [
    "WRITTEN_WITH",
    "CentralCanaries",
    "CentralPrivacy",
    "ClientPrivacy",
    "CompressedBroadcast",
    "IdentityCheck",
    "LocalCanaries",
    "NormGate",
    "RecordCanaryReport",
    "RecordPrivacy",
    "SimulatedAttack",
    "Stage",
    "Step",
    "WeightCap",
    "record_canaries",
    "round_arrivals",
    "round_collection",
    "round_downlink",
    "round_stages",
]


def round_stages(
    settings: TrainerArguments,
    fabric: L.Fabric,
    local: LocalTraining | None = None,
    downlink: Downlink | None = None,
    identity: Callable[[list[State]], float] | None = None,
) -> list[Stage]:
    """The stages of a run with ``settings`` (a trainer's arguments), in the order each hook runs them.

    Uploads are screened (weight cap, attack, norm gate) before central DP clips what they add to the sum, so a
    refused upload spends nothing; the norm gate checks the aggregate before the compressed broadcast sends it, and
    the identity check measures only an accepted aggregate. (The clock is the collection's: :func:`round_arrivals`.)

    Args:
        settings: The trainer's arguments (``strategy``, ``max_client_weight``, ``attack``, ``max_update_norm``,
            ``max_update_norm_ratio``, ``privacy``, ``dp_sgd``).
        fabric: The run's processes.
        local: How clients train (DP-SGD's accounting reads its data plan).
        downlink: The server's compressed broadcast (``trainer.compressed_downloads``); ``None``: full states.
        identity: The module's averaging identity error, to be logged; ``None``: not checked.
    """
    strategy, privacy, dp_sgd, audit = settings.strategy, settings.privacy, settings.dp_sgd, settings.privacy_audit
    secure = settings.secure_aggregation is not None
    stages: list[Stage] = []
    if settings.max_client_weight is not None and strategy.weighted:
        stages.append(WeightCap(settings.max_client_weight))
    if settings.attack is not None:
        stages.append(SimulatedAttack(settings.attack))
    gate = NormGate(strategy, settings.max_update_norm, settings.norm_gate_ratio, note=settings.norm_gate_note)
    stages.append(gate)
    if privacy is not None:  # on the server's sum, or (local DP) accounted only: each client noised its own upload
        stages.append(CentralPrivacy(privacy, fabric, secure) if privacy.central else ClientPrivacy(privacy, secure))
    if audit is not None and privacy is not None:  # (after the privacy stage: it scores its release)
        stages.append((CentralCanaries if privacy.central else LocalCanaries)(audit, privacy, fabric))
    if dp_sgd is not None:
        stages.append(RecordPrivacy(dp_sgd, local))
    if audit is not None and privacy is None and dp_sgd is not None:  # DP-SGD alone: canaries inside its steps
        stages.append(RecordCanaryReport(audit, dp_sgd, dp_sgd.canaries))
    if downlink is not None:
        stages.append(CompressedBroadcast(downlink))
    if identity is not None:
        stages.append(IdentityCheck(identity, fabric))
    return stages


#: What to set to continue a checkpoint that holds a part's state under each key, when this run lacks the part.
WRITTEN_WITH = {
    "privacy": "it was written by a private run (trainer.privacy); set the same trainer.privacy to continue its budget",
    "dp_sgd": "it was written by a run with trainer.dp_sgd (trainer.dp_sgd); set the same trainer.dp_sgd to continue "
    "its clients' budgets",
    "downlink": "it was written with trainer.compressed_downloads (its clients hold the broadcasts' state, the server "
    "a downlink memory); set trainer.compressed_downloads true",
    "buffered": "it was written with trainer.buffered (FedBuff's clients in flight); set the same trainer.buffered",
    "clock": "it was written with trainer.clock.availability (its simulated time); set the same trainer.clock",
}


def round_arrivals(settings: TrainerArguments, local: LocalTraining, target: int | None) -> Arrivals:
    """How the uploads of a run with ``settings`` arrive (:mod:`lightning_fl.federated.arrivals`): FedBuff's buffer
    (``buffered``: fed by the clock in process, by the replies of an asynchronous transport on Flower), rounds timed
    by the clock (``clock``: ``target`` reports close a round under over-selection), or every reply."""
    clock = settings.clock
    if settings.buffered is not None and getattr(settings.transport, "asynchronous", False):
        return Buffered(settings.buffered, None, local, Delivered())  # (its clients' real arrivals: Flower's)
    if settings.buffered is not None and clock is not None:
        return Buffered(settings.buffered, clock, local)
    if clock is not None:
        return Timed(clock, local, layout_bytes(settings.codec), None if clock.over_selection == 0 else target)
    return WaitForAll()


def round_collection(settings: TrainerArguments, local: LocalTraining, arrivals: Arrivals) -> Uploads:
    """How a run's uploads reach the server: only as their sum under ``secure_aggregation``, else each on its own."""
    from lightning_fl.federated.server.collect import Uploads  # (the collections run the stages: imported when built)
    from lightning_fl.federated.server.secure_uploads import SecureUploads

    kind = SecureUploads if local.secure is not None else Uploads
    return kind(settings.transport, settings.codec, local, settings.fold_groups, settings.enable_progress_bar, arrivals)


def round_downlink(settings: TrainerArguments) -> Downlink | None:
    """The server's compressed broadcast (``compressed_downloads``); ``None``: clients download full states."""
    return Downlink(settings.codec) if settings.compressed_downloads else None


def record_canaries(settings: TrainerArguments) -> RecordCanaries | None:
    """The privacy audit's canaries among one client's records, under DP-SGD without user-level DP (``None``:
    none)."""
    audit = settings.privacy_audit
    return RecordCanaries(audit) if audit is not None and settings.privacy is None else None
