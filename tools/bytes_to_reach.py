"""Bytes per client until a run's mean test accuracy first reaches a target, counted three ways (FLITE's claim 4).

For each label of each CSV (tools/sweep.py output): the first round whose val/acc, averaged over seeds, is at
least ``--target``, and at that round the mean cumulative bytes per client counted as

- ``up``: uploads only (``comm/cum_client_up_bytes``);
- ``total``: uploads and downloads as the run's ledger counts them (``comm/cum_client_bytes``);
- ``total, base held``: ``total`` less the first round's download, for clients that already hold the starting
  model (FLITE's clients hold the pretrained base; here PowerSGD's and top-k's hold the same base, so their first
  download of it need not travel either).

    python tools/bytes_to_reach.py docs/results/flite_fashion_mnist.csv docs/results/flite_downloads_fashion_mnist.csv \
        --labels latent powersgd_r2 powersgd_r8 topk_1pct topk_10pct --target 0.8553
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict
from pathlib import Path


def reach(path: Path, labels: list[str], target: float) -> list[tuple[str, int | None, float, float, float]]:
    """(label, round or None, up, total, total with the base held) per label, means over seeds."""
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["label"] in labels]
    by: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by[r["label"]][int(r["round"])].append(r)
    out = []
    for label in [lb for lb in labels if lb in by]:
        rounds = by[label]
        first_down = statistics.mean(float(r["comm/client_down_bytes"]) for r in rounds[1])
        for k in sorted(k for k in rounds if k > 0):
            if statistics.mean(float(r["val/acc"]) for r in rounds[k]) >= target:
                up = statistics.mean(float(r["comm/cum_client_up_bytes"]) for r in rounds[k])
                total = statistics.mean(float(r["comm/cum_client_bytes"]) for r in rounds[k])
                out.append((label, k, up, total, total - first_down))
                break
        else:
            out.append((label, None, float("nan"), float("nan"), float("nan")))
    return out


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path, nargs="+")
    parser.add_argument("--labels", nargs="+", required=True)
    parser.add_argument("--target", type=float, required=True, help="mean val/acc to reach")
    args = parser.parse_args(argv)
    lines = [
        f"| csv | run | round reaching {args.target:g} | up | total | total, base held |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for path in args.csv:
        for label, k, up, total, held in reach(path, args.labels, args.target):
            if k is None:
                lines.append(f"| {path.name} | {label} | not reached | | | |")
            else:
                lines.append(f"| {path.name} | {label} | {k} | {up:,.0f} | {total:,.0f} | {held:,.0f} |")
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
