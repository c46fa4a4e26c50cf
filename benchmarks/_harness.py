"""What every benchmark here shares: wall and CPU time, alternated sides, min and median, the machine, JSON.

A shared machine makes single timings lie: a neighbour that wakes up for ten seconds can make one side of
a comparison look ten times slower. So every benchmark

- runs the sides it compares in turn (A, B, A, B, ...) several times (:func:`alternate`), so load falls on
  both alike, and reports each side's min and median, and the per-repeat ratios' min and median;
- reports CPU time (user + system of this process and of the children it waited for, :func:`cpu_seconds`;
  or, for processes not waited for yet, :func:`descendants_cpu_seconds`) beside wall time: a
  neighbour steals wall time, much less CPU time;
- prints the torch thread count and the load average before and after (:func:`machine`), and writes all of
  it as JSON (``--json PATH``) for the results pages (docs/results-*.md) to quote;
- names no folder of the machine it ran on in what it writes (:func:`portable`, :func:`command_line`): a path
  inside the repository is written relative to it, any other absolute path as a placeholder.

Use it from a benchmark script: ``from _harness import ...`` (Python puts a script's folder on ``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
#: An absolute path in a text (not one inside a URL or a relative path).
ABSOLUTE = re.compile(r"(?<![\w.~/:-])/[^\s`'\"(),;=]+")


@dataclass(frozen=True)
class Sample:
    """One timed call: wall seconds and CPU seconds (this process and its waited-for children)."""

    wall: float
    cpu: float


def cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads) and of the children it has waited for.

    This process's time comes from ``time.process_time`` (nanosecond clock), the children's from
    ``getrusage(RUSAGE_CHILDREN)`` (microseconds). A child counts once it has been waited for: wait for what
    you start before you read this.
    """
    return time.process_time() + children_cpu_seconds()


def children_cpu_seconds() -> float:
    """User + system CPU time of the children this process has waited for (and of those they waited for)."""
    try:
        import resource
    except ImportError:  # not Unix: os.times (clock ticks; children are 0 on Windows)
        t = os.times()
        return t.children_user + t.children_system
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def descendants_cpu_seconds() -> float:
    """:func:`children_cpu_seconds` plus the CPU time of every live descendant (and of the children those
    waited for), not this process's own.

    For work done by processes this one has not waited for (yet): servers it started, what they start. Read
    from ``/proc/<pid>/stat`` (utime, stime, cutime, cstime, in clock ticks); a zombie still counts, a
    descendant that ended and was waited for by neither a live descendant nor this process is missed. Without
    ``/proc``: :func:`children_cpu_seconds`.
    """
    total = children_cpu_seconds()
    if not os.path.isdir("/proc"):
        return total
    kids: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # fields from 3 on, after comm's ")"
                kids.setdefault(int(fields[1]), []).append(int(entry))
                stats[int(entry)] = fields
            except (OSError, IndexError, ValueError):
                continue
    ticks, stack = 0, [os.getpid()]
    while stack:
        for pid in kids.get(stack.pop(), []):
            stack.append(pid)
            ticks += sum(int(x) for x in stats[pid][11:15])  # fields 14-17: utime stime cutime cstime
    return total + ticks / os.sysconf("SC_CLK_TCK")


def measure(fn: Callable[[], Any], cpu: Callable[[], float] = cpu_seconds) -> tuple[Any, Sample]:
    """Call ``fn`` once; return its result and how long it took (CPU time read with ``cpu``)."""
    wall, cpu0 = time.perf_counter(), cpu()
    out = fn()
    return out, Sample(time.perf_counter() - wall, cpu() - cpu0)


def alternate(
    sides: dict[str, Callable[[], Any]], repeats: int, cpu: Callable[[], float] = cpu_seconds
) -> dict[str, list[Sample]]:
    """Run every side once per repeat, in turn (``A B A B ...``); return each side's samples in order."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    samples: dict[str, list[Sample]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            samples[name].append(measure(fn, cpu)[1])
    return samples


def spread(values: Iterable[float]) -> dict[str, float]:
    """``min``, ``median`` and ``max`` of ``values`` (and how many)."""
    values = list(values)
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def summarise(samples: dict[str, list[Sample]], per: float = 1.0) -> dict[str, dict[str, dict[str, float]]]:
    """Per side: the spread of wall and CPU seconds, each divided by ``per`` (e.g. per client)."""
    return {
        name: {"wall": spread(s.wall / per for s in runs), "cpu": spread(s.cpu / per for s in runs)}
        for name, runs in samples.items()
    }


def ratios(samples: dict[str, list[Sample]], numerator: str, denominator: str) -> dict[str, dict[str, float]]:
    """The per-repeat ratios ``numerator / denominator`` of wall and of CPU time, as spreads (NaN for a zero)."""
    pairs = list(zip(samples[numerator], samples[denominator], strict=True))
    return {
        "wall": spread(_div(a.wall, b.wall) for a, b in pairs),
        "cpu": spread(_div(a.cpu, b.cpu) for a, b in pairs),
    }


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


def machine() -> dict[str, Any]:
    """What the numbers depend on: torch's threads, the cores, the load average, versions."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_1_5_15": [round(x, 2) for x in load],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def add_arguments(parser: argparse.ArgumentParser, repeats: int | None = 5) -> None:
    """The options every benchmark takes: ``--repeats`` (unless ``repeats`` is None: the script has its own) and
    ``--json``."""
    if repeats is not None:
        parser.add_argument(
            "--repeats", type=int, default=repeats, help=f"alternations of the sides (default {repeats})"
        )
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")


def fmt(spread_: dict[str, float], unit: str = "s", scale: float = 1.0, digits: int = 3) -> str:
    """``min X, median Y`` of a spread, scaled (e.g. 1e3 for ms)."""
    return f"min {spread_['min'] * scale:.{digits}f}{unit}, median {spread_['median'] * scale:.{digits}f}{unit}"


def line(name: str, summary: dict[str, dict[str, float]], unit: str = "s", scale: float = 1.0, digits: int = 3) -> str:
    """``NAME: wall min X, median Y; CPU min X, median Y`` for one side of :func:`summarise`."""
    return f"{name}: wall {fmt(summary['wall'], unit, scale, digits)}; CPU {fmt(summary['cpu'], unit, scale, digits)}"


def ratio_line(name: str, ratio: dict[str, dict[str, float]], digits: int = 3) -> str:
    """``NAME per repeat: wall min X, median Y; CPU min X, median Y`` for :func:`ratios`."""
    return f"{name} per repeat: wall {fmt(ratio['wall'], '', 1, digits)}; CPU {fmt(ratio['cpu'], '', 1, digits)}"


def report(name: str, before: dict[str, Any], results: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """Print the machine lines and write ``{"benchmark", "machine_before", "machine_after", "results"}``."""
    after = machine()
    print(
        f"[{name}] torch threads {after['torch_threads']}, cores {after['cpu_count']}, load average "
        f"{before['loadavg_1_5_15']} before, {after['loadavg_1_5_15']} after"
    )
    payload = {"benchmark": name, "machine_before": before, "machine_after": after, "results": results}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(portable(json.loads(json.dumps(payload, default=_plain))), indent=2) + "\n")
        print(f"[{name}] wrote {path}")
    return payload


def portable(value: Any, name: str = "path") -> Any:
    """``value`` as a published file may hold it: every absolute path in a string (or in the strings of a dict or
    list, named by their key) written relative to the repository when it lies inside it, else as ``<name>``."""
    if isinstance(value, dict):
        return {k: portable(v, k if isinstance(k, str) else name) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v, name) for v in value]
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str):
        return value

    def shown(match: re.Match) -> str:
        path = Path(match.group(0))
        return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else f"<{name}>"

    return ABSOLUTE.sub(shown, value)


def command_line(script: str, argv: list[str]) -> str:
    """``python benchmarks/SCRIPT ARGV`` as a results file quotes it: each absolute path among the arguments
    :func:`portable`, named after the option before it (``--workdir /tmp/x`` -> ``--workdir <workdir>``)."""
    words = ["python", f"benchmarks/{script}"]
    for before, arg in zip(["", *argv], argv, strict=False):
        shown = portable(arg, before[2:] if before.startswith("--") else "path")
        words.append(shown if re.fullmatch(r"<[\w-]+>", shown) else shlex.quote(shown))
    return " ".join(words)


def _plain(value: Any) -> Any:
    if isinstance(value, Sample):
        return asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")
