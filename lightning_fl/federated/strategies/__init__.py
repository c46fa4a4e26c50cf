"""Server strategies: one algorithm per file, each citing its paper; select one with ``--trainer.strategy``."""

from lightning_fl.federated.strategies.base import GroupedSums, RunningSum, Strategy, mean_of_uploads
from lightning_fl.federated.strategies.fedadagrad import FedAdagrad
from lightning_fl.federated.strategies.fedadam import FedAdam
from lightning_fl.federated.strategies.fedavg import FedAvg
from lightning_fl.federated.strategies.fedavgm import FedAvgM
from lightning_fl.federated.strategies.fedopt import FedOpt
from lightning_fl.federated.strategies.fedyogi import FedYogi
from lightning_fl.federated.strategies.krum import Krum, krum_scores
from lightning_fl.federated.strategies.median import Median, coordinate_median
from lightning_fl.federated.strategies.trimmed_mean import TrimmedMean

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
