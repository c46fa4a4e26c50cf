"""Run one of the package's Python entry points as a forked child of the test process.

A fresh interpreter spends most of a tiny run importing (torch, Lightning, and torchmetrics, which imports
torchvision, scipy.signal and transformers eagerly): several seconds of CPU before the first line of ours. A child
forked from the test process has all of that imported already and runs the same ``__main__`` (a script's or a
module's) with the given argv, folder and environment, in its own process group, its output captured from its file
descriptors. Used where a test checks what a script or tool does; tests whose subject is a fresh process (its
start-up, its traceback-free output, two processes started together, a distributed launch) start real ones.
"""

from __future__ import annotations

import contextlib
import logging
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path

_PYTHONS_FORMAT = getattr(warnings, "_formatwarning_orig", warnings.formatwarning)


def run_python(args: Sequence, *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``python *args`` (``script.py ...`` or ``-m module ...``) in ``cwd`` under ``env``, as a forked child.

    Returns what ``subprocess.run(..., capture_output=True, text=True)`` would; raises ``subprocess.TimeoutExpired``
    after killing the child's process group (it and whatever it started) if it outlives ``timeout``."""
    args = [str(a) for a in args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _child(args, cwd, env, out.fileno(), err.fileno())
        code = _wait(pid, timeout)
        out.seek(0), err.seek(0)
        stdout, stderr = (f.read().decode(errors="replace") for f in (out, err))
    if code is None:
        raise subprocess.TimeoutExpired([sys.executable, *args], timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess([sys.executable, *args], code, stdout, stderr)


def _wait(pid: int, timeout: float) -> int | None:
    """The child's exit code, or None once it has been killed for running past ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.02)


def _child(args: list[str], cwd: Path, env: dict[str, str], out: int, err: int) -> None:
    code = 1
    try:
        os.setsid()
        os.dup2(out, 1), os.dup2(err, 2)
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False, buffering=1)  # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(2, "w", closefd=False, buffering=1)  # noqa: SIM115
        sys.stdin = open(os.devnull)  # noqa: SIM115
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        _fresh_warnings_and_logging()
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[:0] = [str(cwd), *extra]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = args
            sys.path[:0] = [str(Path(args[0]).resolve().parent), *extra]
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _fresh_warnings_and_logging() -> None:
    """What a fresh interpreter starts with, instead of the test's warning recorder and log capture."""
    warnings.resetwarnings()
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")

    warnings.formatwarning = _PYTHONS_FORMAT  # (the package's CLI sets its one-line format again when it starts)

    def show(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
