"""What a population costs: start-up, round time and peak memory for 10^4 to 10^6 clients on one machine.

Each population size runs in its own process (so its peak RSS is its own): Synthetic 8x8 images, ``--per-client``
samples per client (IID), the quickstart model (a 2-layer GroupNorm CNN, FLITE's latent over conv+linear layers at
d = 64, from scratch), ``--clients`` clients sampled per round, one local epoch, ``--rounds`` rounds, no evaluation,
no logger, one thread.

- **start-up**: from the process's start to the first round's start: importing, generating the images (the
  data itself: ``data_s``), splitting them into the clients (``partition_s``), building the model, the
  trainer's set-up;
- **round**: each round's time (clients and server, ``time/clients_and_server_s``), and per sampled client;
- **peak RSS**: the process's maximum resident memory (``ru_maxrss``), and the RSS once the packages are
  imported (about 0.8 GB of it is torch and Lightning) and once the data is split.

Goal (ours): 10^6 clients with peak RSS < 4 GB and start-up < 60 s, with the round time per client no higher
than at 10^4 clients (the population costs nothing per round).

    python benchmarks/population.py                                 # 10^4, 10^5, 10^6 clients
    python benchmarks/population.py --populations 100000 --json docs/results/population.json
"""

from __future__ import annotations

import time

START = time.perf_counter()  # before any import: start-up counts them

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one(population: int, per_client: int, clients: int, rounds: int, codec: str, client_state_mb: float | None):
    """Run one population in this process; print its numbers as one JSON line."""
    import contextlib
    import io
    import logging
    import tempfile
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning_fl").setLevel(logging.ERROR)
    from lightning_fl.compress import FP32, TopK
    from lightning_fl.data import FederatedDataModule, Synthetic
    from lightning_fl.federated import FederatedTrainer
    from lightning_fl.methods import LatentClassifier
    from lightning_fl.models import SmallCNN

    imported, rss_after_import = time.perf_counter(), current_rss_mib()
    source = Synthetic(image_size=8, channels=1, train_size=population * per_client, test_size=64)
    source.load("train")
    data_done = time.perf_counter()
    dm = FederatedDataModule(source, num_clients=population, batch_size=per_client, seed=0)
    dm.prepare_data()
    dm.setup("fit")
    split_done = time.perf_counter()
    rss_after_split = current_rss_mib()
    torch.manual_seed(0)
    backbone = SmallCNN(in_channels=1, image_size=8, channels=[32, 64], feature_dim=128, norm_groups=8)
    module = LatentClassifier(backbone, 10, base="scratch", latent_dim=64, rank=32, layers="conv+linear")
    with tempfile.TemporaryDirectory() as root:
        trainer = FederatedTrainer(
            rounds=rounds,
            clients_per_round=clients,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            limit_val_batches=0,
            check_identity=False,
            default_root_dir=root,
            name="population",
            seed=0,
            codec=TopK(density=0.1) if codec == "topk" else FP32(),
            client_state_memory_mb=client_state_mb,
        )
        fit_start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.fit(module, datamodule=dm)
        fit_s = time.perf_counter() - fit_start
        round_s = [h["time/clients_and_server_s"] for h in trainer.history if h["round"] > 0]
        stores = {name: len(store) for name, store in trainer.codec.client_stores().items()}
    print(
        json.dumps(
            {
                "population": population,
                "per_client": per_client,
                "clients_per_round": clients,
                "codec": codec,
                "client_state_memory_mb": client_state_mb,
                "clients_with_state": stores,
                "import_s": imported - START,
                "data_s": data_done - imported,
                "partition_s": split_done - data_done,
                "startup_s": (fit_start - START) + (fit_s - sum(round_s)),
                "round_s": round_s,
                "round_ms_per_client": [1e3 * s / clients for s in round_s],
                "rss_after_import_mib": rss_after_import,
                "rss_after_split_mib": rss_after_split,
                "peak_rss_mib": peak_rss_mib(),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--populations", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--per-client", type=int, default=8, help="samples per client (default 8)")
    parser.add_argument("--clients", type=int, default=1000, help="clients per round (default 1,000)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--codec",
        choices=["fp32", "topk"],
        default="fp32",
        help="topk: top-k with error feedback, whose residuals are per-client state",
    )
    parser.add_argument("--client-state-mb", type=float, default=None, help="trainer.client_state_memory_mb")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: one population
    args = parser.parse_args()
    if args.one is not None:
        one(args.one, args.per_client, args.clients, args.rounds, args.codec, args.client_state_mb)
        return
    from _harness import machine, report  # beside this script

    before = machine()
    results = []
    for population in args.populations:
        cmd = [
            sys.executable,
            __file__,
            "--one",
            str(population),
            "--per-client",
            str(args.per_client),
            "--clients",
            str(args.clients),
            "--rounds",
            str(args.rounds),
            "--codec",
            args.codec,
        ]
        if args.client_state_mb is not None:
            cmd += ["--client-state-mb", str(args.client_state_mb)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"population {population} failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(result)
        print(
            f"{population:>9,} clients: start-up {result['startup_s']:.1f} s (import {result['import_s']:.1f}, data "
            f"{result['data_s']:.1f}, partition {result['partition_s']:.1f}); rounds "
            + ", ".join(f"{s:.1f} s" for s in result["round_s"])
            + f" ({', '.join(f'{ms:.1f}' for ms in result['round_ms_per_client'])} ms/client); peak RSS "
            f"{result['peak_rss_mib']:.0f} MiB (after the split {result['rss_after_split_mib']:.0f} MiB)",
            flush=True,
        )
    report("population", before, {"args": vars(args), "populations": results}, args.json)


if __name__ == "__main__":
    main()
