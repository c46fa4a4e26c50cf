"""What the command line can answer before torch and Lightning are imported (5 s on a small machine).

``python -m lightning_fl --help`` (``-h``, or no arguments) is answered here with :data:`USAGE`: the subcommands,
where the configs and the docs are, and an example (a subcommand's ``--help`` needs the full parser).

The shape of the command line lives here, in a module that imports neither: the subcommands and the top-level keys
every config has (:mod:`lightning_fl.cli.parser` builds its parsers from these,
:mod:`lightning_fl.cli.parse_errors` cites them). :func:`precheck` runs first in ``python -m lightning_fl`` and
answers, in a fraction of a second and with the words the full parser would use, the mistakes that need no class:
an unknown subcommand, a ``--config`` file that does not exist, one that breaks YAML's syntax, and one with an
unknown top-level key. Anything it is not sure of is left to the full parser, which refuses the same mistakes the
same way (``tests/test_cli_precheck.py`` checks that the two agree).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from pathlib import Path
from typing import Any

# The subcommands, with their help: the CLI builds one parser each from this, and messages cite them.
SUBCOMMANDS = {
    "fit": "Train the model (resume with --ckpt_path).",
    "validate": "Evaluate on the validation split (weights from --ckpt_path).",
    "test": "Evaluate on the test split (weights from --ckpt_path).",
    "export": "Write the fine-tuned language model as a Hugging Face folder (--ckpt_path, --out DIR; --adapter: "
    "LoRA's PEFT adapter).",
}

# The top-level keys of every config, with their help, in the order messages list them: the CLI's subcommand
# parser adds exactly these (``--config`` first), so this pre-check and the full parser accept the same keys.
TOP_KEYS = {
    "seed_everything": "Global seed; true picks one (0 unless PL_GLOBAL_SEED is set) and records it in the saved "
    "config.",
    "trainer": "lightning.Trainer, or any class with fit/validate/test(model, datamodule=, ckpt_path=).",
    "model": "The LightningModule to run.",
    "data": "The LightningDataModule.",
    "ckpt_path": "Checkpoint to resume (fit) or evaluate.",
    "threads": "CPU threads per process for torch; null: one fewer than the cores (at least 1), shared among a "
    "node's processes. More threads than free cores slow small models down when the machine is shared.",
    "config": "Path to a YAML config file.",
}
# The program as users type it, and what it is: the full parser's prog and description (lightning_fl.cli.parser).
PROG = "python -m lightning_fl"
DESCRIPTION = "Federated learning experiments: FLITE, FMP and their baselines."
_WIDTH = max(len(name) for name in SUBCOMMANDS) + 2

# ``python -m lightning_fl --help``: printed before anything heavy is imported.
USAGE = "\n".join(
    [
        f"usage: {PROG} {{{','.join(SUBCOMMANDS)}}} --config FILE [--KEY.SUB VALUE ...]",
        "",
        DESCRIPTION,
        "",
        "subcommands:",
        *(f"  {name:<{_WIDTH}}{text}" for name, text in SUBCOMMANDS.items()),
        "",
        "example:",
        f"  {PROG} fit --config configs/quickstart.yaml",
        "",
        "configs:  configs/ in the repository, one YAML file per experiment; override any key with a dotted",
        "          option, e.g. --trainer.rounds 5.",
        f"keys:     {PROG} fit --help lists the top-level keys (trainer, model, data, ...);",
        "          --KEY.help CLASS the options of one class (e.g. --trainer.help FederatedTrainer);",
        "          --config FILE --print_config every key of a config with its value.",
        'docs:     docs/ in the repository (start at docs/index.md); the site: pip install -e ".[docs]", then',
        "          mkdocs serve.",
    ]
)

# What jsonargparse accepts at the top of a config file besides the keys: its record of the file's path.
_IGNORED_KEYS = {"__path__"}

HINT = (
    "Run with --print_config to see every key and its value, or --KEY.help CLASS for the options of one class "
    "(e.g. --trainer.strategy.help FedAdam)."
)


def fail(message: str) -> None:
    """Print ``error: message`` and the hint to stderr and exit with code 2 (a mistake in the arguments)."""
    print(f"error: {message}", file=sys.stderr)
    print(HINT, file=sys.stderr)
    raise SystemExit(2)


def unknown_subcommand(name: str) -> str:
    close = difflib.get_close_matches(name, list(SUBCOMMANDS), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"unknown subcommand '{name}'.{hint} Accepted: {', '.join(SUBCOMMANDS)}."


def unknown_top_key(key: str) -> str:
    """``key`` (dotted or not) is not a top-level key, or under one: name it (its first part unless it starts with
    a top-level key) and the keys that are."""
    if key.split(".")[0] not in TOP_KEYS:
        key = key.split(".")[0]
    close = difflib.get_close_matches(key, list(TOP_KEYS), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"unknown key '{key}'.{hint} Accepted top-level keys: {', '.join(TOP_KEYS)}."


def missing_config(path: str) -> str:
    return f"config file {path} does not exist; check the path given to --config."


def yaml_syntax(path: str, bad: Exception) -> str:
    """Where the config file ``path`` breaks YAML's syntax (``bad``, what the YAML reader raised)."""
    import yaml

    if not isinstance(bad, yaml.MarkedYAMLError):
        return f"config file {path}: YAML syntax error: {bad}"
    mark = bad.problem_mark or bad.context_mark
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    opened = bad.context_mark if bad.context and bad.context_mark is not mark else None
    context = f" ({bad.context} at line {opened.line + 1})" if opened is not None else ""
    return (
        f"config file {path}: YAML syntax error{where}: {bad.problem or bad.context}{context}; "
        "check the indentation, the ':' after each key and the closing brackets there."
    )


def config_values(argv: list[str]) -> list[str]:
    """The values given to ``--config``/``-c`` (``--config X``, ``--config=X``, ``-c X``, ``-c=X``), in order."""
    values = []
    for i, arg in enumerate(argv):
        if arg in ("-c", "--config") and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif arg.startswith(("--config=", "-c=")):
            values.append(arg.split("=", 1)[1])
    return values


def _has_value(value: Any) -> bool:
    """Whether a config value sets anything: jsonargparse flattens nested mappings, so an empty one sets nothing
    (and is not refused even under an unknown key)."""
    return not isinstance(value, dict) or any(_has_value(v) for v in value.values())


def _unknown_key(config: Any) -> str | None:
    if not isinstance(config, dict):
        return None  # (not a mapping: the full parser says what it expected)
    for key, value in config.items():
        if not isinstance(key, str):
            return None
        top = key.split(".")[0]
        if top not in TOP_KEYS and top not in _IGNORED_KEYS and _has_value(value):
            return key
    return None


def _check_config(value: str) -> str | None:
    """What is wrong with one ``--config`` value that needs no class to see, or None."""
    import yaml

    if value == "-" or "://" in value:
        return None  # standard input, a URL: left to jsonargparse
    path = os.path.expanduser(value)
    if not os.path.exists(path):
        # jsonargparse reads a value that is not a file as the config itself when it is a YAML mapping
        try:
            inline = yaml.safe_load(value)
        except yaml.YAMLError:
            return None
        if isinstance(inline, str):
            return missing_config(os.path.join(os.getcwd(), path))  # (as jsonargparse names it: joined, not resolved)
        if isinstance(inline, dict) and not all(v is None for v in inline.values()):
            key = _unknown_key(inline)
            return unknown_top_key(key) if key is not None else None
        return None
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as bad:
        return yaml_syntax(value, bad)
    except Exception:  # (a value the safe loader cannot build, which jsonargparse's own loader may read)
        return None
    key = _unknown_key(config)
    return unknown_top_key(key) if key is not None else None


def _stops_parsing(arg: str) -> bool:
    """``--help`` and ``--KEY.help CLASS`` print and exit when the parser reaches them: what follows is not read."""
    return arg in ("-h", "--help") or re.fullmatch(r"--[\w.]+\.help(?:=.*)?", arg) is not None


def check(argv: list[str]) -> str | None:
    """The first mistake in ``argv`` that needs no class to see, as the one line :func:`fail` prints, or None."""
    if not argv or argv[0].startswith("-"):
        return None  # the root parser's own options (--help): left to it
    subcommand, rest = argv[0], argv[1:]
    if subcommand not in SUBCOMMANDS:
        return unknown_subcommand(subcommand)
    stop = next((i for i, arg in enumerate(rest) if _stops_parsing(arg)), len(rest))
    for value in config_values(rest[:stop]):
        if (problem := _check_config(value)) is not None:
            return f"{subcommand}: {problem}"
    return None


def precheck(argv: list[str]) -> None:
    """Print :data:`USAGE` and exit for ``--help``/``-h`` (code 0) or no arguments (code 2, after one line saying
    what is missing); exit with code 2 and one line (:func:`fail`) if :func:`check` finds a mistake in ``argv``."""
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        raise SystemExit(0)
    if not argv:
        print(f"error: give a subcommand: {', '.join(SUBCOMMANDS)}.\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    if (problem := check(argv)) is not None:
        fail(problem)
