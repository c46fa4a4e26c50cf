"""Turn a sweep CSV (tools/sweep.py) into markdown tables (mean +/- std over seeds) and figures.

A report file says what to draw:

```yaml
csv: runs/sweeps/flite_claims/results.csv
figures_dir: docs/figures              # PNG files
tensorboard: runs/sweeps/flite_claims/report   # optional: the figures are also logged here
tables:
  - title: Final accuracy, calibration and bytes
    labels: [latent_d64, fedavg]       # default: every label, in CSV order
    round: null                        # a round number shows that round (0: the starting model) instead
    best: false                        # true: each run's best value over rounds 1.. (lowest loss/ppl, else highest)
    columns: [val/acc, val/ece, comm/client_up_bytes, comm/cum_client_bytes]
  - title: Accuracy under attack        # a pivot: rows and columns are tags, cells one metric
    pivot: {rows: strategy, columns: [attack, f]}
    where: {sweep: robustness_digits, state: latent}
    metric: val/acc
    digits: 3                           # decimals of the cells (mean and std)
    gain: false                         # true: each run's value less its own round 0 (its starting model)
    scale: 1                            # with gain: times this (100: accuracy in points)
  - title: Table I analogue             # rows are methods: metric columns "test/{method}/{metric}" per label
    methods: [fmp, mp, cann]
    labels: [digits, fashion_mnist]
    metrics: [acc, ece]
    comm: "comm/{method}/kb_per_client"  # optional last column (mean over the labels that have it)
    mean: true                          # optional: a "mean <metric>" column, the mean over labels of the
                                        # per-label means
    spread: sem                         # optional (any table of columns or methods): cells are mean +/- standard
                                        # error over seeds (default: std)
figures:
  - {name: pareto, kind: pareto, labels: [latent_d64, fedavg, powersgd_r2]}   # acc vs cumulative MB (log x)
  - {name: latent_dim, kind: sweep, x: d, where: {method: latent}, metric: val/acc}  # final metric vs a tag
  - {name: quant, kind: bars, labels: [latent_fp32, latent_int4], metric: val/acc}   # final metric per label
  - {name: budget, kind: budget, labels: [...], budget_mb: 1.0}   # best acc within a byte budget
  - {name: per_round, kind: rounds, labels: [fedavg, fedadam], metric: val/acc}      # metric per round
```

``csv`` may be a list of files (read one after the other, e.g. the same study on two data sets). Rows that record
different machines (the ``environment`` column of tools/sweep.py) are refused: their bases differ.

    python tools/report.py REPORT.yaml              # prints the tables, writes the figures
    python tools/report.py REPORT.yaml --markdown FILE   # also writes the tables to FILE
    python tools/report.py REPORT.yaml --markdown FILE --no-figures   # the tables only

Kinds: ``pareto`` plots val/acc against cumulative bytes per client (both directions, MB, log scale) round by
round, one curve per label (mean over seeds); ``sweep`` plots the final ``metric`` against a numeric tag, one
line per value of ``series`` (a tag, optional) or, with ``methods`` and a ``metric`` template such as
``test/{method}/acc``, one line per method (optional ``ylabel``, and ``yscale`` such as ``log``; ``best: true``
plots each run's best over rounds; a value ``inf`` of the tag is drawn as a dashed level line); ``bars``
shows the final ``metric`` per label; ``budget`` shows, per label, the best val/acc reached while cumulative
bytes per client stay within ``budget_mb``; ``rounds`` plots ``metric`` against the round, one curve per
label (``yscale`` too). Error bars and bands are one standard deviation over seeds. A ``pivot`` table shows
``mean (std)`` of one metric with a row per value of the ``rows`` tag and a column per combination of the
``columns`` tags (in CSV order); ``best: true`` takes each run's best over rounds instead of its final round.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import yaml

MB = 2**20


def read(path: Path) -> list[dict]:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            if k not in ("sweep", "label") and v not in ("", None):
                with contextlib.suppress(ValueError):
                    r[k] = float(v)
    return rows


def labels_in_order(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["label"] for r in rows))


def select(rows: list[dict], labels: list[str] | None = None, where: dict | None = None) -> list[dict]:
    out = [r for r in rows if labels is None or r["label"] in labels]
    for k, v in (where or {}).items():
        out = [r for r in out if str(r.get(k)) == str(v) or r.get(k) == v]
    return out


def finals(rows: list[dict], round_: int | None = None, key=lambda r: r["label"]) -> dict[Any, list[dict]]:
    """Final-round rows (or the rows of round ``round_``) per ``key`` (the label), one per seed."""
    groups = defaultdict(list)
    for r in rows:
        if (r["final"] == 1) if round_ is None else (r["round"] == round_):
            groups[key(r)].append(r)
    return groups


def per_run(r: dict) -> tuple:
    """One run across sweeps: two sweeps may share labels."""
    return r.get("sweep"), r["label"]


def mean_std(values: list[float]) -> tuple[float, float]:
    vals = np.array([v for v in values if v != "" and not (isinstance(v, float) and math.isnan(v))], dtype=float)
    if len(vals) == 0:
        return float("nan"), float("nan")
    return float(vals.mean()), float(vals.std(ddof=1)) if len(vals) > 1 else 0.0


def spread_of(spec: dict) -> bool:
    """Whether a table's cells show the standard error of the mean over seeds (``spread: sem``) or the std."""
    if spec.get("spread", "std") not in ("std", "sem"):
        raise SystemExit(f"error: table {spec.get('title')!r}: spread must be std or sem, not {spec['spread']!r}")
    return spec.get("spread", "std") == "sem"


def mean_spread(values: list[float], sem: bool) -> tuple[float, float]:
    """:func:`mean_std`, the std divided by the square root of the number of values when ``sem``."""
    mean, std = mean_std(values)
    if sem and not math.isnan(std):
        std /= math.sqrt(sum(v != "" and not (isinstance(v, float) and math.isnan(v)) for v in values))
    return mean, std


def fmt(column: str, mean: float, std: float) -> str:
    if math.isnan(mean):
        return "-"
    if "bytes" in column:
        return f"{mean:,.0f}" if std == 0 else f"{mean:,.0f} +/- {std:,.0f}"
    if "identity" in column:
        return f"{mean:.1e}"
    return f"{mean:.4f} +/- {std:.4f}"


def lower_is_better(column: str) -> bool:
    return any(k in column for k in ("loss", "ppl", "ece", "bytes", "time"))


def bests(rows: list[dict], columns: list[str]) -> dict[Any, list[dict]]:
    """Per label, one row per seed holding each column's best value over rounds 1.. (the federated rounds)."""
    runs = defaultdict(list)
    for r in rows:
        if r["round"] >= 1:
            runs[(r["label"], r["seed"])].append(r)
    groups = defaultdict(list)
    for (label, seed), group in runs.items():
        best = {**group[0], "label": label, "seed": seed}  # the run's tags come along (pivots read them)
        for c in columns:
            values = [r[c] for r in group if r.get(c, "") != ""]
            if values:
                best[c] = min(values) if lower_is_better(c) else max(values)
        groups[label].append(best)
    return groups


def best_within_budget(rows: list[dict], budget_bytes: float) -> list[float]:
    """Per seed, the best val/acc of rounds 1.. whose cumulative bytes per client stay within ``budget_bytes``
    (round 0 is the starting model, which costs nothing and is not what a method reached)."""
    best: dict[Any, float] = {}
    for r in rows:
        if r.get("val/acc", "") == "" or r.get("round", 0) < 1 or (r.get("comm/cum_client_bytes") or 0) > budget_bytes:
            continue
        best[r["seed"]] = max(best.get(r["seed"], -math.inf), r["val/acc"])
    return list(best.values())


def table(rows: list[dict], spec: dict) -> str:
    labels = spec.get("labels") or labels_in_order(rows)
    columns = spec.get("columns", ["val/acc", "val/ece", "comm/client_up_bytes", "comm/cum_client_bytes"])
    chosen = select(rows, labels, spec.get("where"))
    if spec.get("best"):
        groups, which = bests(chosen, columns), "best over rounds 1 to R"
    else:
        groups = finals(chosen, spec.get("round"))
        which = "final round" if spec.get("round") is None else f"round {spec['round']}"
    sem = spread_of(spec)
    spread = "standard error" if sem else "std"
    lines = [f"**{spec.get('title', 'Results')}** ({which}, mean +/- {spread} over seeds)", ""]
    lines.append("| run | seeds | " + " | ".join(columns) + " |")
    lines.append("| --- | --- | " + " | ".join("---" for _ in columns) + " |")
    for label in labels:
        group = groups.get(label, [])
        cells = [fmt(c, *mean_spread([r.get(c, "") for r in group], sem)) for c in columns]
        lines.append(f"| {label} | {len(group)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pivot_table(rows: list[dict], spec: dict) -> str:
    """One metric: a row per value of ``pivot.rows``, a column per combination of the ``pivot.columns`` tags."""
    row_tag, col_tags = spec["pivot"]["rows"], spec["pivot"]["columns"]
    metric, digits = spec.get("metric", "val/acc"), int(spec.get("digits", 3))
    chosen = select(rows, spec.get("labels"), spec.get("where"))
    groups = bests(chosen, [metric]) if spec.get("best") else finals(chosen, spec.get("round"), key=per_run)
    if spec.get("gain"):  # each run's value less its own round-0 value (its starting model), times ``scale``
        start = {(r.get("sweep"), r["label"], r["seed"]): r.get(metric, "") for r in chosen if r["round"] == 0}
        scale = float(spec.get("scale", 1))
        groups = {
            key: [gain_row(r, start.get((r.get("sweep"), r["label"], r["seed"]), ""), metric, scale) for r in group]
            for key, group in groups.items()
        }
    cells: dict[tuple, list[float]] = defaultdict(list)
    row_keys, col_keys = [], []
    for group in groups.values():
        first = group[0]
        rk, ck = first.get(row_tag), tuple(first.get(t) for t in col_tags)
        row_keys += [rk] if rk not in row_keys else []
        col_keys += [ck] if ck not in col_keys else []
        cells[rk, ck] += [r.get(metric, "") for r in group]
    which = "final round" if spec.get("round") is None else f"round {spec['round']}"
    which = "best over rounds 1 to R" if spec.get("best") else which
    if spec.get("gain"):
        which += ", less the run's round 0" + (f", x {float(spec['scale']):g}" if "scale" in spec else "")
    seeds = sorted({len(g) for g in groups.values()})
    lines = [
        f"**{spec.get('title', metric)}** ({metric}, {which}, mean (std) over {'/'.join(map(str, seeds))} seeds)",
        "",
    ]
    header = [
        " ".join(f"{t}={v:g}" if isinstance(v, float) else str(v) for t, v in zip(col_tags, ck, strict=True))
        for ck in col_keys
    ]
    lines.append(f"| {row_tag} | " + " | ".join(header) + " |")
    lines.append("| --- | " + " | ".join("---" for _ in header) + " |")
    sign = "+" if spec.get("gain") else ""
    for rk in row_keys:
        values = []
        for ck in col_keys:
            mean, std = mean_std(cells.get((rk, ck), []))
            values.append("-" if math.isnan(mean) else f"{mean:{sign}.{digits}f} ({std:.{digits}f})")
        lines.append(f"| {rk} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def gain_row(row: dict, start, metric: str, scale: float) -> dict:
    """``row`` with ``metric`` replaced by ``scale (row[metric] - start)``; empty when either is missing."""
    missing = row.get(metric, "") == "" or start == ""
    return {**row, metric: "" if missing else scale * (float(row[metric]) - float(start))}


def method_table(rows: list[dict], spec: dict) -> str:
    """Rows are methods, columns ``label metric`` read from ``test/{method}/{metric}`` (final rows)."""
    labels = spec.get("labels") or labels_in_order(rows)
    metrics = spec.get("metrics", ["acc", "ece"])
    template = spec.get("template", "test/{method}/{metric}")
    groups = finals(select(rows, labels))
    header = [f"{label} {metric}" for label in labels for metric in metrics]
    header += [f"mean {metric}" for metric in metrics] if spec.get("mean") else []
    header += ["KB per client"] if spec.get("comm") else []
    sem = spread_of(spec)
    spread = "standard error" if sem else "std"
    lines = [f"**{spec.get('title', 'Methods')}** (mean +/- {spread} over seeds)", ""]
    lines.append("| method | " + " | ".join(header) + " |")
    lines.append("| --- | " + " | ".join("---" for _ in header) + " |")
    for method in spec["methods"]:
        cells, per_label = [], defaultdict(list)
        for label in labels:
            for metric in metrics:
                column = template.format(method=method, metric=metric)
                values = [r.get(column, "") for r in groups.get(label, [])]
                mean, std = mean_spread(values, sem)
                cells.append(fmt(column, mean, std))
                per_label[metric].append(mean)
        if spec.get("mean"):  # a mean over every label, or "-" when one is missing
            cells += ["-" if any(map(math.isnan, per_label[m])) else f"{np.mean(per_label[m]):.4f}" for m in metrics]
        if spec.get("comm"):
            column = spec["comm"].format(method=method)
            kb = mean_std([r.get(column, "") for label in labels for r in groups.get(label, [])])[0]
            cells.append("-" if math.isnan(kb) else f"{kb:.2f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve(rows: list[dict], label: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per round: mean cumulative MB per client, mean and std of val/acc over seeds."""
    by_round = defaultdict(list)
    for r in rows:
        if r["label"] == label and r.get("val/acc", "") != "":
            by_round[int(r["round"])].append(r)
    rounds = sorted(by_round)
    x = np.array([np.mean([r.get("comm/cum_client_bytes", 0.0) or 0.0 for r in by_round[k]]) / MB for k in rounds])
    stats = [mean_std([r["val/acc"] for r in by_round[k]]) for k in rounds]
    return x, np.array([m for m, _ in stats]), np.array([s for _, s in stats])


def figure(rows: list[dict], spec: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    kind = spec["kind"]
    metric = spec.get("metric", "val/acc")
    if kind == "pareto":
        for label in spec.get("labels") or labels_in_order(rows):
            x, y, s = curve(rows, label)
            x = np.maximum(x, 1e-6)  # round 0 has sent nothing yet
            ax.plot(x, y, marker="o", ms=3, label=label)
            ax.fill_between(x, y - s, y + s, alpha=0.2)
        ax.set_xscale("log")
        ax.set_xlabel("cumulative MB per client (up + down)")
        ax.set_ylabel("test accuracy")
    elif kind == "sweep":
        picked = select(rows, spec.get("labels"), spec.get("where"))
        chosen = bests(picked, [metric]) if spec.get("best") else finals(picked, key=per_run)
        series = defaultdict(list)
        for group in chosen.values():
            if spec.get("methods"):  # one line per method, the metric a template
                for method in spec["methods"]:
                    column = metric.format(method=method)
                    series[method].append((float(group[0][spec["x"]]), *mean_std([r.get(column, "") for r in group])))
                continue
            key = group[0].get(spec["series"], "") if spec.get("series") else ""
            series[key].append((float(group[0][spec["x"]]), *mean_std([r[metric] for r in group])))
        for key, points in sorted(series.items(), key=lambda kv: str(kv[0])):
            points.sort()
            finite = [p for p in points if math.isfinite(p[0])]
            xs, ms, ss = zip(*finite, strict=True) if finite else ((), (), ())
            line = ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=str(key) if key != "" else None)
            for _, m, _ in (p for p in points if not math.isfinite(p[0])):  # x = inf (e.g. epsilon): a level line
                ax.axhline(m, ls="--", lw=1, color=line[0].get_color(), label=f"{key}, {spec['x']} = inf")
        ax.set_xscale(spec.get("xscale", "log"), **({"base": 2} if spec.get("xscale", "log") == "log" else {}))
        ax.set_xlabel(spec["x"])
        ax.set_ylabel(spec.get("ylabel", metric.replace("{method}/", "")))
        ax.set_yscale(spec.get("yscale", "linear"))
    elif kind == "rounds":
        for label in spec.get("labels") or labels_in_order(rows):
            by_round = defaultdict(list)
            for r in select(rows, [label], spec.get("where")):
                if r.get(metric, "") != "":
                    by_round[int(r["round"])].append(r[metric])
            xs = sorted(by_round)
            stats = np.array([mean_std(by_round[k]) for k in xs])
            if len(xs):
                ax.plot(xs, stats[:, 0], marker="o", ms=3, label=label)
                ax.fill_between(xs, stats[:, 0] - stats[:, 1], stats[:, 0] + stats[:, 1], alpha=0.2)
        ax.set_xlabel("round")
        ax.set_ylabel(metric)
        ax.set_yscale(spec.get("yscale", "linear"))
    elif kind in ("bars", "budget"):
        labels = spec.get("labels") or labels_in_order(rows)
        means, stds = [], []
        for label in labels:
            if kind == "bars":
                m, s = mean_std([r[metric] for r in finals(select(rows, [label]))[label]])
            else:
                m, s = mean_std(best_within_budget(select(rows, [label]), spec["budget_mb"] * MB))
            means.append(m)
            stds.append(s)
        ax.bar(range(len(labels)), means, yerr=stds, capsize=3)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        finite = [m for m in means if not math.isnan(m)]
        if finite:
            ax.set_ylim(min(finite) - 0.02, max(finite) + 0.01)
        ax.set_ylabel("best test accuracy within budget" if kind == "budget" else metric)
    else:
        raise SystemExit(f"error: unknown figure kind {kind!r}; use pareto, sweep, rounds, bars or budget")
    ax.set_title(spec.get("title", spec["name"]))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def spec_rows(spec: dict) -> list[dict]:
    """The rows of a report spec's CSV file or files (paths relative to the working directory)."""
    files = spec["csv"] if isinstance(spec["csv"], list) else [spec["csv"]]
    rows = [r for f in files for r in read(Path(f))]
    if not rows:
        raise SystemExit(f"error: {spec['csv']} has no rows; run tools/sweep.py first")
    one_machine(rows, ", ".join(map(str, files)))
    return rows


def one_machine(rows: list[dict], where: str) -> None:
    """Refuse rows made on different machines (their ``environment`` column, tools/sweep.py): another machine
    pretrains another base from the same recipe, so their runs are neither paired nor set side by side."""
    machines = list(dict.fromkeys(str(r["environment"]) for r in rows if r.get("environment") not in ("", None)))
    if len(machines) > 1:
        raise SystemExit(
            f"error: {where} hold rows from {len(machines)} machines (column environment: {'; '.join(machines)}); "
            "a report pairs and compares its rows, so make them on one machine or report each machine's on its own"
        )


def markdown(spec: dict, rows: list[dict]) -> str:
    """Every table of a report spec, as ``--markdown`` writes them (less the final newline)."""
    kinds = {"methods": method_table, "pivot": pivot_table}
    render = [next((f for key, f in kinds.items() if key in t), table) for t in spec.get("tables", [])]
    return "\n\n".join(f(rows, t) for f, t in zip(render, spec.get("tables", []), strict=True))


def save_figure(rows: list[dict], fig_spec: dict, out: Path):
    """Draw one figure of a report spec and write it as ``<out>/<name>.png``: the figure and its path."""
    fig = figure(rows, fig_spec)
    path = out / f"{fig_spec['name']}.png"
    fig.savefig(path, dpi=120)
    return fig, path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path)
    parser.add_argument("--markdown", type=Path, default=None, help="write the tables to this file")
    parser.add_argument("--no-figures", action="store_true", help="tables only: write no figure and no TensorBoard log")
    args = parser.parse_args(argv)
    spec = yaml.safe_load(args.report.read_text())
    rows = spec_rows(spec)
    tables = markdown(spec, rows)
    print(tables)
    if args.markdown is not None:
        args.markdown.write_text(tables + "\n")
    if args.no_figures:
        return
    out = Path(spec.get("figures_dir", "docs/figures"))
    out.mkdir(parents=True, exist_ok=True)
    writer = None
    if spec.get("tensorboard"):
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(spec["tensorboard"])
    for fig_spec in spec.get("figures", []):
        fig, path = save_figure(rows, fig_spec, out)
        if writer is not None:
            writer.add_figure(f"report/{fig_spec['name']}", fig)
        print(f"wrote {path}")
    if writer is not None:
        writer.close()


if __name__ == "__main__":
    main()
