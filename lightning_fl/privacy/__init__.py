"""Differential privacy for federated rounds: user-level central DP (with adaptive clipping), local DP and the
accountant (Google's ``dp-accounting``) that says what a run has spent (``--trainer.privacy``); record-level DP-SGD
inside clients (``--trainer.dp_sgd``)."""

from lightning_fl.privacy.accountant import (
    Accountant,
    RoundEvent,
    gaussian_epsilon_closed_form,
    update_noise_multiplier,
)
from lightning_fl.privacy.audit import PrivacyAudit
from lightning_fl.privacy.base import Plan, Privacy, clip
from lightning_fl.privacy.central import AdaptiveClipping, CentralDP
from lightning_fl.privacy.distributed import DistributedDP
from lightning_fl.privacy.dpsgd import DPSGD
from lightning_fl.privacy.local import LocalDP

__all__ = [
    "DPSGD",
    "Accountant",
    "AdaptiveClipping",
    "CentralDP",
    "DistributedDP",
    "LocalDP",
    "Plan",
    "Privacy",
    "PrivacyAudit",
    "RoundEvent",
    "clip",
    "gaussian_epsilon_closed_form",
    "update_noise_multiplier",
]
