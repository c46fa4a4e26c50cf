"""Threads per process, quiet and with a busy neighbour: the quickstart's time with ``--threads 1`` vs ``2``.

Each measurement is a whole ``python -m lightning_fl fit`` of the quickstart (the base cached by a warm-up run,
so it measures the federated rounds plus start-up), alternating the two settings ``--repeats`` times (1, 2,
1, 2, ...), on a quiet machine and next to one process that keeps a core busy. For each condition and setting
it prints the min and median of the wall time and of the CPU time (user + system of the fit, waited for before
it is read, and of this process), and the min and median of the per-repeat ratio threads 2 / threads 1 (wall
and CPU); then the torch thread count and the load average before and after. It writes ``--out`` (JSON:
settings, results per condition and setting, ratios per condition) and, with ``--json PATH``, the same with
every sample and the machine's state.

    python benchmarks/threads.py                       # 5 rounds, 3 repeats per setting and condition
    python benchmarks/threads.py --rounds 2 --repeats 1 --out threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from _harness import Sample, add_arguments, line, machine, measure, ratio_line, ratios, report, summarise

REPO = Path(__file__).resolve().parents[1]
BUSY = "while True:\n    pass\n"


def run_once(threads: int, rounds: int, root: Path, env: dict) -> Sample:
    """Wall and CPU seconds of one quickstart fit with ``--threads threads`` (waited for, so its CPU counts)."""
    cmd = [
        sys.executable,
        "-m",
        "lightning_fl",
        "fit",
        "--config",
        str(REPO / "configs" / "quickstart.yaml"),
        "--threads",
        str(threads),
        "--trainer.rounds",
        str(rounds),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger",
        "false",
        "--trainer.default_root_dir",
        str(root),
    ]

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=1800)

    done, sample = measure(run)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    add_arguments(parser, repeats=3)
    parser.add_argument("--root", type=Path, default=None, help="the runs' folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=Path("threads.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lightning_fl_threads_bench-") as tmp:
        measure_threads(args, args.root if args.root is not None else Path(tmp))


def measure_threads(args: argparse.Namespace, root: Path) -> None:
    """The measurements, with the runs written under ``root``."""
    before = machine()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    run_once(1, 1, root, env)  # warm-up: pretrains and caches the base
    results, per_repeat, raw = {}, {}, {}
    for condition in ("quiet", "one busy neighbour"):
        neighbour = subprocess.Popen([sys.executable, "-c", BUSY]) if condition != "quiet" else None
        try:
            samples: dict[str, list[Sample]] = {"threads 1": [], "threads 2": []}
            for _ in range(args.repeats):
                for threads in (1, 2):  # alternate the two settings
                    samples[f"threads {threads}"].append(run_once(threads, args.rounds, root, env))
        finally:  # the neighbour's CPU joins the children's once waited for here: after the last sample
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait(timeout=30)
        summary = summarise(samples)
        for side, spreads in summary.items():
            row = {
                "wall_min_s": spreads["wall"]["min"],
                "wall_median_s": spreads["wall"]["median"],
                "cpu_min_s": spreads["cpu"]["min"],
                "cpu_median_s": spreads["cpu"]["median"],
                "samples": [[s.wall, s.cpu] for s in samples[side]],
            }
            results[f"{condition}, {side}"] = row
            print(line(f"{condition:>18}, --{side}", spreads, digits=1))
        ratio = ratios(samples, "threads 2", "threads 1")
        per_repeat[f"{condition}, threads 2 / threads 1"] = {
            "wall_min": ratio["wall"]["min"],
            "wall_median": ratio["wall"]["median"],
            "cpu_min": ratio["cpu"]["min"],
            "cpu_median": ratio["cpu"]["median"],
        }
        print(ratio_line(f"{condition:>18}, threads 2 / threads 1", ratio))
        raw[condition] = {side: [asdict(s) for s in runs] for side, runs in samples.items()}
    info = {"rounds": args.rounds, "repeats": args.repeats, "cores": len(os.sched_getaffinity(0))}
    info["load_average"] = os.getloadavg()
    info["load_average_before"] = before["loadavg_1_5_15"]
    print(f"cores {info['cores']}, load average {info['load_average'][0]:.2f} (1 min) at the end")
    out = {"settings": info, "results": results, "ratios": per_repeat}
    report("threads", before, {**out, "raw": raw}, args.json)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
