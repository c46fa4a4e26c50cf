"""What the federated simulation costs beyond the training it runs.

Times one FederatedTrainer round (K=8 IID clients, E=1, FP32 uploads, the identity check on) and
one centralised lightning.Trainer epoch over the same training data, model and batch size, both
without evaluation. The module is FLITE's LatentClassifier on the small GroupNorm CNN (a random base:
speed does not depend on the weights).

Each repeat runs a fresh 2-round federated fit, then a fresh 2-epoch lightning fit, and keeps the second
(warm) round and epoch; the two sides alternate ``--repeats`` times (round, epoch, round, epoch, ...). The
round is ``RoundRunner.run`` (clients + upload + gate + aggregation + identity check), the epoch is Lightning's
``on_train_epoch_start`` to ``on_train_epoch_end``. It prints, for each side, the min and median of the wall
time and of the CPU time (user + system, all threads), the min and median of the per-repeat ratio round /
epoch (wall and CPU), the torch thread count and the load average before and after, and last its results as
one JSON line (``--json PATH`` also writes them with the machine's state to a file).

    python benchmarks/round_overhead.py                  # Fashion-MNIST if installed, else synthetic 28x28
    python benchmarks/round_overhead.py --samples 12000  # a subset, quicker
    python benchmarks/round_overhead.py --repeats 3 --json round_overhead.json

Goal (ours): round / epoch <= 1.15. Results: docs/results-flite-extras.md, "Overheads".
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path
from typing import ClassVar

import lightning as L
import torch
from _harness import Sample, add_arguments, cpu_seconds, line, machine, measure, ratio_line, ratios, report, summarise

from lightning_fl.data import FashionMNIST, FederatedDataModule, Synthetic
from lightning_fl.errors import DatasetNotFoundError
from lightning_fl.federated import FederatedTrainer
from lightning_fl.federated.trainer import loop as federated_loop
from lightning_fl.methods import LatentClassifier
from lightning_fl.models import SmallCNN


def make_model() -> LatentClassifier:
    torch.manual_seed(0)
    return LatentClassifier(SmallCNN(), 10, base="scratch", latent_dim=64, rank=32, layers="conv+linear")


class TimedRunner(federated_loop.RoundRunner):
    """The round runner, timing each round (wall and CPU) into ``TimedRunner.samples``."""

    samples: ClassVar[list[Sample]] = []

    def run(self, *args, **kwargs):
        out, sample = measure(lambda: super(TimedRunner, self).run(*args, **kwargs))
        TimedRunner.samples.append(sample)
        return out


class EpochTimer(L.Callback):
    def __init__(self) -> None:
        self.samples: list[Sample] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._wall, self._cpu = time.perf_counter(), cpu_seconds()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.samples.append(Sample(time.perf_counter() - self._wall, cpu_seconds() - self._cpu))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=None, help="training samples (default: all)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    add_arguments(parser, repeats=5)
    args = parser.parse_args()
    before = machine()
    warnings.filterwarnings("ignore")
    source = FashionMNIST(download=False)
    try:
        source.prepare()
    except DatasetNotFoundError:
        source = Synthetic(image_size=28, train_size=args.samples or 60000, test_size=1000)
    dm = FederatedDataModule(source, num_clients=args.clients, batch_size=args.batch, max_train_samples=args.samples)
    dm.prepare_data()
    dm.setup("fit")
    federated_loop.RoundRunner = TimedRunner  # FederatedTrainer builds its runner by this name

    samples: dict[str, list[Sample]] = {"round": [], "epoch": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):  # alternated: round, epoch, round, epoch, ...
            TimedRunner.samples.clear()
            FederatedTrainer(
                rounds=2,
                default_root_dir=Path(tmp, f"fed-{i}"),
                logger=False,
                enable_progress_bar=False,
                limit_val_batches=0,
                seed=0,
            ).fit(make_model(), datamodule=dm)
            samples["round"].append(TimedRunner.samples[-1])  # the second (warm) round

            timer = EpochTimer()
            L.Trainer(
                max_epochs=2,
                default_root_dir=tmp,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                limit_val_batches=0,
                num_sanity_val_steps=0,
                callbacks=[timer],
            ).fit(make_model(), datamodule=dm)
            samples["epoch"].append(timer.samples[-1])  # the second (warm) epoch

    summary = summarise(samples)
    ratio = ratios(samples, "round", "epoch")
    n = len(dm.split_indices("clients"))
    print(
        f"{type(source).__name__}: {n} training samples, batch {args.batch}, K={args.clients}, E=1; "
        f"{args.repeats} repeats, alternated (the second of 2 rounds / epochs each)"
    )
    print(line("federated round (clients + upload + gate + aggregation + identity check)", summary["round"]))
    print(line("centralised lightning.Trainer epoch", summary["epoch"]))
    print(ratio_line("ratio round / epoch", ratio))
    results = {
        "samples": n,
        "batch": args.batch,
        "clients": args.clients,
        "repeats": args.repeats,
        "round_s": summary["round"]["wall"]["median"],
        "epoch_s": summary["epoch"]["wall"]["median"],
        "ratio": ratio["wall"]["median"],
        "round": summary["round"],
        "epoch": summary["epoch"],
        "ratio_per_repeat": ratio,
    }
    report("round_overhead", before, {**results, "raw": samples}, args.json)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
