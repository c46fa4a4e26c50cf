"""Clients per second: latent clients trained one at a time against vectorised cohorts of 8, 32 and 128.

The models are FLITE's latent over conv+linear layers (d = 64, r = 32, stored factors) on the quickstart's
network (``digits``: a 2-layer GroupNorm CNN on 8x8 images) and on the Fashion-MNIST SmallCNN (``fmnist``: the
same layers on 28x28 images), from a random base (the base's values do not change the cost). Each client holds
``--per-client`` Synthetic images and trains one local epoch with batches of ``--batch``, Adam and gradient
clipping 1.0, as in the configs. Every side trains the same ``--clients`` clients from the same global state:
``sequential`` calls the client runner once per client (what ``client_batching: sequential`` does);
``cohortK`` calls the cohort runner on groups of K clients (``client_batching: vmap, cohort_size: K``). Sides
alternate ``--repeats`` times in one process, one thread; the report gives clients per second (wall and CPU,
min and median) and each cohort's speed-up over sequential per repeat.

Goal (ours): >= 3x clients/s on 2 CPU cores for the digits model.

It also times what ``vmap`` makes of a convolution whose weights differ per client, the Fashion-MNIST model's
second layer for ``--clients`` clients (16 images of 32 x 14 x 14 each, 64 filters of 3 x 3): ``conv_loop``,
one convolution per client, against ``conv_grouped``, the one grouped convolution (groups = clients) that
``vmap`` runs instead, forward only.

With ``--grid`` it measures instead the rule by which the trainer declines cohorts on CPU (their activations
outgrow the caches; ``cohort_too_large`` in lightning_fl/federated/clients/cohort.py): the SmallCNN, latent and full
weights, on images of 8 to 28 pixels and batches of 16 and 32, each cohort size against one client at a time,
with each point's activations and what the rule decides.

    python benchmarks/cohort.py
    python benchmarks/cohort.py --models digits --json docs/results/cohort.json
    python benchmarks/cohort.py --grid --clients 64 --cohorts 8 32 --json docs/results/cohort_rule.json
"""

from __future__ import annotations

import argparse
import logging
import warnings

import torch
from _harness import add_arguments, alternate, fmt, machine, ratios, report, summarise

from lightning_fl.compress import FP32
from lightning_fl.data import FederatedDataModule, Synthetic
from lightning_fl.federated.clients.client import ClientJob, LocalTraining, _cpu_fabric, run_client
from lightning_fl.federated.clients.cohort import (
    MAX_CLIENT_ACTIVATION,
    MAX_COHORT_ACTIVATION,
    largest_activation,
    run_cohort,
)
from lightning_fl.methods import Classifier, LatentClassifier, Recipe
from lightning_fl.models import SmallCNN

IMAGE_SIZE = {"digits": 8, "fmnist": 28}


def make(model: str | int, clients: int, per_client: int, batch: int, kind: str = "latent"):
    """The SmallCNN on ``model``'s images (or images of ``model`` x ``model`` pixels): FLITE's latent
    (``kind='latent'``) or every weight trained (``'full'``, Adam, as configs/fedavg_*.yaml)."""
    torch.manual_seed(0)
    size = IMAGE_SIZE[model] if isinstance(model, str) else model
    backbone = SmallCNN(in_channels=1, image_size=size, channels=[32, 64], feature_dim=128, norm_groups=8)
    if kind == "full":
        module = Classifier(
            backbone,
            10,
            head="trainable",
            recipe=Recipe(optimizer="adam", lr=0.01, warmup_epochs=0, schedule="constant"),
        )
    else:
        module = LatentClassifier(backbone, 10, base="scratch", latent_dim=64, rank=32, layers="conv+linear")
    source = Synthetic(image_size=size, channels=1, train_size=clients * per_client, test_size=16)
    dm = FederatedDataModule(source, num_clients=clients, batch_size=batch, augment=False, seed=0)
    dm.prepare_data()
    dm.setup("fit")
    return module, dm


def sides(module, dm, clients: int, cohorts: list[int]) -> dict:
    fabric, local, state = _cpu_fabric(), LocalTraining(epochs=1), module.federated_state()
    ids = list(range(clients))

    def sequential() -> None:
        for c in ids:
            run_client(ClientJob(module, dm, state, 0, 0, FP32(), local, fabric), c)

    def cohort(size: int):
        def run() -> None:
            for start in range(0, clients, size):
                run_cohort(ClientJob(module, dm, state, 0, 0, FP32(), local, fabric), ids[start : start + size])

        return run

    return {"sequential": sequential, **{f"cohort{k}": cohort(k) for k in cohorts}}


def conv_sides(clients: int) -> dict:
    x, w = torch.randn(clients, 16, 32, 14, 14), torch.randn(clients, 64, 32, 3, 3)

    def loop() -> None:
        for k in range(clients):
            torch.nn.functional.conv2d(x[k], w[k], padding=1)

    def grouped() -> None:
        torch.func.vmap(lambda a, b: torch.nn.functional.conv2d(a, b, padding=1))(x, w)

    return {"conv_loop": loop, "conv_grouped": grouped}


GRID = [
    (kind, size, batch)
    for kind in ("latent", "full")
    for size, batch in ((8, 16), (12, 16), (16, 16), (20, 16), (28, 16), (8, 32), (10, 32))
]


def grid(args: argparse.Namespace) -> dict:
    """The measurements behind the CPU rule that declines cohorts (``MAX_CLIENT_ACTIVATION``,
    ``MAX_COHORT_ACTIVATION`` in lightning_fl/federated/clients/cohort.py): for each model kind, image size and batch,
    the largest activation per client and per cohort, whether the rule lets the cohort run, and its speed-up over one
    client at a time (CPU time per repeat, min and median)."""
    rows = []
    for kind, size, batch in [point for point in GRID if args.grid_images is None or point[1] in args.grid_images]:
        module, dm = make(size, args.clients, 2 * batch, batch, kind)
        per_client = largest_activation(module, next(iter(dm.client_dataloader(0)))[0])
        runs = sides(module, dm, args.clients, args.cohorts)
        for run in runs.values():
            run()
        samples = alternate(runs, args.repeats)
        for k in args.cohorts:
            speedup = ratios(samples, "sequential", f"cohort{k}")["cpu"]
            runs_as_cohort = per_client <= MAX_CLIENT_ACTIVATION and per_client * k <= MAX_COHORT_ACTIVATION
            rows.append(
                {
                    "kind": kind,
                    "image": size,
                    "batch": batch,
                    "cohort": k,
                    "client_activation": per_client,
                    "cohort_activation": per_client * k,
                    "rule_runs_cohort": runs_as_cohort,
                    "speedup_cpu": speedup,
                }
            )
            print(
                f"[grid] {kind} {size}x{size} batch {batch} cohort {k}: activation {per_client:,} per client, "
                f"{per_client * k:,} per cohort, rule: {'cohort' if runs_as_cohort else 'one at a time'}; "
                f"speed-up {fmt(speedup, 'x', 1, 2)}",
                flush=True,
            )
    return {"limits": {"client": MAX_CLIENT_ACTIVATION, "cohort": MAX_COHORT_ACTIVATION}, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["digits", "fmnist"], choices=sorted(IMAGE_SIZE))
    parser.add_argument("--clients", type=int, default=128, help="clients each side trains (default 128)")
    parser.add_argument("--cohorts", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--per-client", type=int, default=32, help="samples per client (default 32)")
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16: 2 steps per client)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--grid",
        action="store_true",
        help="measure the rule that declines cohorts on CPU instead "
        "(SmallCNN, latent and full, several image sizes and batches; 2 local steps per client)",
    )
    parser.add_argument("--grid-images", type=int, nargs="+", help="with --grid: only these image sizes")
    add_arguments(parser, repeats=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning_fl").setLevel(logging.ERROR)
    before = machine()
    if args.grid:
        report("cohort", before, {"args": vars(args), "grid": grid(args)}, args.json)
        return
    results = {}
    for model in args.models:
        module, dm = make(model, args.clients, args.per_client, args.batch)
        runs = sides(module, dm, args.clients, [k for k in args.cohorts if k <= args.clients])
        for run in runs.values():  # warm-up: first calls build caches (factors, vmap's batching rules)
            run()
        samples = alternate(runs, args.repeats)
        per_client = summarise(samples, per=args.clients)
        speedups = {name: ratios(samples, "sequential", name) for name in runs if name != "sequential"}
        results[model] = {"seconds_per_client": per_client, "speedup_over_sequential": speedups}
        for name, summary in per_client.items():
            rate = {k: {"min": 1 / v["max"], "median": 1 / v["median"]} for k, v in summary.items()}
            line = f"[{model}] {name}: clients/s wall {fmt(rate['wall'], '', 1, 1)}; CPU {fmt(rate['cpu'], '', 1, 1)}"
            if name in speedups:
                line += f"; speed-up per repeat: wall {fmt(speedups[name]['wall'], 'x', 1, 2)}"
                line += f", CPU {fmt(speedups[name]['cpu'], 'x', 1, 2)}"
            print(line, flush=True)
    convs = conv_sides(args.clients)
    for run in convs.values():
        run()
    conv = alternate(convs, args.repeats)
    results["conv"] = {"seconds": summarise(conv), "grouped_over_loop": ratios(conv, "conv_grouped", "conv_loop")}
    for name, summary in results["conv"]["seconds"].items():
        print(f"[conv] {name}: wall {fmt(summary['wall'], ' s')}")
    report("cohort", before, {"args": vars(args), "models": results}, args.json)


if __name__ == "__main__":
    main()
