"""lightning_fl: communication-efficient (FLITE) and Bayesian (FMP) federated learning on Lightning.

Importing the package is cheap: its names (``lightning_fl.FederatedTrainer``, ``lightning_fl.methods``, ...) are
imported when first used, so a process that needs none of torch (the Flower proxy ClientApp, the CLI answering a
config typo) never pays for it. :func:`load_plugins` imports every plug-in so the CLI can resolve short class
names (``--model Classifier``, ``--model FMPMetaLearner``, ``--data.source FashionMNIST``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# the plug-in packages: every class the CLI can name lives under one of them
PLUGINS = ("compress", "data", "mapping", "methods", "models", "oneshot", "privacy")

_NAMES = {  # public name -> the module that defines it
    "CheckpointError": "lightning_fl.errors",
    "ConfigError": "lightning_fl.errors",
    "DatasetNotFoundError": "lightning_fl.errors",
    "UserError": "lightning_fl.errors",
    "FederatedDataModule": "lightning_fl.data",
    "FederatedTrainer": "lightning_fl.federated",
    "Classifier": "lightning_fl.methods",
    "LanguageModel": "lightning_fl.methods",
    "LatentClassifier": "lightning_fl.methods",
    "LatentLanguageModel": "lightning_fl.methods",
    "LoRAClassifier": "lightning_fl.methods",
    "LoRALanguageModel": "lightning_fl.methods",
    "Recipe": "lightning_fl.methods",
    "set_threads": "lightning_fl.threads",
    "TrainerLike": "lightning_fl.trainer_api",
}

__all__ = sorted([*_NAMES, *PLUGINS, "__version__", "load_plugins"])


def load_plugins() -> None:
    """Import every plug-in package (what the CLI needs before it resolves a class name)."""
    for name in PLUGINS:
        importlib.import_module(f"lightning_fl.{name}")


def __getattr__(name: str) -> Any:
    if name in PLUGINS:
        return importlib.import_module(f"lightning_fl.{name}")
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_fl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
