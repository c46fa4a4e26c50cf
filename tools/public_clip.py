"""A clip bound for user-level central DP (``trainer.privacy: CentralDP``, ``clip_norm``) from public data only.

The clip bound ``S`` of a private run is part of the mechanism: chosen from the private clients' updates (say, the
``fed/update_norm_median`` of a non-private run on them) it leaks what the guarantee does not account for. This
tool chooses it from the data module's public split alone. It builds the run of a config (the CLI's own parser,
same overrides), forms ``--clients`` K pseudo-clients of ``--windows`` N windows (images, for an image data module)
each from the public split only, trains each exactly as a federated client trains in the first round
(:func:`~lightning_fl.federated.clients.client.run_client`: the config's recipe, ``trainer.local_steps`` or
``local_epochs``, batch size, gradient clipping and codec, from the same starting global state), and measures the
L2 norm of each pseudo-client's update as CentralDP would clip it: the decoded upload minus the global state, in
float64, over every tensor of the federated state. It prints the quantiles and suggests the median as
``--trainer.privacy.clip_norm`` (the quantile that adaptive clipping, Andrew et al. 2021, targets by default).

Public splits: ``FederatedTextDataModule``'s ``pretrain_plays`` (pseudo-clients one speaking role each, the roles
in a seeded order, reused with other windows when K exceeds them) and ``FederatedDataModule``'s
``public_fraction`` (N random public images each; with ``public_samples``, the public images beyond them, which the
pretrained base never saw: a base fits its own pretraining images, and their updates understate a client's), and
``FederatedInstructionDataModule``'s public records (groups of a mean client's size, N records each). A data
module without one is refused in one line.

    python tools/public_clip.py fit --config configs/smollm2_lora.yaml [--clients 16] [--windows 32] [--seed 0] \\
        [--json clip.json] [--any.config.key VALUE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np
import torch

from lightning_fl import threads
from lightning_fl.cli import build
from lightning_fl.errors import ConfigError, UserError
from lightning_fl.federated.clients.client import ClientJob, run_client
from lightning_fl.federated.server.gate import screen_upload
from lightning_fl.federated.trainer import setup
from lightning_fl.privacy.base import flat_update

QUANTILES = {"min": 0.0, "q25": 0.25, "median": 0.5, "q75": 0.75, "max": 1.0}


class PublicClients:
    """K pseudo-clients over public data with what :func:`run_client` asks of a federated data module: each
    ``part`` served by ``serve(part, seed)``, the data module's own client loader for arbitrary data."""

    def __init__(self, parts: list[Any], serve: Callable[[Any, int | None], Any], unit: str, described: str) -> None:
        self.parts, self.serve, self.unit, self.described, self.num_clients = parts, serve, unit, described, len(parts)

    def client_num_samples(self, cid: int) -> int:
        return len(self.parts[cid])

    def client_dataloader(self, cid: int, seed: int | None = None) -> Any:
        return self.serve(self.parts[cid], seed)


def public_clients(data: Any, clients: int, windows: int, seed: int, pretraining: bool = False) -> PublicClients:
    """``clients`` pseudo-clients of at most ``windows`` items each, drawn (seeded) from ``data``'s public split
    (images: those pretraining never saw when there are any, unless ``pretraining``)."""
    rng, name = np.random.default_rng(seed), type(data).__name__
    if callable(getattr(data, "public_groups", None)):  # text: a speaking role each; instructions: client-sized groups
        groups = data.public_groups()
        if not groups and hasattr(data, "pretrain_plays"):
            raise ConfigError(
                f"data.pretrain_plays={data.pretrain_plays}: {name} has no public window to draw "
                "pseudo-clients from; set --data.pretrain_plays (e.g. 0.2)"
            )
        if not groups:
            raise ConfigError(
                f"data.source: {name} has no public records to draw pseudo-clients from; give the source a public "
                "split (InstructionFiles' public file, InstructionTasks' public_per_task)"
            )
        order, parts = rng.permutation(len(groups)), []
        for k in range(clients):
            group = groups[order[k % len(groups)]]
            take = np.sort(rng.choice(len(group), min(windows, len(group)), replace=False))
            parts.append(group.subset(take) if hasattr(group, "subset") else [group[i] for i in take])
        unit, groups_are = ("windows", "public roles") if hasattr(groups[0], "subset") else ("records", "public groups")
        return PublicClients(parts, data.windows_dataloader, unit, f"{len(groups)} {groups_are} of {name}")
    if callable(getattr(data, "split_indices", None)) and callable(getattr(data, "indices_dataloader", None)):
        # A base pretrained on the public images fits them: their updates are smaller than a client's. The public
        # images it never saw (beyond data.public_samples) stand in for clients better, when there are any.
        public, described = data.split_indices("public"), "public images of"
        use_held_out = not pretraining and getattr(data, "public_samples", None)
        held_out = data.split_indices("public_held_out") if use_held_out else public[:0]
        if len(held_out):
            public, described = held_out, f"public images (held out from pretraining; {len(public)} pretrain) of"
        elif len(public) == 0:
            raise ConfigError(
                f"data.public_fraction={data.public_fraction}: {name} has no public split to draw "
                "pseudo-clients from; set --data.public_fraction (e.g. 0.1)"
            )
        parts = [np.sort(rng.choice(public, min(windows, len(public)), replace=False)) for _ in range(clients)]
        return PublicClients(parts, data.indices_dataloader, "images", f"{len(public)} {described} {name}")
    raise ConfigError(
        f"data: {name} has no public split (neither public_groups() nor split_indices('public')) to "
        "draw pseudo-clients from; use a data module with one (FederatedTextDataModule, "
        "FederatedDataModule)"
    )


def update_norms(
    run: Any, clients: int = 16, windows: int = 32, seed: int = 0, pretraining: bool = False
) -> tuple[list[float], PublicClients]:
    """Each public pseudo-client's update norm (as CentralDP clips it) after one federated client's local training."""
    from lightning_fl.federated.trainer.loop import FederatedTrainer

    trainer, model, data = run.trainer, run.model, run.data
    if not isinstance(trainer, FederatedTrainer):
        raise ConfigError(
            f"trainer: {type(trainer).__name__} has no federated clients; public_clip needs "
            "trainer.class_path lightning_fl.FederatedTrainer"
        )
    if trainer.dp_sgd is not None:
        raise ConfigError(
            "trainer.dp_sgd: public_clip measures plain local training (what CentralDP clips); "
            "set --trainer.dp_sgd null"
        )
    threads.for_run(trainer.threads)
    fabric = L.Fabric(accelerator=trainer.accelerator, devices=1, precision=trainer.precision, loggers=[])
    model, _ = setup.prepare(fabric, model, data, "fit")  # data set up, the base prepared, as a run does
    pseudo = public_clients(data, clients, windows, seed, pretraining)
    start = model.federated_state()  # round 0's global state
    # What the server clips: the plain update (no client-side noise, no secure-aggregation masking).
    local = dataclasses.replace(trainer.local, upload_stage=None, secure=None)
    norms = []
    for k in range(pseudo.num_clients):
        result = run_client(ClientJob(model, pseudo, start, 0, seed, trainer.codec, local, fabric), k)
        decoded, problems = screen_upload(result.payload, trainer.codec, start, k)
        if decoded is None:
            raise UserError(f"public pseudo-client {k}: {result.failure or '; '.join(problems)}")
        norms.append(float(flat_update(decoded, start).norm()))
    return norms, pseudo


def summary(norms: list[float]) -> dict[str, float]:
    """The quantiles (linear interpolation) of the norms and the suggested clip bound (their median)."""
    values = torch.tensor(norms, dtype=torch.float64)
    out = {name: float(torch.quantile(values, q)) for name, q in QUANTILES.items()}
    return out | {"clip_norm": out["median"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--clients", type=int, default=16, help="public pseudo-clients K")
    parser.add_argument("--windows", type=int, default=32, help="windows (images) per pseudo-client N")
    parser.add_argument("--seed", type=int, default=0, help="draws the pseudo-clients and their training streams")
    parser.add_argument("--json", default=None, help="also write the JSON line to this file")
    parser.add_argument(
        "--pretraining-images",
        action="store_true",
        help="images: draw from those the base was pretrained on (to see how much they understate)",
    )
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.clients < 1 or args.windows < 1:
            raise ConfigError(f"--clients {args.clients} --windows {args.windows}: both must be >= 1")
        run = build(rest)
        norms, pseudo = update_norms(run, args.clients, args.windows, args.seed, args.pretraining_images)
    except UserError as err:  # a config typo, no public split: one line, exit code 2
        print(f"error: {err}", file=sys.stderr)
        return 2
    stats = summary(norms)
    local = run.trainer.local
    recipe = f"local_steps {local.steps}" if local.steps is not None else f"local_epochs {local.epochs}"
    print(
        f"{pseudo.num_clients} public pseudo-clients of up to {args.windows} {pseudo.unit} from {pseudo.described}; "
        f"a client's round each ({recipe}, batch size {run.data.batch_size}) from the starting state"
    )
    print("update L2 norms: " + "  ".join(f"{name} {stats[name]:.6g}" for name in QUANTILES))
    print(f"suggested: --trainer.privacy.clip_norm {stats['clip_norm']:.6g} (the median)")
    line = json.dumps(
        {"clients": pseudo.num_clients, "windows": args.windows, "seed": args.seed, **stats, "norms": norms}
    )
    print(line)
    if args.json is not None:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
