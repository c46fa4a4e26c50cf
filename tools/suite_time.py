"""Compare the test suite's time between two trees from runs of README's test command, taken in turns.

Each run is a log of ``python -m pytest --durations=0 -q`` (every test's setup, call and teardown seconds, then
pytest's summary line) and, beside it, what ``/usr/bin/time -f "wall %e user %U sys %S"`` wrote for the same
command. Run the two trees alternately (A, B, A, B) on one machine with nothing else on it, one log per run:

    cd OLD_TREE && /usr/bin/time -o old1.time -f "wall %e user %U sys %S" python -m pytest --durations=0 -q > old1.log
    cd NEW_TREE && /usr/bin/time -o new1.time -f "wall %e user %U sys %S" python -m pytest --durations=0 -q > new1.log
    ... (old2, new2)
    python tools/suite_time.py --old old1.log old2.log --new new1.log new2.log --json suite_time.json

For each run it reports wall and CPU (user + system, the workers included) seconds, pytest's counts, and the sum of
the per-test seconds over the tests both trees have (a test of one tree only does not count there, so a suite that
grew is compared on what it shared); for each pair (the i-th old run and the i-th new run) the new / old ratios.
Per-test seconds under pytest-xdist move with which worker ran a test beside which, so read the sums, not single
tests.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

#: One line of ``--durations=0``: seconds, phase, test id.
DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+)")
#: pytest's closing counts (``3 failed, 1484 passed, 7 skipped``).
COUNT = re.compile(r"(\d+) (passed|failed|skipped|error|errors|deselected)\b")
#: What /usr/bin/time wrote with the format above.
TIMES = re.compile(r"wall ([\d.]+) user ([\d.]+) sys ([\d.]+)")


def per_test(log: str) -> dict[str, float]:
    """Seconds per test id (setup + call + teardown) from a ``--durations=0`` log."""
    seconds: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        if match := DURATION.match(line):
            seconds[match.group(3)] += float(match.group(1))
    return dict(seconds)


def counts(log: str) -> dict[str, int]:
    """pytest's closing counts (the last line that has any)."""
    for line in reversed(log.splitlines()):
        found = {kind.rstrip("s") if kind == "errors" else kind: int(n) for n, kind in COUNT.findall(line)}
        if found:
            return found
    return {}


def run_of(log_path: Path) -> dict:
    """One run: its per-test seconds, counts and, from ``LOG`` with ``.time`` for ``.log``, wall and CPU seconds."""
    log = log_path.read_text()
    run = {"log": log_path.name, "tests": per_test(log), "counts": counts(log)}
    time_path = log_path.with_suffix(".time")
    if time_path.exists() and (match := TIMES.search(time_path.read_text())):
        wall, user, system = (float(x) for x in match.groups())
        run |= {"wall_s": wall, "cpu_s": round(user + system, 2)}
    return run


def compare(old: list[dict], new: list[dict]) -> dict:
    """Every run's totals, the tests all runs share, and the new / old ratios per pair and their min and median."""
    shared = set.intersection(*(set(r["tests"]) for r in old + new))
    rows = []
    for side, runs in (("old", old), ("new", new)):
        for run in runs:
            rows.append(
                {
                    "side": side,
                    "log": run["log"],
                    **run["counts"],
                    "wall_s": run.get("wall_s"),
                    "cpu_s": run.get("cpu_s"),
                    "shared_tests_s": round(sum(run["tests"][t] for t in shared), 2),
                }
            )
    pairs: dict[str, list[float]] = {"wall_s": [], "cpu_s": [], "shared_tests_s": []}
    olds, news = rows[: len(old)], rows[len(old) :]
    for a, b in zip(olds, news, strict=True):
        for key in pairs:
            if a[key] and b[key]:
                pairs[key].append(round(b[key] / a[key], 3))
    ratios = {k: {"pairs": v, "min": min(v), "median": statistics.median(v)} for k, v in pairs.items() if v}
    return {"shared_tests": len(shared), "runs": rows, "new_over_old": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, nargs="+", required=True, help="the old tree's logs, in the order run")
    parser.add_argument("--new", type=Path, nargs="+", required=True, help="the new tree's logs, paired in order")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    args = parser.parse_args(argv)
    if len(args.old) != len(args.new):
        print(f"suite_time: {len(args.old)} old logs against {len(args.new)} new ones; give as many of each")
        return 2
    missing = [p for p in args.old + args.new if not p.is_file()]
    if missing:
        print(f"suite_time: no log at {missing[0]}; give the files the test command wrote")
        return 2
    result = compare([run_of(p) for p in args.old], [run_of(p) for p in args.new])
    print(f"tests in every run: {result['shared_tests']}")
    for row in result["runs"]:
        print(
            f"{row['side']} {row['log']}: wall {row['wall_s']} s, CPU {row['cpu_s']} s, passed {row.get('passed', 0)},"
            f" failed {row.get('failed', 0)}, shared tests {row['shared_tests_s']} s"
        )
    for key, ratio in result["new_over_old"].items():
        print(f"new / old {key}: {ratio['pairs']} (min {ratio['min']}, median {ratio['median']})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
