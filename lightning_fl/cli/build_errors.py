"""The reason a class the config names could not be built, in one line naming the key (:func:`build_error`).

jsonargparse builds every class of a parsed config; a constructor that refuses its arguments raises its own
message, which jsonargparse may fold into the text of a Union's members. :class:`FailedBuild` keeps the exception
and class that raised; :func:`name_key` puts the dotted key in front of the message unless it names one already.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

from jsonargparse import ArgumentParser, Namespace

from lightning_fl.cli.classes import init_params, resolve_class
from lightning_fl.cli.parse_errors import _UNION, _error_causes
from lightning_fl.cli.precheck import TOP_KEYS

# What to give instead, for keys whose refusal (Lightning's own message) does not say it.
FIXES = {
    "trainer.devices": "give a number of devices >= 1 or 'auto' (-1 and GPU indices such as '0,1' need GPUs)",
}


class FailedBuild:
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


def instantiate(parser: ArgumentParser, cfg: Namespace, failed: FailedBuild) -> Namespace:
    """Build every class of ``cfg``, keeping the one that raises (and its arguments) in ``failed``."""
    return parser.instantiate(cfg, instantiators=[(failed, object, True)])


def build_error(err: BaseException, cfg: Namespace | None = None, failed: FailedBuild | None = None) -> str:
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
        cls = resolve_class(given.group(1)) if given else None
    message = " ".join(line.strip() for line in text.splitlines() if line.strip())
    keys = [(k, node) for k, node in _config_classes(cfg) if cls is not None and resolve_class(node.class_path) is cls]
    # the same class may be given twice (two callbacks): the one built with these arguments
    agree = [k for k, node in keys if all(kwargs.get(n, v) == v for n, v in _plain_init_args(node).items())]
    return name_key(message, (agree or [k for k, _ in keys] or [None])[0], cls)


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


def nan_key(value: Any, key: str = "") -> str | None:
    """The dotted key of the first NaN in a parsed config (``.nan``, YAML's NaN), or None: no key takes one."""
    if isinstance(value, float) and math.isnan(value):
        return key
    if isinstance(value, Namespace):
        value = vars(value)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for name, sub in items:
        if isinstance(name, int):
            sub_key = f"{key}[{name}]"
        else:
            sub_key = key if name == "init_args" else f"{key}.{name}" if key else str(name)
        if (found := nan_key(sub, sub_key)) is not None:
            return found
    return None


def _plain_init_args(node: Namespace) -> dict[str, Any]:
    init_args = node.get("init_args")
    if not isinstance(init_args, Namespace):
        return {}
    return {n: v for n, v in vars(init_args).items() if isinstance(v, (str, int, float, bool, type(None)))}


def quoted_argument(message: str, cls: type | None) -> str | None:
    """The argument of ``cls`` that ``message`` quotes the way Lightning does: `Trainer(devices=0)`, `devices`."""
    params = init_params(cls) if cls is not None else []
    return next((n for n in re.findall(r"`(?:\w+\()?(\w+)(?:=|`)", message) if n in params), None)


def name_key(message: str, key: str | None, cls: type | None) -> str:
    """``message``, starting with the dotted key it is about unless it names one already.

    ``key`` is that of the class ``cls`` that refused; Lightning quotes the argument (`Trainer(devices=0)`), and
    our classes name it from their own level ("codec.bits must be ...").
    """
    if key is None:
        return message
    params = init_params(cls) if cls is not None else []
    if argument := quoted_argument(message, cls) or next(
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
