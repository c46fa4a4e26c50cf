"""``python -m lightning_fl.flower.supernode [flower-supernode options]``: a SuperNode that leaves no process behind.

``flower-supernode`` starts a ``flower-superexec``, which starts one ``flwr-clientapp`` per message, and never stops
them itself: each watches its parent's PID and exits once that is gone. A SuperNode stopped by SIGTERM whose own
parent has not reaped it yet still holds its PID (a zombie), so its SuperExec keeps running; and a ClientApp busy
when its SuperNode stops retries for about a minute. This command runs ``flower-supernode`` with the same options in
a process group of its own, passes SIGTERM, SIGINT and SIGHUP on to it, reaps it as soon as it exits, then stops
what is left of its group (SIGTERM, then SIGKILL after :data:`GRACE` seconds), and exits with the SuperNode's exit
status (128 + the signal's number when a signal ended it; 2 and one line when ``flower-supernode`` is not
installed). On Linux it also adopts the processes the SuperNode leaves (a child subreaper) and reaps them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE = 10.0  # seconds the SuperNode's leftover processes get between SIGTERM and SIGKILL
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_CHILD_SUBREAPER = 36


def executable(name: str) -> str | None:
    """``name`` on PATH, else beside this interpreter (a virtual environment run without activating it)."""
    found = shutil.which(name)
    if found is None and (beside := Path(sys.executable).parent / name).is_file():
        found = str(beside)
    return found


def adopt_orphans() -> bool:
    """Make this process the one the SuperNode's orphans are re-parented to, so it can reap them (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _reap() -> None:
    """Collect every exited child (adopted orphans included) without waiting."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (a member that is not ours any more: nothing this command may stop)
        return False
    return True


def stop_group(group: int, grace: float = GRACE) -> None:
    """SIGTERM every process left in process group ``group``, SIGKILL those alive after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if not _group_alive(group):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            _reap()
            if not _group_alive(group):
                return
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    exe = executable("flower-supernode")
    if exe is None:
        print('error: flower-supernode not found: pip install "lightning-fl[flower]" (flwr 1.42)', file=sys.stderr)
        return 2
    adopt_orphans()
    child = subprocess.Popen([exe, *args], start_new_session=True)  # its own group: the SuperExec and apps join it

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        status = child.wait()
    finally:
        stop_group(child.pid)
        _reap()
    return 128 - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main())
