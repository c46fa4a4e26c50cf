"""A clock for simulated rounds: every client's device speed and link, and the time a round takes.

A simulated round has no wall-clock of its own (its clients train one after another on this machine), so the time a
deployment would feel comes from a model. Each client ``c`` has, drawn once from ``(seed, c)`` and kept for the whole
run (a device is a device):

* a compute time per local step, ``step_s`` times a log-normal factor of spread ``device_sigma`` (median 1);
* a download and an upload bandwidth, log-normal around the medians ``down_mbps`` and ``up_mbps`` (spread
  ``link_sigma``), and a latency ``latency_s`` per message;
* a setup time ``setup_s`` per round (0 by default): getting ready to train (starting its runtime, loading its
  model), which runs while the download does, from the moment the round's message reaches the client.

A client's round is its download (or its setup, if longer), its local steps and its upload, one after the other::

    finish_c = latency + max(8 * down_bytes_c / down_bps_c, setup_s)  +  steps_c * step_s_c
               + latency + 8 * up_bytes_c / up_bps_c

with the byte ledger's exact bytes (the global state, or the compressed broadcasts it missed; the codec's upload).
The server's own work is not modelled (it is the same for every method). How a round closes:

* **wait for all** (default): when the slowest client has reported;
* **deadline** (``deadline_s``): at the deadline, or when every client has reported, whichever comes first; the
  clients still running are dropped: they downloaded (counted in the ledger), their upload never arrives;
* **over-selection** (``over_selection``): ``ceil((1 + over_selection) * m)`` clients are sampled for a target of
  ``m``, and the round closes when ``m`` have reported (or at the deadline, if sooner): the protocol of Bonawitz et al.,
  "Towards Federated Learning at Scale: System Design" (MLSys 2019), which selects about 130% of the target.

With ``availability`` (:mod:`lightning_fl.federated.arrivals.availability`) clients come and go: a client that goes
offline before its upload is in never reports, and the server learns it when the client leaves, so a round waiting
for all closes when every client has reported or left. A client works until it reports, leaves, or the round closes
(the server then tells it to stop): the compute seconds it spent are :attr:`Timing.spent_s`, and those of a client
whose update is not aggregated are thrown away. Device energy is a model: ``power_w`` watts while a client computes
(the radio's energy is not modelled).

Defaults, and why. Device speeds are log-normal: Meta's production system found client execution times log-normal
(Huba et al., "PAPAYA: Practical, Private, and Scalable Federated Learning", MLSys 2022), and FedScale's runtime draws
them so with a tail skew of 0.6 (Lai et al., "FedScale", ICML 2022): ``device_sigma = 0.6``. Links: Ookla's Speedtest
Global Index gave mobile means of 35.96 Mbit/s down, 11.22 Mbit/s up and 40 ms latency worldwide in September 2020:
``down_mbps = 36``, ``up_mbps = 11``, ``latency_s = 0.04``; the spread between countries' medians is wide (3 Mbit/s to
over 100 Mbit/s down), and ``link_sigma = 1.0`` (a factor of e either way for one client in three) is our choice.
``step_s = 0.05`` (50 ms per local step of a small CNN on a phone) is our choice too: set it for your model and devices.
``power_w = 3.0`` (a phone's processor under a sustained load draws watts, not tens of them) is our choice, stated as
a model: joules are ``power_w`` times compute seconds, the same figure for every device. ``setup_s = 0``: a device
that is ready when its message arrives. On Flower it is not: a SuperNode starts the ClientApp's process once a
message's metadata is in, while the content downloads, so a round on a slow link hides the process's start
(measured: docs/results-systems.md, "A shaped link per client").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lightning_fl.errors import ConfigError
from lightning_fl.federated.arrivals.availability import Availability
from lightning_fl.seeding import STREAM_CLOCK, derive_seed


@dataclass(frozen=True)
class Links:
    """The drawn speeds of some clients, one entry per client: seconds per local step, bits per second down and up,
    and seconds of setup per round (``None``: the clock's ``setup_s`` for every client)."""

    step_s: np.ndarray
    down_bps: np.ndarray
    up_bps: np.ndarray
    setup_s: np.ndarray | None = None


@dataclass(frozen=True)
class Timing:
    """A round's clients' times (seconds, one entry per client, in the order given) and when the round closes.

    ``on_time[i]``: client ``i`` reported before the round closed (its upload is aggregated); ``offline[i]``: it went
    offline before it reported, and before the round closed; ``spent_s[i]``: the compute seconds it spent before it
    reported, left or the round closed (its whole ``compute_s`` if it reported); ``ready_s[i]``: when it starts to
    compute (its download done, and its setup)."""

    download_s: np.ndarray
    compute_s: np.ndarray
    upload_s: np.ndarray
    close_s: float
    on_time: np.ndarray
    offline: np.ndarray
    spent_s: np.ndarray
    ready_s: np.ndarray

    @property
    def finish_s(self) -> np.ndarray:
        return self.ready_s + self.compute_s + self.upload_s


class Clock:
    """``trainer.clock``: simulated time for every round (module docstring: the model, the rules and the defaults).

    Args:
        step_s: Median seconds of one local step (forward, backward, optimiser) on a client's device.
        device_sigma: Spread of the devices' speeds: each client's step time is ``step_s * exp(device_sigma * N)``.
        down_mbps: Median download bandwidth (Mbit/s, 10**6 bits per second).
        up_mbps: Median upload bandwidth (Mbit/s).
        link_sigma: Spread of the clients' bandwidths (log-normal, drawn independently down and up).
        latency_s: Seconds added to each message (the download and the upload).
        deadline_s: Close each round this many seconds after it starts; the clients still running are dropped.
            ``null``: no deadline.
        over_selection: Sample ``ceil((1 + over_selection) * m)`` clients and close the round when ``m`` have reported
            (``m``: ``clients_per_round``); 0: sample ``m`` and wait for them (or the deadline).
        availability: When each client is available (:class:`~lightning_fl.federated.arrivals.availability.OnOff`,
            :class:`~lightning_fl.federated.arrivals.availability.Diurnal` or
            :class:`~lightning_fl.federated.arrivals.availability.AvailabilityTrace`); ``null``: always.
        power_w: Watts a device draws while it trains (a model: joules are ``power_w`` times compute seconds).
        setup_s: Seconds a client spends getting ready for a round while its download runs (the module docstring).
    """

    def __init__(
        self,
        step_s: float = 0.05,
        device_sigma: float = 0.6,
        down_mbps: float = 36.0,
        up_mbps: float = 11.0,
        link_sigma: float = 1.0,
        latency_s: float = 0.04,
        deadline_s: float | None = None,
        over_selection: float = 0.0,
        availability: Availability | None = None,
        power_w: float = 3.0,
        setup_s: float = 0.0,
    ) -> None:
        self.step_s, self.device_sigma = step_s, device_sigma
        self.down_mbps, self.up_mbps, self.link_sigma, self.latency_s = down_mbps, up_mbps, link_sigma, latency_s
        self.deadline_s, self.over_selection = deadline_s, over_selection
        self.availability, self.power_w, self.setup_s = availability, power_w, setup_s
        if problems := self.problems():
            raise ConfigError("; ".join(problems))

    def problems(self) -> list[str]:
        """One line per impossible setting."""
        positive = {"step_s": self.step_s, "down_mbps": self.down_mbps, "up_mbps": self.up_mbps}
        non_negative = {
            "device_sigma": self.device_sigma,
            "link_sigma": self.link_sigma,
            "latency_s": self.latency_s,
            "over_selection": self.over_selection,
            "power_w": self.power_w,
            "setup_s": self.setup_s,
        }
        out = [
            f"trainer.clock.{k} must be a finite number > 0, got {v}"
            for k, v in positive.items()
            if not _finite(v) or v <= 0
        ]
        out += [
            f"trainer.clock.{k} must be a finite number >= 0, got {v}"
            for k, v in non_negative.items()
            if not _finite(v) or v < 0
        ]
        if self.deadline_s is not None and (not _finite(self.deadline_s) or self.deadline_s <= 0):
            out.append(f"trainer.clock.deadline_s must be a number of seconds > 0 or null, got {self.deadline_s}")
        if self.availability is not None and not isinstance(self.availability, Availability):
            out.append(
                f"trainer.clock.availability must be OnOff, Diurnal, AvailabilityTrace or null, got "
                f"{type(self.availability).__name__}"
            )
        return out

    # ============================================================================ who is sampled
    def sampled_count(self, target: int, num_clients: int) -> int:
        """Clients to sample for a target of ``target`` (over-selection), at most ``num_clients``."""
        return min(num_clients, math.ceil((1 + self.over_selection) * min(target, num_clients) - 1e-9))

    # ============================================================================ the clients' speeds
    def links(self, seed: int, clients: list[int]) -> Links:
        """The speeds of ``clients``: each drawn from ``(seed, client)`` alone, the same in every round."""
        draws = np.array(
            [np.random.default_rng(derive_seed(seed, c, STREAM_CLOCK)).standard_normal(3) for c in clients]
        ).reshape(len(clients), 3)
        return Links(
            step_s=self.step_s * np.exp(self.device_sigma * draws[:, 0]),
            down_bps=self.down_mbps * 1e6 * np.exp(self.link_sigma * draws[:, 1]),
            up_bps=self.up_mbps * 1e6 * np.exp(self.link_sigma * draws[:, 2]),
            setup_s=np.full(len(clients), float(self.setup_s)),
        )

    # ============================================================================ a round
    def timing(
        self,
        seed: int,
        clients: list[int],
        steps: np.ndarray,
        down_bytes: np.ndarray,
        up_bytes: np.ndarray,
        target: int | None = None,
        until_s: np.ndarray | None = None,
        links: Links | None = None,
    ) -> Timing:
        """When each of ``clients`` (in this order) finishes, and when the round closes under the run's rule.

        Args:
            seed: The run's seed (the clients' speeds).
            clients: The round's available clients.
            steps: Local steps each runs.
            down_bytes: Bytes each downloads.
            up_bytes: Bytes each uploads.
            target: Reports that close the round (over-selection); ``None``: every client's.
            until_s: Seconds after the round starts at which each client goes offline (``inf``: it stays);
                ``None``: every client stays.
            links: The clients' speeds, one entry each in the order of ``clients`` (measured ones, say), instead
                of those drawn from ``seed``; ``None``: drawn (:meth:`links`).
        """
        speed = self.links(seed, clients) if links is None else links
        down = self.latency_s + 8.0 * np.asarray(down_bytes, dtype=np.float64) / speed.down_bps
        setup = np.full(len(clients), float(self.setup_s)) if speed.setup_s is None else speed.setup_s
        ready = np.maximum(down, self.latency_s + setup)  # (setup 0: the download)
        compute = np.asarray(steps, dtype=np.float64) * speed.step_s
        up = self.latency_s + 8.0 * np.asarray(up_bytes, dtype=np.float64) / speed.up_bps
        finish = ready + compute + up
        until = np.full(len(clients), np.inf) if until_s is None else np.asarray(until_s, dtype=np.float64)
        leaves = until < finish  # it goes offline before its upload is in: it never reports
        reports = np.where(leaves, np.inf, finish)
        close = float(np.minimum(finish, until).max()) if len(clients) else 0.0  # all reported or left
        if target is not None and 0 < target <= int((~leaves).sum()) and target < len(clients):
            close = float(np.sort(reports)[target - 1])  # the target-th report
        if self.deadline_s is not None:
            close = min(close, float(self.deadline_s))
        on_time = reports <= close
        if target is not None and int(on_time.sum()) > target:  # reports at the closing instant: first in client order
            at_close = reports == close
            on_time = (reports < close) | (at_close & (np.cumsum(at_close) <= target - int((reports < close).sum())))
        offline = leaves & (until <= close)
        stop = np.where(on_time, finish, np.minimum(until, close))  # when it stopped working for the round
        spent = np.clip(stop - ready, 0.0, compute)
        return Timing(down, compute, up, close, on_time, offline, spent, ready)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return f"Clock({args})"


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
