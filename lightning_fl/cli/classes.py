"""What the CLI's messages know about the classes a key takes: their short names, the constructor arguments they
accept, and the class a key is declared with."""

from __future__ import annotations

import inspect

import lightning as L


def public_subclasses(base: type) -> list[str]:
    """Short names of the usable lightning_fl classes deriving from ``base`` (plug-in bases excluded).

    A base that lightning_fl does not implement (Lightning's ``Logger``) lists its own package's public classes.
    """
    ours, theirs, stack = set(), set(), [base]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if (
            cls.__name__.startswith(("_", "LazyInstance_"))  # jsonargparse's wrapper of a lazy default
            or cls.__dict__.get("_plugin_base", False)
            or cls.__dict__.get("_is_protocol", False)  # a typing.Protocol (TrainerLike) is a contract, not a class
            or inspect.isabstract(cls)
        ):
            continue
        if cls.__module__.startswith("lightning_fl"):
            ours.add(cls.__name__)
        elif cls.__module__.split(".")[0] == base.__module__.split(".")[0] and "._" not in f"{cls.__module__}.":
            theirs.add(cls.__name__)
    return sorted(ours or theirs)


def resolve_class(path: str) -> type | None:
    module, _, name = path.rpartition(".")
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except Exception:
        return None


def init_params(cls: type) -> list[str]:
    """Constructor arguments of ``cls``, following ``**kwargs`` into the parent classes."""
    names: list[str] = []
    for klass in cls.__mro__:
        try:
            params = list(inspect.signature(klass.__init__).parameters.values())
        except (TypeError, ValueError):
            break
        skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        names += [p.name for p in params if p.name != "self" and p.kind not in skip and p.name not in names]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            break
    return names


def base_for(keys: list[str], class_paths: list[str]) -> type | None:
    """The declared type of the innermost key, found from its parent's constructor annotation."""
    if len(keys) == 1:
        return {"trainer": L.Trainer, "model": L.LightningModule, "data": L.LightningDataModule}.get(keys[0])
    parent = resolve_class(class_paths[-1]) if class_paths else None
    if parent is None:
        return None
    try:
        hints = inspect.get_annotations(parent.__init__, eval_str=True)
    except Exception:
        return None
    hint = hints.get(keys[-1])
    for candidate in getattr(hint, "__args__", (hint,)):
        if inspect.isclass(candidate):
            return candidate
    return None
