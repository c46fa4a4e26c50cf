"""Paired per-seed differences between two runs of a sweep CSV (test accuracy in points, or ``--metric``), at the
best and last round.

For each seed both labels have, ``100 (acc_a - acc_b)`` at the best evaluated round after round 0 and at the last
one; then the mean, its standard error over seeds and their ratio (the project's 2-SE rule reads |ratio| < 2 as a
tie). Used for the comparisons quoted in docs/results-lora.md. With ``--against OTHER.csv``, ``b`` is read from
that CSV: the same run in two sweeps (e.g. a study rerun with another clip bound).

    python tools/paired_seeds.py docs/results/lora_fashion_mnist.csv latent_d256_r256 ffa_r4
    python tools/paired_seeds.py docs/results/dp_shakespeare_sgd.csv A B --against docs/results/dp_shakespeare.csv \\
        --metric val/ppl
    python tools/paired_seeds.py docs/results/dp_fashion_mnist_public_clip.csv fedavg_eps4_iid fedavg_eps4_iid \\
        --against docs/results/dp_fashion_mnist.csv
    python tools/paired_seeds.py docs/results/dp_fashion_mnist_public_clip.csv --each \\
        --against docs/results/dp_fashion_mnist.csv

``--each`` (with ``--against``) pairs every label with itself in the other CSV, one line per label, then the
largest difference over all of them: how much a rerun moved a whole study. Rows that record different machines (the
``environment`` column of tools/sweep.py), in one CSV or across the two, are refused: their bases differ.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling tools
from report import lower_is_better, one_machine  # lower-is-better: loss, ppl, ECE, bytes, time


def accuracies(path: Path, metric: str = "val/acc") -> dict[tuple[str, int], dict[int, float]]:
    """``{(label, seed): {round: metric}}`` for every evaluated row."""
    out: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    with path.open() as f:
        rows = list(csv.DictReader(f))
    one_machine(rows, str(path))
    for row in rows:
        if row.get(metric):
            out[(row["label"], int(row["seed"]))][int(row["round"])] = float(row[metric])
    return out


def machines(path: Path) -> set[str]:
    """The machines a sweep CSV's rows were made on (its ``environment`` column; none recorded: empty)."""
    with path.open() as f:
        return {r["environment"] for r in csv.DictReader(f) if r.get("environment")}


def paired(acc: dict, a: str, b: str, other: dict | None = None, metric: str = "val/acc") -> dict[str, dict]:
    """Per seed, best and last round: the differences (accuracy in points, other metrics as they are), their mean,
    SE and mean / SE (``b`` from ``other`` when given)."""
    other = acc if other is None else other
    seeds = sorted({s for label, s in acc if label == a} & {s for label, s in other if label == b})
    best, scale = (min, 1.0) if lower_is_better(metric) else (max, 100.0 if metric.endswith("acc") else 1.0)
    pick = {"best": lambda d: best(v for r, v in d.items() if r > 0), "last": lambda d: d[max(d)]}
    out = {}
    for name, f in pick.items():
        xs = [scale * (f(acc[(a, s)]) - f(other[(b, s)])) for s in seeds]
        mean = statistics.mean(xs)
        se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan
        out[name] = {"per_seed": xs, "mean": mean, "se": se, "ratio": mean / se if se else math.nan}
    return out


def each(acc: dict, other: dict, metric: str = "val/acc") -> dict[str, dict]:
    """``paired(acc, label, label, other)`` for every label with a seed in both, in ``acc``'s order."""
    labels = dict.fromkeys(label for label, seed in acc if (label, seed) in other)
    return {label: paired(acc, label, label, other, metric) for label in labels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path)
    parser.add_argument("a", nargs="?")
    parser.add_argument("b", nargs="?")
    parser.add_argument("--against", type=Path, default=None, help="read b from this CSV")
    parser.add_argument("--each", action="store_true", help="with --against: every label against itself there")
    parser.add_argument("--metric", default="val/acc", help="a CSV column (loss, ppl: lower is better)")
    args = parser.parse_args()
    if args.each != (args.a is None and args.b is None) or (args.each and args.against is None):
        parser.error("give two labels A B, or --each with --against OTHER.csv")
    acc = accuracies(args.csv, args.metric)
    other = accuracies(args.against, args.metric) if args.against is not None else None
    if other is not None and len(mixed := machines(args.csv) | machines(args.against)) > 1:
        parser.exit(
            2,
            f"error: {args.csv} and {args.against} were made on different machines ({'; '.join(mixed)}): "
            "their bases differ, so their seeds do not pair\n",
        )
    unit, digits = (" points", 2) if args.metric.endswith("acc") else ("", 4)
    if args.each:
        rows = each(acc, other, args.metric)
        for label, r in rows.items():
            print(
                f"{label}: seeds {len(r['last']['per_seed'])}; "
                + "; ".join(f"{name} round {', '.join(f'{x:+.{digits}f}' for x in r[name]['per_seed'])}" for name in r)
            )
        worst = {
            name: max((abs(x) for r in rows.values() for x in r[name]["per_seed"]), default=math.nan)
            for name in ("best", "last")
        }
        runs = sum(len(r["last"]["per_seed"]) for r in rows.values())
        print(
            f"{len(rows)} labels, {runs} runs paired; largest |difference|{unit}: best round "
            f"{worst['best']:.{digits}f}, last round {worst['last']:.{digits}f}"
        )
        return
    for name, r in paired(acc, args.a, args.b, other, args.metric).items():
        seeds = ", ".join(f"{x:+.{digits}f}" for x in r["per_seed"])
        print(
            f"{args.a} - {args.b} ({args.metric}), {name} round: per seed {seeds}; mean {r['mean']:+.{digits}f}"
            f"{unit}, SE {r['se']:.{digits}f}, {r['ratio']:+.1f} SE"
        )


if __name__ == "__main__":
    main()
