"""What starting costs: import time, resident memory after import, ``fit --help`` and the config mistakes the CLI
answers before torch is imported, each in a fresh process.

Sides, alternated ``--repeats`` times, each a new ``python`` process (so nothing is cached in memory but what
the operating system keeps of the files):

- ``torch``: ``import torch``;
- ``lightning``: ``import lightning`` (torch, Lightning, torchmetrics: what every run needs);
- ``lightning_fl``: ``import lightning_fl; lightning_fl.load_plugins()`` (all of the above, and every plug-in, so
  short class names resolve: what the CLI imports; a bare ``import lightning_fl`` imports nothing heavy);
- ``lightning.pytorch``: ``import lightning.pytorch`` (the floor any ``LightningCLI`` pays before it parses);
- ``fit --help``: ``python -m lightning_fl fit --help`` (placed right after ``lightning.pytorch`` in each repeat, and
  reported also as the per-repeat difference to it, min and median);
- ``missing config``, ``YAML syntax error``, ``unknown key``: ``python -m lightning_fl fit --config FILE`` with a
  file that does not exist, one that breaks YAML's syntax, and one with a misspelt top-level key (``modle``);
  each must exit with code 2.

For each: wall and CPU seconds of the whole process (min and median) and its peak resident memory over the whole
process (``ru_maxrss`` from ``wait4``, started from a small launcher so that it is the process's own: interpreter
shutdown included, which adds about 130 MiB once torch is loaded); for the import sides also the peak resident
memory right after the import (the process's own ``RUSAGE_SELF``, "after imports"). The difference between
``lightning_fl`` and ``lightning`` is what this package adds, and between ``fit --help`` and ``lightning.pytorch``
what the CLI adds to the floor. For the import sides it also reports which optional heavy modules the import
leaves loaded (POT, matplotlib, Flower, scikit-learn, TensorBoard's writer), which should be none of ours.

    python benchmarks/startup.py
    python benchmarks/startup.py --repeats 5 --json docs/results/startup.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import Sample, add_arguments, fmt, machine, report, spread

HEAVY = ["ot", "matplotlib", "flwr", "sklearn", "torch.utils.tensorboard"]
PROBE = "import sys, json; print(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
IMPORTS = ["torch", "lightning", "lightning_fl", "lightning.pytorch"]
# The config mistakes: the file's text (None: no file), each run as ``fit --config FILE``.
MISTAKES = {
    "missing config": None,
    "YAML syntax error": "trainer:\n  init_args:\n    rounds: 1\n   devices: 1\n",
    "unknown key": "modle:\n  class_path: Classifier\n",
}
SIDES = [*IMPORTS, "fit --help", *MISTAKES]
# What one side adds to another, per repeat: the CLI to the floor a LightningCLI pays, the package to Lightning.
PAIRS = [("fit --help", "lightning.pytorch"), ("lightning_fl", "lightning")]


# Starts the measured process and reports its rusage. Linux carries a process's peak RSS across exec from the
# memory of the process that forked it, so a child forked from this script (torch imported: 500 MiB) could never
# report less; forked from this small launcher (``python -S``, about 10 MiB), it reports its own.
LAUNCHER = """
import json, os, sys, time
report, args = sys.argv[1], sys.argv[2:]
wall = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execv(args[0], args)
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - wall
with open(report, "w") as f:
    json.dump([wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss, os.waitstatus_to_exitcode(status)], f)
"""


def run(args: list[str], expect: int = 0) -> tuple[Sample, float, str]:
    """Run ``python args`` to the end; its wall and CPU seconds, its peak RSS in MiB (that process's own, from
    ``wait4`` in :data:`LAUNCHER`) and its stdout."""
    with tempfile.TemporaryDirectory() as folder:
        report, out, err = (Path(folder) / name for name in ("report.json", "out", "err"))
        with out.open("w") as stdout, err.open("w") as stderr:
            launcher = [sys.executable, "-S", "-c", LAUNCHER, str(report), sys.executable, *args]
            subprocess.run(launcher, stdout=stdout, stderr=stderr, check=True)
        wall, cpu, kib, code = json.loads(report.read_text())
        if code != expect:
            raise SystemExit(f"python {' '.join(args)} exited with {code}, not {expect}:\n{err.read_text()[-2000:]}")
        return Sample(wall, cpu), kib / 1024, out.read_text()  # Linux reports KiB


def side_args(name: str, folder: Path) -> list[str]:
    if name == "fit --help":
        return ["-m", "lightning_fl", "fit", "--help"]
    if name in MISTAKES:
        path = folder / f"{name.replace(' ', '_')}.yaml"
        if MISTAKES[name] is not None:
            path.write_text(MISTAKES[name])
        return ["-m", "lightning_fl", "fit", "--config", str(path)]
    probe = PROBE.format(heavy=HEAVY)
    load = "; lightning_fl.load_plugins()" if name == "lightning_fl" else ""
    rss = "import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    return ["-c", f"import {name}{load}; {probe}; {rss}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", nargs="+", default=SIDES, choices=SIDES)
    add_arguments(parser, repeats=5)
    args = parser.parse_args()
    before = machine()
    samples: dict[str, list[Sample]] = {name: [] for name in args.sides}
    rss: dict[str, list[float]] = {name: [] for name in args.sides}
    process_rss: dict[str, list[float]] = {name: [] for name in args.sides}
    loaded: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            for name in args.sides:
                sample, mib, out = run(side_args(name, Path(folder)), expect=2 if name in MISTAKES else 0)
                samples[name].append(sample)
                process_rss[name].append(mib)
                if name in IMPORTS:
                    heavy, kib = out.strip().splitlines()[-2:]
                    loaded[name] = json.loads(heavy)
                    rss[name].append(int(kib) / 1024)  # Linux reports KiB
    results = {"settings": {"repeats": args.repeats, "sides": args.sides}, "sides": {}}
    for name in args.sides:
        wall, cpu = spread(s.wall for s in samples[name]), spread(s.cpu for s in samples[name])
        entry = {"wall_s": wall, "cpu_s": cpu, "process_peak_rss_mib": spread(process_rss[name])}
        text = f"{name}: wall {fmt(wall, ' s', 1, 2)}; CPU {fmt(cpu, ' s', 1, 2)}"
        if rss[name]:
            entry["peak_rss_mib"] = spread(rss[name])
            text += f"; peak RSS after imports {fmt(entry['peak_rss_mib'], ' MiB', 1, 0)}"
        text += f"; process peak RSS {fmt(entry['process_peak_rss_mib'], ' MiB', 1, 0)}"
        if name in loaded:
            entry["heavy_modules_loaded"] = loaded[name]
            text += "; optional heavy modules loaded: " + (", ".join(loaded[name]) or "none")
        results["sides"][name] = entry
        print(text)
    results["over"] = {}
    for name, floor in PAIRS:  # per repeat, the two ran one after the other: a neighbour's load falls on both
        if name in samples and floor in samples:
            pairs = list(zip(samples[name], samples[floor], strict=True))
            over = {
                "wall_s": spread(a.wall - b.wall for a, b in pairs),
                "cpu_s": spread(a.cpu - b.cpu for a, b in pairs),
            }
            results["over"][f"{name} - {floor}"] = over
            wall, cpu = fmt(over["wall_s"], " s", 1, 2), fmt(over["cpu_s"], " s", 1, 2)
            print(f"{name} over {floor}, per repeat: wall {wall}; CPU {cpu}")
    report("startup", before, results, args.json)


if __name__ == "__main__":
    main()
