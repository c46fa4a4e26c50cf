"""Checkpoint files: crash-safe writes, safe reads, content digests for caches, and the package's cache folder."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightning_fl.errors import CheckpointError


def default_cache_dir() -> Path:
    """``$LIGHTNING_FL_CACHE`` or ``~/.cache/lightning_fl`` (pretrained bases and other derived files)."""
    env = os.environ.get("LIGHTNING_FL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_fl"


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` that never leaves a partial file: temp file in the same folder, fsync, rename, fsync dir.

    A reader sees either the previous file or the complete new one, also after a crash or a kill.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def remove_stale_temps(folder: str | Path) -> int:
    """Delete temp files left by an interrupted :func:`atomic_save`; returns how many."""
    removed = 0
    for tmp in Path(folder).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
        removed += 1
    return removed


def read_checkpoint(path: str | Path, what: str = "checkpoint") -> Any:
    """``torch.load`` with ``weights_only=True`` (tensors and plain containers, no code); failures name ``what``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"{what} {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"{what} {path} could not be read safely (weights_only=True): {err}") from err


def digest_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of named tensors (names and float32 values, in name order): part of cache keys and fingerprints."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()
