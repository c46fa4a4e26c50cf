"""What a node pins in its own ``--node-config``, so that no message from a server can switch it off.

A node builds the run it trains from the config the server sends in its hello (:mod:`lightning_fl.flower.node`):
by default, the server decides whether uploads go through secure aggregation and which noise a client adds. A
node that must not depend on that pins it:

- ``require-secure-aggregation = true``: the node serves only runs that set ``trainer.secure_aggregation``, and
  (as every such run) uploads only through SecAgg+; a hello or a train message for any other run is refused.
- ``require-privacy = "LocalDP"`` (or ``"DistributedDP"``, ``"DPSGD"``): the node serves only runs whose
  ``trainer.privacy`` is that client-side mechanism (``DPSGD``: whose ``trainer.dp_sgd`` is set).
- ``min-noise-multiplier = 1.0``: and only with at least this noise multiplier: LocalDP's, DistributedDP's (the
  central ``z`` its shares add up to), DP-SGD's (for this node's client, as planned; a calibrated one is checked
  after training, before anything is sent).
- ``max-cohort = 16``: the most clients a round of this federation may have; DistributedDP's noise share is then
  never smaller than ``z S / sqrt(16)``, and a run that plans more clients a round is refused.

DistributedDP's share, ``z S / sqrt(m)``, depends on the round's cohort ``m``, which the server's messages state
(the federation's size and the config's clients per round). A node never takes it from them alone: its share is
for ``min(m, the nodes it sees in the round's SecAgg+ key sharing, max-cohort)``
(:func:`noise_cohort`), so a server that announces a larger federation gets the share of the cohort the node
checked, never less noise. A node that pins its noise (``require-privacy DistributedDP`` or
``min-noise-multiplier``) serves a DistributedDP run only where it can check the cohort: under secure aggregation,
or with ``max-cohort``.

A refused hello leaves the node's run as it was; a refused train message uploads nothing.
"""

from __future__ import annotations

from typing import Any

from lightning_fl.privacy import DistributedDP, LocalDP

KEYS = ("require-secure-aggregation", "require-privacy", "min-noise-multiplier", "max-cohort")
PRIVACY = ("LocalDP", "DistributedDP", "DPSGD")
#: The client-side mechanism each ``require-privacy`` value pins (DP-SGD's is ``trainer.dp_sgd``, checked apart).
PINNED = {"LocalDP": LocalDP, "DistributedDP": DistributedDP}


def pins(node_config: dict[str, Any]) -> tuple[bool, str | None, float | None, int | None]:
    """The node's pins, checked: (secure aggregation required, client-side mechanism required, minimum ``z``,
    largest cohort)."""
    secure, privacy, floor, cohort = (node_config.get(k) for k in KEYS)
    if secure not in (None, True, False):
        raise ValueError(f"node config require-secure-aggregation must be true or false, got {secure!r}")
    if privacy not in (None, "", *PRIVACY):
        raise ValueError(f"node config require-privacy must be one of {', '.join(PRIVACY)}, got {privacy!r}")
    if floor is not None and (isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor >= 0):
        raise ValueError(f"node config min-noise-multiplier must be a number >= 0, got {floor!r}")
    if cohort is not None and (isinstance(cohort, bool) or not isinstance(cohort, int) or cohort < 1):
        raise ValueError(f"node config max-cohort must be an integer >= 1 (the most clients a round), got {cohort!r}")
    return bool(secure), privacy or None, None if floor is None else float(floor), cohort


def noise_cohort(local: Any, node_config: dict[str, Any], seen: int | None = None) -> float | None:
    """The cohort ``m`` this node draws a DistributedDP noise share for: the run's planned clients a round, but
    never more than the ``seen`` nodes of the round's SecAgg+ key sharing (``None``: not a SecAgg+ round) or its
    pinned ``max-cohort``. ``None`` when the run's client side draws no share for a cohort."""
    stage = local.upload_stage
    if stage is None or not getattr(stage, "central", False) or getattr(stage, "plan", None) is None:
        return None
    largest = pins(node_config)[3]
    return min(float(stage.plan.expected_clients), *(float(n) for n in (seen, largest) if n is not None))


def pin_problem(local: Any, node_config: dict[str, Any], planned_z: float | None = None) -> str | None:
    """Why this node must not serve the run whose client side is ``local`` (``None``: it may). ``planned_z``:
    DP-SGD's noise multiplier for this node's client once planned (until then only a fixed one is checked)."""
    secure, privacy, floor, largest = pins(node_config)
    if secure and local.secure is None:
        return "this node pins require-secure-aggregation, and the run does not set trainer.secure_aggregation"
    stage, dp_sgd = local.upload_stage, local.dp_sgd
    if privacy == "DPSGD" and dp_sgd is None:
        return "this node pins require-privacy DPSGD, and the run does not set trainer.dp_sgd"
    if privacy not in (None, "DPSGD") and not isinstance(stage, PINNED[privacy]):  # (a subclass keeps its pin)
        mine = type(stage).__name__ if stage is not None else "none"
        return f"this node pins require-privacy {privacy}, and the run's client-side trainer.privacy is {mine}"
    shared = stage is not None and getattr(stage, "central", False)  # a share of a noise the cohort adds up
    if shared and largest is None and local.secure is None and (privacy is not None or floor is not None):
        pinned = f"require-privacy {privacy}" if privacy is not None else f"min-noise-multiplier {floor:g}"
        return (
            f"this node pins {pinned}, and its {type(stage).__name__} share is for the round's cohort, which a node "
            "sees only in secure aggregation: pin max-cohort (the most clients a round) or require-secure-aggregation"
        )
    plan = getattr(stage, "plan", None) if shared else None
    if largest is not None and plan is not None and plan.expected_clients > largest:
        return (
            f"this node pins max-cohort {largest}, and the run plans {int(plan.expected_clients):,} clients a round "
            f"(of a federation of {plan.num_clients:,})"
        )
    if floor is None:
        return None
    noises = {}
    if stage is not None:
        noises["trainer.privacy"] = getattr(stage, "z", None)
    if dp_sgd is not None:
        noises["trainer.dp_sgd"] = planned_z if planned_z is not None else dp_sgd.z
    if not noises:
        return f"this node pins min-noise-multiplier {floor:g}, and the run adds no noise on the client"
    for key, z in noises.items():
        if z is not None and float(z) < floor:
            return f"this node pins min-noise-multiplier {floor:g}, and the run's {key} noise multiplier is {z:.4g}"
    return None
