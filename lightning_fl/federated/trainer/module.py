"""The contract between a method and the federated loop: :class:`FederatedModule` and its optional hooks.

A method federates when it is a LightningModule that says what its clients send
(:meth:`FederatedModule.federated_state`) and how it takes the server's state back
(:meth:`FederatedModule.load_federated_state`). Its ``training_step``, ``configure_optimizers`` and
evaluation hooks are Lightning's own. Optional hooks, looked up once when a run starts
(:class:`ModuleHooks`), let a method do more:

=============================  ==============================================================================
``prepare_base(datamodule)``   produce the starting weights (e.g. pretrain-and-cache a base); run on rank 0
                               first, then on the others
``check_data(datamodule)``     refuse data that does not fit the model, naming the config keys
``factor_fingerprint()``       a string every process must agree on (FLITE: factors and base); a process
                               whose model differs refuses to train, and so does a resume
``averaging_identity_error``   ``(uploads) -> float`` logged as ``fed/identity_error`` under linear strategies
``text_samples()``             ``{tag: markdown}`` written to TensorBoard's Text tab before the first round and
                               after the last (a language model's generated sample)
=============================  ==============================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lightning_fl.errors import ConfigError
from lightning_fl.federated.server.state import State

REQUIRED = ("federated_state", "load_federated_state")
OPTIONAL = ("prepare_base", "check_data", "factor_fingerprint", "averaging_identity_error", "text_samples")


@runtime_checkable
class FederatedModule(Protocol):
    """What the federated loop needs of a method (besides being a LightningModule)."""

    def federated_state(self) -> State:
        """What a client uploads and the server aggregates: named tensors, detached copies."""
        ...

    def load_federated_state(self, state: State) -> None:
        """Set the module from a (global) federated state with the keys :meth:`federated_state` returns."""
        ...


@dataclass(frozen=True)
class ModuleHooks:
    """The optional hooks a module defines (``None`` where it does not), resolved once per run."""

    prepare_base: Callable[[Any], None] | None
    check_data: Callable[[Any], None] | None
    factor_fingerprint: Callable[[], str] | None
    averaging_identity_error: Callable[[list[State]], float] | None
    text_samples: Callable[[], dict[str, str]] | None

    @classmethod
    def of(cls, module: Any) -> ModuleHooks:
        """Check ``module`` against :class:`FederatedModule` and collect its optional hooks."""
        missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
        if missing:
            raise ConfigError(
                f"{type(module).__name__} cannot be federated: it lacks {', '.join(missing)}. Define "
                "federated_state() -> dict[str, Tensor] and load_federated_state(state) (see docs/extending.md), "
                "or subclass lightning_fl.methods.Classifier, which sends every trainable parameter."
            )
        found = {name: getattr(module, name, None) for name in OPTIONAL}
        return cls(**{name: hook if callable(hook) else None for name, hook in found.items()})
