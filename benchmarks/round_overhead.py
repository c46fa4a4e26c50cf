"""What the federated simulation costs beyond the training it runs.

Times one FederatedTrainer round (K=8 IID clients, E=1, FP32 uploads, the identity check on) and
one centralised lightning.Trainer epoch over the same training data, model and batch size, both
without evaluation, and prints their ratio. The module is FLITE's LatentClassifier on the small
GroupNorm CNN (a random base: speed does not depend on the weights).

    python benchmarks/round_overhead.py                 # Fashion-MNIST if installed, else synthetic 28x28
    python benchmarks/round_overhead.py --samples 12000 # a subset, quicker

Goal (ours): round / epoch <= 1.15. Results: docs/results.md, "Overheads".
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings

import lightning as L
import torch

from lightning_fl.data import FashionMNIST, FederatedDataModule, Synthetic
from lightning_fl.errors import DatasetNotFoundError
from lightning_fl.federated import FederatedTrainer
from lightning_fl.methods import LatentClassifier
from lightning_fl.models import SmallCNN


def make_model() -> LatentClassifier:
    torch.manual_seed(0)
    return LatentClassifier(SmallCNN(), 10, base="scratch", latent_dim=64, rank=32, layers="conv+linear")


class EpochTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._t0 = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.times.append(time.perf_counter() - self._t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=None, help="training samples (default: all)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    source = FashionMNIST(download=False)
    try:
        source.prepare()
    except DatasetNotFoundError:
        source = Synthetic(image_size=28, train_size=args.samples or 60000, test_size=1000)
    dm = FederatedDataModule(source, num_clients=args.clients, batch_size=args.batch, max_train_samples=args.samples)
    dm.prepare_data()
    dm.setup("fit")

    with tempfile.TemporaryDirectory() as tmp:
        fed = FederatedTrainer(
            rounds=2, default_root_dir=tmp, logger=False, enable_progress_bar=False, limit_val_batches=0, seed=0
        )
        fed.fit(make_model(), datamodule=dm)
        round_s = fed.history[-1]["time/clients_and_server_s"]  # the second (warm) round

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
        epoch_s = timer.times[-1]

    n = len(dm.split_indices("clients"))
    print(f"{type(source).__name__}: {n} training samples, batch {args.batch}, K={args.clients}, E=1")
    print(f"federated round (clients + upload + gate + aggregation + identity check): {round_s:8.2f} s")
    print(f"centralised lightning.Trainer epoch:                                       {epoch_s:8.2f} s")
    print(f"ratio round / epoch: {round_s / epoch_s:.3f}")
    print(json.dumps({"samples": n, "round_s": round_s, "epoch_s": epoch_s, "ratio": round_s / epoch_s}))


if __name__ == "__main__":
    main()
