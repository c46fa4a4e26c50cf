"""The equal-bytes frontier of a language-model sweep: test perplexity and next-token accuracy against the bytes of
one upload, per method, as mean +/- standard error over seeds (tools/sweeps/smollm2_frontier.yaml's CSV).

For each run (label, seed): the base is round 0 (the pretrained model, before any round); the final round is the
last one; the best round is the evaluated round (1 on) with the lowest perplexity. Each label's row gives the upload
bytes (``comm/client_up_bytes``, equal in every round), how many seeds finished, the base, final and best test
perplexity with the change from the base in percent, the final and best next-token accuracy, and the min and median
wall time of a round (``time/round_s``, evaluation included where a round evaluates; on a shared machine the min is
the one to compare). A figure plots the
final perplexity against the bytes (log scale), one line per method, the base as a dashed line.

Private sweeps (rows with ``privacy/epsilon``, e.g. tools/sweeps/smollm2_dp_frontier.yaml): the table adds the
epsilon spent by the final round, the noise multiplier z and the clip bound S, rows are grouped by the sweep's
``eps`` tag (no noise first), and the figure draws one line per method and ``eps``.

    python tools/llm_frontier.py docs/results/smollm2_frontier.csv --markdown docs/results/smollm2_frontier.md \
        --figure docs/figures/smollm2_frontier.png
    python tools/llm_frontier.py docs/results/smollm2_dp_frontier.csv --markdown docs/results/smollm2_dp_frontier.md \
        --figure docs/figures/smollm2_dp_frontier.png --title "... under user-level DP"
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from collections import defaultdict
from pathlib import Path

TITLE = "SmolLM2-135M on Shakespeare roles: the equal-bytes frontier"


def number(value: str) -> float | None:
    return float(value) if value not in ("", None) else None


def runs_of(paths: list[Path]) -> dict[tuple[str, int], list[dict]]:
    """The CSV rows of every (label, seed), in round order."""
    runs: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                runs[(row["label"], int(row["seed"]))].append(row)
    for rows in runs.values():
        rows.sort(key=lambda r: int(r["round"]))
    return runs


def last(rows: list[dict], key: str) -> float | None:
    """The last value of ``key`` logged in a run (None if it never was)."""
    values = [number(r.get(key)) for r in rows if number(r.get(key)) is not None]
    return values[-1] if values else None


def summary(rows: list[dict]) -> dict[str, float]:
    """One run: base, final and best perplexity (and accuracy at the same rounds), bytes, round time."""
    evaluated = [r for r in rows if number(r.get("val/ppl")) is not None]
    base = next(r for r in evaluated if int(r["round"]) == 0)
    final = rows[-1]
    if number(final.get("val/ppl")) is None:
        raise SystemExit(f"{final['label']} seed {final['seed']}: its last round has no val/ppl (unfinished?)")
    best = min((r for r in evaluated if int(r["round"]) >= 1), key=lambda r: float(r["val/ppl"]))
    uploads = {number(r.get("comm/client_up_bytes")) for r in rows[1:]} - {None}
    times = [number(r.get("time/round_s")) for r in rows[1:] if number(r.get("time/round_s")) is not None]
    return {
        "base_ppl": float(base["val/ppl"]),
        "final_ppl": float(final["val/ppl"]),
        "best_ppl": float(best["val/ppl"]),
        "best_round": int(best["round"]),
        "base_acc": float(base["val/acc"]),
        "final_acc": float(final["val/acc"]),
        "best_acc": max(float(r["val/acc"]) for r in evaluated if int(r["round"]) >= 1),
        "bytes": max(uploads) if uploads else math.nan,
        "round_s": statistics.median(times) if times else math.nan,
        "round_min_s": min(times) if times else math.nan,
        "rounds": int(final["round"]),
        "method": final.get("method", ""),
        "eps": final.get("eps", ""),
        "epsilon": last(rows, "privacy/epsilon"),
        "z": last(rows, "privacy/noise_multiplier"),
        "clip": last(rows, "privacy/clip_norm"),
    }


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (nan for one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan)


def cell(values: list[float], digits: int) -> str:
    mean, se = mean_se(values)
    return f"{mean:.{digits}f}" if math.isnan(se) else f"{mean:.{digits}f} +/- {se:.{digits}f}"


def table(runs: dict[tuple[str, int], list[dict]]) -> tuple[str, dict[str, list[dict]]]:
    by_label: dict[str, list[dict]] = defaultdict(list)
    for (label, _seed), rows in runs.items():
        by_label[label].append(summary(rows))
    private = any(x["epsilon"] is not None for s in by_label.values() for x in s)
    extra = " epsilon spent | z | S |" if private else ""
    lines = [
        f"| run | method | bytes per upload | seeds |{extra} base ppl | final ppl | change | best ppl (round) | "
        "final acc | best acc | round, wall min / median |",
        "| --- " * (11 + 3 * private) + "|",
    ]

    def order(label: str) -> tuple:
        first = by_label[label][0]
        eps = float(first["eps"]) if first["eps"] not in ("", None) else math.inf
        return -eps, first["method"], first["bytes"]

    for label in sorted(by_label, key=order):
        s = by_label[label]
        change = [100 * (x["final_ppl"] / x["base_ppl"] - 1) for x in s]
        rounds = sorted({x["best_round"] for x in s})
        dp = ""
        if private:
            eps, z = max(x["epsilon"] or 0.0 for x in s), statistics.fmean(x["z"] or 0.0 for x in s)
            dp = f" {eps:.2f} | {z:.4f} |" if z else " inf (no noise) | 0 |"
            dp += f" {s[0]['clip']:.4g} |"
        lines.append(
            f"| {label} | {s[0]['method']} | {s[0]['bytes']:,.0f} | {len(s)} |{dp} "
            f"{cell([x['base_ppl'] for x in s], 2)} | "
            f"{cell([x['final_ppl'] for x in s], 2)} | {cell(change, 1)}% | {cell([x['best_ppl'] for x in s], 2)} "
            f"({', '.join(map(str, rounds))}) | {cell([x['final_acc'] for x in s], 4)} | "
            f"{cell([x['best_acc'] for x in s], 4)} | {min(x['round_min_s'] for x in s):.0f} / "
            f"{statistics.median(x['round_s'] for x in s):.0f} s |"
        )
    return "\n".join(lines), by_label


def figure(by_label: dict[str, list[dict]], path: Path, title: str = TITLE) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    methods: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for s in by_label.values():
        mean, se = mean_se([x["final_ppl"] for x in s])
        line = s[0]["method"] + (f", epsilon {s[0]['eps']}" if s[0]["eps"] not in ("", None) else "")
        methods[line].append((s[0]["bytes"], mean, 0.0 if math.isnan(se) else se))
    base = statistics.fmean(x["base_ppl"] for s in by_label.values() for x in s)
    cap = 2 * base  # a run that collapsed (DP noise) is drawn at the cap, its value written beside it
    for method, points in sorted(methods.items()):
        points.sort()
        shown = [min(p[1], cap) for p in points]
        bars = ax.errorbar(
            [p[0] for p in points],
            shown,
            yerr=[p[2] if p[1] <= cap else 0 for p in points],
            marker="o",
            capsize=3,
            label=method,
        )
        for (x, y, _), y_shown in zip(points, shown, strict=True):
            if y > cap:
                ax.annotate(
                    f"{method}: {y:,.0f} (off scale)",
                    (x, y_shown),
                    textcoords="offset points",
                    xytext=(-4, -12 - 10 * len(ax.texts)),
                    ha="right",
                    fontsize=7,
                    color=bars[0].get_color(),
                )
    ax.axhline(base, color="grey", linestyle="--", label=f"base (round 0): {base:.1f}")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per upload (float32)")
    ax.set_ylabel("test perplexity, final round")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path, nargs="+")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    parser.add_argument("--figure", type=Path, default=None, help="write the frontier figure (PNG) here")
    parser.add_argument("--title", default=TITLE, help="the figure's title")
    args = parser.parse_args()
    text, by_label = table(runs_of(args.csv))
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(f"Made by `python tools/llm_frontier.py {' '.join(map(str, args.csv))}`.\n\n{text}\n")
    if args.figure is not None:
        figure(by_label, args.figure, args.title)
        print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
