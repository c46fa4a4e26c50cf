"""The command line, ``python -m lightning_fl fit|validate|test|export --config FILE [--key.sub value ...]``.

- :mod:`~lightning_fl.cli.command`: parse, seed, build the plug-ins and run the subcommand
  (:func:`~lightning_fl.cli.command.main`, :func:`~lightning_fl.cli.command.build`); :mod:`~lightning_fl.cli.parser`:
  the parsers (:func:`~lightning_fl.cli.parser.build_parser`) and the YAML of a config.
- :mod:`~lightning_fl.cli.precheck`: the subcommands and top-level keys, and the mistakes answered before torch is
  imported (``python -m lightning_fl`` runs it first).
- :mod:`~lightning_fl.cli.parse_errors`, :mod:`~lightning_fl.cli.build_errors`: jsonargparse's errors (parsing, then
  building the classes) in one line naming the key; :mod:`~lightning_fl.cli.classes`: what those messages know
  about the classes a key takes.
- :mod:`~lightning_fl.cli.corrections`: where the parsers correct jsonargparse (``null`` given to a class inside a
  class, the headings of a class's help).

Importing this package imports no torch (the pre-check must not pay for it): :func:`~lightning_fl.cli.command.main`,
:func:`~lightning_fl.cli.command.build` and the other names below are imported from their modules when first used.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {  # public name -> the module that defines it
    "ConfigParseError": "lightning_fl.cli.command",
    "Run": "lightning_fl.cli.command",
    "build": "lightning_fl.cli.command",
    "build_parser": "lightning_fl.cli.parser",
    "dump_config": "lightning_fl.cli.parser",
    "main": "lightning_fl.cli.command",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_fl.cli' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
