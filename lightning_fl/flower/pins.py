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

A refused hello leaves the node's run as it was; a refused train message uploads nothing.
"""

from __future__ import annotations

from typing import Any

KEYS = ("require-secure-aggregation", "require-privacy", "min-noise-multiplier")
PRIVACY = ("LocalDP", "DistributedDP", "DPSGD")


def pins(node_config: dict[str, Any]) -> tuple[bool, str | None, float | None]:
    """The node's pins, checked: (secure aggregation required, client-side mechanism required, minimum ``z``)."""
    secure, privacy, floor = (node_config.get(k) for k in KEYS)
    if secure not in (None, True, False):
        raise ValueError(f"node config require-secure-aggregation must be true or false, got {secure!r}")
    if privacy not in (None, "", *PRIVACY):
        raise ValueError(f"node config require-privacy must be one of {', '.join(PRIVACY)}, got {privacy!r}")
    if floor is not None and (isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor >= 0):
        raise ValueError(f"node config min-noise-multiplier must be a number >= 0, got {floor!r}")
    return bool(secure), privacy or None, None if floor is None else float(floor)


def pin_problem(local: Any, node_config: dict[str, Any], planned_z: float | None = None) -> str | None:
    """Why this node must not serve the run whose client side is ``local`` (``None``: it may). ``planned_z``:
    DP-SGD's noise multiplier for this node's client once planned (until then only a fixed one is checked)."""
    secure, privacy, floor = pins(node_config)
    if secure and local.secure is None:
        return "this node pins require-secure-aggregation, and the run does not set trainer.secure_aggregation"
    stage, dp_sgd = local.upload_stage, local.dp_sgd
    if privacy == "DPSGD" and dp_sgd is None:
        return "this node pins require-privacy DPSGD, and the run does not set trainer.dp_sgd"
    if privacy not in (None, "DPSGD") and type(stage).__name__ != privacy:
        mine = type(stage).__name__ if stage is not None else "none"
        return f"this node pins require-privacy {privacy}, and the run's client-side trainer.privacy is {mine}"
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
