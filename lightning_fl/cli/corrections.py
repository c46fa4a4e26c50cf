"""Where this CLI corrects jsonargparse: :func:`correct_jsonargparse` applies both, once per process.

- A value given on the command line to a class inside a class (``--trainer.privacy.noise_seed null``: ``privacy``
  is a class among ``trainer``'s arguments) is read as YAML for the outer class, then handed to the inner one as
  text again, which jsonargparse writes with ``str()``: ``null`` arrived as the text ``None`` (refused: "expected
  int or null, got 'None'"). :func:`nested_values_as_yaml` writes it back as YAML (``null``).
- A class's help (``--KEY.help CLASS``) heads its options with the first line of the class's docstring, which breaks
  off mid-sentence when the sentence wraps: :func:`whole_first_sentences` heads them with the whole sentence.

Both replace a function that jsonargparse keeps in one of its private modules (``jsonargparse._typehints``,
``jsonargparse._signatures``); a jsonargparse without it is left as it is (``tests/test_cli.py`` then fails).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import yaml


def correct_jsonargparse() -> None:
    """Apply :func:`nested_values_as_yaml` and :func:`whole_first_sentences` (each once per process)."""
    nested_values_as_yaml()
    whole_first_sentences()


# ------------------------------------------------------------------------------ values for a class in a class
def as_yaml(value: Any) -> Any:
    """``value`` (read from YAML) as YAML text again, so reading it gives it back; text and what YAML cannot write
    (a namespace) as they are."""
    if isinstance(value, str):
        return value
    try:
        text = yaml.safe_dump(value, default_flow_style=True, width=2**31)
    except yaml.YAMLError:
        return value
    return text.removesuffix("\n...\n").strip()


def nested_values_as_yaml() -> None:
    """Give a class inside a class its command-line value as YAML (``null``), not as Python writes it (``None``).

    jsonargparse reads ``--trainer.privacy.noise_seed null`` for ``trainer``, as YAML (``None``), then hands the
    rest to ``trainer``'s class as the text ``--privacy.noise_seed={value}``: the value is written back here first.
    """
    typehints = importlib.import_module("jsonargparse._typehints")
    original: Callable[..., Any] | None = getattr(typehints, "adapt_class_type", None)
    nested_arg = getattr(importlib.import_module("jsonargparse._util"), "NestedArg", None)
    if original is None or nested_arg is None or getattr(original, "values_as_yaml", False):
        return

    def adapt_class_type(value: Any, *args: Any, **kwargs: Any) -> Any:
        init_args = value.get("init_args") if hasattr(value, "get") else None
        if isinstance(init_args, nested_arg) and not isinstance(init_args.val, str):
            value = value.clone() if hasattr(value, "clone") else dict(value)
            value["init_args"] = nested_arg(key=init_args.key, val=as_yaml(init_args.val))
        return original(value, *args, **kwargs)

    adapt_class_type.values_as_yaml = True  # type: ignore[attr-defined]
    typehints.adapt_class_type = adapt_class_type


# ------------------------------------------------------------------------------ the headings of a class's help
_SENTENCE_END = re.compile(r"\.(?=\s+[A-Z]|\s*$)")  # (not "e.g. the", nor "trainer.rounds")


def first_sentence(doc: str | None) -> str | None:
    """The first sentence of a docstring's first paragraph, its lines joined, without its full stop."""
    if not doc or not doc.strip():
        return None
    paragraph = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    end = _SENTENCE_END.search(paragraph)
    return paragraph[: end.start()] if end else paragraph


def _docstrings(component: Any, method_name: str | None) -> list[str]:
    """The docstrings jsonargparse may take a heading from: the method's, else the class's and its bases' and their
    constructors'."""
    if method_name:
        component = getattr(component, method_name, None)
    owners = inspect.getmro(component) if inspect.isclass(component) else (component,)
    inits = [c.__dict__["__init__"] for c in owners if inspect.isclass(component) and "__init__" in c.__dict__]
    return [doc for obj in (*owners, *inits) if isinstance(doc := getattr(obj, "__doc__", None), str)]


def whole_first_sentences() -> None:
    """Make the heading of a class's options (``--KEY.help CLASS``) the docstring's whole first sentence.

    jsonargparse heads them with docstring_parser's short description: the docstring's first line, which breaks off
    mid-sentence when the sentence wraps onto the next line ("... adds a ``1 / m`` share of the:"). Its lookup is
    kept (which docstring); the heading becomes that docstring's first sentence. jsonargparse keeps the lookup as a
    module global, replaced here once per process; a jsonargparse without it keeps its own headings.
    """
    signatures = importlib.import_module("jsonargparse._signatures")
    original: Callable[..., str | None] | None = getattr(signatures, "get_doc_short_description", None)
    if original is None or getattr(original, "whole_sentence", False):
        return

    def short_description(component: Any, method_name: str | None = None, logger: Any = None) -> str | None:
        short = original(component, method_name, logger=logger)
        if not short:
            return short
        for doc in _docstrings(component, method_name):
            if inspect.cleandoc(doc).split("\n", 1)[0].strip() == short.strip():
                return first_sentence(doc)
        return short

    short_description.whole_sentence = True  # type: ignore[attr-defined]
    signatures.get_doc_short_description = short_description
