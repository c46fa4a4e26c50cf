"""The update-norm gate study: how tight a gate honest clients allow, and which attacks each gate stops.

Reads the CSVs of two sweeps (tools/sweeps/gate_honest.yaml, tools/sweeps/gate_attacks.yaml) and prints two
markdown tables (``--markdown FILE`` also writes them):

1. **Honest clients.** The gate refuses an upload whose update norm is above ``ratio`` times the round's median.
   Honest runs with the gate off log each round's largest norm over its median (``fed/update_norm_max_ratio``):
   a gate ratio above it refuses nothing that round, and until a round where it does not, the gated run is the
   gate-free run bit for bit. So a gate whose ratio is above every logged value refuses no honest upload in
   these runs (an exact 0); below, the table counts the rounds where it would refuse at least one upload (a
   lower bound on its refusals).
2. **Attacks.** The final accuracy (mean (std) over seeds) per attack and gate, beside the clean run, and the
   share of uploads the gate refused out of the hostile uploads sent; "stops" marks a mean within
   ``--margin`` (2 pp) of the clean mean.

    python tools/gate_study.py docs/results/gate_honest.csv docs/results/gate_attacks.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from collections import defaultdict
from pathlib import Path

GATES = (100.0, 10.0, 5.0, 3.0, 2.0)


def read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def number(text: str) -> float:
    return float(text) if text not in ("", None) else math.nan


def honest_table(rows: list[dict[str, str]], gates: tuple[float, ...] = GATES) -> list[str]:
    """Per setting: the max-over-median ratios of every round, and how many rounds each gate would touch."""
    ratios: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    uploads: dict[tuple[str, str, str], float] = defaultdict(float)
    refused: dict[tuple[str, str, str], float] = defaultdict(float)
    seeds: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for row in rows:
        if int(row["round"]) == 0:
            continue
        key = (row["data"], row["state"], row["partition"])
        seeds[key].add(row["seed"])
        ratio = number(row["fed/update_norm_max_ratio"])
        if not math.isnan(ratio):
            ratios[key].append(ratio)
        refused[key] += number(row["fed/dropped_clients"]) or 0.0
        uploads[key] += number(row["fed/clients"])  # the round's sampled clients (none is unavailable here)
    head = ["data", "model", "partition", "runs x rounds", "uploads", "max / median: median, 99th pct, largest"]
    head += [f"rounds a gate of {g:g} would refuse in" for g in gates]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for key in sorted(ratios):
        values = sorted(ratios[key])
        p99 = values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]
        cells = [
            key[0],
            key[1],
            key[2],
            f"{len(seeds[key])} x {len(values) // max(1, len(seeds[key]))}",
            f"{uploads[key]:.0f}",
            f"{statistics.median(values):.2f}, {p99:.2f}, {values[-1]:.2f}",
        ]
        cells += [f"{sum(v > g for v in values)} of {len(values)}" for g in gates]
        if refused[key]:
            cells[4] += f" ({refused[key]:.0f} refused with the gate off)"
        out.append("| " + " | ".join(cells) + " |")
    return out


def final_rows(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [r for r in rows if r["final"] == "1"]


def attack_table(rows: list[dict[str, str]], honest: list[dict[str, str]], margin: float) -> list[str]:
    """Final val/acc per (model, n, attack) x gate, with the share of hostile uploads refused."""
    clean: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in final_rows(rows):
        if r["attack"] == "none":
            clean[(r["state"], r["n"])].append(number(r["val/acc"]))
    for r in final_rows(honest):  # the clean 8-client runs: digits IID, gate off
        if r["data"] == "digits" and r["partition"] == "iid":
            clean[(r["state"], "8")].append(number(r["val/acc"]))
    acc: dict[tuple[str, str, str, str], list[float]] = defaultdict(list)
    refused: dict[tuple[str, str, str, str], float] = defaultdict(float)
    sent: dict[tuple[str, str, str, str], float] = defaultdict(float)
    gates: set[str] = set()
    for r in rows:
        if r["attack"] == "none":
            continue
        key = (r["state"], r["n"], r["attack"], r["gate"])
        gates.add(r["gate"])
        if r["final"] == "1":
            acc[key].append(number(r["val/acc"]))
        if int(r["round"]) > 0:
            refused[key] += number(r["fed/dropped_clients"]) or 0.0
            sent[key] += number(r["fed/attacked_clients"]) or 0.0
    order = sorted(gates, key=float, reverse=True)
    head = ["model", "hostile", "attack", "clean"] + [f"gate {g}" for g in order]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for state, n, attack in sorted({k[:3] for k in acc}, key=lambda k: (k[0], int(k[1]), k[2])):
        base = clean.get((state, n), [])
        base_mean = statistics.mean(base) if base else math.nan
        cells = [state, f"3 of {n}", attack, _mean_std(base)]
        for g in order:
            key = (state, n, attack, g)
            if key not in acc:
                cells.append("")
                continue
            values = acc[key]
            share = refused[key] / sent[key] if sent[key] else math.nan
            stops = "**stops**, " if abs(statistics.mean(values) - base_mean) <= margin else ""
            cells.append(f"{_mean_std(values)}; {stops}refused {share:.0%}")
        out.append("| " + " | ".join(cells) + " |")
    return out


def _mean_std(values: list[float]) -> str:
    if not values:
        return ""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ({std:.3f})"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("honest", type=Path, help="CSV of tools/sweeps/gate_honest.yaml")
    parser.add_argument("attacks", type=Path, nargs="?", help="CSV of tools/sweeps/gate_attacks.yaml")
    parser.add_argument("--margin", type=float, default=0.02, help="'stops': within this of the clean accuracy")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    args = parser.parse_args(argv)
    honest = read(args.honest)
    lines = [
        "**Honest clients, gate off: each round's largest update norm over its median**",
        "",
        *honest_table(honest),
    ]
    if args.attacks is not None:
        lines += [
            "",
            "**Digits, IID, FedAvg, 20 rounds: final val/acc under attack by gate ratio, mean (std) over "
            "seeds; refused: uploads refused over hostile uploads sent**",
            "",
            *attack_table(read(args.attacks), honest, args.margin),
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text)
    return text


if __name__ == "__main__":
    main()
