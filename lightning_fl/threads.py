"""How many CPU threads each process's torch uses: a default that does not collapse when cores are shared.

torch starts one intra-op thread per core. Its OpenMP threads wait for each other at every parallel region,
so when another busy process holds one of the cores, every small operation waits for a descheduled thread
(measured in docs/results-systems.md, "Threads"). The models federated here are small, so the default leaves one core
free: ``cores - 1`` threads (at least 1) per process, divided among the processes a node starts (``devices``)
when they share its cores.

The setting is ``threads`` in every config (``--threads N``; ``null``: that default). An explicit value is per
process. The CLI applies it before anything is built (every Fabric process runs the CLI, so each applies it)
and exports it as ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` for processes started otherwise.

From Python, :class:`~lightning_fl.federated.FederatedTrainer` applies the same default when it starts a run
(:func:`for_run`, its ``threads`` argument) unless the threads were chosen already: README's Python example ran
with torch's own default, two threads on 2 cores, and was several times slower than the CLI.
"""

from __future__ import annotations

import os

import torch

from lightning_fl.errors import ConfigError

_explicit = False  # whether the last set_threads call was given a number (then it is per process)
_chosen = False  # whether set_threads was called in this process (the CLI's ``threads`` key, or the user)
_torch_at_import = torch.get_num_threads()  # torch's count before this package chose any: the user changed it if not


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
    global _explicit, _chosen
    if threads is not None and (isinstance(threads, bool) or int(threads) != threads or threads < 1):
        raise ConfigError(f"threads must be a whole number >= 1 or null (the default), got {threads!r}")
    _explicit, _chosen = threads is not None, True
    return _apply(int(threads) if threads is not None else default_threads(processes))


def for_run(threads: int | None = None) -> int:
    """The threads a run started from Python uses (``FederatedTrainer(threads=...)``); return the number.

    ``threads`` given: that many per process (:func:`set_threads`). ``None``: threads chosen already in this process
    are kept: by :func:`set_threads` (the CLI's ``threads`` key calls it), by ``torch.set_num_threads`` after this
    module was imported (then per process, as an explicit number), or by ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` in
    the environment (as a process that Fabric starts inherits them); else the CLI's default (:func:`default_threads`).
    Fabric's processes then share the node's cores (:func:`share_among`) unless the number is explicit.
    """
    if threads is not None:
        return set_threads(threads)
    current = torch.get_num_threads()
    if _chosen or any(os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return current
    return set_threads(current if current != _torch_at_import else None)


def share_among(processes: int) -> int:
    """In one of ``processes`` processes sharing this machine's cores: its default share, unless explicit."""
    if processes <= 1 or _explicit:
        return torch.get_num_threads()
    return _apply(default_threads(processes))


def _apply(n: int) -> int:
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    return n
