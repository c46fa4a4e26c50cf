"""Lightning's and torch's messages that say nothing to a user of this package, filtered out by the CLI.

Each pattern is a line a run prints without reason here: advertising tips, the availability of accelerators the
machine does not have, a deprecation inside Lightning's own code, a warning that frozen (eval-mode) modules exist
(FLITE's frozen base is meant to be), and checkpoint-folder chatter when ``test`` reads another run's checkpoint.
Warnings and errors a user can act on are kept. :func:`show_progress` prints the package's own progress lines
(long phases: pretraining a base, training FMP's generator) that would otherwise stay silent.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

#: Lightning log lines (INFO) that are dropped.
LOG_NOISE = (
    r"💡 Tip: ",  # litlogger / litmodels advertisements
    r"GPU available: False",  # no GPU: nothing to report
    r"TPU available: False",
    r"HPU available: False",
)
#: Python warnings (message starts) that are ignored.
WARNING_NOISE = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # raised inside Lightning's own pytree helper
    r"Found \d+ module\(s\) in eval mode at the start of training",  # frozen bases are in eval mode on purpose
    r"The dirpath has changed from",  # `test --ckpt_path` of another run's checkpoint
)
LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropNoise(logging.Filter):
    pattern = re.compile("|".join(LOG_NOISE))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


_FILTER = _DropNoise()


def quiet_lightning() -> None:
    """Install the filters (idempotent): drop :data:`LOG_NOISE` log lines and ignore :data:`WARNING_NOISE`."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    for message in WARNING_NOISE:
        warnings.filterwarnings("ignore", message=message)
    if not os.environ.get("LIGHTNING_FL_DEBUG"):  # (debugging keeps Python's file:line prefix)
        warnings.formatwarning = one_line_warning


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as the CLI prints it: ``warning: <message>``, without the source file and line of the code that
    raised it (which says nothing to a user); other categories keep their name."""
    kind = "warning" if category is UserWarning else category.__name__
    return f"{kind}: {message}\n"


class _CurrentStderr(logging.Handler):
    """A handler that writes to whatever ``sys.stderr`` is when a record comes (not the stream of its creation)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def show_progress() -> None:
    """Print the package's own progress lines (INFO and above of the ``lightning_fl`` loggers) on stderr, once: they
    do not propagate to the root logger, where a dependency may have put a handler of its own (``import opacus``
    adds one, which printed every line a second time)."""
    logger = logging.getLogger("lightning_fl")
    if not any(isinstance(h, _CurrentStderr) for h in logger.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
