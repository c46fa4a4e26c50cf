"""Time to accuracy from a sweep whose runs carry the simulated clock (``trainer.clock``): a table and a figure.

Reads a sweep CSV (``tools/sweep.py``; the runs tagged ``method`` and ``close``) and gives, per method and way of
closing a round, over seeds: the final test accuracy (mean +- SE), the simulated time the run took, and for each
``--target`` accuracy the simulated minutes, the rounds (server steps, for FedBuff) and the client updates it took
to first reach it (at an evaluated round; a seed that never reaches it counts as not reached), and each client's
bytes. ``--gain`` G instead sets each run's target to its own round-0 (base) accuracy plus G: where the seeds' bases
differ by as much as the methods' gains, an absolute target near the base is met at round 0 by some seeds (a
target is met within 1e-9, so that a sum's rounding does not decide). A second table says where a round's time
goes: per method and way of closing, the medians over rounds and seeds of the simulated round (a FedBuff step for
FedBuff) and of a round's median client download, compute and upload times (as ``trainer.clock`` logs them; FedBuff
logs none). The figure draws the mean accuracy over seeds against simulated minutes (left) and against client
updates (right), one colour per method and one line style per way of closing a round. Where the runs log the work
their clients spent (``work/*``, ``trainer.clock``), a third table says how much of it was thrown away: per method and
way of closing, the device seconds of training and their share spent by clients whose update was not aggregated
(late, offline, unavailable or refused), the joules of that (``power_w`` times seconds: a model), and the clients
that went offline (``trainer.clock.availability``), summed over rounds and averaged over seeds.

    python tools/time_to_accuracy.py docs/results/time_to_accuracy_fashion_mnist.csv --gain 0.0005 0.003 \
        --markdown docs/results/time_to_accuracy_fashion_mnist.md --figure docs/figures/time_to_accuracy.png \
        --title "Fashion-MNIST, 1,000 clients: time to accuracy on the simulated clock (3 seeds)"

Client updates: a synchronous round aggregates ``fed/clients`` (those sampled) less the late, offline, unavailable and
refused ones; a FedBuff step logs the updates it aggregated as ``fed/clients``.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from collections import defaultdict
from pathlib import Path

CLOSES = {
    "sync": "wait for all",
    "over-selection": "over-selection",
    "over-selection-onoff": "over-selection, clients on/off",
    "fedbuff": "FedBuff",
}
#: The synchronous round's clients that sent no aggregated update.
NOT_AGGREGATED = ("fed/late_clients", "fed/offline_clients", "fed/unavailable_clients", "fed/dropped_clients")


#: The sweep CSV's columns that are text (``environment``: the sweep tool's record of the machine).
TEXT = ("sweep", "label", "method", "close", "environment")


def _num(value: str) -> float | None:
    return float(value) if value not in ("", None) else None


def read(path: Path) -> dict[tuple[str, str], dict[int, list[dict]]]:
    """``{(method, close): {seed: [round rows in order]}}`` with numbers parsed."""
    runs: dict[tuple[str, str], dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    with path.open() as f:
        for row in csv.DictReader(f):
            parsed = {k: (v if k in TEXT else _num(v)) for k, v in row.items()}
            runs[(row["method"], row["close"])][int(row["seed"])].append(parsed)
    for seeds in runs.values():
        for rows in seeds.values():
            rows.sort(key=lambda r: r["round"])
    return runs


def curve(rows: list[dict]) -> list[tuple[float, float, float, int]]:
    """A run's evaluated points: (simulated seconds, client updates, accuracy, round), from round 0 (the base) on."""
    points, updates, elapsed = [], 0.0, 0.0
    for r in rows:
        if r["round"] > 0:
            elapsed = r.get("time/simulated_elapsed_s") or elapsed
            updates += (
                (r.get("fed/clients") or 0.0) - sum(r.get(k) or 0.0 for k in NOT_AGGREGATED)
                if r.get("fed/staleness_max") is None
                else (r.get("fed/clients") or 0.0)
            )  # (a FedBuff step: aggregated)
        if r.get("val/acc") is not None:
            points.append((elapsed, updates, r["val/acc"], int(r["round"])))
    return points


def reach(points: list[tuple[float, float, float, int]], target: float) -> tuple[float, float, int] | None:
    """The simulated seconds, client updates and round at the first evaluated point at or above ``target``."""
    return next(((t, u, r) for t, u, acc, r in points if acc >= target - 1e-9), None)


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, math.nan
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def fmt(m: float, se: float, digits: int = 4) -> str:
    return f"{m:.{digits}f}" if math.isnan(se) else f"{m:.{digits}f} +/- {se:.{digits}f}"


def ordered(runs: dict) -> list:
    """``runs``' items by method, then way of closing a round in ``CLOSES``' order."""
    return sorted(runs.items(), key=lambda kv: (kv[0][0], list(CLOSES).index(kv[0][1])))


def table(runs: dict, targets: list[float], gain: bool = False) -> str:
    """The table of the module docstring; ``gain``: ``targets`` are gains over each run's round-0 accuracy."""
    name = [f"base + {t:.4f}" if gain else f"{t:.4f}" for t in targets]
    heads = "".join(f" minutes to {t} | rounds to {t} | client updates to {t} |" for t in name)
    lines = [
        f"| method | round closes | seeds | final test accuracy | simulated minutes |{heads} bytes per client (mean) |",
        "|---|---|--:|--:|--:|" + "--:|" * (3 * len(targets)) + "--:|",
    ]
    for (method, close), seeds in ordered(runs):
        curves = [curve(rows) for rows in seeds.values()]
        finals = [c[-1][2] for c in curves]
        minutes = [c[-1][0] / 60 for c in curves]
        cells = []
        for target in targets:
            reached = [reach(c, c[0][2] + target if gain else target) for c in curves]
            got = [x for x in reached if x is not None]
            if len(got) == len(reached):
                cells += [
                    fmt(*mean_se([t / 60 for t, _, _ in got]), 2),
                    fmt(*mean_se([r for _, _, r in got]), 1),
                    fmt(*mean_se([u for _, u, _ in got]), 0),
                ]
            else:
                cells += [f"{len(got)} of {len(reached)} seeds reach it"] * 3
        cum = [rows[-1].get("comm/cum_client_bytes") or 0.0 for rows in seeds.values()]
        lines.append(
            f"| {method} | {CLOSES.get(close, close)} | {len(seeds)} | {fmt(*mean_se(finals))} | "
            f"{fmt(*mean_se(minutes), 2)} | {' | '.join(cells)} | {sum(cum) / len(cum):,.0f} |"
        )
    return "\n".join(lines)


PARTS = ["time/simulated_round_s", "time/client_download_s", "time/client_compute_s", "time/client_upload_s"]


def parts(runs: dict) -> str:
    """Where a round's time goes: medians over every round of every seed (module docstring)."""
    lines = [
        "| method | round closes | round (s) | client download (s) | client compute (s) | client upload (s) |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for (method, close), seeds in ordered(runs):
        rows = [r for rows in seeds.values() for r in rows if r["round"] > 0]
        cells = []
        for key in PARTS:
            values = [r[key] for r in rows if r.get(key) is not None]
            cells.append(f"{statistics.median(values):.3f}" if values else "-")
        lines.append(f"| {method} | {CLOSES.get(close, close)} | {' | '.join(cells)} |")
    return "\n".join(lines)


def work(runs: dict) -> str | None:
    """How much of the clients' work was thrown away (module docstring); ``None`` when no run logs ``work/*``."""
    lines = [
        "| method | round closes | device seconds of training | thrown away | thrown away (J) | clients gone offline |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for (method, close), seeds in ordered(runs):
        sums = {
            key: [sum(r.get(key) or 0.0 for r in rows if r["round"] > 0) for rows in seeds.values()]
            for key in ("work/compute_s", "work/wasted_compute_s", "work/wasted_energy_j", "fed/offline_clients")
        }
        if not any(sums["work/compute_s"]):
            continue
        total, wasted = (sum(sums[k]) / len(seeds) for k in ("work/compute_s", "work/wasted_compute_s"))
        joules, offline = (sum(sums[k]) / len(seeds) for k in ("work/wasted_energy_j", "fed/offline_clients"))
        share = f"{100 * wasted / total:.1f}%" if total > 0 else "-"
        lines.append(
            f"| {method} | {CLOSES.get(close, close)} | {total:,.1f} | {share} | {joules:,.1f} | {offline:,.0f} |"
        )
    return "\n".join(lines) if len(lines) > 2 else None


def figure(runs: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {m: f"C{i}" for i, m in enumerate(sorted({m for m, _ in runs}))}
    styles = {"sync": "-", "over-selection": "--", "over-selection-onoff": "-.", "fedbuff": ":"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for (method, close), seeds in sorted(runs.items()):
        curves = [curve(rows) for rows in seeds.values()]
        n = min(len(c) for c in curves)
        mean = [[sum(c[i][k] for c in curves) / len(curves) for i in range(n)] for k in range(3)]
        label = f"{method}, {CLOSES.get(close, close)}"
        kw = {"color": colours[method], "linestyle": styles.get(close, "-"), "label": label, "marker": "."}
        left.plot([t / 60 for t in mean[0]], mean[2], **kw)
        right.plot(mean[1], mean[2], **kw)
    left.set_xscale("symlog", linthresh=0.1)
    left.set_xlabel("simulated minutes")
    right.set_xlabel("client updates aggregated")
    left.set_ylabel("test accuracy (mean over seeds)")
    right.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path)
    goal = parser.add_mutually_exclusive_group(required=True)
    goal.add_argument("--target", type=float, nargs="+", help="test accuracies to reach")
    goal.add_argument("--gain", type=float, nargs="+", help="gains over each run's base (round 0) to reach")
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--figure", type=Path, default=None)
    parser.add_argument("--title", default="Time to accuracy on the simulated clock")
    args = parser.parse_args()
    runs = read(args.csv)
    targets, flag = (args.gain, "--gain") if args.gain else (args.target, "--target")
    text = table(runs, targets, gain=bool(args.gain)) + "\n\nWhere a round's time goes (medians):\n\n" + parts(runs)
    if (thrown := work(runs)) is not None:
        text += "\n\nThe work thrown away (sums over the rounds, means over seeds):\n\n" + thrown
    print(text)
    if args.markdown is not None:
        command = f"python tools/time_to_accuracy.py {args.csv} {flag} {' '.join(map(str, targets))}"
        args.markdown.write_text(f"Made by `{command}`.\n\n{text}\n")
    if args.figure is not None:
        figure(runs, args.figure, args.title)


if __name__ == "__main__":
    main()
