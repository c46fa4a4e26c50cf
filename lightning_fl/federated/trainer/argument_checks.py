"""The checks of :class:`~lightning_fl.federated.trainer.arguments.TrainerArguments`: every impossible value or
combination of the trainer's arguments, one line each naming the key and what to write instead, and what
``max_update_norm_ratio: auto`` resolves to."""

from __future__ import annotations

import math
from typing import Any

from lightning_fl.compress.error_feedback import UpdateCompressor
from lightning_fl.federated.arrivals.clock import Clock
from lightning_fl.federated.arrivals.fedbuff import FedBuff, buffered_problems
from lightning_fl.federated.clients.transport import Transport
from lightning_fl.federated.persistence.budget import ledger_problems
from lightning_fl.federated.server.strategies import Strategy
from lightning_fl.federated.server.strategies.base import configured_name
from lightning_fl.privacy.audit import PrivacyAudit
from lightning_fl.privacy.base import Privacy
from lightning_fl.privacy.dpsgd import DPSGD
from lightning_fl.privacy.secure import SecureAggregation

#: What ``trainer.max_update_norm_ratio: auto`` is when no mechanism clips every upload.
DEFAULT_NORM_RATIO = 10.0
#: Why the summary says the default gate is off.
NOTE_TAIL = "the clip bound bounds every upload instead"


def clipping_mechanism(a: dict[str, Any]) -> str | None:
    """The key whose mechanism clips every upload to a public bound (``trainer.privacy`` CentralDP or DistributedDP,
    ``trainer.secure_aggregation``), which turns ``max_update_norm_ratio: auto`` off; ``None``: there is none."""
    if isinstance(a["privacy"], Privacy) and a["privacy"].central:
        return f"trainer.privacy {type(a['privacy']).__name__}"
    if a["secure_aggregation"] is not None:
        return "trainer.secure_aggregation"
    return None


def norm_gate_ratio(a: dict[str, Any]) -> float | None:
    """The relative bound the gate applies for the trainer's arguments ``a``: ``max_update_norm_ratio``, with ``auto``
    :data:`DEFAULT_NORM_RATIO`, or ``None`` (off) under a :func:`clipping_mechanism`."""
    value = a["max_update_norm_ratio"]
    if value != "auto":
        return value
    return None if clipping_mechanism(a) is not None else DEFAULT_NORM_RATIO


def norm_gate_note(a: dict[str, Any]) -> str | None:
    """The summary's line when ``max_update_norm_ratio: auto`` is off (``None``: it is not)."""
    if a["max_update_norm_ratio"] != "auto" or (mechanism := clipping_mechanism(a)) is None:
        return None
    return f"relative norm gate off (trainer.max_update_norm_ratio auto under {mechanism}): {NOTE_TAIL}"


def _devices_problems(devices: Any, accelerator: str, num_nodes: int) -> list[str]:
    d = str(devices).replace(" ", "")
    gpu_list = "," in d and d.strip(",") != "" and all(i.isdigit() for i in d.split(",") if i)
    if not (d in ("auto", "-1") or (d.isdigit() and int(d) >= 1) or gpu_list):
        return [
            f"trainer.devices must be a number of processes >= 1, -1 (all GPUs), 'auto' or GPU indices such as "
            f"'0,1', got {devices!r}"
        ]
    if accelerator == "cpu" and (d == "-1" or gpu_list):
        return [f"trainer.devices {devices!r} selects GPUs but trainer.accelerator is cpu: give a number of processes"]
    if num_nodes > 1 and d in ("auto", "-1"):
        return [
            f"trainer.devices must be a number of processes per node when trainer.num_nodes > 1 (every node must "
            f"start the same number), got {devices!r}"
        ]
    return []


def trainer_problems(a: dict[str, Any]) -> list[str]:
    """What is wrong with the trainer's arguments ``a`` (the fields of
    :class:`~lightning_fl.federated.trainer.arguments.TrainerArguments` by name)."""
    ranges = {  # key: (holds, what it must be)
        "rounds": (a["rounds"] >= 1, ">= 1"),
        "clients_per_round": (a["clients_per_round"] is None or a["clients_per_round"] >= 1, ">= 1 or null"),
        "local_epochs": (a["local_epochs"] >= 1, ">= 1"),
        "local_steps": (a["local_steps"] is None or a["local_steps"] >= 1, ">= 1 or null"),
        "upload_policy": (a["upload_policy"] in ("drop", "raise"), "'drop' or 'raise'"),
        "dropout": (0 <= a["dropout"] < 1, "in [0, 1)"),
        "num_nodes": (a["num_nodes"] >= 1, ">= 1"),
        "resume": (a["resume"] in (True, False, "auto"), "true, false or 'auto'"),
        "val_every_n_rounds": (a["val_every_n_rounds"] >= 1, ">= 1"),
        "save_every_n_rounds": (a["save_every_n_rounds"] >= 0, ">= 0"),
        "client_batching": (
            a["client_batching"] in ("sequential", "vmap", "lockstep"),
            "'sequential', 'vmap' or 'lockstep'",
        ),
        "cohort_size": (a["cohort_size"] >= 1, ">= 1"),
        "client_state_memory_mb": (
            a["client_state_memory_mb"] is None
            or (math.isfinite(a["client_state_memory_mb"]) and a["client_state_memory_mb"] >= 0),
            ">= 0 or null",
        ),
        "sampling": (a["sampling"] in ("fixed", "poisson"), "'fixed' or 'poisson'"),
        "fold_groups": (isinstance(a["fold_groups"], int) and a["fold_groups"] >= 1, "a whole number >= 1"),
        "threads": (
            a["threads"] is None
            or (isinstance(a["threads"], int) and not isinstance(a["threads"], bool) and a["threads"] >= 1),
            "a whole number >= 1 or null",
        ),
    }
    for key in ("max_update_norm", "max_update_norm_ratio", "max_client_weight"):
        value, auto = a[key], key == "max_update_norm_ratio"
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        ok = value is None or number or (auto and value == "auto")
        ranges[key] = (ok, "a positive number, 'auto' or null" if auto else "a positive number or null")
    kinds = {  # key: (class, its names in the message)
        "strategy": (Strategy, "a Strategy"),
        "privacy": (Privacy, "CentralDP, DistributedDP, LocalDP or null"),
        "privacy_audit": (PrivacyAudit, "PrivacyAudit or null"),
        "dp_sgd": (DPSGD, "DPSGD or null"),
        "secure_aggregation": (SecureAggregation, "SecureAggregation or null"),
        "transport": (Transport, "a Transport or null"),
        "clock": (Clock, "Clock or null"),
        "buffered": (FedBuff, "FedBuff or null"),
    }
    quoted = {"upload_policy", "resume", "client_batching", "sampling", "fold_groups", "threads"}
    shown = {key: repr(a[key]) if key in quoted else str(a[key]) for key in ranges}
    problems = [f"trainer.{key} must be {what}, got {shown[key]}" for key, (ok, what) in ranges.items() if not ok]
    problems += [
        f"trainer.{key} must be {names}, got {type(a[key]).__name__}"
        for key, (kind, names) in kinds.items()
        if not isinstance(a[key], kind) and (key == "strategy" or a[key] is not None)
    ]
    fraction, per_round = a["client_fraction"], a["clients_per_round"]
    if not (0 < fraction <= 1 if fraction is not None else per_round is not None):
        problems.insert(
            0, f"trainer.client_fraction must be in (0, 1] (or null with trainer.clients_per_round set), got {fraction}"
        )
    problems += _devices_problems(a["devices"], a["accelerator"], a["num_nodes"])
    if isinstance(a["privacy"], Privacy) and a["privacy"].central and a["upload_policy"] == "raise":
        problems.append(
            f"trainer.upload_policy 'raise' with trainer.privacy {type(a['privacy']).__name__}: one "
            "client's upload (its data) would decide whether the whole run stops, which the guarantee "
            "does not cover; use trainer.upload_policy drop"
        )
    if a["unprotected_statistics"] is True and a["privacy"] is None and a["dp_sgd"] is None:
        problems.append(
            "trainer.unprotected_statistics labels the statistics a private run keeps out of its logs, and this run "
            "has no trainer.privacy or trainer.dp_sgd (it logs them as they are): remove the key"
        )
    problems += ledger_problems(a)
    if a["unprotected_statistics"] not in (True, False):
        problems.append(f"trainer.unprotected_statistics must be true or false, got {a['unprotected_statistics']!r}")
    if a["privacy_audit"] is not None and a["privacy"] is None and a["dp_sgd"] is None:
        problems.append(
            "trainer.privacy_audit audits trainer.privacy or trainer.dp_sgd: set one, or remove trainer.privacy_audit"
        )
    if a["privacy_audit"] is not None and a["privacy"] is None and a["client_batching"] != "sequential":
        problems.append(
            "trainer.privacy_audit of DP-SGD scores each step of one client trained alone: set "
            "trainer.client_batching sequential"
        )
    private = a["dp_sgd"] is not None or (isinstance(a["privacy"], Privacy) and a["privacy"].client_stage)
    if private and getattr(a["strategy"], "weighted", False):
        problems.append(
            "trainer.strategy weighted: true weighs uploads by their clients' sample counts, which a "
            "client under local DP, distributed DP or DP-SGD does not send (they are its data); set "
            "weighted: false"
        )
    if a["dp_sgd"] is not None and a["gradient_clip_val"] is not None:
        problems.append(
            "trainer.gradient_clip_val clips a batch's gradient, which DP-SGD replaces by clipping each "
            "record's (trainer.dp_sgd.max_grad_norm): remove trainer.gradient_clip_val"
        )
    if a["dp_sgd"] is not None and a["precision"] not in (None, "32-true", "32", 32):
        problems.append(
            f"trainer.dp_sgd trains in 32-bit; trainer.precision is {a['precision']!r}: set it to 32-true or null"
        )
    if isinstance(secure := a["secure_aggregation"], SecureAggregation):
        problems += secure.problems(a["strategy"], a["privacy"], a["codec"], norm_gate_ratio(a), a["attack"])
    problems += downlink_problems(a["compressed_downloads"], a["codec"], secure) + clock_problems(a)
    return problems + (buffered_problems(a) if isinstance(a["buffered"], FedBuff) else [])


def clock_problems(a: dict[str, Any]) -> list[str]:
    """What makes ``trainer.clock`` impossible with the other settings (one line each)."""
    clock = a["clock"]
    if not isinstance(clock, Clock):
        return []
    if a["transport"] is not None and a["buffered"] is None:  # (FedBuff's own line says it)
        return [
            "trainer.clock simulates the time of rounds run in process; a Flower run's rounds take real time "
            "(time/round_s): remove trainer.clock"
        ]
    if clock.availability is not None and (a["privacy"] is not None or a["dp_sgd"] is not None):
        key = "privacy" if a["privacy"] is not None else "dp_sgd"
        return [
            f"trainer.clock.availability samples only the clients available when a round starts, and trainer.{key}'s "
            "accountant assumes every client can be sampled in every round: remove trainer.clock.availability or "
            f"trainer.{key}"
        ]
    if clock.over_selection > 0 and a["privacy"] is not None:
        return [
            f"trainer.clock.over_selection {clock.over_selection} samples more clients than trainer.privacy's "
            "accountant and fixed denominator assume (clients_per_round): set over_selection 0 (a deadline alone "
            "is covered: a late client adds zero)"
        ]
    return []


def downlink_problems(compressed_downloads: object, codec: object, secure_aggregation: object) -> list[str]:
    """What makes ``trainer.compressed_downloads`` impossible with the other settings (one line each)."""
    if compressed_downloads is False:
        return []
    if compressed_downloads is not True:
        return [f"trainer.compressed_downloads must be true or false, got {compressed_downloads!r}"]
    if secure_aggregation is not None:
        return [
            "trainer.compressed_downloads compresses the broadcast with the codec's compressor, but "
            "trainer.secure_aggregation uploads with none (codec FP32): remove one of the two keys"
        ]
    if not isinstance(codec, UpdateCompressor):
        return [
            f"trainer.compressed_downloads compresses the broadcast with the codec's compressor and error "
            f"feedback, and trainer.codec {configured_name(codec)} is not a compressor: set trainer.codec TopK "
            "or PowerSGD, or remove the key"
        ]
    return []
