"""Bayesian federated learning: martingale posteriors and FMP (federated martingale posterior sampling)."""

from lightning_fl.bayes.datamodule import FederatedTasks
from lightning_fl.bayes.distances import energy_distance, wasserstein1
from lightning_fl.bayes.erm import ERMNotConverged, fit_softmax, predict_proba
from lightning_fl.bayes.fmp import FMPMetaLearner
from lightning_fl.bayes.generator_training import GeneratorTraining, evaluate_generator, train_generator
from lightning_fl.bayes.predictive import PredictiveGenerator
from lightning_fl.bayes.protocol import ANN, CANN, FMP, LANN, LMP, MP, Context, OneShotMethod, Outcome
from lightning_fl.bayes.summarize import Identity, MeanPooling, PMASummariser, RandomSelection, Summariser
from lightning_fl.bayes.tasks import Task, TaskSampler

__all__ = [
    "ANN",
    "CANN",
    "FMP",
    "LANN",
    "LMP",
    "MP",
    "Context",
    "ERMNotConverged",
    "FMPMetaLearner",
    "FederatedTasks",
    "GeneratorTraining",
    "Identity",
    "MeanPooling",
    "OneShotMethod",
    "Outcome",
    "PMASummariser",
    "PredictiveGenerator",
    "RandomSelection",
    "Summariser",
    "Task",
    "TaskSampler",
    "energy_distance",
    "evaluate_generator",
    "fit_softmax",
    "predict_proba",
    "train_generator",
    "wasserstein1",
]
