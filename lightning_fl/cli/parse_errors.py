"""The one place that turns jsonargparse's and the plug-ins' errors into one line naming the key and the fix.

jsonargparse reports a bad config as an indented tree (keys, class paths, each member of a Union); the
classes the config builds raise their own messages. :func:`format_parse_error` reads the tree down to the
failure the user meant and says it with the dotted key (a class that refused its arguments while being built:
:mod:`lightning_fl.cli.build_errors`); :func:`yaml_syntax_error` names the file and line of a YAML mistake.
The CLI (:mod:`lightning_fl.cli.command`) calls them; ``tests/test_cli.py`` holds one case per message.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import re
from itertools import pairwise
from pathlib import Path

import yaml

from lightning_fl.cli.classes import base_for, init_params, public_subclasses, resolve_class
from lightning_fl.cli.precheck import (
    missing_config,
    unknown_subcommand,
    unknown_top_key,
    yaml_syntax,
)
from lightning_fl.trainer_api import TrainerLike

FABRIC_STRATEGIES = {"auto", "ddp", "ddp_spawn", "dp", "fsdp", "deepspeed", "single_device", "xla"}
# What jsonargparse names as the class of a key whose class was not chosen yet.
BASE_CLASS_PATHS = {"lightning.LightningModule", "lightning.LightningDataModule"}

# jsonargparse reports a failure as an indented tree: 'Parser key "k":' and "Problem with given class_path 'X':"
# open a level; a Union lists each member's failure as "- ..." items under "Errors:", then the value given.
_UNION = "Does not validate against any of the Union subtypes"
# A Union member's failure that only says the value was meant for another member.
_NOT_A_SUBCLASS = "does not (?:correspond to a subclass of|implement protocol) "
_OTHER_MEMBER = re.compile(rf"Import path (?:\S+ )?{_NOT_A_SUBCLASS}")


@dataclasses.dataclass(frozen=True)
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

    # ``--model.help NAME`` (help for one class) reports its key as the option itself.
    if match := re.match(r"--([\w.]+)\.help: Expected a dot import path string: (\S+)", message):
        chain, message = match.group(1).split("."), f"Expected a dot import path string: {match.group(2)}"

    # A key given before its class is chosen: ``--model.lr 1`` with no ``--model`` or config sets ``model``.
    unchosen = re.search(r"^unrecognized arguments: --([\w.]+)", message, flags=re.M) or re.search(
        r"Option '([^']+)' is not accepted", message
    )
    if unchosen and class_paths and class_paths[-1] in BASE_CLASS_PATHS and chain:
        head = ".".join(chain)
        key = f"{head}.{unchosen.group(1)}"
        return f"{prefix}{key}: choose the {head} class first, with --{head} CLASS or a --config that sets {head}."

    if match := re.search(r"Option '([^']+)' is not accepted", message):
        option = match.group(1)
        cls = resolve_class(class_paths[-1]) if class_paths else None
        key = ".".join([*chain, option])
        if cls is None:
            return f"{prefix}unknown key '{key}'"
        accepted = init_params(cls)
        close = difflib.get_close_matches(option, accepted, n=1)
        hint = f" Did you mean '{'.'.join([*chain, close[0]])}'?" if close else ""
        return (
            f"{prefix}unknown key '{key}' for {cls.__module__}.{cls.__name__}.{hint} Accepted: {', '.join(accepted)}."
        )

    # A misspelt field of a dataclass argument (``model.recipe``): jsonargparse names the group and the option.
    field = re.search(r"Group '(?:[\w.]*\.)?(\w+)' does not accept option '([^'=]+)'", message) or re.search(
        r"^unrecognized arguments: --(\w+)\.(\w+)[= ]", message, flags=re.M
    )
    if field and class_paths and class_paths[-1] not in BASE_CLASS_PATHS:
        group, option = field.groups()
        default = getattr(inspect.signature(resolve_class(class_paths[-1])).parameters.get(group), "default", None)
        accepted = [f.name for f in dataclasses.fields(default)] if dataclasses.is_dataclass(default) else []
        close = difflib.get_close_matches(option, accepted, n=1)
        key, hint = (
            ".".join([*chain, group]),
            f" Did you mean '{'.'.join([*chain, group, close[0]])}'?" if close else "",
        )
        return f"{prefix}unknown key '{key}.{option}'.{hint} Accepted: {', '.join(accepted)}."

    if match := re.search(r"does not accept option '([^']+)'", message) or re.search(
        r"Unrecognized arguments: (\S+)", message
    ):
        return prefix + unknown_top_key(match.group(1).lstrip("-"))

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
        base = base_for(chain, class_paths)
        choices = public_subclasses(base) if base is not None else []
        if chain == ["trainer"]:
            choices = sorted({"Trainer", *public_subclasses(TrainerLike)})
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
        return prefix + missing_config(match.group(1))

    if match := re.search(r"the following arguments are required: (.+)", message):
        missing = match.group(1).replace(f"{subcommand}.", "") if subcommand else match.group(1)
        return (
            f"{prefix}missing required key(s): {missing}. Pass them with --config FILE or --{missing.split(',')[0]} ..."
        )

    if match := re.search(r"invalid choice: '([^']+)'", message):
        return unknown_subcommand(match.group(1))

    expected = re.findall(r"Expected an? (.+?)(?:\. Got value: (.+)|$)", message, flags=re.M)
    if expected:
        got = next((g for _, g in expected if g), None)
        if got is None and (given := re.search(r"Given value: (.+)", message)):
            got = given.group(1)
        types = _merge_literals([_clean_type(t) for t, _ in expected])
        key = ".".join(chain) or "?"
        if "float" in types and got is not None and re.fullmatch(r"[+-]?\.?nan", got.strip(), flags=re.I):
            return prefix + not_finite(key)
        got_text = f", got {got.strip()!r}" if got is not None else ""
        return f"{prefix}{key}: expected {' or '.join(types)}{got_text}."

    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return prefix + " ".join(lines[:6])


def not_finite(key: str) -> str:
    """A NaN given to ``key`` (``nan``, which YAML reads as text, or ``.nan``)."""
    return f"{key} must be a finite number, got nan"


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


def yaml_syntax_error(argv: list[str], err: BaseException) -> str | None:
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
        except yaml.YAMLError as bad:
            return yaml_syntax(path, bad)
    return None
