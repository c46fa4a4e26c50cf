"""Federated training: the Fabric-based trainer, the byte ledger, aggregation and the upload gate."""

from lightning_fl.federated.aggregate import UploadRejectedError, check_upload, weighted_mean
from lightning_fl.federated.ledger import ByteLedger
from lightning_fl.federated.trainer import FactorMismatchError, FederatedTrainer

__all__ = [
    "ByteLedger",
    "FactorMismatchError",
    "FederatedTrainer",
    "UploadRejectedError",
    "check_upload",
    "weighted_mean",
]
