"""The centralised latent probe: FLITE's latent trained without a federation, on the pooled data of a config's
clients and from the config's own base (docs/results-flite.md, FLITE on Fashion-MNIST, "Why so little accuracy gain").

    python tools/latent_probe.py --epochs 2 --dims 64:32 256:256 512:512 \\
        --json docs/results/latent_probe_fashion_mnist.json fit --config configs/flite_fashion_mnist.yaml

For each ``d:r`` it builds the config's run with ``--model.latent_dim d --model.rank r`` (anything after the options
is the usual command line), prepares the base exactly as the federated run does (pretrained on the public split and
cached, or read from the cache), then trains the latent with ``lightning.Trainer(max_epochs=E)`` on the clients'
pooled data (the data module's ``train_split`` switched to ``clients`` after the base is ready), validating after
every epoch (the test split when ``val_fraction`` is 0). Epoch 0 is the base. It prints one table row per ``d:r``
and writes every epoch's metrics to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import lightning as L

from lightning_fl.cli import build
from lightning_fl.errors import UserError


class _Epochs(L.Callback):
    """Collects ``val/acc`` and ``val/ece`` after every validation."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("val/acc", "val/ece")}
        self.rows.append({"epoch": len(self.rows), **metrics})


def probe(argv: list[str], latent_dim: int, rank: int, epochs: int) -> dict:
    """One ``d:r``: the base's metrics (epoch 0), then each epoch's, and the optimiser steps taken."""
    run = build([*argv, "--model.latent_dim", str(latent_dim), "--model.rank", str(rank)])
    model, data = run.model, run.data
    data.prepare_data()
    data.setup("fit")
    model.prepare_base(data)  # the federated run's base: its cache key names the public split
    data.train_split = "clients"
    epochs_seen = _Epochs()
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[epochs_seen],
        inference_mode=False,  # the factors materialise in the first validation and are then trained through
    )
    trainer.validate(model, datamodule=data, verbose=False)
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - t0
    return {
        "latent_dim": latent_dim,
        "rank": rank,
        "steps": trainer.global_step,
        "fit_seconds": round(seconds, 1),
        "epochs": epochs_seen.rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--dims", nargs="+", default=["64:32"], help="latent_dim:rank pairs")
    parser.add_argument("--json", type=Path, default=None, help="write every epoch's metrics here")
    known, rest = parser.parse_known_args(argv)
    try:
        dims = [tuple(int(v) for v in pair.split(":")) for pair in known.dims]
        if any(len(pair) != 2 for pair in dims):
            raise ValueError
    except ValueError:
        print(f"error: --dims {' '.join(known.dims)}: give latent_dim:rank pairs, e.g. 64:32 256:256", file=sys.stderr)
        return 2
    if not rest:
        print(
            "error: give the run after the options, e.g. fit --config configs/flite_fashion_mnist.yaml", file=sys.stderr
        )
        return 2
    results = []
    try:
        for d, r in dims:
            results.append(probe(rest, d, r, known.epochs))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("| latent d, rank r | " + " | ".join(f"epoch {e}: acc / ECE" for e in range(known.epochs + 1)) + " |")
    print("| --- | " + " | ".join("---" for _ in range(known.epochs + 1)) + " |")
    for row in results:
        cells = [f"{e['val/acc']:.4f} / {e['val/ece']:.4f}" for e in row["epochs"]]
        print(f"| {row['latent_dim']}, {row['rank']} | " + " | ".join(cells) + " |")
    if known.json is not None:
        command = "python tools/latent_probe.py " + " ".join(argv if argv is not None else sys.argv[1:])
        known.json.write_text(json.dumps({"command": command, "runs": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
