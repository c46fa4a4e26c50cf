"""The command line's parsers: the root parser, one subcommand parser each for ``fit``, ``validate``, ``test`` and
``export`` (their keys are :data:`~lightning_fl.cli.precheck.TOP_KEYS`; ``export`` adds ``--out`` and ``--adapter``),
and the YAML they write of a parsed config.

A class's help (``--KEY.help CLASS``) is named as users type it (``usage: python -m lightning_fl fit ...``); what
else the parsers do differently from jsonargparse's own is in :mod:`lightning_fl.cli.corrections`.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from typing import Any

import lightning as L
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, set_parsing_settings

from lightning_fl.cli.corrections import correct_jsonargparse
from lightning_fl.cli.precheck import DESCRIPTION, PROG, SUBCOMMANDS, TOP_KEYS
from lightning_fl.trainer_api import TrainerLike, lazy_instance

TrainerType = L.Trainer | TrainerLike


_ROLE = re.compile(r":(?:class|meth|func|attr|data|mod|obj|exc):`(~?)([^`]+)`")


def plain_roles(text: str) -> str:
    """``text`` with the docstrings' Sphinx roles (class, meth, func, attr, data, mod, obj, exc) as a terminal shows
    them: a target written with a leading ``~`` as its last name, else its whole dotted path; a function's or method's
    name gets ``()``, as Sphinx writes it."""

    def plain(match: re.Match) -> str:
        role, short, target = match.group(0)[1:5], match.group(1), match.group(2)
        name = target.rsplit(".", 1)[-1] if short else target
        return name + ("()" if role in ("meth", "func") else "")

    return _ROLE.sub(plain, text)


class _SubcommandParser(ArgumentParser):
    """A subcommand's parser, named ``python -m lightning_fl SUBCOMMAND`` (:attr:`name`) unless told otherwise.

    jsonargparse prints one class's help (``--KEY.help CLASS``) with a parser it makes as ``type(parser)(...)``
    without a ``prog``, which argparse then names after ``sys.argv[0]`` (``__main__.py``): made from this class,
    it is named after the subcommand too, and prints the docstrings' roles as plain names (:func:`plain_roles`).
    """

    name = PROG

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args:  # (argparse's first positional argument is prog)
            kwargs.setdefault("prog", self.name)
        super().__init__(*args, **kwargs)

    def format_help(self) -> str:
        return plain_roles(super().format_help())


# One parser class per subcommand, each naming its own (module attributes, so that they pickle like any class).
_NAMED_PARSERS: dict[str, type[_SubcommandParser]] = {}
for _name in SUBCOMMANDS:
    _NAMED_PARSERS[_name] = globals()[f"_{_name.capitalize()}Parser"] = type(
        f"_{_name.capitalize()}Parser", (_SubcommandParser,), {"name": f"{PROG} {_name}", "__module__": __name__}
    )


def _subcommand_parser(name: str) -> ArgumentParser:
    """One subcommand's parser. Its keys are those of :data:`~lightning_fl.cli.precheck.TOP_KEYS` (with their
    help), which the pre-check that runs before torch is imported accepts; a key added here must be added there."""
    arguments = {  # each top-level key's type and default
        "config": {"action": ActionConfigFile},
        "seed_everything": {"type": bool | int, "default": True},
        "trainer": {"type": TrainerType, "default": lazy_instance(L.Trainer)},
        "model": {"type": L.LightningModule, "required": True},
        "data": {"type": L.LightningDataModule, "required": True},
        "ckpt_path": {"type": str | None, "default": None},
        "threads": {"type": int | None, "default": None},
    }
    if arguments.keys() != TOP_KEYS.keys():
        raise AssertionError(f"the CLI's keys {list(arguments)} are not cli.precheck.TOP_KEYS {list(TOP_KEYS)}")
    parser = _NAMED_PARSERS[name](exit_on_error=False, description=SUBCOMMANDS[name])
    for key, kwargs in arguments.items():
        flags = ["-c", "--config"] if key == "config" else [f"--{key}"]
        parser.add_argument(*flags, help=TOP_KEYS[key], **kwargs)
    if name == "export":  # its own options, given on the command line
        from lightning_fl.cli.export import EXPORT_OPTIONS

        parser.add_argument("--out", type=str | None, default=None, help=EXPORT_OPTIONS["out"])
        parser.add_argument("--adapter", type=bool, default=False, help=EXPORT_OPTIONS["adapter"])
    return parser


def build_parsers(*, field_docs: bool = False) -> tuple[ArgumentParser, dict[str, ArgumentParser]]:
    """The root parser and the subcommands' parsers by name, every plug-in imported so short class names resolve.

    ``field_docs``: a class's help (``--KEY.help CLASS``) shows the docstrings under dataclass fields too, as Sphinx
    and mkdocstrings read them (:class:`~lightning_fl.federated.trainer.arguments.TrainerArguments` documents its
    fields so).
    Off unless help is asked for (:func:`asks_for_help`): to find them, jsonargparse reads the source of every class
    it meets and of each of its bases, torch's and Lightning's included (0.8 s of CPU more to parse
    ``configs/quickstart.yaml``; 0.05 s more for ``--trainer.help FederatedTrainer``, 0.4 s for a LightningModule's
    help), for help that a run never prints. jsonargparse keeps this setting for the whole process, so every call
    sets it.
    """
    from lightning_fl import load_plugins

    load_plugins()  # every plug-in imported, so short class names resolve
    set_parsing_settings(docstring_parse_attribute_docstrings=field_docs)
    correct_jsonargparse()
    root = ArgumentParser(prog=PROG, description=DESCRIPTION, exit_on_error=False)
    subcommands = root.add_subcommands(required=True, dest="subcommand")
    parsers = {name: _subcommand_parser(name) for name in SUBCOMMANDS}
    for name, parser in parsers.items():
        subcommands.add_subcommand(name, parser, help=SUBCOMMANDS[name])
    return root, parsers


def build_parser(*, field_docs: bool = False) -> ArgumentParser:
    """The root parser with the ``fit``, ``validate`` and ``test`` subcommands (``field_docs``: see
    :func:`build_parsers`)."""
    return build_parsers(field_docs=field_docs)[0]


def asks_for_help(argv: list[str]) -> bool:
    """Whether ``argv`` asks for help (``-h``, ``--help``, ``--KEY.help CLASS``): the one output that shows the
    docstrings of a class's arguments."""
    return any(a in ("-h", "--help") or re.fullmatch(r"--[\w.]+\.help(?:=.*)?", a) for a in argv)


def dump_config(parser: ArgumentParser, cfg: Namespace) -> str:
    """YAML of ``cfg`` with every value, ``None`` included, so the file reruns the same experiment."""
    cfg = cfg.clone()
    cfg.pop("config", None)
    return parser.dump(cfg, skip_unset=False)


@contextlib.contextmanager
def full_keys_in_class_help(argv: list[str]):
    """``--trainer.strategy.help FedAdam`` prints the class's options under the last part of the key
    (``--strategy.server_lr``, which the command line then refuses): print them under the whole key instead."""
    keys = [m.group(1) for a in argv if (m := re.fullmatch(r"--([\w.]+)\.help(?:=.*)?", a))]
    key = keys[0] if keys else None
    if key is None or "." not in key:
        yield
        return
    short = key.rsplit(".", 1)[1]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield
    finally:
        text = re.sub(rf"--{re.escape(short)}\.(?=[\w])", f"--{key}.", out.getvalue())
        text = text.replace(f"--{short}.help", f"--{key}.help")
        sys.stdout.write(text)
