"""Federated training: the round loop, the client runner, server strategies, the upload gate and the ledger.

The contracts: a method is a :class:`FederatedModule`; a client's round is :func:`run_client`; the server's
algorithm is a :class:`~lightning_fl.federated.strategies.Strategy`; :class:`FederatedTrainer` sequences rounds.
"""

from lightning_fl.federated import attacks, strategies
from lightning_fl.federated.attacks import ALIE, Attack, GaussianNoise, NaNUpload, Scaling, SignFlip
from lightning_fl.federated.buffered import FedBuff
from lightning_fl.federated.client import run_client
from lightning_fl.federated.clock import Clock
from lightning_fl.federated.gate import UploadRejectedError, check_upload
from lightning_fl.federated.ledger import ByteLedger
from lightning_fl.federated.local import ClientJob, ClientResult, LocalTraining
from lightning_fl.federated.loop import FederatedTrainer
from lightning_fl.federated.module import FederatedModule, ModuleHooks
from lightning_fl.federated.setup import FactorMismatchError
from lightning_fl.federated.strategies import (
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

__all__ = [
    "ALIE",
    "Attack",
    "ByteLedger",
    "ClientJob",
    "ClientResult",
    "Clock",
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
