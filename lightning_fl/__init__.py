"""lightning_fl: communication-efficient (FLITE) and Bayesian (FMP) federated learning on Lightning.

Importing the package imports every plug-in so the CLI can resolve short class names
(``--model Classifier``, ``--model FMPMetaLearner``, ``--data.source FashionMNIST``).
"""

__version__ = "0.1.0"

from lightning_fl import compress, data, mapping, methods, models, oneshot, privacy
from lightning_fl.data import FederatedDataModule
from lightning_fl.errors import CheckpointError, ConfigError, DatasetNotFoundError, UserError
from lightning_fl.federated import FederatedTrainer
from lightning_fl.methods import Classifier, LanguageModel, LatentClassifier, LatentLanguageModel
from lightning_fl.threads import set_threads
from lightning_fl.trainer_api import TrainerLike

__all__ = [
    "CheckpointError",
    "Classifier",
    "ConfigError",
    "DatasetNotFoundError",
    "FederatedDataModule",
    "FederatedTrainer",
    "LanguageModel",
    "LatentClassifier",
    "LatentLanguageModel",
    "TrainerLike",
    "UserError",
    "__version__",
    "compress",
    "data",
    "mapping",
    "methods",
    "models",
    "oneshot",
    "privacy",
    "set_threads",
]
