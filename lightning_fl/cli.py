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

import ast
import difflib
import inspect
import os
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import lightning as L
import yaml
from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser, Namespace, lazy_instance
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback

from lightning_fl import runs
from lightning_fl.errors import ConfigError, UserError
from lightning_fl.quiet import quiet_lightning, show_progress
from lightning_fl.threads import set_threads
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


class RunSummaryCallback(Callback):
    """Prints what a ``lightning.Trainer`` fit reached and where its files are, when it ends (rank 0)."""

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log_dir = trainer.log_dir  # collective: every rank must ask
        if trainer.is_global_zero:
            print(lightning_summary(trainer, log_dir), flush=True)


def lightning_summary(trainer: L.Trainer, log_dir: str | None) -> str:
    """The final ``val/*`` metrics, the epochs and steps, the checkpoint and the run folder (``log_dir``) of a fit."""
    lines = [f"Finished after {trainer.current_epoch} epoch(s) ({trainer.global_step} optimiser steps)."]
    metrics = trainer.callback_metrics
    for key in sorted(k for k in metrics if k.startswith("val/")):
        lines.append(f"  {key}: {float(metrics[key]):.4f} at the end")
    checkpoint = trainer.checkpoint_callback
    if checkpoint is not None and getattr(checkpoint, "last_model_path", ""):
        lines.append(f"  checkpoint: {checkpoint.last_model_path}")
    if log_dir is not None:
        lines.append(f"  run folder: {log_dir} (config.yaml)")
        if trainer.loggers:
            lines.append(f"  TensorBoard: tensorboard --logdir {Path(log_dir).parent}")
    return "\n".join(lines)


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
    parser.add_argument(
        "--threads",
        type=int | None,
        default=None,
        help="CPU threads per process for torch; null: one fewer than the cores (at least 1), shared among a "
        "node's processes. More threads than free cores slow small models down when the machine is shared.",
    )
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
            or inspect.isabstract(cls)
        ):
            continue
        if cls.__module__.startswith("lightning_fl"):
            ours.add(cls.__name__)
        elif cls.__module__.split(".")[0] == base.__module__.split(".")[0] and "._" not in f"{cls.__module__}.":
            theirs.add(cls.__name__)
    return sorted(ours or theirs)


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
TOP_KEYS = ["seed_everything", "trainer", "model", "data", "ckpt_path", "threads", "config"]

# jsonargparse reports a failure as an indented tree: 'Parser key "k":' and "Problem with given class_path 'X':"
# open a level; a Union lists each member's failure as "- ..." items under "Errors:", then the value given.
_UNION = "Does not validate against any of the Union subtypes"
# A Union member's failure that only says the value was meant for another member.
_NOT_A_SUBCLASS = "does not (?:correspond to a subclass of|implement protocol) "
_OTHER_MEMBER = re.compile(rf"Import path (?:\S+ )?{_NOT_A_SUBCLASS}")


@dataclass(frozen=True)
class _Cause:
    """One leaf of jsonargparse's error tree: the keys and class paths above it, its text, the value given."""

    keys: tuple[str, ...]
    class_paths: tuple[str, ...]
    text: str
    given: str | None = None


def _error_causes(message: str, *, building: bool = False) -> list[_Cause]:
    """The deepest failures in jsonargparse's report, each Union narrowed to the member the value was meant for.

    ``building``: the report comes from instantiating classes, where a member's "Expected a ..." only says that
    the value is not of that member's type (the class that was given raised the real error).
    """
    lines = [(len(line) - len(line.lstrip()), line.strip()) for line in message.splitlines() if line.strip()]
    causes = _parse_tree(lines, (), (), None, building)
    if not causes:
        return []
    first = max(causes, key=lambda c: len(c.keys))
    same = [c for c in causes if (c.keys, c.class_paths) == (first.keys, first.class_paths)]
    return list(dict.fromkeys(same))  # each Union member may repeat the same failure


def _block_end(lines: list[tuple[int, str]], i: int) -> int:
    end = i + 1
    while end < len(lines) and lines[end][0] > lines[i][0]:
        end += 1
    return end


def _parse_tree(
    lines: list[tuple[int, str]], keys: tuple[str, ...], class_paths: tuple[str, ...], given: str | None, building: bool
) -> list[_Cause]:
    causes: list[_Cause] = []
    i = 0
    while i < len(lines):
        indent, text = lines[i]
        end = _block_end(lines, i)
        children = lines[i + 1 : end]
        if match := re.match(r'Parser key "([^"]+)"[^:]*:\s*(.*)', text):
            inner = [(indent + 1, match.group(2))] if match.group(2) else []
            sub_keys = keys if keys[-1:] == (match.group(1),) else (*keys, match.group(1))
            causes += _parse_tree(inner + children, sub_keys, class_paths, given, building)
        elif match := re.match(r"Problem with given class_path '([^']+)':\s*(.*)", text):
            inner = [(indent + 1, match.group(2))] if match.group(2) else []
            causes += _parse_tree(inner + children, keys, (*class_paths, match.group(1)), given, building)
        elif text.startswith(_UNION):
            items: list[list[tuple[int, str]]] = []
            while end < len(lines) and lines[end][0] == indent and not lines[end][1].startswith(_UNION):
                sibling, sibling_end = lines[end][1], _block_end(lines, end)
                if sibling == "Errors:":
                    items = _union_items(lines[end + 1 : sibling_end])
                end = sibling_end
                if sibling.startswith("Given value:"):
                    given = sibling.removeprefix("Given value:").strip()
                    break
            members = [_parse_tree(item, keys, class_paths, given, building) for item in items]
            causes += [c for member in _meant_members(members, building) for c in member]
        else:
            causes.append(_Cause(keys, class_paths, "\n".join([text, *(t for _, t in children)]), given))
        i = end
    return causes


def _union_items(lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Split a Union's "Errors:" block into its "- ..." items (the text after the dash, and what is below it)."""
    items: list[list[tuple[int, str]]] = []
    for indent, text in lines:
        if text.startswith("- ") and (not items or indent <= items[-1][0][0] - 2):
            items.append([(indent + 2, text[2:])])
        elif items:
            items[-1].append((indent, text))
    return items


def _meant_members(members: list[list[_Cause]], building: bool) -> list[list[_Cause]]:
    """The Union members the value was meant for: drop those that only say the value is another member's."""

    def other(cause: _Cause) -> bool:
        return bool(_OTHER_MEMBER.match(cause.text)) or (building and cause.text.startswith("Expected a"))

    return [m for m in members if m and not all(other(c) for c in m)] or members


def _given_value(given: str) -> str:
    """The value as the user wrote it: jsonargparse shows ``--a.b x`` given to a class as ``NestedArg(...)``."""
    if match := re.fullmatch(r"NestedArg\(key='[^']*', val=(.*)\)", given):
        try:
            return str(ast.literal_eval(match.group(1)))
        except (ValueError, SyntaxError):
            return match.group(1)
    return given


def format_parse_error(message: str, subcommand: str | None) -> str:
    """Turn jsonargparse's nested report into one message: the dotted key, the problem, what is accepted."""
    chain: list[str] = []
    class_paths: list[str] = []
    if causes := _error_causes(message):
        chain, class_paths = list(causes[0].keys), list(causes[0].class_paths)
        message = "\n".join(c.text for c in causes)
        if causes[0].given is not None and "Got value:" not in message:
            message += f"\nGiven value: {_given_value(causes[0].given)}"
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
        if option.split(".")[0] not in TOP_KEYS:
            option = option.split(".")[0]
        close = difflib.get_close_matches(option, TOP_KEYS, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        return f"{prefix}unknown key '{option}'.{hint} Accepted top-level keys: {', '.join(TOP_KEYS)}."

    # A Union's report leaves the value out of its members' "Import path ... does not ..." (it is "Given value").
    wrong_base = re.search(rf"Import path (?:([\w.]+) )?{_NOT_A_SUBCLASS}(\w+)", message)
    given_path = re.search(r"^Given value: ([\w.]+)$", message, flags=re.M)
    if wrong_base and not wrong_base.group(1) and given_path:
        imports = [given_path.group(1)]
    else:
        imports = re.findall(r"(?:Expected a dot import path string|Unable to import)[:\s]+'?([\w.]+)", message)
        imports += [wrong_base.group(1)] if wrong_base and wrong_base.group(1) else []
    if imports:
        name = imports[-1]  # the innermost: outer Union members report the enclosing class_path first
        key = ".".join(chain) or "?"
        base = _base_for(chain, class_paths)
        choices = _public_subclasses(base) if base is not None else []
        if chain == ["trainer"]:
            choices = sorted({"Trainer", *_public_subclasses(TrainerLike)})
        label = "Accepted short names"
        if key == "trainer.strategy" and name.split(".")[-1].lower() in FABRIC_STRATEGIES:
            label = "Fabric's strategy is trainer.fabric_strategy; server strategies"
        problem = f"unknown class '{name}'"
        if wrong_base and wrong_base.group(1) in (None, name):
            problem = f"'{name}' is not a {wrong_base.group(2)} subclass"
        full_path = "a full import path 'package.module.Class'" + (f" of a {base.__name__} subclass" if base else "")
        if choices:
            return f"{prefix}{key}: {problem}. {label}: {', '.join(choices)}; or give {full_path}."
        return f"{prefix}{key}: {problem}; give {full_path}."

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
        types = _merge_literals([_clean_type(t) for t, _ in expected])
        key = ".".join(chain) or "?"
        got_text = f", got {got.strip()!r}" if got is not None else ""
        return f"{prefix}{key}: expected {' or '.join(types)}{got_text}."

    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return prefix + " ".join(lines[:6])


def _clean_type(text: str) -> str:
    text = text.strip().rstrip(".")
    text = re.sub(r"<class '(?:builtins\.)?([\w.]+)'>", r"\1", text)
    text = re.sub(r"^typing\.Literal\[(.*)\]$", r"one of \1", text)
    return text.replace("typing.Literal", "one of ").replace("NoneType", "null")


def _merge_literals(types: list[str]) -> list[str]:
    """Distinct types, the choices of several ``Literal`` members in one "one of ..." (in the first one's place)."""
    choices = [t.removeprefix("one of ") for t in types if t.startswith("one of ")]
    if len(choices) > 1:
        first = next(i for i, t in enumerate(types) if t.startswith("one of "))
        types = [t for t in types if not t.startswith("one of ")]
        types.insert(first, "one of " + ", ".join(dict.fromkeys(", ".join(choices).split(", "))))
    return list(dict.fromkeys(types))


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
        trainer.callbacks.extend([SaveConfigCallback(config_yaml), RunSummaryCallback()])
    elif callable(getattr(trainer, "log_config", None)):
        trainer.log_config(config_yaml)
    else:
        warnings.warn(
            f"{type(trainer).__name__} has no log_config(config_yaml) method; the resolved config is not saved",
            stacklevel=2,
        )


# What to give instead, for keys whose refusal (Lightning's own message) does not say it.
FIXES = {
    "trainer.devices": "give a number of devices >= 1 or 'auto' (-1 and GPU indices such as '0,1' need GPUs)",
}


class _FailedBuild:
    """A jsonargparse instantiator that builds each class as usual and remembers the last one that raised.

    jsonargparse keeps only the text of a Union member's failure (``trainer`` is a Lightning ``Trainer`` or a
    ``TrainerLike``; some keys take a class or ``null``); this keeps the constructor's own exception and class.
    """

    def __init__(self) -> None:
        self.cls: type | None = None
        self.kwargs: dict[str, Any] = {}
        self.error: BaseException | None = None

    def __call__(self, class_type: type, *args: Any, **kwargs: Any) -> Any:
        try:
            return class_type(*args, **kwargs)
        except Exception as err:
            self.cls, self.kwargs, self.error = class_type, kwargs, err
            raise


def _instantiate(parser: ArgumentParser, cfg: Namespace, failed: _FailedBuild) -> Namespace:
    if not hasattr(parser, "instantiate"):  # jsonargparse < 4.49
        return parser.instantiate_classes(cfg)
    if "instantiators" in inspect.signature(parser.instantiate).parameters:
        return parser.instantiate(cfg, instantiators=[(failed, object, True)])
    return parser.instantiate(cfg)


def _build_error(err: BaseException, cfg: Namespace | None = None, failed: _FailedBuild | None = None) -> str:
    """The reason a plug-in could not be built: the constructor's own message in one line, naming the key.

    The message is that of the class that raised (``failed``), else the failure in jsonargparse's report of the
    class that was given (not the other Union members', nor the namespace it dumps); the key is the one the
    message names, else that of the class in ``cfg``.
    """
    cls, kwargs, text = None, {}, str(err)
    raised = " ".join(str(failed.error).split()) if failed is not None and failed.error is not None else ""
    if failed is not None and (failed.error is err or (raised and raised in " ".join(text.split()))):
        cls, kwargs, text = failed.cls, failed.kwargs, str(failed.error)
    elif _UNION in text and (causes := _error_causes(text, building=True)):
        text = "; ".join(c.text for c in causes)
        given = re.search(r"class_path='([^']+)'", causes[0].given or "")
        cls = _resolve_class(given.group(1)) if given else None
    message = " ".join(line.strip() for line in text.splitlines() if line.strip())
    keys = [(k, node) for k, node in _config_classes(cfg) if cls is not None and _resolve_class(node.class_path) is cls]
    # the same class may be given twice (two callbacks): the one built with these arguments
    agree = [k for k, node in keys if all(kwargs.get(n, v) == v for n, v in _plain_init_args(node).items())]
    return _name_key(message, (agree or [k for k, _ in keys] or [None])[0], cls)


def _config_classes(value: Any, key: str = "") -> Iterator[tuple[str, Namespace]]:
    """(dotted key, ``class_path`` and ``init_args``) of each class in a parsed config, outer classes first."""
    if isinstance(value, Namespace):
        if isinstance(value.get("class_path"), str):
            yield key, value
            value = value.get("init_args")
        for name, sub in vars(value).items() if isinstance(value, Namespace) else ():
            yield from _config_classes(sub, f"{key}.{name}" if key else name)
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            yield from _config_classes(sub, f"{key}[{i}]")


def _plain_init_args(node: Namespace) -> dict[str, Any]:
    init_args = node.get("init_args")
    if not isinstance(init_args, Namespace):
        return {}
    return {n: v for n, v in vars(init_args).items() if isinstance(v, (str, int, float, bool, type(None)))}


def _quoted_argument(message: str, cls: type | None) -> str | None:
    """The argument of ``cls`` that ``message`` quotes the way Lightning does: `Trainer(devices=0)`, `devices`."""
    params = _init_params(cls) if cls is not None else []
    return next((n for n in re.findall(r"`(?:\w+\()?(\w+)(?:=|`)", message) if n in params), None)


def _name_key(message: str, key: str | None, cls: type | None) -> str:
    """``message``, starting with the dotted key it is about unless it names one already.

    ``key`` is that of the class ``cls`` that refused; Lightning quotes the argument (`Trainer(devices=0)`), and
    our classes name it from their own level ("codec.bits must be ...").
    """
    if key is None:
        return message
    params = _init_params(cls) if cls is not None else []
    if argument := _quoted_argument(message, cls) or next(
        (n for n in re.findall(r"(\w+)=", message) if n in params), None
    ):
        key = f"{key}.{argument}"
    if match := re.match(r"(\w+)\.\w", message):
        head = match.group(1)
        if head in params:  # relative to the class that refused
            return f"{key}.{message}"
        if "." in key and head == key.rsplit(".", 1)[1]:  # relative to the class's parent
            return f"{key.rsplit('.', 1)[0]}.{message}"
    if re.match(rf"({'|'.join(TOP_KEYS)})\b", message) or re.search(r"\b(trainer|model|data)\.\w", message):
        return message
    fix = f"; {FIXES[key]}" if key in FIXES else ""
    return f"{key}: {message.rstrip('.')}{fix}" if fix else f"{key}: {message}"


def _check_ckpt_path(path: str | None, trainer: Any = None) -> None:
    """Refuse a ``ckpt_path`` that is missing, or, for ``lightning.Trainer``, one our safe reader refuses.

    Left to itself, Lightning loads ``ckpt_path`` with ``torch.load`` without passing ``weights_only``, so with
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` in the environment it would unpickle anything. Reading the file first
    with :func:`~lightning_fl.checkpoint.read_checkpoint` (``weights_only=True``) refuses a file that needs a
    Python object (or is truncated, or not a Lightning checkpoint) with one clear line before Lightning opens it;
    :func:`main` then also passes ``weights_only=True`` to Lightning, which covers its own names. Lightning's names
    ``last``, ``best`` and ``hpc`` name the run's own files and are left to it; remote checkpoints (URLs, the
    model registry) are refused for ``lightning.Trainer`` as they cannot be checked first. Other trainers read
    their checkpoints themselves (``FederatedTrainer`` through the same reader).
    """
    from lightning_fl.checkpoint import read_checkpoint
    from lightning_fl.errors import CheckpointError

    if path is None or path in {"last", "best", "hpc"}:
        return
    lightning = isinstance(trainer, L.Trainer)
    if "://" in path or path.lower() == "registry" or path.lower().startswith("registry:"):
        if lightning:
            raise CheckpointError(f"ckpt_path {path}: remote checkpoints are not read; download it and pass the file")
        return
    if not lightning:
        if not Path(path).expanduser().is_file():
            raise UserError(
                f"ckpt_path {path} does not exist; pass a checkpoint file (e.g. <run>/checkpoints/last.ckpt)"
            )
        return
    fix = "pass a checkpoint file written by a lightning.Trainer run (e.g. <run>/checkpoints/last.ckpt)"
    ckpt = read_checkpoint(path, "ckpt_path", fix=fix)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise CheckpointError(f"ckpt_path {path} is not a Lightning checkpoint (no 'state_dict'); {fix}")


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


def _yaml_syntax_error(argv: list[str], err: BaseException) -> str | None:
    """Where a ``--config`` file breaks YAML's syntax (jsonargparse's report names neither file nor line)."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, yaml.YAMLError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    paths = [value for flag, value in pairwise(argv) if flag in ("-c", "--config")]
    paths += [arg.split("=", 1)[1] for arg in argv if arg.startswith(("--config=", "-c="))]
    for path in paths:
        try:
            yaml.safe_load(Path(path).read_text())
        except OSError:
            continue
        except yaml.MarkedYAMLError as bad:
            mark = bad.problem_mark or bad.context_mark
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            opened = bad.context_mark if bad.context and bad.context_mark is not mark else None
            context = f" ({bad.context} at line {opened.line + 1})" if opened is not None else ""
            return (
                f"config file {path}: YAML syntax error{where}: {bad.problem or bad.context}{context}; "
                "check the indentation, the ':' after each key and the closing brackets there."
            )
        except yaml.YAMLError as bad:
            return f"config file {path}: YAML syntax error: {bad}"
    return None


def build(argv: list[str]) -> Run:
    """Parse ``argv`` (``fit --config FILE --key value ...``), seed, and build the plug-ins; do not run.

    Raises :class:`ConfigParseError` or :class:`~lightning_fl.errors.UserError` with one line naming the key.
    Used by :func:`main` and by the Flower apps, which build the same run from the same arguments.
    """
    quiet_lightning()
    show_progress()
    parser, subparsers = _build()
    subcommand = next((a for a in argv if a in SUBCOMMANDS), None)
    try:
        cfg = parser.parse_args(list(argv))
    except ArgumentError as err:
        if (bad_yaml := _yaml_syntax_error(argv, err)) is not None:
            raise ConfigParseError(f"{subcommand}: {bad_yaml}" if subcommand else bad_yaml) from None
        raise ConfigParseError(format_parse_error(str(err), subcommand)) from None
    subcommand = cfg.subcommand
    sub_cfg = cfg[subcommand]
    try:
        set_threads(sub_cfg.threads)  # before anything is built: data loading and pretraining use them too
    except ConfigError as err:
        raise ConfigParseError(f"{subcommand}: {err}") from None
    seed = _resolve_seed(sub_cfg.seed_everything)
    if seed is not None:
        sub_cfg.seed_everything = seed
    config_yaml = dump_config(subparsers[subcommand], sub_cfg)
    failed = _FailedBuild()
    try:
        init = _instantiate(parser, cfg, failed)
    except (UserError, ValueError, TypeError, MisconfigurationException) as err:
        if os.environ.get("LIGHTNING_FL_DEBUG"):
            raise
        reason = _build_error(err, sub_cfg, failed)
        raise ConfigParseError(f"{subcommand}: could not build the config: {reason}") from None
    run = init[subcommand]
    return Run(subcommand, run.trainer, run.model, run.data, run.ckpt_path, config_yaml)


def main(argv: list[str] | None = None) -> Any:
    """Parse, seed, build the four plug-ins, save the resolved config, and run the subcommand."""
    try:
        run = build(sys.argv[1:] if argv is None else list(argv))
    except ConfigParseError as err:
        _fail(str(err))
    lock = None
    try:
        _check_ckpt_path(run.ckpt_path, run.trainer)
        _attach_config(run.trainer, run.config_yaml)
        method = getattr(run.trainer, run.subcommand)
        if not isinstance(run.trainer, L.Trainer):
            return method(run.model, datamodule=run.data, ckpt_path=run.ckpt_path)
        lock = runs.claim_for_lightning(run.trainer)  # its own version_N, even when runs start together
        # weights_only passed explicitly: Lightning's torch.load then ignores TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD too
        return method(run.model, datamodule=run.data, ckpt_path=run.ckpt_path, weights_only=True)
    except UserError as err:
        _fail(f"{run.subcommand}: {err}")
    except (MisconfigurationException, ValueError, TypeError) as err:  # Lightning/Fabric refusing trainer settings
        quoted = _quoted_argument(str(err), type(run.trainer))
        if os.environ.get("LIGHTNING_FL_DEBUG") or not (isinstance(err, MisconfigurationException) or quoted):
            raise
        _fail(f"{run.subcommand}: {_name_key(' '.join(str(err).split()), 'trainer', type(run.trainer))}")
    finally:
        if lock is not None:
            lock.release()
    return None
