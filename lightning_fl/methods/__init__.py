"""Methods: LightningModules that train under ``lightning.Trainer`` and, per round, under federated trainers."""

from lightning_fl.methods.classifier import CLASSIFIER_RECIPE, Classifier, TrainingDivergedError, load_state_dict_file
from lightning_fl.methods.fed_sb import FedSBLanguageModel
from lightning_fl.methods.fedprox import FedProx
from lightning_fl.methods.language import LM_PRETRAINING, LM_RECIPE, LanguageModel, LatentLanguageModel
from lightning_fl.methods.latent import LATENT_RECIPE, LatentClassifier
from lightning_fl.methods.lora import LORA_RECIPE, LoRAClassifier, LoRALanguageModel
from lightning_fl.methods.pretraining import Pretraining
from lightning_fl.methods.schedules import Recipe, warmup_cosine_factor

__all__ = [
    "CLASSIFIER_RECIPE",
    "LATENT_RECIPE",
    "LM_PRETRAINING",
    "LM_RECIPE",
    "LORA_RECIPE",
    "Classifier",
    "FedProx",
    "FedSBLanguageModel",
    "LanguageModel",
    "LatentClassifier",
    "LatentLanguageModel",
    "LoRAClassifier",
    "LoRALanguageModel",
    "Pretraining",
    "Recipe",
    "TrainingDivergedError",
    "load_state_dict_file",
    "warmup_cosine_factor",
]
