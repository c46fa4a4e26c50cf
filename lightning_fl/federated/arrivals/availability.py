"""Clients that come and go (``trainer.clock.availability``): when each client is available, on the clock's time.

A client's availability is a sorted list of half-open on-intervals ``[start, end)`` of simulated seconds since the
first round started; outside them it is off (not charging, not idle, not on an unmetered network: whatever keeps a
deployment from training on it). One query serves every policy: :meth:`Availability.window` gives the on-interval
that holds time ``t`` or the next one after it, so "is ``c`` available at ``t``" and "until when" are one look-up.

* Rounds timed by the clock sample only the clients available when the round starts, and a sampled client whose
  interval ends before its upload is in is *offline*: lost to the round, its work thrown away
  (:class:`~lightning_fl.federated.arrivals.Timed`).
* FedBuff draws a new client among the available ones, and a client that goes offline before it finishes frees its
  slot when it leaves (:class:`~lightning_fl.federated.arrivals.Buffered`).

Three patterns, each seeded per client from ``(seed, client)`` (:data:`~lightning_fl.seeding.STREAM_AVAILABILITY`), so
a client's availability is the same whoever it is sampled with and a resumed run sees the same intervals:

* :class:`OnOff`: a two-state Markov chain in continuous time: on for an exponential time of mean ``mean_on_s``,
  then off for one of mean ``mean_off_s``, and so on; the first state is drawn from the chain's stationary law, on
  with probability ``mean_on_s / (mean_on_s + mean_off_s)`` (the fraction of time a client is available).
* :class:`Diurnal`: on for ``on_fraction`` of every ``period_s`` (a day by default), in one window a period whose start
  is a per-client phase drawn uniformly: the devices of many time zones, each available in its own night. (A sine
  with a per-client phase, on where it exceeds ``cos(pi * on_fraction)``, gives the same windows.)
* :class:`AvailabilityTrace`: the intervals of a CSV file (its format: the class docstring), optionally repeated.
"""

from __future__ import annotations

import bisect
import csv
import math
from pathlib import Path

import numpy as np

from lightning_fl.errors import ConfigError
from lightning_fl.seeding import STREAM_AVAILABILITY, derive_seed

KEY = "trainer.clock.availability"
#: The simulated time past which nothing is looked for (seconds: about 30,000 years).
HORIZON_S = 1e12


class Availability:
    """Base class: when each client is available. A subclass gives :meth:`intervals` (and may check the data's
    number of clients in :meth:`check_population`); the queries are the base class's, over a cache of each client's
    intervals."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int], tuple[float, list[float], list[float]]] = {}

    def intervals(self, seed: int, client: int, horizon_s: float) -> list[tuple[float, float]]:
        """``client``'s on-intervals that start before ``horizon_s``, sorted and disjoint (the last may end after it).
        The list for a larger horizon extends the list for a smaller one."""
        raise NotImplementedError

    def check_population(self, num_clients: int) -> None:
        """Refuse a pattern that does not fit the data's ``num_clients`` clients (a trace naming others)."""

    # ============================================================================ the queries
    def window(self, seed: int, client: int, t: float) -> tuple[float, float]:
        """The on-interval ``(start, end)`` of ``client`` that holds ``t`` (``start <= t``) or, if it is off at
        ``t``, the next one (``start > t``); ``(inf, inf)`` if it is never on again."""
        horizon, starts, ends = self._cache.get((seed, client), (0.0, [], []))
        while True:
            i = bisect.bisect_right(ends, t)  # the first interval that ends after t
            if i < len(ends) or horizon >= HORIZON_S:
                break
            horizon = min(HORIZON_S, max(2.0 * horizon, 2.0 * t, 64.0))
            found = self.intervals(seed, client, horizon)
            starts, ends = [s for s, _ in found], [e for _, e in found]
            self._cache[(seed, client)] = (horizon, starts, ends)
        return (starts[i], ends[i]) if i < len(ends) else (math.inf, math.inf)

    def available(self, seed: int, client: int, t: float) -> bool:
        """Whether ``client`` is available at time ``t``."""
        return self.window(seed, client, t)[0] <= t

    def until(self, seed: int, client: int, t: float) -> float:
        """When ``client``, available at ``t``, goes off (``inf``: never); ``t`` if it is off at ``t``."""
        start, end = self.window(seed, client, t)
        return end if start <= t else t

    def next_on(self, seed: int, client: int, t: float) -> float:
        """The first time at or after ``t`` at which ``client`` is available (``inf``: never)."""
        return max(t, self.window(seed, client, t)[0])

    def available_clients(self, seed: int, clients: list[int], t: float) -> list[int]:
        """Those of ``clients`` available at ``t``, in the order given."""
        return [c for c in clients if self.available(seed, c, t)]

    def first_on(self, seed: int, clients: list[int], t: float) -> float:
        """The first time at or after ``t`` at which one of ``clients`` is available (``inf``: never)."""
        return min((self.next_on(seed, c, t) for c in clients), default=math.inf)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_cache"}  # (the cache is rebuilt on demand)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._cache = {}


def _rng(seed: int, client: int) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, client, STREAM_AVAILABILITY))


def _positive(**values: float) -> list[str]:
    return [
        f"{KEY}.{k} must be a finite number > 0, got {v!r}"
        for k, v in values.items()
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v <= 0
    ]


class OnOff(Availability):
    """Each client on and off in turn, for exponential times (a two-state Markov chain; the module docstring).

    A client is available a fraction ``mean_on_s / (mean_on_s + mean_off_s)`` of the time, at any time and on
    average over the clients. The defaults (10 minutes on, 20 off: available a third of the time) are our choice,
    stated as a model: set them from your deployment's traces.

    Args:
        mean_on_s: Mean simulated seconds a client stays available.
        mean_off_s: Mean simulated seconds a client stays away.
    """

    def __init__(self, mean_on_s: float = 600.0, mean_off_s: float = 1200.0) -> None:
        super().__init__()
        self.mean_on_s, self.mean_off_s = mean_on_s, mean_off_s
        if problems := _positive(mean_on_s=mean_on_s, mean_off_s=mean_off_s):
            raise ConfigError("; ".join(problems))

    def intervals(self, seed: int, client: int, horizon_s: float) -> list[tuple[float, float]]:
        rng = _rng(seed, client)
        on = bool(rng.random() < self.mean_on_s / (self.mean_on_s + self.mean_off_s))
        t, out = 0.0, []
        while t < horizon_s:
            length = float(rng.exponential(self.mean_on_s if on else self.mean_off_s))
            if on:
                out.append((t, t + length))
            t, on = t + length, not on
        return out

    def __repr__(self) -> str:
        return f"OnOff(mean_on_s={self.mean_on_s}, mean_off_s={self.mean_off_s})"


class Diurnal(Availability):
    """Each client available in one window of every period, from a per-client phase (the module docstring).

    Client ``c`` with phase ``u_c`` (uniform on ``[0, 1)``) is available on ``[(k + u_c) P, (k + u_c + f) P)`` for
    every whole ``k``, ``P = period_s`` and ``f = on_fraction``: a fraction ``f`` of the time. The defaults (a day,
    available a third of it: a night's charging) are our choice, stated as a model; a simulated run much shorter than
    ``period_s`` sees each client's window at most once, so set ``period_s`` against the run's simulated time.

    Args:
        period_s: Simulated seconds of one period (86,400: a day).
        on_fraction: The fraction of each period a client is available, in ``(0, 1]``.
    """

    def __init__(self, period_s: float = 86400.0, on_fraction: float = 1 / 3) -> None:
        super().__init__()
        self.period_s, self.on_fraction = period_s, on_fraction
        problems = _positive(period_s=period_s, on_fraction=on_fraction)
        if not problems and on_fraction > 1:
            problems.append(f"{KEY}.on_fraction must be in (0, 1], got {on_fraction!r}")
        if problems:
            raise ConfigError("; ".join(problems))

    def phase(self, seed: int, client: int) -> float:
        """Client ``client``'s phase ``u_c`` in ``[0, 1)``."""
        return float(_rng(seed, client).random())

    def intervals(self, seed: int, client: int, horizon_s: float) -> list[tuple[float, float]]:
        p, f, phase = self.period_s, self.on_fraction, self.phase(seed, client)
        if f >= 1:
            return [(-p, math.inf)]
        out, k = [], -1  # from the window before 0, which may still be open at 0
        while (k + phase) * p < horizon_s:
            out.append(((k + phase) * p, (k + phase + f) * p))
            k += 1
        return out

    def __repr__(self) -> str:
        return f"Diurnal(period_s={self.period_s}, on_fraction={self.on_fraction})"


class AvailabilityTrace(Availability):
    """The on-intervals of a CSV file, one row an interval: a header ``client,start_s,end_s``, then rows of a client
    id (a whole number from 0) and the start and end of an interval in simulated seconds since the first round
    (``0 <= start_s < end_s``, finite)::

        client,start_s,end_s
        0,0,120.5
        0,300,900
        2,60,1e4

    A client is available from ``start_s`` up to (not at) ``end_s``; overlapping or touching intervals of one client
    are joined; a client no row names is never available. ``repeat_s`` repeats the trace: the intervals then lie in
    ``[0, repeat_s]`` and recur every ``repeat_s`` seconds (a day's trace for a run of many days); ``null``: after
    its last interval a client is off for good.

    Args:
        path: The CSV file (relative paths from the working directory).
        repeat_s: The trace's period in simulated seconds, or ``null`` (not repeated).
    """

    def __init__(self, path: str | Path, repeat_s: float | None = None) -> None:
        super().__init__()
        self.path, self.repeat_s = str(path), repeat_s
        if repeat_s is not None and (problems := _positive(repeat_s=repeat_s)):
            raise ConfigError(problems[0] + " or null")
        self.table = read_trace(Path(path), repeat_s)

    def check_population(self, num_clients: int) -> None:
        if self.table and (top := max(self.table)) >= num_clients:
            raise ConfigError(
                f"{KEY}.path {self.path} names client {top} but the data has {num_clients} clients (ids 0 to "
                f"{num_clients - 1}): fix the trace or data.num_clients"
            )

    def intervals(self, seed: int, client: int, horizon_s: float) -> list[tuple[float, float]]:
        rows = self.table.get(client, [])
        if self.repeat_s is None or not rows:
            return list(rows)
        out, k = [], 0
        while k * self.repeat_s < horizon_s:
            out.extend((s + k * self.repeat_s, e + k * self.repeat_s) for s, e in rows)
            k += 1
        return _joined(out)

    def __repr__(self) -> str:
        return f"AvailabilityTrace(path={self.path!r}, repeat_s={self.repeat_s})"


def read_trace(path: Path, repeat_s: float | None = None) -> dict[int, list[tuple[float, float]]]:
    """Each client's joined on-intervals from the CSV file at ``path`` (:class:`AvailabilityTrace`'s format); a
    ``ConfigError`` names the key, the line and the fix of the first row that does not fit."""
    where = f"{KEY}.path {path}"
    if not path.is_file():
        raise ConfigError(f"{where} does not exist: give a CSV file with the header client,start_s,end_s")
    table: dict[int, list[tuple[float, float]]] = {}
    with path.open(newline="") as f:
        rows = csv.reader(f)
        header = [h.strip() for h in next(rows, [])]
        if header != ["client", "start_s", "end_s"]:
            raise ConfigError(f"{where}: line 1 must be the header client,start_s,end_s, got {','.join(header)!r}")
        for line, row in enumerate(rows, start=2):
            if not row or all(not cell.strip() for cell in row):
                continue
            try:
                client, start, end = int(row[0]), float(row[1]), float(row[2])
                ok = len(row) == 3 and client >= 0 and 0 <= start < end and math.isfinite(end)
                ok = ok and (repeat_s is None or end <= repeat_s)
            except (ValueError, IndexError):
                ok = False
            if not ok:
                bound = f" <= repeat_s {repeat_s}" if repeat_s is not None else ""
                raise ConfigError(
                    f"{where}: line {line} must be a client id >= 0 and 0 <= start_s < end_s{bound} (finite "
                    f"seconds), got {','.join(row)!r}: fix that row"
                )
            table.setdefault(client, []).append((start, end))
    return {c: _joined(rows) for c, rows in sorted(table.items())}


def _joined(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` sorted, with overlapping or touching ones joined."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
