"""``python -m lightning_fl fit|validate|test --config FILE [--key.sub value ...]``.

A thin jsonargparse program with LightningCLI's syntax. Unlike ``LightningCLI``, the trainer is
a plug-in too: any class with ``fit/validate/test(model, *, datamodule=..., ckpt_path=...)``
works (``lightning.Trainer`` for centralised runs, federated trainers for rounds). Every config
has the keys ``seed_everything``, ``trainer``, ``model``, ``data`` (and ``ckpt_path``).

The fully resolved config (defaults included, the seed made concrete) is saved as
``config.yaml`` in the run folder and logged to TensorBoard as text. Mistakes in the config end
with exit code 2 and one message naming the key and what it accepts.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser, Namespace, lazy_instance
from lightning.pytorch.callbacks import Callback

from lightning_fl.errors import UserError
from lightning_fl.trainer_api import TrainerLike, write_config

SUBCOMMANDS = {
    "fit": "Train the model (resume with --ckpt_path).",
    "validate": "Evaluate on the validation split (weights from --ckpt_path).",
    "test": "Evaluate on the test split (weights from --ckpt_path).",
}
TrainerType = L.Trainer | TrainerLike


class SaveConfigCallback(Callback):
    """Writes the resolved config to ``<log_dir>/config.yaml`` and logs it to TensorBoard as text."""

    def __init__(self, config_yaml: str) -> None:
        self.config_yaml = config_yaml
        self.saved_to: Path | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.saved_to is not None:
            return
        log_dir = trainer.log_dir  # collective: every rank must ask
        if log_dir is None or not trainer.is_global_zero:
            return
        experiments = [getattr(logger, "experiment", None) for logger in trainer.loggers]
        self.saved_to = write_config(log_dir, self.config_yaml, experiments)


# --------------------------------------------------------------------------------------- parser
def _subcommand_parser(name: str) -> ArgumentParser:
    parser = ArgumentParser(exit_on_error=False, description=SUBCOMMANDS[name])
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="Path to a YAML config file.")
    parser.add_argument(
        "--seed_everything",
        type=bool | int,
        default=True,
        help="Global seed; true picks one (0 unless PL_GLOBAL_SEED is set) and records it in the saved config.",
    )
    parser.add_argument(
        "--trainer",
        type=TrainerType,
        default=lazy_instance(L.Trainer),
        help="lightning.Trainer, or any class with fit/validate/test(model, datamodule=, ckpt_path=).",
    )
    parser.add_argument("--model", type=L.LightningModule, required=True, help="The LightningModule to run.")
    parser.add_argument("--data", type=L.LightningDataModule, required=True, help="The LightningDataModule.")
    parser.add_argument("--ckpt_path", type=str | None, default=None, help="Checkpoint to resume (fit) or evaluate.")
    return parser


def _build() -> tuple[ArgumentParser, dict[str, ArgumentParser]]:
    import lightning_fl  # noqa: F401  (imports every plug-in so short class names resolve)

    root = ArgumentParser(
        prog="python -m lightning_fl",
        description="Federated learning experiments: FLITE, FMP and their baselines.",
        exit_on_error=False,
    )
    subcommands = root.add_subcommands(required=True, dest="subcommand")
    parsers = {name: _subcommand_parser(name) for name in SUBCOMMANDS}
    for name, parser in parsers.items():
        subcommands.add_subcommand(name, parser, help=SUBCOMMANDS[name])
    return root, parsers


def build_parser() -> ArgumentParser:
    """The root parser with the ``fit``, ``validate`` and ``test`` subcommands."""
    return _build()[0]


def dump_config(parser: ArgumentParser, cfg: Namespace) -> str:
    """YAML of ``cfg`` with every value, ``None`` included, so the file reruns the same experiment."""
    cfg = cfg.clone()
    cfg.pop("config", None)
    try:
        return parser.dump(cfg, skip_unset=False)
    except TypeError:  # jsonargparse < 4.49
        return parser.dump(cfg, skip_none=False)


# --------------------------------------------------------------------------------------- errors
def _public_subclasses(base: type) -> list[str]:
    """Short names of the usable lightning_fl classes deriving from ``base`` (plug-in bases excluded)."""
    names, stack = set(), [base]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if (
            cls.__module__.startswith("lightning_fl")
            and not cls.__name__.startswith(("_", "LazyInstance_"))  # jsonargparse's wrapper of a lazy default
            and not cls.__dict__.get("_plugin_base", False)
            and not inspect.isabstract(cls)
        ):
            names.add(cls.__name__)
    return sorted(names)


def _resolve_class(path: str) -> type | None:
    module, _, name = path.rpartition(".")
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except Exception:
        return None


def _init_params(cls: type) -> list[str]:
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


def _base_for(keys: list[str], class_paths: list[str]) -> type | None:
    """The declared type of the innermost key, found from its parent's constructor annotation."""
    if len(keys) == 1:
        return {"trainer": L.Trainer, "model": L.LightningModule, "data": L.LightningDataModule}.get(keys[0])
    parent = _resolve_class(class_paths[-1]) if class_paths else None
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


# Keys that moved: the old key, and what to write instead.
RENAMED = {
    "trainer.aggregation": "it became trainer.strategy: FedAvg with weighted false ('mean') or true ('weighted')",
}
FABRIC_STRATEGIES = {"auto", "ddp", "ddp_spawn", "dp", "fsdp", "deepspeed", "single_device", "xla"}


def format_parse_error(message: str, subcommand: str | None) -> str:
    """Turn jsonargparse's nested report into one message: the dotted key, the problem, what is accepted."""
    keys = re.findall(r'Parser key "([^"]+)"', message)
    class_paths = re.findall(r"Problem with given class_path '([^']+)'", message)
    # jsonargparse repeats each Union member's error; the dotted key is the chain of distinct keys.
    chain: list[str] = []
    for k in keys:
        if not chain or chain[-1] != k:
            chain.append(k)
    prefix = f"{subcommand}: " if subcommand else ""

    if match := re.search(r"Option '([^']+)' is not accepted", message):
        option = match.group(1)
        cls = _resolve_class(class_paths[-1]) if class_paths else None
        key = ".".join([*chain, option])
        if key in RENAMED:
            return f"{prefix}unknown key '{key}': {RENAMED[key]}."
        if cls is None:
            return f"{prefix}unknown key '{key}'"
        accepted = _init_params(cls)
        close = difflib.get_close_matches(option, accepted, n=1)
        hint = f" Did you mean '{'.'.join([*chain, close[0]])}'?" if close else ""
        return (
            f"{prefix}unknown key '{key}' for {cls.__module__}.{cls.__name__}.{hint} Accepted: {', '.join(accepted)}."
        )

    if match := re.search(r"does not accept option '([^']+)'", message) or re.search(
        r"Unrecognized arguments: (\S+)", message
    ):
        option = match.group(1).lstrip("-")
        top = ["seed_everything", "trainer", "model", "data", "ckpt_path", "config"]
        if option.split(".")[0] not in top:
            option = option.split(".")[0]
        close = difflib.get_close_matches(option, top, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        return f"{prefix}unknown key '{option}'.{hint} Accepted top-level keys: {', '.join(top)}."

    if imports := re.findall(
        r"(?:Expected a dot import path string|Import path|Unable to import)[:\s]+'?([\w.]+)", message
    ):
        name = imports[-1]  # the innermost: outer Union members report the enclosing class_path first
        key = ".".join(chain) or "?"
        base = _base_for(chain, class_paths)
        choices = _public_subclasses(base) if base is not None else []
        if chain == ["trainer"]:
            choices = sorted({"Trainer", *_public_subclasses(TrainerLike)})
        label = "Accepted short names"
        if key == "trainer.strategy" and name.split(".")[-1].lower() in FABRIC_STRATEGIES:
            label = "Fabric's strategy is trainer.fabric_strategy; server strategies"
        accepted = f" {label}: {', '.join(choices)};" if choices else ""
        return f"{prefix}{key}: unknown class '{name}'.{accepted} or give a full import path 'package.module.Class'" + (
            f" of a {base.__name__} subclass." if base is not None else "."
        )

    if match := re.search(r"File does not exist: '?([^'\n]+)'?", message):
        return f"{prefix}config file {match.group(1)} does not exist; check the path given to --config."

    if match := re.search(r"the following arguments are required: (.+)", message):
        missing = match.group(1).replace(f"{subcommand}.", "") if subcommand else match.group(1)
        return (
            f"{prefix}missing required key(s): {missing}. Pass them with --config FILE or --{missing.split(',')[0]} ..."
        )

    if match := re.search(r"invalid choice: '([^']+)'", message):
        close = difflib.get_close_matches(match.group(1), list(SUBCOMMANDS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        return f"unknown subcommand '{match.group(1)}'.{hint} Accepted: {', '.join(SUBCOMMANDS)}."

    expected = re.findall(r"Expected an? (.+?)(?:\. Got value: (.+)|$)", message, flags=re.M)
    if expected:
        got = next((g for _, g in expected if g), None)
        if got is None and (given := re.search(r"Given value: (.+)", message)):
            got = given.group(1)
        types = list(dict.fromkeys(_clean_type(t) for t, _ in expected))
        key = ".".join(chain) or "?"
        got_text = f", got {got.strip()!r}" if got is not None else ""
        return f"{prefix}{key}: expected {' or '.join(types)}{got_text}."

    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return prefix + " ".join(lines[:6])


def _clean_type(text: str) -> str:
    text = text.strip().rstrip(".")
    text = re.sub(r"<class '(?:builtins\.)?([\w.]+)'>", r"\1", text)
    return text.replace("typing.Literal", "one of ").replace("NoneType", "null")


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    print("Run with --help for the keys, or --print_config to see the resolved config.", file=sys.stderr)
    raise SystemExit(2)


# --------------------------------------------------------------------------------------- running
def _resolve_seed(value: bool | int) -> int | None:
    if value is False:
        return None
    return L.seed_everything(None if value is True else int(value), workers=True, verbose=False)


def _attach_config(trainer: Any, config_yaml: str) -> None:
    if isinstance(trainer, L.Trainer):
        trainer.callbacks.append(SaveConfigCallback(config_yaml))
    elif callable(getattr(trainer, "log_config", None)):
        trainer.log_config(config_yaml)
    else:
        warnings.warn(
            f"{type(trainer).__name__} has no log_config(config_yaml) method; the resolved config is not saved",
            stacklevel=2,
        )


def _build_error(err: Exception) -> str:
    """The reason a plug-in could not be built, without jsonargparse's report on the union's other members.

    ``trainer`` accepts a Lightning ``Trainer`` or a ``TrainerLike``; when ours refuses a value, jsonargparse
    reports every member's failure and the whole namespace. Keep only the lines that say what is wrong.
    """
    text = str(err)
    if "Does not validate against any of the Union subtypes" not in text:
        return f"{type(err).__name__}: {err}"
    reasons = [
        line.strip()[2:]
        for line in text.splitlines()
        if line.strip().startswith("- ") and "does not correspond to a subclass" not in line
    ]
    return "; ".join(reasons) if reasons else f"{type(err).__name__}: {err}"


def _check_ckpt_path(path: str | None) -> None:
    special = {"last", "best", "hpc", "registry"}
    if path is None or path in special or "://" in path:
        return
    if not Path(path).expanduser().is_file():
        raise UserError(f"ckpt_path {path} does not exist; pass a checkpoint file (e.g. <run>/checkpoints/last.ckpt)")


@dataclass
class Run:
    """A parsed and built config: the subcommand, the four plug-ins and the resolved YAML that made them."""

    subcommand: str
    trainer: Any
    model: Any
    data: Any
    ckpt_path: str | None
    config_yaml: str


class ConfigParseError(UserError):
    """The arguments or the config file could not be parsed (the message names the key)."""


def build(argv: list[str]) -> Run:
    """Parse ``argv`` (``fit --config FILE --key value ...``), seed, and build the plug-ins; do not run.

    Raises :class:`ConfigParseError` or :class:`~lightning_fl.errors.UserError` with one line naming the key.
    Used by :func:`main` and by the Flower apps, which build the same run from the same arguments.
    """
    parser, subparsers = _build()
    subcommand = next((a for a in argv if a in SUBCOMMANDS), None)
    try:
        cfg = parser.parse_args(list(argv))
    except ArgumentError as err:
        raise ConfigParseError(format_parse_error(str(err), subcommand)) from None
    subcommand = cfg.subcommand
    sub_cfg = cfg[subcommand]
    seed = _resolve_seed(sub_cfg.seed_everything)
    if seed is not None:
        sub_cfg.seed_everything = seed
    config_yaml = dump_config(subparsers[subcommand], sub_cfg)
    try:
        init = parser.instantiate(cfg) if hasattr(parser, "instantiate") else parser.instantiate_classes(cfg)
    except (UserError, ValueError, TypeError) as err:
        if os.environ.get("LIGHTNING_FL_DEBUG"):
            raise
        raise ConfigParseError(f"{subcommand}: could not build the config: {_build_error(err)}") from None
    run = init[subcommand]
    return Run(subcommand, run.trainer, run.model, run.data, run.ckpt_path, config_yaml)


def main(argv: list[str] | None = None) -> Any:
    """Parse, seed, build the four plug-ins, save the resolved config, and run the subcommand."""
    try:
        run = build(sys.argv[1:] if argv is None else list(argv))
    except ConfigParseError as err:
        _fail(str(err))
    try:
        _check_ckpt_path(run.ckpt_path)
        _attach_config(run.trainer, run.config_yaml)
        method = getattr(run.trainer, run.subcommand)
        return method(run.model, datamodule=run.data, ckpt_path=run.ckpt_path)
    except UserError as err:
        _fail(f"{run.subcommand}: {err}")
    return None
