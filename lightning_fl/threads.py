"""How many CPU threads each process's torch uses: a default that does not collapse when cores are shared.

torch starts one intra-op thread per core. Its OpenMP threads wait for each other at every parallel region,
so when another busy process holds one of the cores, every small operation waits for a descheduled thread
(measured in docs/results.md, "Threads"). The models federated here are small, so the default leaves one core
free: ``cores - 1`` threads (at least 1) per process, divided among the processes a node starts (``devices``)
when they share its cores.

The setting is ``threads`` in every config (``--threads N``; ``null``: that default). An explicit value is per
process. The CLI applies it before anything is built (every Fabric process runs the CLI, so each applies it)
and exports it as ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` for processes started otherwise.
"""

from __future__ import annotations

import os

import torch

from lightning_fl.errors import ConfigError

_explicit = False  # whether the last set_threads call was given a number (then it is per process)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and ``taskset`` restrict)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def default_threads(processes: int = 1) -> int:
    """``cores - 1`` (at least 1) shared among ``processes`` processes on this machine, at least 1 each."""
    return max(1, (usable_cores() - 1) // max(1, processes))


def set_threads(threads: int | None = None, processes: int = 1) -> int:
    """Give torch ``threads`` intra-op threads (``None``: :func:`default_threads`); return the number set.

    Also exports it as ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` for child processes.
    """
    global _explicit
    if threads is not None and (isinstance(threads, bool) or int(threads) != threads or threads < 1):
        raise ConfigError(f"threads must be a whole number >= 1 or null (the default), got {threads!r}")
    _explicit = threads is not None
    return _apply(int(threads) if threads is not None else default_threads(processes))


def share_among(processes: int) -> int:
    """In one of ``processes`` processes sharing this machine's cores: its default share, unless explicit."""
    if processes <= 1 or _explicit:
        return torch.get_num_threads()
    return _apply(default_threads(processes))


def _apply(n: int) -> int:
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    return n
