"""The cost of record-level DP-SGD in a client: per-record gradients against a plain step, by engine and batching.

Each side trains the same ``--clients`` clients one round of ``--steps`` local steps (batch ``--batch``: the
expected size of a Poisson batch under DP-SGD) from the same global state, on the Fashion-MNIST SmallCNN (28 x 28,
channels 32/64, feature 128) from a random base (values do not change the cost):

- ``latent_plain``: FLITE's latent (d = 64, r = 32, conv+linear), plain local training (no DP);
- ``latent_functorch``: the latent under DP-SGD, per-record gradients by ``torch.func`` (one client at a time);
- ``latent_cohort``: the same in one vectorised cohort of all the clients (``client_batching: vmap``);
- ``full_plain``: full weights (420,448 trainable floats), plain local training;
- ``full_opacus``: full weights under DP-SGD through Opacus (``GradSampleModule`` + ``DPOptimizer``);
- ``full_functorch``: full weights under DP-SGD, per-record gradients by ``torch.func``.

Sides alternate ``--repeats`` times in one process, one thread; the report gives seconds per local step (wall and
CPU, min and median) and each DP side's cost over its plain side per repeat.

    python benchmarks/dp_sgd.py
    python benchmarks/dp_sgd.py --clients 8 --steps 10 --repeats 3 --json docs/results/dp_sgd_speed.json
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import warnings

import torch
from _harness import add_arguments, alternate, fmt, machine, ratios, report, summarise

from lightning_fl.compress import FP32
from lightning_fl.data import FederatedDataModule, Synthetic
from lightning_fl.federated.clients.client import ClientJob, LocalTraining, _cpu_fabric, run_client
from lightning_fl.federated.clients.dp_cohort import run_cohort_dp_sgd
from lightning_fl.methods import LATENT_RECIPE, Classifier, LatentClassifier, Recipe
from lightning_fl.models import SmallCNN
from lightning_fl.privacy import DPSGD


def backbone() -> SmallCNN:
    torch.manual_seed(0)
    return SmallCNN(in_channels=1, image_size=28, channels=[32, 64], feature_dim=128, norm_groups=8)


def sides(clients: int, steps: int, batch: int) -> dict:
    source = Synthetic(image_size=28, channels=1, train_size=clients * batch * 4, test_size=16)
    dm = FederatedDataModule(source, num_clients=clients, batch_size=batch, augment=False, seed=0)
    dm.prepare_data()
    dm.setup("fit")
    latent = LatentClassifier(
        backbone(),
        10,
        base="scratch",
        latent_dim=64,
        rank=32,
        layers="conv+linear",
        head="orthogonal",
        recipe=dataclasses.replace(LATENT_RECIPE, grad_clip=None),
    )
    full = Classifier(backbone(), 10, head="orthogonal", recipe=Recipe(warmup_epochs=0, schedule="constant"))
    fabric, ids = _cpu_fabric(), list(range(clients))

    def one_at_a_time(module, dp):
        state, local = module.federated_state(), LocalTraining(steps=steps, dp_sgd=dp)

        def run() -> None:
            for c in ids:
                run_client(ClientJob(module, dm, state, 0, 0, FP32(), local, fabric), c)

        return run

    def cohort(module, dp):
        state, local = module.federated_state(), LocalTraining(steps=steps, dp_sgd=dp)
        return lambda: run_cohort_dp_sgd(ClientJob(module, dm, state, 0, 0, FP32(), local, fabric), ids)

    def dp(engine: str) -> DPSGD:
        return DPSGD(max_grad_norm=1.0, noise_multiplier=1.0, engine=engine)

    return {
        "latent_plain": one_at_a_time(latent, None),
        "latent_functorch": one_at_a_time(latent, dp("functorch")),
        "latent_cohort": cohort(latent, dp("functorch")),
        "full_plain": one_at_a_time(full, None),
        "full_opacus": one_at_a_time(full, dp("opacus")),
        "full_functorch": one_at_a_time(full, dp("functorch")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="local steps per client (default 10)")
    parser.add_argument("--batch", type=int, default=64, help="(expected) batch size (default 64)")
    parser.add_argument("--threads", type=int, default=1)
    add_arguments(parser, repeats=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning_fl").setLevel(logging.ERROR)
    before = machine()
    runs = sides(args.clients, args.steps, args.batch)
    for run in runs.values():  # warm-up: factors, vmap's batching rules, Opacus' imports
        run()
    samples = alternate(runs, args.repeats)
    per_step = summarise(samples, per=args.clients * args.steps)
    over_plain = {
        name: ratios(samples, name, f"{name.split('_')[0]}_plain") for name in runs if not name.endswith("_plain")
    }
    for name, summary in per_step.items():
        wall, cpu = fmt(summary["wall"], " s", 1, 4), fmt(summary["cpu"], " s", 1, 4)
        line = f"[dp_sgd] {name}: per step wall {wall}; CPU {cpu}"
        if name in over_plain:
            line += f"; over plain: CPU {fmt(over_plain[name]['cpu'], 'x', 1, 2)}"
        print(line, flush=True)
    report("dp_sgd", before, {"args": vars(args), "seconds_per_step": per_step, "over_plain": over_plain}, args.json)


if __name__ == "__main__":
    main()
