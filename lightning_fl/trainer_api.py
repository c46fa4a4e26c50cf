"""What the CLI asks of a trainer, how a run folder records the config and the machine that made it, and cheap lazy
defaults.

Kept apart from the CLI so trainers (``FederatedTrainer``, a user's own) never import the CLI.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")

#: The resolved config is written under this name in every run folder.
CONFIG_FILENAME = "config.yaml"
#: The compute environments a run folder's run ran under (a JSON list; one, unless it resumed on another machine).
ENVIRONMENT_FILENAME = "environment.json"


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


def record_environment(folder: str | Path, device: Any = "cpu") -> Path:
    """Add the compute environment of ``device`` (:func:`~lightning_fl.checkpoint.compute_environment`) to
    ``<folder>/environment.json`` unless it is there: the machines a run ran on, which decide its bits beside its
    inputs (``tools/sweep.py`` records them in every row, and refuses to mix machines in one CSV)."""
    import json

    from lightning_fl.checkpoint import atomic_write_text, compute_environment

    path = Path(folder) / ENVIRONMENT_FILENAME
    seen = read_environments(folder)
    here = compute_environment(device)
    if here not in seen:
        atomic_write_text(path, json.dumps([*seen, here], indent=1) + "\n")
    return path


def read_environments(folder: str | Path) -> list[dict[str, Any]]:
    """The environments ``<folder>/environment.json`` lists (none for a folder without it, or an unreadable one)."""
    import json

    try:
        found = json.loads((Path(folder) / ENVIRONMENT_FILENAME).read_text())
    except (OSError, ValueError):
        return []
    return [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []


def lazy_instance(class_type: type[T], **kwargs: Any) -> T:
    """A default of ``class_type(**kwargs)`` built when first used, that the CLI prints as its class and arguments:
    jsonargparse's ``lazy_instance`` without its ``inspect.stack()``.

    jsonargparse finds the caller's module with ``inspect.stack()``, which reads the source of every frame on the
    stack and walks ``sys.modules`` for each: 0.1-0.15 s a call once torch and Lightning are loaded, and each
    default of a plug-in is one call at import. This makes the same class (``LazyInstance_<name>``, set on and
    reused from the caller's module) and the same instance; with a jsonargparse that lacks the private base it
    builds on, it calls jsonargparse's own.
    """
    from jsonargparse import typing as jsonargparse_typing

    base = getattr(jsonargparse_typing, "_LazyInitBaseClass", None)
    if base is None:
        return jsonargparse_typing.lazy_instance(class_type, **kwargs)
    caller = sys.modules.get(sys._getframe(1).f_globals.get("__name__", ""))
    name = f"LazyInstance_{class_type.__name__}"
    lazy_class = getattr(caller, name, None)
    if lazy_class is None:
        lazy_class = type(name, (base, class_type), {"__doc__": f"Class for lazy instances of {class_type}"})
        if caller is not None:
            lazy_class.__module__ = caller.__name__
            setattr(caller, name, lazy_class)
    elif not (issubclass(lazy_class, base) and issubclass(lazy_class, class_type)):
        raise TypeError(f"{caller.__name__}.{name} is not a lazy {class_type.__name__}")
    return lazy_class(class_type, kwargs)
