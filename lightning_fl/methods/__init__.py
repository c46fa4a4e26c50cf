"""Methods: LightningModules that train under ``lightning.Trainer`` and, per round, under federated trainers."""

from lightning_fl.methods.classifier import Classifier, TrainingDivergedError, load_state_dict_file
from lightning_fl.methods.fedprox import FedProx
from lightning_fl.methods.language import LM_PRETRAINING, LanguageModel, LatentLanguageModel
from lightning_fl.methods.latent import LatentClassifier
from lightning_fl.methods.lora import LoRAClassifier, LoRALanguageModel
from lightning_fl.methods.pretraining import Pretraining
from lightning_fl.methods.schedules import warmup_cosine_factor

__all__ = [
    "LM_PRETRAINING",
    "Classifier",
    "FedProx",
    "LanguageModel",
    "LatentClassifier",
    "LatentLanguageModel",
    "LoRAClassifier",
    "LoRALanguageModel",
    "Pretraining",
    "TrainingDivergedError",
    "load_state_dict_file",
    "warmup_cosine_factor",
]
