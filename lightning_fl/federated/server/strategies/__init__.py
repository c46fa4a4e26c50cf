"""Server strategies: one algorithm per file, each citing its paper; select one with ``--trainer.strategy``."""

from lightning_fl.federated.server.strategies.base import GroupedSums, RunningSum, Strategy, mean_of_uploads
from lightning_fl.federated.server.strategies.fedadagrad import FedAdagrad
from lightning_fl.federated.server.strategies.fedadam import FedAdam
from lightning_fl.federated.server.strategies.fedavg import FedAvg
from lightning_fl.federated.server.strategies.fedavgm import FedAvgM
from lightning_fl.federated.server.strategies.fedopt import FedOpt
from lightning_fl.federated.server.strategies.fedyogi import FedYogi
from lightning_fl.federated.server.strategies.krum import Krum, krum_scores
from lightning_fl.federated.server.strategies.median import Median, coordinate_median
from lightning_fl.federated.server.strategies.trimmed_mean import TrimmedMean

__all__ = [
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedOpt",
    "FedYogi",
    "GroupedSums",
    "Krum",
    "Median",
    "RunningSum",
    "Strategy",
    "TrimmedMean",
    "coordinate_median",
    "krum_scores",
    "mean_of_uploads",
]
