"""Checkpoint files: crash-safe writes, safe reads, content digests and the package's content-addressed caches."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

import torch

from lightning_fl.errors import CheckpointError, DiskFullError


def default_cache_dir() -> Path:
    """``$LIGHTNING_FL_CACHE`` or ``~/.cache/lightning_fl`` (pretrained bases and other derived files)."""
    env = os.environ.get("LIGHTNING_FL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_fl"


def cache_key_text(key: dict[str, Any]) -> str:
    """The canonical text of a cache key (sorted JSON; objects by ``str``): what a cache file records and is
    hashed to name it."""
    return json.dumps(key, sort_keys=True, default=str)


def cache_file(kind: str, key: dict[str, Any], filename: str, cache_dir: str | Path | None = None) -> Path:
    """Where the derived file described by ``key`` lives: ``<cache_dir>/<kind>/<digest>/<filename>``.

    ``digest`` is the first 16 hex digits of the SHA-256 of :func:`cache_key_text`; ``cache_dir`` defaults to
    :func:`default_cache_dir`. Everything that determines the file's contents belongs in ``key``, so a changed
    setting is a new folder, never a stale hit; every key also holds what the machine adds
    (:func:`compute_environment`). The package's three caches use it: pretrained bases (``bases/``), extracted
    features (``features/``) and FMP's predictive generators (``generators/``).
    """
    digest = hashlib.sha256(cache_key_text(key).encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return root / kind / digest / filename


def compute_environment(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What, besides its inputs, decides the bits of a file trained or computed on ``device``: for a cache key.

    The torch version and the device; on a CPU also its kernel level (``AVX2``, ``AVX512``...) and the number of
    intra-op threads, since kernels split their sums among the threads and add the parts in another order: the same
    Fashion-MNIST feature extractor trained with 1 and with 2 threads gives other features (docs/results-fmp.md).
    """
    device = torch.device(device)
    env: dict[str, Any] = {"torch": str(torch.__version__), "device": device.type}  # a str, not a TorchVersion
    if device.type == "cuda":
        env["name"] = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        env["cpu"] = torch.backends.cpu.get_cpu_capability()
        env["threads"] = torch.get_num_threads()
    return env


def environment_label(environment: dict[str, Any]) -> str:
    """One line for a :func:`compute_environment`: ``torch=2.14.1 device=cpu cpu=AVX512 threads=1``."""
    return " ".join(f"{k}={v}" for k, v in environment.items())


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` that never leaves a partial file: temp file in the same folder, fsync, rename, fsync dir.

    A reader sees either the previous file or the complete new one, also after a crash or a kill.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        _raise_if_full(err, obj, path)
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            _raise_if_full(err, obj, path)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def _raise_if_full(err: OSError, obj: Any, path: Path) -> None:
    """A full disk (or quota) while writing ``path``: one line naming the folder and the bytes needed."""
    import errno
    import shutil

    if err.errno not in (errno.ENOSPC, errno.EDQUOT):
        return
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        free = f"{shutil.disk_usage(path.parent).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    previous = f"; the previous {path.name} is intact" if path.exists() else ""
    raise DiskFullError(
        f"no space left to write {path} ({len(buffer.getvalue()):,} bytes needed, {free} in {path.parent})"
        f"{previous}; free some space or point trainer.default_root_dir to another disk"
    ) from None


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temp file and a rename: concurrent writers never interleave."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def remove_stale_temps(folder: str | Path) -> int:
    """Delete temp files left by an interrupted :func:`atomic_save`; returns how many."""
    removed = 0
    for tmp in Path(folder).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
        removed += 1
    return removed


#: What to do about a checkpoint that cannot be used, unless the caller knows better.
DEFAULT_FIX = "pass a checkpoint written by this package"

Source = str | Path | bytes | bytearray | memoryview | BinaryIO


def read_checkpoint(
    source: Source, what: str = "checkpoint", *, fix: str = DEFAULT_FIX, map_location: Any = "cpu"
) -> Any:
    """The one way the package reads a checkpoint or cached file: ``torch.load(..., weights_only=True)``.

    ``source`` is a path, the bytes of a file, or a binary file object. ``weights_only=True`` is passed
    explicitly, so tensors and plain containers load but nothing is imported and no code runs, even when
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set (torch honours that variable only when the argument is left out).

    Every failure (missing, a folder, empty, truncated, not a checkpoint, a pickle that needs a Python object)
    raises :class:`CheckpointError` with one line: ``what`` (the config key or the cache it is for), the file,
    the reason and ``fix``. A ``what`` ending in ``=`` is joined to the path without a space (``key=path``).
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        name, stream = f"{what} (in-memory bytes)", io.BytesIO(bytes(source))
    elif hasattr(source, "read"):
        name, stream = f"{what} ({getattr(source, 'name', 'in-memory stream')})", source
    else:
        path = Path(source).expanduser()
        name = checkpoint_name(what, path)
        if path.is_dir():
            raise CheckpointError(f"{name} is a folder, not a checkpoint file; {fix}")
        if not path.is_file():
            problem = "is not a regular file" if path.exists() else "does not exist"
            raise CheckpointError(f"{name} {problem}; {fix}")
        stream = path
    try:
        return torch.load(stream, map_location=map_location, weights_only=True)
    except Exception as err:
        raise CheckpointError(f"{name} could not be read safely (weights_only=True): {_why(err)}; {fix}") from err


def checkpoint_name(what: str, path: str | Path) -> str:
    """How messages name a file: ``what path``, or ``key=path`` when ``what`` ends with ``=``."""
    return f"{what}{path}" if what.endswith("=") else f"{what} {path}"


def _why(err: Exception) -> str:
    """One line saying why ``torch.load(weights_only=True)`` failed (torch's own messages span paragraphs)."""
    text = str(err)
    # The name comes from the file: keep to identifier characters so a crafted one cannot garble the terminal.
    if match := re.search(r"(?:unsupported GLOBAL|Unsupported (?:global|class): GLOBAL) ([\w.]+)", text):
        return f"it needs the Python object {match.group(1)} (loading it could run code), which is refused"
    if match := re.search(r"Unsupported operand (\d+)", text):
        return f"it is not a file written by torch.save, or it is corrupt (pickle opcode {match.group(1)} refused)"
    if "Weights only load failed" in text:
        return "it holds Python objects other than tensors and plain containers, which are refused"
    if isinstance(err, EOFError):
        return "it is empty or truncated"
    if "zip archive" in text or "PytorchStreamReader" in text:
        return "it is truncated or corrupt (an incomplete zip archive)"
    if isinstance(err, OSError):
        return f"{type(err).__name__}: {err.strerror or text}"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {first[:200]}" if first else type(err).__name__


def tensor_state(obj: Any, name: str, *, keys: tuple[str, ...] = (), fix: str = DEFAULT_FIX) -> dict[str, torch.Tensor]:
    """The state dict (names to tensors) in a loaded checkpoint: ``obj[key]`` for the first of ``keys`` present, else
    ``obj`` itself; raise :class:`CheckpointError` naming ``name`` (the key and file) when it is not one."""
    if isinstance(obj, dict):
        obj = next((obj[k] for k in keys if k in obj), obj)
    if (
        not isinstance(obj, dict)
        or not obj
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    ):
        raise CheckpointError(f"{name} holds no state dict of tensors; {fix}")
    return obj


def state_mismatch(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> str | None:
    """What keeps ``state`` from loading into a module whose state dict is ``own`` (``None`` if it fits)."""
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    parts = [f"missing {missing[:4]}"] * bool(missing) + [f"unexpected {unexpected[:4]}"] * bool(unexpected)
    parts += [f"shape (file vs model) {wrong[:4]}"] * bool(wrong)
    return "; ".join(parts) or None


def digest_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of named tensors (names and float32 values, in name order): part of cache keys and fingerprints."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def content_digest(obj: Any) -> str:
    """SHA-256 of a checkpoint's content: every tensor (dtype, shape, bytes) and plain value (type and repr), in
    key order. What :func:`lightning_fl.federated.persistence.checkpoint.save_round` stores and ``load_round``
    verifies: a flipped bit anywhere in what the file holds changes it."""
    h = hashlib.sha256()
    _digest_into(h, obj)
    return h.hexdigest()


def _digest_into(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for key in sorted(obj, key=repr):
            _digest_into(h, key)
            _digest_into(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}".encode())
        for item in obj:
            _digest_into(h, item)
    else:  # None, bool, int, float (repr keeps every bit, nan included), str, bytes
        h.update(f"V{type(obj).__name__}:{obj!r};".encode())


def zip_problem(path: str | Path) -> str | None:
    """Why the zip archive ``torch.save`` wrote at ``path`` fails its own checks (a member's CRC), else ``None``."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError) as err:
        return f"it is not an intact zip archive ({type(err).__name__}: {str(err)[:120]})"
    except Exception as err:  # zlib.error and friends: whatever a damaged archive makes the reader raise
        return f"it is not an intact zip archive ({type(err).__name__}: {str(err)[:120]})"
    return None if bad is None else f"its member {bad!r} fails its CRC check (the file is corrupt)"
