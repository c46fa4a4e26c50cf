"""One-shot federated learning: every client uploads once, the server answers with a model or a posterior.

FMP ("Federated Martingale Posterior Sampling") and the baselines of its comparison, several of them not
Bayesian (one-shot FedAvg, local and centralised ERM):

- :mod:`~lightning_fl.oneshot.features`: the frozen features ``h`` every method works on;
- :mod:`~lightning_fl.oneshot.task_data`: federated tasks drawn from them (:class:`FederatedTasks`);
- :mod:`~lightning_fl.oneshot.base` and :mod:`~lightning_fl.oneshot.methods`: the one-shot contract and the
  methods of the paper's table; :mod:`~lightning_fl.oneshot.baselines`: the other baselines;
- :mod:`~lightning_fl.oneshot.meta_learner`: :class:`FMPMetaLearner`, which meta-trains FMP's summariser
  and evaluates every method (run by ``lightning.Trainer``);
- the pieces: ERM refits (:mod:`~lightning_fl.oneshot.erm`), the predictive generator
  (:mod:`~lightning_fl.oneshot.predictive`), summarisers, task samplers and distances.
"""

from lightning_fl.oneshot import baselines
from lightning_fl.oneshot.base import Context, OneShotMethod, Outcome, upload
from lightning_fl.oneshot.distances import energy_distance, wasserstein1
from lightning_fl.oneshot.erm import ERMNotConverged, fit_softmax, predict_proba
from lightning_fl.oneshot.features import ExtractedFeatures, FeatureData, FeatureExtractor, FeatureSet, PixelFeatures
from lightning_fl.oneshot.generator_training import GeneratorTraining, evaluate_generator, train_generator
from lightning_fl.oneshot.meta_learner import FMPMetaLearner
from lightning_fl.oneshot.methods import ANN, CANN, FMP, LANN, LMP, MP
from lightning_fl.oneshot.predictive import PolyaUrn, Predictive, PredictiveGenerator
from lightning_fl.oneshot.summarize import Identity, KMeans, MeanPooling, PMASummariser, RandomSelection, Summariser
from lightning_fl.oneshot.task_data import FederatedTasks
from lightning_fl.oneshot.tasks import Task, TaskSampler

__all__ = [
    "ANN",
    "CANN",
    "FMP",
    "LANN",
    "LMP",
    "MP",
    "Context",
    "ERMNotConverged",
    "ExtractedFeatures",
    "FMPMetaLearner",
    "FeatureData",
    "FeatureExtractor",
    "FeatureSet",
    "FederatedTasks",
    "GeneratorTraining",
    "Identity",
    "KMeans",
    "MeanPooling",
    "OneShotMethod",
    "Outcome",
    "PMASummariser",
    "PixelFeatures",
    "PolyaUrn",
    "Predictive",
    "PredictiveGenerator",
    "RandomSelection",
    "Summariser",
    "Task",
    "TaskSampler",
    "baselines",
    "energy_distance",
    "evaluate_generator",
    "fit_softmax",
    "predict_proba",
    "train_generator",
    "upload",
    "wasserstein1",
]
