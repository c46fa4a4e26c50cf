"""What varies around :class:`~lightning_fl.federated.FederatedTrainer`'s rounds, as callbacks.

Each callback sees the rounds start (``start``: the rounds already done, by a resumed run), every round's end
(after the round is logged and checkpointed; ``round`` is 1-based, as in the logs) and the rounds' end. The
trainer's own: the progress report, the module's text samples and the dropped clients in TensorBoard, the collapse
alarm; a transport (Flower's) is one too, and reports each finished round to its federation.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any, Protocol

import lightning as L
from tqdm.auto import tqdm

from lightning_fl.federated.trainer.summary import collapse
from lightning_fl.privacy.base import Privacy
from lightning_fl.privacy.dpsgd import DPSGD
from lightning_fl.privacy.secure import SecureAggregation


class RoundResults(Protocol):
    """What the callbacks read of the last round (the trainer's
    :class:`~lightning_fl.federated.server.round.RoundRunner`)."""

    #: Clients that answered the last round but were left out of its aggregate.
    dropped: list[int]
    #: The last round's aggregated update norms, largest first, with their clients.
    update_norms: list[tuple[float, int]]

    @property
    def unprotected(self) -> str:
        """What the rounds do with statistics from the clients' updates: ``keep``, ``withhold`` or ``label``."""
        ...


class Rounds(Protocol):
    """What a callback reads of the trainer that runs its rounds (:class:`~lightning_fl.federated.FederatedTrainer`)."""

    fabric: L.Fabric
    rounds: int
    enable_progress_bar: bool
    history: list[dict[str, float]]
    model: L.LightningModule
    alarm: str | None
    round_runner: RoundResults
    privacy: Privacy | None
    dp_sgd: DPSGD | None
    secure_aggregation: SecureAggregation | None


class Callback:
    """Base class: every hook does nothing.

    Rounds are numbered from 1, as everywhere a run reports them (``fed/round``, TensorBoard's step, the checkpoints,
    the summary); round 0 is the starting model, evaluated before the first round.
    """

    def on_rounds_start(self, trainer: Rounds, start: int) -> None:
        """Before the first round this fit runs: ``start`` rounds are done already (0, or a resumed run's), so the
        next round is ``start + 1``."""

    def on_round_end(self, trainer: Rounds, round: int, metrics: dict[str, float]) -> None:
        """After round ``round`` (1-based: the number of rounds done, ``metrics["fed/round"]``) is evaluated, logged
        and checkpointed."""

    def on_rounds_end(self, trainer: Rounds) -> None:
        """After the last round (or the round the privacy budget stopped at)."""


#: A round's line is printed at least this often (seconds) where there is no bar, whatever the tenths of the run.
LINE_EVERY_S = 30.0


class ProgressReport(Callback):
    """A bar over rounds on a terminal (``trainer.enable_progress_bar``); elsewhere (CI logs, files), or with the bar
    off, a plain line every tenth of the run, and after any round that ends :data:`LINE_EVERY_S` or more after the
    last line. Shows the metric and the cumulative bytes per client (both directions)
    in MiB. From rank 0 only."""

    def on_rounds_start(self, trainer: Rounds, start: int) -> None:
        rank_zero, terminal = trainer.fabric.is_global_zero, sys.stderr.isatty()
        self.lines = rank_zero and not (terminal and trainer.enable_progress_bar)
        self.printed = time.perf_counter()
        self.bar = tqdm(
            total=trainer.rounds,
            initial=start,
            desc="round",
            dynamic_ncols=True,
            disable=not (rank_zero and terminal and trainer.enable_progress_bar),
        )

    def on_round_end(self, trainer: Rounds, round: int, metrics: dict[str, float]) -> None:
        shown = {k: f"{metrics[k]:.4f}" for k in ("val/acc", "val/ppl", "val/exact_match") if k in metrics}
        shown["MiB/client"] = f"{metrics['comm/cum_client_bytes'] / 2**20:.3f}"
        self.bar.update(1)
        self.bar.set_postfix(shown)
        total, now = trainer.rounds, time.perf_counter()
        due = round % max(1, total // 10) == 0 or round == total or now - self.printed >= LINE_EVERY_S
        if self.lines and due:
            self.printed = now
            print(f"round {round}/{total}: " + ", ".join(f"{k} {v}" for k, v in shown.items()), flush=True)

    def on_rounds_end(self, trainer: Rounds) -> None:
        self.bar.close()


class TensorBoardText(Callback):
    """The module's text samples (e.g. generated text; TensorBoard's Text tab) before the first round and after the
    last, and the ids of the clients the gate left out of each round (``fed/dropped_clients``). From rank 0."""

    def __init__(self, text_samples: Any = None) -> None:
        self.text_samples = text_samples

    def on_rounds_start(self, trainer: Rounds, start: int) -> None:
        self.ran = start < trainer.rounds
        if start == 0:
            self._samples(trainer, 0)

    def on_round_end(self, trainer: Rounds, round: int, metrics: dict[str, float]) -> None:
        dropped, mode = trainer.round_runner.dropped, unprotected(trainer)
        if dropped and mode != "withhold" and (experiment := _experiment(trainer)) is not None:
            tag = "fed/dropped_clients" if mode == "keep" else "unprotected/fed/dropped_clients"
            experiment.add_text(tag, ", ".join(map(str, dropped)), round)

    def on_rounds_end(self, trainer: Rounds) -> None:
        if self.ran:
            self._samples(trainer, trainer.rounds)

    def _samples(self, trainer: Rounds, step: int) -> None:
        if self.text_samples is not None and (experiment := _experiment(trainer)) is not None:
            for tag, text in self.text_samples().items():
                experiment.add_text(tag, text, step)


class CollapseAlarm(Callback):
    """Warn once per run when the global model collapses against round 0 (chance accuracy, a loss blown up),
    naming the largest updates aggregated; the warning is kept as ``trainer.alarm`` for the run's summary."""

    def on_round_end(self, trainer: Rounds, round: int, metrics: dict[str, float]) -> None:
        first = next((h for h in trainer.history if h.get("round") == 0), None)
        if trainer.alarm is not None or first is None:
            return
        hparams = getattr(trainer.model, "hparams", {})
        num_classes = hparams.get("num_classes") if hasattr(hparams, "get") else None
        why = collapse(first, metrics, num_classes if isinstance(num_classes, int) else None)
        if why is None:
            return
        largest = ", ".join(f"client {c} (norm {n:.3g})" for n, c in trainer.round_runner.update_norms[:3])
        seen = (
            "no single update is seen (secure aggregation)"
            if trainer.secure_aggregation is not None
            else (f"the largest updates aggregated: {largest or 'none known'}")
        )
        if unprotected(trainer) == "withhold" and trainer.secure_aggregation is None:
            seen = "the updates' norms stay out of a private run's logs (trainer.unprotected_statistics)"
        trainer.alarm = f"round {round}: the global model collapsed: {why}; {seen}; {collapse_advice(trainer)}"
        warnings.warn(trainer.alarm, stacklevel=2)


def collapse_advice(trainer: Rounds) -> str:
    """What may hold a collapsed model in this run: the noise first where there is noise, a robust strategy only
    where one may run (not under user-level DP or secure aggregation, which refuse them)."""
    privacy, dp_sgd = trainer.privacy, trainer.dp_sgd
    if privacy is not None:
        z = getattr(privacy, "z", None)
        noise = f" (noise multiplier {z:.4g})" if isinstance(z, float) else ""
        return (
            f"under trainer.privacy the noise{noise} may be what moved it: more clients per round, a larger "
            "epsilon or fewer rounds lower it; a lower trainer.privacy.clip_norm bounds each update"
        )
    if trainer.secure_aggregation is not None:
        return (
            "trainer.max_update_norm bounds the aggregate's step (a robust strategy needs single updates, which "
            "secure aggregation hides)"
        )
    robust = "a robust strategy (trainer.strategy Median or Krum) or a lower trainer.max_update_norm_ratio may hold it"
    if dp_sgd is not None:
        return (
            f"DP-SGD's noise inside the clients may be what moved it (a larger trainer.dp_sgd.target_epsilon or "
            f"more records per client lower it); else {robust}"
        )
    return robust


def unprotected(trainer: Rounds) -> str:
    """What the trainer's rounds do with statistics from the clients' updates (``RoundSettings.unprotected``)."""
    return trainer.round_runner.unprotected


def _experiment(trainer: Rounds) -> Any:
    fabric = trainer.fabric
    return fabric.logger.experiment if fabric.loggers and fabric.is_global_zero else None
