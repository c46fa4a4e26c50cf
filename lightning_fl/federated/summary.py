"""The few lines a federated run prints when it ends: what it reached, what it cost, and where it is."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lightning_fl.privacy.audit import audit_lines, write_report

#: Evaluation metrics where lower is better (every other ``val/*`` metric: higher is better).
LOWER_IS_BETTER = ("loss", "ppl", "ece")
#: Where ``validate`` and ``test`` write (their config and logs): a new ``validate_N`` or ``test_N`` folder.
EVALUATION_FOLDER = "written to {} (a new folder for this evaluation)"
#: What ``val/*`` is when the data module has no validation split (its ``val_is_test``).
TEST_AS_VAL = "val/* is the test split (no validation split: data.val_fraction 0)"


def best_round(history: list[dict[str, float]], key: str) -> tuple[int, float] | None:
    """The round (1..R) with the best ``key`` and its value, in the metric's direction; ``None`` if never logged."""
    rows = [(int(h["round"]), float(h[key])) for h in history if h.get("round", 0) >= 1 and key in h]
    if not rows:
        return None
    lower = key.rsplit("/", 1)[-1] in LOWER_IS_BETTER
    return min(rows, key=lambda rv: rv[1] if lower else -rv[1])


def collapse(start: dict[str, float], now: dict[str, float], num_classes: int | None) -> str | None:
    """Why the global model looks collapsed against round 0 (``None``: it does not): accuracy at chance where it was
    well above, or a validation loss far above its start (or not finite)."""
    if num_classes and "val/acc" in now and "val/acc" in start:
        chance = 1.0 / num_classes
        if start["val/acc"] > chance + 0.1 and now["val/acc"] <= chance + 0.02:
            return f"val/acc {now['val/acc']:.4f} is at chance (1/{num_classes}; {start['val/acc']:.4f} at round 0)"
    if "val/loss" in now and "val/loss" in start and math.isfinite(start["val/loss"]):
        loss, begin = now["val/loss"], start["val/loss"]
        if not math.isfinite(loss) or loss > max(3 * begin, begin + 2):
            return f"val/loss {loss:.4g} against {begin:.4g} at round 0"
    return None


def write_audit(trainer: Any) -> dict[str, Any]:
    """The privacy audit's report (``trainer.privacy_audit``), written to ``privacy_audit.json`` by rank 0."""
    if trainer.privacy is not None:
        report = trainer.privacy_audit.report(trainer.privacy.epsilon(), trainer.privacy.delta)
    else:  # DP-SGD's: the audited client's record-level epsilon
        dp, client = trainer.dp_sgd, trainer.dp_sgd.canaries.client
        report = trainer.privacy_audit.report(dp.client_epsilon(client) if client is not None else math.nan, dp.delta)
        report["level"], report["unit"] = f"canary records of client {client}", "step"
    if trainer.fabric.is_global_zero:
        write_report(report, trainer.log_dir / "privacy_audit.json")
    return report


#: The summary's line for a private run that logs its unprotected statistics (``trainer.unprotected_statistics``).
UNPROTECTED = (
    "  unprotected/* holds statistics of the clients' updates outside the privacy guarantee "
    "(trainer.unprotected_statistics): keep them with the server"
)


def trainer_summary(trainer: Any, datamodule: Any, audit: dict[str, Any] | None = None) -> str:
    """:func:`run_summary` of ``trainer`` (a :class:`~lightning_fl.federated.FederatedTrainer`) after its fit on
    ``datamodule`` (``audit``: the privacy audit's report)."""
    ledger, privacy, dp_sgd = trainer.ledger, trainer.privacy, trainer.dp_sgd
    return run_summary(
        trainer.history, trainer.log_dir, trainer.logger, trainer.stopped, trainer.alarm,
        val_is_test=getattr(datamodule, "val_is_test", False) is True,  # (a data module may not say)
        took_part=(*ledger.took_part(), ledger.num_clients) if ledger is not None else None,
        privacy=privacy.guarantee(trainer.secure_aggregation is not None) if privacy is not None else "",
        record_privacy=dp_sgd.guarantee() if dp_sgd is not None else "",
        audit=audit_lines(audit) if audit is not None else [],
        data=datamodule.summary_lines() if callable(getattr(datamodule, "summary_lines", None)) else [],
        gate=trainer.norm_gate_note,
    )  # fmt: skip


def run_summary(
    history: list[dict[str, float]],
    log_dir: Path,
    logger: bool,
    stopped: str | None = None,
    alarm: str | None = None,
    *,
    val_is_test: bool = False,
    took_part: tuple[int, float, int] | None = None,
    privacy: str = "",
    record_privacy: str = "",
    audit: list[str] | None = None,
    data: list[str] | None = None,
    gate: str | None = None,
) -> str:
    """One line per evaluation metric (start, final, best round), the bytes, the privacy spent, why the run stopped
    early (``stopped``), and where the run's files are.

    Args:
        val_is_test: The data module's ``val/*`` is its test split (said first: each best round is then chosen on
            test data).
        took_part: The clients that took part, their mean bytes and the number of clients (the ledger's): said when
            not every client took part.
        privacy, record_privacy: What user-level DP's and DP-SGD's epsilons protect (the mechanisms' ``guarantee``),
            each on a line under its epsilon.
        audit: The privacy audit's lines (:func:`~lightning_fl.privacy.audit.audit_lines`), under the epsilon.
        data: What the data module says of its data (its ``summary_lines()``: e.g. records cut at the context).
        gate: Why the relative norm gate is off by default (the trainer's ``norm_gate_note``).
    """
    if not history:
        return f"No round ran. Run folder: {log_dir}"
    last = history[-1]
    start = next((h for h in history if h.get("round") == 0), None)
    lines = [f"Finished round {int(last['round'])} in {last.get('time/elapsed_s', 0.0):.1f} s of rounds."]
    if "time/simulated_elapsed_s" in last:  # trainer.clock
        late = sum(h.get("fed/late_clients", 0.0) for h in history)
        stale = max((h["fed/staleness_max"] for h in history if "fed/staleness_max" in h), default=None)
        tail = f"{late:,.0f} late client(s) left out" if stale is None else f"FedBuff, staleness up to {stale:.0f}"
        lines.append(f"  simulated time (trainer.clock): {last['time/simulated_elapsed_s']:,.1f} s over the rounds; "
                     f"{tail}")  # fmt: skip
    if val_is_test and any(k.startswith("val/") for k in last):
        lines.append(f"  {TEST_AS_VAL}: each best round below is chosen on test data")
    for key in sorted(k for k in last if k.startswith("val/")):
        best = best_round(history, key)
        begin = f"{start[key]:.4f} at round 0, " if start is not None and key in start else ""
        at_best = f", best {best[1]:.4f} (round {best[0]})" if best is not None else ""
        lines.append(f"  {key}: {begin}{last[key]:.4f} at the end{at_best}")
    for key in sorted(k for k in last if k.startswith("test/")):  # trainer.test_after_fit: read once per model
        begin = f"{start[key]:.4f} before the first round, " if start is not None and key in start else ""
        lines.append(f"  {key}: {begin}{last[key]:.4f} after the last (the test split, chosen on by nothing)")
    lines += [f"  {line}" for line in data or []]
    if "comm/cum_client_bytes" in last:
        per_client = last["comm/cum_client_bytes"]
        mib = per_client / 2**20
        text = f"  bytes per client (uploads and downloads, mean over clients): {per_client:,.0f} ({mib:.3f} MiB)"
        if last.get("comm/cum_rejected_bytes"):
            text += f"; refused uploads: {last['comm/cum_rejected_bytes']:,.0f} bytes in all"
        lines.append(text)
        if took_part is not None and 0 < took_part[0] < took_part[2]:
            count, mean, clients = took_part
            lines.append(f"  bytes per client that took part ({count:,} of {clients:,} clients): {mean:,.0f} "
                         f"({mean / 2**20:.3f} MiB)")  # fmt: skip
    if "privacy/epsilon" in last:
        eps, delta = last["privacy/epsilon"], last.get("privacy/delta")
        at = f" at delta {delta:.3g}" if delta is not None else ""
        lines.append(f"  privacy: user-level epsilon {eps:.4g}{at} after {int(last['round'])} rounds (noise multiplier "
                     f"{last.get('privacy/noise_multiplier', float('nan')):.4g})")  # fmt: skip
        lines += [f"    {line}" for line in privacy.splitlines()]
        if "privacy/population_epsilon" in last:
            lines.append(population_line(last["privacy/population_epsilon"], last.get("privacy/population_rounds")))
    if "privacy/record_epsilon_max" in last:
        worst, median = last["privacy/record_epsilon_max"], last.get("privacy/record_epsilon_median", float("nan"))
        lines.append(f"  record-level DP-SGD: worst client's epsilon {worst:.4g} at delta "
                     f"{last.get('privacy/record_delta', float('nan')):.3g}, median {median:.4g} (every client: "
                     "dp_sgd_clients.csv)")  # fmt: skip
        lines += [f"    {line}" for line in record_privacy.splitlines()]
        if "privacy/record_population_epsilon_max" in last:
            worst = last["privacy/record_population_epsilon_max"]
            lines.append(f"    the population, every run that drew on it: worst client's epsilon {worst:.4g}")
    if any(k.startswith("unprotected/") for k in last):  # trainer.unprotected_statistics
        lines.append(UNPROTECTED)
    lines += [f"  {line}" for line in audit or []]
    if gate is not None:
        lines.append(f"  {gate}")
    if alarm is not None:
        lines.append(f"  warning: {alarm}")
    if stopped is not None:
        lines.append(f"  {stopped}")
    lines.append(f"  run folder: {log_dir} (config.yaml, checkpoints/last.ckpt)")
    if logger:
        lines.append(f"  TensorBoard: tensorboard --logdir {log_dir.parent}")
    return "\n".join(lines)


def population_line(epsilon: float, rounds: float | None) -> str:
    """What the population (the data set and partition) has spent, by every run that drew on it."""
    released = f" over {int(rounds)} released rounds" if rounds is not None else ""
    return f"    the population (data set and partition), every run that drew on it: epsilon {epsilon:.4g}{released}"


def write_client_epsilons(dp_sgd: Any, path: Path) -> None:
    """Every client's record-level DP-SGD spend (``trainer.dp_sgd``) as a CSV row, written atomically."""
    rows = dp_sgd.report()
    if not rows:
        return
    header = list(rows[0])
    text = ",".join(header) + "\n" + "".join(",".join(f"{r[k]:.6g}" if isinstance(r[k], float) else str(r[k])
                                                      for k in header) + "\n" for r in rows)  # fmt: skip
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def evaluation_lines(metrics: dict[str, float], command: str, log_dir: Path | None, val_is_test: bool = False) -> str:
    """What ``validate``/``test`` print: where the results went (the evaluation's own folder), each metric on its line
    (``val_is_test``: ``val/*`` is the test split, said first), and a NaN or Inf one said plainly."""
    lines = [f"{command}: {len(metrics)} metric(s)"]
    if log_dir is not None:
        lines[0] += f", {EVALUATION_FOLDER.format(log_dir)}"
    lines += [f"  {TEST_AS_VAL}"] if val_is_test and any(k.startswith("val/") for k in metrics) else []
    width = max((len(k) for k in metrics), default=0)
    for key in sorted(metrics):
        value = metrics[key]
        lines.append(f"  {key:<{width}}  {value:.6g}")
    bad = [k for k, v in metrics.items() if not math.isfinite(v)]
    if bad:
        lines.append(f"warning: {', '.join(sorted(bad))} not finite: the model's outputs are NaN or Inf "
                     "(check the checkpoint and the data)")  # fmt: skip
    return "\n".join(lines)
