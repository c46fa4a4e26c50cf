"""Which DP-SGD engine serves a module (:mod:`lightning_fl.federated.clients.dp_client`): Opacus' hooks where it wraps
every trainable layer, ``torch.func`` otherwise; BatchNorm refused by both (its batch statistics mix records)."""

from __future__ import annotations

import torch

from lightning_fl.errors import ConfigError
from lightning_fl.privacy.dpsgd import DPSGD


def batchnorm_problem(module: torch.nn.Module) -> str | None:
    """Why ``module`` cannot train under DP-SGD because of batch normalisation (``None``: it can)."""
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            return (
                f"trainer.dp_sgd cannot train {type(module).__name__}: its layer {name or '(root)'} is "
                f"{type(m).__name__}, whose batch statistics mix records (and whose running statistics are not "
                "protected); use a GroupNorm model (e.g. lightning_fl.models.SmallCNN or ResNetGN)"
            )
    return None


def opacus_problem(module: torch.nn.Module) -> str | None:
    """Why Opacus' ``GradSampleModule`` cannot compute ``module``'s per-record gradients (``None``: it can)."""
    from opacus import GradSampleModule

    for name, m in module.named_modules():
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if own and type(m) not in GradSampleModule.GRAD_SAMPLERS:
            return f"its layer {name or '(root)'} ({type(m).__name__}) has trainable parameters Opacus has no rule for"
        if own and any(True for _ in m.buffers(recurse=False)):
            return f"its trainable layer {name or '(root)'} ({type(m).__name__}) keeps buffers"
    return None


def functorch_problem(module: torch.nn.Module) -> str | None:
    """Why the ``functorch`` engine cannot train ``module`` (``None``: it can)."""
    from lightning_fl.methods.recipe import TrainingRecipe

    if not isinstance(module, TrainingRecipe) or type(module).training_step is not TrainingRecipe.training_step:
        return (
            f"{type(module).__name__} is not a TrainingRecipe with the recipe's own training_step (forward, "
            "then compute_loss on one record)"
        )
    return None


def choose_engine(module: torch.nn.Module, dp: DPSGD) -> str:
    """The engine that computes ``module``'s per-record gradients: ``dp.engine``, or for ``auto`` Opacus when it
    can wrap every trainable layer, else ``functorch``; a one-line error when the chosen one cannot."""
    try:
        import opacus  # noqa: F401  (either engine steps through its DPOptimizer)
    except ImportError as err:
        raise ConfigError("trainer.dp_sgd needs Opacus: pip install 'lightning-fl[privacy]'") from err
    if (problem := batchnorm_problem(module)) is not None:
        raise ConfigError(problem)
    if getattr(module, "mu", 0) and hasattr(module, "proximal_term"):
        raise ConfigError(
            "trainer.dp_sgd with FedProx: its proximal term is not a sum over records, and Opacus would leave it "
            "out of the step; use model.mu 0 (or a Classifier)"
        )
    engine, problem = dp.engine, None
    if engine in ("auto", "opacus"):
        problem = opacus_problem(module)
        if engine == "auto":
            engine = "opacus" if problem is None else "functorch"
    if engine == "functorch":
        problem = functorch_problem(module)
    if problem is not None:
        other = "functorch" if engine == "opacus" else "opacus"
        raise ConfigError(
            f"trainer.dp_sgd.engine {engine} cannot train this model: {problem}; try trainer.dp_sgd.engine {other}"
        )
    return engine
