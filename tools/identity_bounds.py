"""The largest FLITE averaging-identity error (``fed/identity_error``) in the sweep CSVs, per CSV and overall.

README.md, the results pages (docs/results-*.md) and the config headers quote these maxima as bounds, each followed
by the command that prints it; ``tests/test_docs_consistency.py`` checks every quoted bound against this script. A
bound is quoted as the maximum rounded up to two significant digits (the ``quoted`` column).

    python tools/identity_bounds.py                                   # every CSV in docs/results/ with the column
    python tools/identity_bounds.py docs/results/shakespeare.csv      # these CSVs only
    python tools/identity_bounds.py --include scratch                 # only runs whose label contains "scratch"
    python tools/identity_bounds.py --exclude scratch --exclude 1e6   # leave those runs out

Each line gives the maximum over every run and round of a CSV and where it occurs (label, seed, round); the
last line the maximum over all of them. LoRA runs log their aggregation error in the same column (a different
quantity, not a rounding error): rows tagged ``method`` ``lora`` or ``ffa`` are left out.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLUMN = "fed/identity_error"
NOT_FLITE = ("lora", "ffa")  # their fed/identity_error is LoRA's aggregation error


def quoted(value: float) -> str:
    """``value`` rounded up to two significant digits, as the docs write a bound: 8.34e-07 -> ``8.4e-7``."""
    if value <= 0:
        return "0"
    exponent = math.floor(math.log10(value))
    mantissa = math.ceil(round(value / 10 ** (exponent - 1), 9))  # 10 .. 100
    if mantissa == 100:
        mantissa, exponent = 10, exponent + 1
    return f"{mantissa / 10:.1f}e{exponent}"


def largest(path: Path, include: list[str] = (), exclude: list[str] = ()) -> tuple[float, dict] | None:
    """The largest ``fed/identity_error`` in ``path`` over the runs whose label contains every ``include`` and
    no ``exclude`` substring, with its row; ``None`` when the CSV has no such value."""
    best = None
    with path.open() as f:
        for row in csv.DictReader(f):
            label = row.get("label", "")
            if any(s not in label for s in include) or any(s in label for s in exclude):
                continue
            if row.get("method") in NOT_FLITE:
                continue
            text = row.get(COLUMN) or ""
            try:
                value = float(text)
            except ValueError:
                continue
            if math.isfinite(value) and (best is None or value > best[0]):
                best = (value, row)
    return best


def has_column(path: Path) -> bool:
    with path.open() as f:
        return COLUMN in (csv.DictReader(f).fieldnames or [])


def maxima(
    paths: list[Path] | None = None, include: list[str] = (), exclude: list[str] = ()
) -> dict[Path, tuple[float, dict]]:
    """Per CSV (default: every CSV in docs/results/ that has the column), its largest value and row."""
    if paths is None:
        paths = [p for p in sorted((REPO / "docs" / "results").glob("*.csv")) if has_column(p)]
    out = {}
    for path in paths:
        found = largest(path, include, exclude)
        if found is not None:
            out[path] = found
    return out


def overall(found: dict[Path, tuple[float, dict]]) -> tuple[Path, float, dict] | None:
    """The largest value of :func:`maxima`'s result, with its CSV and row."""
    if not found:
        return None
    path = max(found, key=lambda p: found[p][0])
    return path, *found[path]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="*", type=Path, help="sweep CSVs (default: every one in docs/results/)")
    parser.add_argument("--include", action="append", default=[], metavar="TEXT", help="labels containing TEXT")
    parser.add_argument("--exclude", action="append", default=[], metavar="TEXT", help="leave out labels with TEXT")
    return parser.parse_args(argv)


def compute(args: argparse.Namespace) -> dict[Path, tuple[float, dict]]:
    """:func:`maxima` for the parsed command line (exits with a message for a CSV without the column)."""
    for path in args.csv:
        if not path.is_file():
            raise SystemExit(f"error: {path} is not a file")
        if not has_column(path):
            raise SystemExit(f"error: {path} has no {COLUMN} column")
    return maxima(args.csv or None, args.include, args.exclude)


def shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> int:
    found = compute(parse_args(argv))
    top = overall(found)
    if top is None:
        print(f"no {COLUMN} value in the selected runs", file=sys.stderr)
        return 1
    print(f"{'csv':<48} {'max':>10} {'quoted':>7}  where")
    for path, (value, row) in found.items():
        where = f"{row.get('label')}, seed {row.get('seed')}, round {row.get('round')}"
        print(f"{shown(path):<48} {value:>10.3e} {quoted(value):>7}  {where}")
    path, value, row = top
    where = f"{shown(path)}: {row.get('label')}, seed {row.get('seed')}, round {row.get('round')}"
    print(f"{f'overall ({len(found)} CSV files)':<48} {value:>10.3e} {quoted(value):>7}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
