"""Run folders: claimed atomically, and locked while a process writes them.

A run writes ``<root>/<name>/<version>/`` (config, TensorBoard events, checkpoints). Two runs started at the
same moment must never share a folder, and a run that resumes must never attach to a folder another live
process is writing. So:

- a new folder is claimed with an exclusive ``mkdir`` (``version_N``, the next free ``N``; a process that
  loses the race takes ``N + 1``; an evaluation, ``validate`` or ``test``, claims ``validate_N`` or ``test_N``);
- the claiming process holds an exclusive ``flock`` on ``<folder>/.lock`` (which records its pid and host)
  until the run ends; the kernel drops the lock when the process dies, even by ``kill -9``, so a stale lock
  never blocks a later resume;
- a folder that already holds a run is only ever reopened to resume that run.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import lightning as L
from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_fl.errors import UserError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: folders are still claimed exclusively, but not locked
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".lock"


class RunFolderError(UserError):
    """A run folder is being written by another process, or already holds another run."""


class RunLock:
    """An exclusive, non-blocking lock on a run folder (``flock`` on ``<folder>/.lock``)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        """Take the lock if no live process holds it; write our pid and host into the lock file."""
        if self._fd is not None:
            return True
        for _ in range(10):  # a holder that finished may remove the file between our open and our lock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    return False
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break  # we hold the lock of the file that is there
            except FileNotFoundError:
                pass
            os.close(fd)
        else:  # pragma: no cover - ten removals in a row
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd
        return True

    def release(self) -> None:
        """Remove the lock file (while still holding it: a process waiting for it then sees it is gone) and let go."""
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder(folder: str | Path) -> str | None:
    """Who writes ``folder`` now (``"pid P on HOST"``), or ``None`` when no live process holds its lock."""
    path = Path(folder) / LOCK_NAME
    if fcntl is None or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        text = path.read_text(errors="replace").strip()
        return text or "another process"
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` holds (part of) a run: anything but its lock file."""
    return folder.is_dir() and any(p.name != LOCK_NAME for p in folder.iterdir())


def _next_free(parent: Path, prefix: str = "version") -> int:
    numbers = [int(p.name.split("_", 1)[1]) for p in parent.glob(f"{prefix}_*") if p.name.split("_", 1)[1].isdigit()]
    return max(numbers, default=-1) + 1


def claim(
    parent: str | Path,
    version: int | str | None = None,
    resume: Path | None = None,
    restart_incomplete: bool = False,
    prefix: str = "version",
) -> RunLock:
    """Claim and lock the run folder under ``parent`` (``<root>/<name>``); the lock says which folder.

    Args:
        parent: The experiment folder.
        version: ``None``: a new ``<prefix>_N`` (exclusive ``mkdir``, so concurrent runs get distinct folders);
            an int ``N``: ``version_N``; a string: that folder name.
        resume: The folder of the run being resumed (it may hold a run; it must not be locked by another process).
        restart_incomplete: A named folder whose run never saved a checkpoint (it died in its first round) may be
            started over; without it, any folder holding a run is refused.
        prefix: A new folder's name before ``_N``: ``version`` for training runs, ``validate`` or ``test`` for
            evaluations.
    """
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    if version is None and resume is None:
        n = _next_free(parent, prefix)
        while True:
            folder = parent / f"{prefix}_{n}"
            try:
                folder.mkdir()
            except FileExistsError:  # another run took it between our scan and our mkdir
                n += 1
                continue
            lock = RunLock(folder)
            if lock.acquire():
                return lock
            n += 1  # pragma: no cover - a folder we just created is locked by someone else
    if version is None:
        folder = Path(resume)
    else:
        folder = parent / (version if isinstance(version, str) else f"version_{version}")
    folder.mkdir(parents=True, exist_ok=True)
    lock = RunLock(folder)
    if not lock.acquire():
        raise RunFolderError(
            f"run folder {folder} is being written by {holder(folder) or 'another process'}; wait for that run to "
            "finish, or choose another trainer.version (null picks a new folder)"
        )
    resuming = resume is not None and folder.resolve() == Path(resume).resolve()
    incomplete = not any((folder / "checkpoints").glob("*.ckpt"))
    if not resuming and holds_run(folder) and not (restart_incomplete and incomplete):
        lock.release()
        raise RunFolderError(
            f"run folder {folder} already holds a run; resume it (trainer.resume true, or --ckpt_path "
            f"{folder}/checkpoints/last.ckpt), choose another trainer.version, or delete the folder"
        )
    return lock


def claim_for_lightning(trainer: L.Trainer, prefix: str = "version") -> RunLock | None:
    """Claim a new run folder (``<prefix>_N``) for a ``lightning.Trainer``'s loggers before it creates one itself.

    Lightning picks ``version_N`` by listing the folder, so two runs started together would share one. On the
    process of rank 0 (other ranks receive rank 0's folder from Lightning), the first logger without a version
    gets a claimed folder; loggers sharing its directory get the same version. ``None``: nothing to claim.
    """
    if rank_zero_only.rank != 0:
        return None
    loggers = [lg for lg in trainer.loggers if getattr(lg, "_version", 0) is None and hasattr(lg, "root_dir")]
    if not loggers:
        return None
    parent = Path(loggers[0].root_dir)
    lock = claim(parent, prefix=prefix)
    for lg in loggers:
        if Path(lg.root_dir) == parent:
            lg._version = lock.folder.name  # Lightning's loggers keep the version here; no public setter exists
    return lock
