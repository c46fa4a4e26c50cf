"""One run's logged scalars as a table, read from its TensorBoard event files.

For runs that have no sweep CSV (a pretraining run, a single federated run, the centralised latent probe):
the results pages (docs/results-*.md) quote their per-epoch and per-round numbers through this command.

    python tools/run_table.py runs/pretrain_fashion_mnist/version_0 --tags val/acc val/ece --by epoch
    python tools/run_table.py runs/flite_fashion_mnist/version_0 --tags val/acc val/ece       # per round
    python tools/run_table.py runs/flite_fashion_mnist/version_0 --summary                     # every tag

The table has one column per logged step (a federated run logs round r at step r) or, with ``--by epoch``, per
training epoch, numbered from 1 (Lightning logs an ``epoch`` scalar beside each value; its 0-based epoch is
mapped to 1-based). ``--summary`` prints, per tag, the first and last value and the largest and smallest with
the step where each occurs. Event files of one folder are read in name order (their creation time): a resumed
run that logs a step again overrides the earlier value.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path


class RunTableError(Exception):
    """Bad input: printed as one line, exit status 2."""


def read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar tag under ``run_dir`` (its event files, recursively) as ``{tag: {step: value}}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(run_dir.rglob("events.out.tfevents.*"), key=lambda p: (p.name, str(p))) if run_dir.is_dir() else []
    if not files:
        raise RunTableError(
            f"no TensorBoard event files under {run_dir}: give a run's folder (e.g. runs/NAME/version_0)"
        )
    scalars: dict[str, dict[int, float]] = {}
    for path in files:
        events = EventAccumulator(str(path), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            for event in events.Scalars(tag):
                scalars.setdefault(tag, {})[int(event.step)] = float(event.value)
    return scalars


def by_epoch(scalars: dict[str, dict[int, float]], tag: str) -> dict[int, float]:
    """``tag``'s values keyed by 1-based training epoch, through the ``epoch`` scalar logged at the same step."""
    epochs = scalars.get("epoch")
    if not epochs:
        raise RunTableError("--by epoch needs the run's 'epoch' scalar (Lightning logs it); leave out --by epoch")
    out = {}
    for step, value in scalars[tag].items():
        if step not in epochs:
            raise RunTableError(f"{tag} at step {step} has no 'epoch' logged at that step; leave out --by epoch")
        out[int(epochs[step]) + 1] = value
    return out


def _pick(scalars: dict[str, dict[int, float]], tags: list[str] | None) -> list[str]:
    if not tags:
        return sorted(scalars)
    unknown = [t for t in tags if t not in scalars]
    if unknown:
        raise RunTableError(
            f"--tags {' '.join(unknown)}: not logged by this run; it logged {', '.join(sorted(scalars))}"
        )
    return tags


def table(scalars: dict[str, dict[int, float]], tags: list[str], by: str = "step", decimals: int = 4) -> str:
    """A markdown table: one row per tag, one column per step (or epoch); a value not logged there is ``-``."""
    rows = {tag: by_epoch(scalars, tag) if by == "epoch" else scalars[tag] for tag in tags}
    columns = sorted({k for values in rows.values() for k in values})
    lines = [
        "| " + " | ".join([by, *map(str, columns)]) + " |",
        "| " + " | ".join(["---"] * (len(columns) + 1)) + " |",
    ]
    for tag, values in rows.items():
        cells = [_format(values[k], decimals) if k in values else "-" for k in columns]
        lines.append("| " + " | ".join([tag, *cells]) + " |")
    return "\n".join(lines)


def summary(scalars: dict[str, dict[int, float]], tags: list[str], decimals: int = 4) -> str:
    """Per tag: first, last, largest and smallest value, each with its step."""
    lines = []
    for tag in tags:
        items = sorted(scalars[tag].items())
        top = max(items, key=lambda kv: kv[1])  # the first step on ties
        low = min(items, key=lambda kv: kv[1])
        picks = (("first", items[0]), ("last", items[-1]), ("max", top), ("min", low))
        parts = [f"{name} {_format(v, decimals)} (step {s})" for name, (s, v) in picks]
        lines.append(f"{tag}: " + ", ".join(parts) + f"; {len(items)} values")
    return "\n".join(lines)


def _format(value: float, decimals: int) -> str:
    if not math.isfinite(value):
        return str(value)  # inf (a non-private run's epsilon), nan
    if value != 0 and abs(value) < 10 ** (-decimals):
        return f"{value:.2g}"  # an identity error of 3.6e-07 stays readable
    if value == int(value) and abs(value) >= 1:
        return f"{int(value):,}"  # bytes and counts
    return f"{value:.{decimals}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run's folder (its event files are found recursively)")
    parser.add_argument("--tags", nargs="+", default=None, help="scalar tags to show (default: all)")
    parser.add_argument("--by", choices=["step", "epoch"], default="step", help="columns: logged step or epoch")
    parser.add_argument("--summary", action="store_true", help="first, last, max and min of each tag instead")
    parser.add_argument("--decimals", type=int, default=4)
    args = parser.parse_args(argv)
    try:
        scalars = read_scalars(args.run_dir)
        tags = _pick(scalars, args.tags)
        if args.summary:
            print(summary(scalars, tags, args.decimals))
        else:
            print(table(scalars, tags, args.by, args.decimals))
    except RunTableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
