"""Threads per process, quiet and with a busy neighbour: the quickstart's time with ``--threads 1`` vs ``2``.

Each measurement is a whole ``python -m lightning_fl fit`` of the quickstart (the base cached by a warm-up run,
so it measures the federated rounds plus start-up), alternating the two settings ``--repeats`` times, on a quiet
machine and next to one process that keeps a core busy. Prints min and median wall time and CPU time (the
child's user + system), the load average, and writes JSON.

    python benchmarks/threads.py                       # 5 rounds, 3 repeats per setting and condition
    python benchmarks/threads.py --rounds 2 --repeats 1 --out /tmp/threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUSY = "while True:\n    pass\n"


def run_once(threads: int, rounds: int, root: Path, env: dict) -> tuple[float, float]:
    """Wall and CPU seconds of one quickstart fit with ``--threads threads``."""
    cmd = [
        sys.executable, "-m", "lightning_fl", "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
        "--threads", str(threads), "--trainer.rounds", str(rounds), "--trainer.enable_progress_bar", "false",
        "--trainer.logger", "false", "--trainer.default_root_dir", str(root),
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", type=Path, default=Path("/tmp/lightning_fl_threads_bench"))
    parser.add_argument("--out", type=Path, default=Path("threads.json"))
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    run_once(1, 1, args.root, env)  # warm-up: pretrains and caches the base
    results = {}
    for condition in ("quiet", "one busy neighbour"):
        neighbour = subprocess.Popen([sys.executable, "-c", BUSY]) if condition != "quiet" else None
        try:
            samples: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
            for _ in range(args.repeats):
                for threads in (1, 2):  # alternate the two settings
                    samples[threads].append(run_once(threads, args.rounds, args.root, env))
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait(timeout=30)
        for threads, pairs in samples.items():
            walls, cpus = [w for w, _ in pairs], [c for _, c in pairs]
            row = {
                "wall_min_s": min(walls),
                "wall_median_s": statistics.median(walls),
                "cpu_min_s": min(cpus),
                "cpu_median_s": statistics.median(cpus),
                "samples": pairs,
            }
            results[f"{condition}, threads {threads}"] = row
            print(
                f"{condition:>18}, --threads {threads}: wall min {row['wall_min_s']:.1f} s, median "
                f"{row['wall_median_s']:.1f} s; CPU min {row['cpu_min_s']:.1f} s, median {row['cpu_median_s']:.1f} s"
            )
    info = {"rounds": args.rounds, "repeats": args.repeats, "cores": len(os.sched_getaffinity(0))}
    info["load_average"] = os.getloadavg()
    print(f"cores {info['cores']}, load average {info['load_average'][0]:.2f} (1 min) at the end")
    args.out.write_text(json.dumps({"settings": info, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
