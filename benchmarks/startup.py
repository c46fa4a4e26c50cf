"""What starting costs: import time, resident memory after import, and ``fit --help``, each in a fresh process.

Sides, alternated ``--repeats`` times, each a new ``python`` process (so nothing is cached in memory but what
the operating system keeps of the files):

- ``torch``: ``import torch``;
- ``lightning``: ``import lightning`` (torch, Lightning, torchmetrics: what every run needs);
- ``lightning_fl``: ``import lightning_fl; lightning_fl.load_plugins()`` (all of the above, and every plug-in, so
  short class names resolve: what the CLI imports; a bare ``import lightning_fl`` imports nothing heavy);
- ``fit --help``: ``python -m lightning_fl fit --help``.

For each: wall and CPU seconds of the whole process (min and median) and its peak resident memory (``ru_maxrss``
of the child). The difference between ``lightning_fl`` and ``lightning`` is what this package adds; it also
reports which optional heavy modules an import leaves loaded (POT, matplotlib, Flower, scikit-learn,
TensorBoard's writer), which should be none.

    python benchmarks/startup.py
    python benchmarks/startup.py --repeats 5 --json docs/results/startup.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from _harness import Sample, add_arguments, fmt, machine, measure, report, spread

HEAVY = ["ot", "matplotlib", "flwr", "sklearn", "torch.utils.tensorboard"]
PROBE = "import sys, json; print(json.dumps([m for m in {heavy!r} if m in sys.modules]))"


def run(args: list[str]) -> tuple[Sample, str]:
    """Run ``python args`` to the end; its wall and CPU seconds and its stdout (a side prints its own peak RSS:
    ``RUSAGE_CHILDREN``'s is the largest child's so far, not this one's)."""
    proc, sample = measure(lambda: subprocess.run([sys.executable, *args], capture_output=True, text=True))
    if proc.returncode != 0:
        raise SystemExit(f"python {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return sample, proc.stdout


def side_args(name: str) -> list[str]:
    probe = PROBE.format(heavy=HEAVY)
    rss = "import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    if name == "fit --help":
        return ["-m", "lightning_fl", "fit", "--help"]
    load = "; lightning_fl.load_plugins()" if name == "lightning_fl" else ""
    return ["-c", f"import {name}{load}; {probe}; {rss}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", nargs="+", default=["torch", "lightning", "lightning_fl", "fit --help"])
    add_arguments(parser, repeats=5)
    args = parser.parse_args()
    before = machine()
    samples: dict[str, list[Sample]] = {name: [] for name in args.sides}
    rss: dict[str, list[float]] = {name: [] for name in args.sides}
    loaded: dict[str, list[str]] = {}
    for _ in range(args.repeats):
        for name in args.sides:
            sample, out = run(side_args(name))
            samples[name].append(sample)
            if name != "fit --help":
                heavy, kib = out.strip().splitlines()[-2:]
                loaded[name] = json.loads(heavy)
                rss[name].append(int(kib) / 1024)  # Linux reports KiB
    results = {"settings": {"repeats": args.repeats, "sides": args.sides}, "sides": {}}
    for name in args.sides:
        wall, cpu = spread(s.wall for s in samples[name]), spread(s.cpu for s in samples[name])
        entry = {"wall_s": wall, "cpu_s": cpu}
        text = f"{name}: wall {fmt(wall, ' s', 1, 2)}; CPU {fmt(cpu, ' s', 1, 2)}"
        if rss[name]:
            entry["peak_rss_mib"] = spread(rss[name])
            entry["heavy_modules_loaded"] = loaded[name]
            text += f"; peak RSS {fmt(entry['peak_rss_mib'], ' MiB', 1, 0)}; optional heavy modules loaded: "
            text += ", ".join(loaded[name]) or "none"
        results["sides"][name] = entry
        print(text)
    report("startup", before, results, args.json)


if __name__ == "__main__":
    main()
