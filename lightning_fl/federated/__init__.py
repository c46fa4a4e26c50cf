"""Federated training: the round loop, the client runner, server strategies, the upload gate and the ledger.

The contracts: a method is a :class:`FederatedModule`; a client's round is :func:`run_client`; the server's
algorithm is a :class:`~lightning_fl.federated.server.strategies.Strategy`; :class:`FederatedTrainer` sequences rounds.
"""

from lightning_fl.federated.arrivals.availability import Availability, AvailabilityTrace, Diurnal, OnOff
from lightning_fl.federated.arrivals.clock import Clock
from lightning_fl.federated.arrivals.fedbuff import FedBuff
from lightning_fl.federated.clients.client import run_client
from lightning_fl.federated.clients.local import ClientJob, ClientResult, LocalTraining
from lightning_fl.federated.persistence.ledger import ByteLedger
from lightning_fl.federated.server import attacks, strategies
from lightning_fl.federated.server.attacks import ALIE, Attack, GaussianNoise, NaNUpload, Scaling, SignFlip
from lightning_fl.federated.server.gate import UploadRejectedError, check_upload
from lightning_fl.federated.server.strategies import (
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedYogi,
    Krum,
    Median,
    Strategy,
    TrimmedMean,
)
from lightning_fl.federated.trainer.loop import FederatedTrainer
from lightning_fl.federated.trainer.module import FederatedModule, ModuleHooks
from lightning_fl.federated.trainer.setup import FactorMismatchError

__all__ = [
    "ALIE",
    "Attack",
    "Availability",
    "AvailabilityTrace",
    "ByteLedger",
    "ClientJob",
    "ClientResult",
    "Clock",
    "Diurnal",
    "FactorMismatchError",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedBuff",
    "FedYogi",
    "FederatedModule",
    "FederatedTrainer",
    "GaussianNoise",
    "Krum",
    "LocalTraining",
    "Median",
    "ModuleHooks",
    "NaNUpload",
    "OnOff",
    "Scaling",
    "SignFlip",
    "Strategy",
    "TrimmedMean",
    "UploadRejectedError",
    "attacks",
    "check_upload",
    "run_client",
    "strategies",
]
