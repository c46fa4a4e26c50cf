"""Peak memory of one FedAvg round against the number of clients: rows kept (before) against streamed (after).

Before the round became a pipeline every round gathered its uploads into an ``(n, D)`` float32 matrix; a round
that still keeps rows (a robust strategy, the relative norm gate ``max_update_norm_ratio``, ALIE, the identity
check) does the same today, so ``rows`` measures both. ``streamed`` is FedAvg with nothing that needs rows (the
relative gate off): each upload is folded into a float64 running sum as it arrives.

Each (clients, mode) runs in a fresh process: it builds a ``D``-weight federated state, runs one round of
``RoundRunner`` whose clients upload ``state + noise`` (no training: only the server's memory is measured)
as FP32 payloads, and reports the process's peak resident memory during the round above its resident
memory just before it (``ru_maxrss``), with the round's wall time; a one-client round runs first, so one-time
costs (lazy imports, allocator pools) are not counted. The two modes alternate per client count.

    python benchmarks/round_memory.py                                   # 10 / 100 / 1,000 clients, D = 1M
    python benchmarks/round_memory.py --clients 10 100 --weights 100000 --json round_memory.json
    python benchmarks/round_memory.py --clients 1000 --groups 8   # also streamed into 8 fold groups (one process)

Expected: ``rows`` grows like ``4 n D`` bytes; ``streamed`` stays at a few ``D``-sized buffers (the float64
sum and one upload in flight) whatever ``n``; ``grouped`` (``trainer.fold_groups`` G, here all G groups on one
process) holds up to G float64 sums. Results: docs/results-systems.md, "The round as a pipeline".
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def worker(clients: int, weights: int, mode: str, groups: int = 1) -> dict:
    """One round in this process; its peak memory above the memory before it."""
    import lightning as L

    from lightning_fl.compress import FP32
    from lightning_fl.federated import ByteLedger, FedAvg, LocalTraining
    from lightning_fl.federated.clients.transport import Reply, Transport
    from lightning_fl.federated.server.collect import Uploads
    from lightning_fl.federated.server.round import RoundRunner
    from lightning_fl.federated.server.stages import NormGate

    class Clients(Transport):
        """Clients that upload the global state plus a small seeded perturbation (no training)."""

        def replies(self, job, ids):
            state = job.state
            for c in ids:
                g = torch.Generator().manual_seed(c)
                upload = {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in state.items()}
                yield Reply(c, 10, FP32().encode(upload, state, c))

    class Population:
        num_clients = clients

    torch.set_num_threads(1)
    state = {"w": torch.zeros(weights)}
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[])
    ratio = 100.0 if mode == "rows" else None  # the relative gate needs every upload: rows are kept
    collection = Uploads(Clients(), FP32(), LocalTraining(), fold_groups=groups if mode == "grouped" else 1)
    gate = NormGate(FedAvg(), max_update_norm_ratio=ratio)
    runner = RoundRunner(fabric, gate.strategy, collection, [gate], ByteLedger(clients))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.run(None, Population(), state, 0, 0, 1)  # warm-up: one client, the code paths' one-time costs
        before = current_rss_bytes()
        start = time.perf_counter()
        _, metrics = runner.run(None, Population(), state, 1, 0, clients)
    seconds = time.perf_counter() - start
    assert metrics["fed/round_skipped"] == 0 and runner.kept_rows == (clients if mode == "rows" else 0)
    return {
        "clients": clients,
        "weights": weights,
        "mode": mode,
        "groups": groups if mode == "grouped" else 1,
        "peak_extra_bytes": peak_rss_bytes() - before,
        "kept_rows": runner.kept_rows,
        "round_seconds": seconds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--weights", type=int, default=1_000_000, help="D, the federated state's size")
    parser.add_argument("--groups", type=int, default=1, help="also measure streaming into this many fold groups")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--worker", nargs=4, metavar=("CLIENTS", "WEIGHTS", "MODE", "GROUPS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), int(args.worker[1]), args.worker[2], int(args.worker[3]))))
        return
    results = []
    modes = ("rows", "streamed", "grouped") if args.groups > 1 else ("rows", "streamed")
    for n in args.clients:
        for mode in modes:
            cmd = [sys.executable, __file__, "--worker", str(n), str(args.weights), mode, str(args.groups)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    mib = 2**20
    print(f"[round_memory] one FedAvg round, D = {args.weights:,} weights, FP32 uploads; extra peak RSS during it")
    grouped = f" | streamed, {args.groups} groups" if args.groups > 1 else ""
    print(f"| clients | rows kept (before) | streamed (after){grouped} | 4 n D | round time, {' / '.join(modes)} |")
    print("|---:|---:|---:|---:|---:" + ("|---:" if grouped else "") + "|")
    for n in args.clients:
        found = [next(r for r in results if r["clients"] == n and r["mode"] == m) for m in modes]
        memory = " | ".join(f"{r['peak_extra_bytes'] / mib:,.0f} MiB" for r in found)
        times = " / ".join(f"{r['round_seconds']:.2f} s" for r in found)
        print(f"| {n:,} | {memory} | {4 * n * args.weights / mib:,.0f} MiB | {times} |")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
        print(f"[round_memory] wrote {args.json}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
