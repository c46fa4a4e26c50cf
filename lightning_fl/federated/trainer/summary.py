"""The few lines a federated run prints when it ends: what it reached, what it cost, and where it is."""

from __future__ import annotations

import math
from pathlib import Path

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


#: The summary's line for a private run that logs its unprotected statistics (``trainer.unprotected_statistics``).
UNPROTECTED = (
    "  unprotected/* holds statistics of the clients' updates outside the privacy guarantee "
    "(trainer.unprotected_statistics): keep them with the server"
)


def run_summary(
    history: list[dict[str, float]],
    log_dir: Path,
    logger: bool,
    stopped: str | None = None,
    alarm: str | None = None,
    *,
    val_is_test: bool = False,
    took_part: tuple[int, float, int] | None = None,
    timing: list[str] | None = None,
    stages: list[str] | None = None,
    data: list[str] | None = None,
) -> str:
    """One line per evaluation metric (start, final, best round), the bytes, the rounds skipped, what each stage
    reports (the privacy spent, the audit, the norm gate), why the run stopped early (``stopped``), and where the
    run's files are.

    Args:
        val_is_test: The data module's ``val/*`` is its test split (said first: each best round is then chosen on
            test data).
        took_part: The clients that took part, their mean bytes and the number of clients (the ledger's): said when
            not every client took part.
        timing: The arrival policy's lines (the simulated time), under the first.
        stages: The stages' lines (each stage's :meth:`~lightning_fl.federated.server.stages.Stage.summary`, in order).
        data: What the data module says of its data (its ``summary_lines()``: e.g. records cut at the context).
    """
    if not history:
        return f"No round ran. Run folder: {log_dir}"
    last = history[-1]
    start = next((h for h in history if h.get("round") == 0), None)
    lines = [f"Finished round {int(last['round'])} in {last.get('time/elapsed_s', 0.0):.1f} s of rounds."]
    lines += [f"  {line}" for line in timing or []]
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
            lines.append(
                f"  bytes per client that took part ({count:,} of {clients:,} clients): {mean:,.0f} "
                f"({mean / 2**20:.3f} MiB)"
            )
    if skipped := skipped_line(history):
        lines.append(f"  {skipped}")
    if any(k.startswith("unprotected/") for k in last):  # trainer.unprotected_statistics
        lines.append(UNPROTECTED)
    lines += [f"  {line}" for line in stages or []]
    if alarm is not None:
        lines.append(f"  warning: {alarm}")
    if stopped is not None:
        lines.append(f"  {stopped}")
    lines.append(f"  run folder: {log_dir} (config.yaml, checkpoints/last.ckpt)")
    if logger:
        lines.append(f"  TensorBoard: tensorboard --logdir {log_dir.parent}")
    return "\n".join(lines)


def skipped_line(history: list[dict[str, float]], shown: int = 8) -> str | None:
    """The rounds that kept the global state (``fed/round_skipped``), counted and named (the first ``shown``);
    ``None`` when none did."""
    rounds = [h for h in history if h.get("round", 0) >= 1]
    skipped = [int(h["round"]) for h in rounds if h.get("fed/round_skipped")]
    if not skipped:
        return None
    named = ", ".join(map(str, skipped[:shown])) + (", ..." if len(skipped) > shown else "")
    return (
        f"rounds skipped (the global state kept: too few accepted uploads, or a refused aggregate): "
        f"{len(skipped)} of {len(rounds)} (round{'s' if len(skipped) > 1 else ''} {named})"
    )


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
        lines.append(
            f"warning: {', '.join(sorted(bad))} not finite: the model's outputs are NaN or Inf "
            "(check the checkpoint and the data)"
        )
    return "\n".join(lines)
