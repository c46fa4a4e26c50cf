"""What the CLI asks of a trainer, and how a run folder records the config that made it.

Kept apart from the CLI so trainers (``FederatedTrainer``, a user's own) never import the CLI.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

#: The resolved config is written under this name in every run folder.
CONFIG_FILENAME = "config.yaml"


@runtime_checkable
class TrainerLike(Protocol):
    """What the CLI needs of a trainer. Subclass it explicitly to make ``--trainer MyTrainer`` resolve by name.

    A trainer that also defines ``log_config(config_yaml: str)`` receives the resolved config to save
    in its run folder.
    """

    def fit(self, model: Any, *, datamodule: Any = None, ckpt_path: Any = None) -> Any: ...

    def validate(self, model: Any, *, datamodule: Any = None, ckpt_path: Any = None) -> Any: ...

    def test(self, model: Any, *, datamodule: Any = None, ckpt_path: Any = None) -> Any: ...


def write_config(folder: str | Path, config_yaml: str, experiments: Iterable[Any] = ()) -> Path:
    """Write ``config.yaml`` into ``folder`` and add it to each TensorBoard writer in ``experiments`` as text."""
    path = Path(folder) / CONFIG_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_yaml)
    text = "".join(f"    {line}\n" for line in config_yaml.splitlines())  # indented: a code block in TensorBoard
    for experiment in experiments:
        if hasattr(experiment, "add_text"):
            experiment.add_text("config", text)
    return path
