"""What a client costs under FederatedTrainer beyond its own training steps: trainer CPU per client vs the floor.

The network (``--backbone``) is the quickstart's SmallCNN (two 3x3 conv stages of 32 and 64 channels with
GroupNorm, a 128-feature linear layer, a linear head) or ``plain``, the same without GroupNorm and with conv
biases (the CNN of the cross-device comparison in issue 39: 421,642 values on 28x28 images); FLITE's latent over
conv+linear layers at d=64, or full weights. The data are ``--image-size`` Synthetic images split IID over
``--population`` clients with ``--per-client`` samples each, ``--clients`` clients per round, one local epoch,
batch ``--batch``, Adam at lr 0.01. Two workloads set these together (``--workload``; an option given wins):

- ``quickstart`` (the default): SmallCNN on 8x8 images, 200 clients of 64, 100 per round, batch 32 (2 steps
  per client), latent and full weights.
- ``cross-device``: the plain CNN on 28x28 images, 1,000 clients of 60, 50 per round, batch 20 (3 local steps
  per client), full weights.

- **trainer**: ``FederatedTrainer.fit`` with ``--rounds`` rounds, no evaluation, no logger, no progress bar:
  everything a round does (sampling, broadcast, the client runner, encoding, the gate, aggregation, the
  ledger, the round checkpoint). Each round is timed from the end of the previous one to its own end (the
  transport's ``finished_round``), so set-up (building the model, the base, the factors) and round 1 are not
  counted.
- **floor**: as many clients' steps with nothing around them: for each client, copy the global state into
  the module, build its optimiser, and run its batches (transformed before any timing) through
  ``training_step``, backward, gradient clipping where the module asks for it, and the optimiser step; then
  read its state.

The sides alternate round by round in one process: after each round but the last, outside both rounds' time,
the floor trains as many clients as a round has (the trainer's clients load the global state again, so this
changes nothing in the fit). A neighbour's load thus falls on a round and on the floor next to it alike.
``--repeats`` fits of ``--rounds`` rounds give ``repeats x (rounds - 1)`` pairs; the report gives CPU and wall
milliseconds per client (min and median over the pairs) and the per-pair ratio trainer / floor. Goal (ours):
trainer CPU per client <= 1.2x the floor at 100 clients per round (quickstart); issue 39: <= 1.15x on the
cross-device workload.

It also prices the one thing a client rebuilds that an optimiser could keep: **optimiser build** (the
module's ``configure_optimizers`` and Fabric's wrapper, as each client does) against **optimiser reset**
(emptying a kept optimiser's state and restoring its groups' settings), 1,000 of each, alternated.

    python benchmarks/client_overhead.py                      # latent and full weights, 100 clients per round
    python benchmarks/client_overhead.py --json docs/results/client_overhead.json
    python benchmarks/client_overhead.py --workload cross-device --rounds 8 --repeats 4
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import logging
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
from _harness import Sample, add_arguments, alternate, cpu_seconds, fmt, machine, measure, ratios, report, summarise
from torch import nn

from lightning_fl.data import FederatedDataModule, Synthetic
from lightning_fl.federated import FederatedTrainer
from lightning_fl.federated.clients.client import _cpu_fabric, configure_optimizer
from lightning_fl.federated.clients.transport import InProcess
from lightning_fl.methods import Classifier, LatentClassifier, Recipe
from lightning_fl.models import SmallCNN
from lightning_fl.models.backbone import Backbone

WORKLOADS = {
    "quickstart": {
        "backbone": "smallcnn",
        "kinds": ["latent", "full"],
        "image_size": 8,
        "population": 200,
        "per_client": 64,
        "clients": 100,
        "batch": 32,
    },
    "cross-device": {
        "backbone": "plain",
        "kinds": ["full"],
        "image_size": 28,
        "population": 1000,
        "per_client": 60,
        "clients": 50,
        "batch": 20,
    },
}


class PlainCNN(Backbone):
    """Two 3x3 conv stages (32 and 64 channels, with biases, ReLU, 2x2 max-pool) and a 128-feature linear layer."""

    def __init__(self, image_size: int) -> None:
        super().__init__()
        self.in_channels, self.out_features = 1, 128
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.fc = nn.Linear(64 * (image_size // 4) ** 2, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(torch.flatten(self.features(x), 1)))


def make_module(kind: str, args: argparse.Namespace, factors: str = "stored") -> Classifier:
    """The ``latent`` (FLITE over conv+linear at d=64, r=32, with ``factors``) or ``full`` module on ``args.backbone``
    and ``args.image_size``, from seed 0."""
    torch.manual_seed(0)
    if args.backbone == "plain":
        backbone = PlainCNN(args.image_size)
    else:
        backbone = SmallCNN(
            in_channels=1, image_size=args.image_size, channels=[32, 64], feature_dim=128, norm_groups=8
        )
    if kind == "latent":
        return LatentClassifier(
            backbone, 10, base="scratch", latent_dim=64, rank=32, layers="conv+linear", factors=factors
        )
    return Classifier(
        backbone, 10, head="trainable", recipe=Recipe(optimizer="adam", lr=0.01, warmup_epochs=0, schedule="constant")
    )


def make_data(args: argparse.Namespace) -> FederatedDataModule:
    n = args.population * args.per_client
    source = Synthetic(image_size=args.image_size, channels=1, train_size=n, test_size=64)
    dm = FederatedDataModule(source, num_clients=args.population, batch_size=args.batch, seed=0)
    dm.prepare_data()
    dm.setup("fit")
    return dm


class FloorBetweenRounds(InProcess):
    """The in-process transport, timing every round after the first (from the end of the previous round to the end
    of this one) and running ``floor`` between rounds, outside those times."""

    def __init__(self, floor: Callable[[], None], rounds: int) -> None:
        super().__init__()
        self.floor, self.last = floor, rounds  # (rounds are 1-based)
        self.rounds: list[Sample] = []
        self.floors: list[Sample] = []
        self.mark: tuple[float, float] | None = None

    def finished_round(self, round: int, metrics: dict[str, float]) -> None:
        wall, cpu = time.perf_counter(), cpu_seconds()
        if self.mark is not None:
            self.rounds.append(Sample(wall - self.mark[0], cpu - self.mark[1]))
        if round < self.last:
            self.floors.append(measure(self.floor)[1])
            self.mark = time.perf_counter(), cpu_seconds()


def trainer_run(
    module: Classifier,
    dm: FederatedDataModule,
    rounds: int,
    clients: int,
    root: str,
    floor: Callable[[], None] = lambda: None,
) -> FloorBetweenRounds:
    """One fit; its transport holds the round and floor timings."""
    trainer = FederatedTrainer(
        rounds=rounds,
        clients_per_round=clients,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        check_identity=False,
        default_root_dir=root,
        name="bench",
        seed=0,
    )
    trainer.transport = timed = FloorBetweenRounds(floor, rounds)
    with contextlib.redirect_stdout(io.StringIO()):  # the run's end-of-run summary
        trainer.fit(module, datamodule=dm)
    return timed


def client_batches(dm: FederatedDataModule, clients: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each client's batches, transformed once before any timing (the floor does no data work at all)."""
    train = dm.source.load("train")
    transform = dm.source.transform(train=True, augment=False)
    out = []
    for client in range(clients):
        idx = dm.client_indices(client % dm.num_clients)
        x = torch.stack([transform(train.images[int(i)]) for i in idx])
        y = torch.as_tensor(train.targets[idx])
        out.append([(x[s : s + dm.batch_size], y[s : s + dm.batch_size]) for s in range(0, len(idx), dm.batch_size)])
    return out


def floor_run(module: Classifier, batches: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    """Each client: load the state, a new optimiser, its batches through training_step, read its state."""
    start = module.federated_state()
    clip = module.recipe.grad_clip  # the module asks for it, so the trainer clips too (FLITE: 1.0)
    module.train()
    for client_batches_ in batches:
        module.load_federated_state(start)
        optimizer = module.configure_optimizers()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for batch_idx, batch in enumerate(client_batches_):
            loss = module.training_step(batch, batch_idx)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        module.federated_state()


def optimizer_sides(module: Classifier, times: int) -> dict:
    """Building a client's optimiser as the client runner does, against resetting one kept optimiser."""
    fabric = _cpu_fabric()
    kept, _ = configure_optimizer(module)
    settings = [{k: v for k, v in group.items() if k != "params"} for group in kept.param_groups]

    def build() -> None:
        for _ in range(times):
            optimizer, _ = configure_optimizer(module)
            fabric.setup_optimizers(optimizer)

    def reset() -> None:
        for _ in range(times):
            kept.state.clear()
            for group, saved in zip(kept.param_groups, settings, strict=True):
                group.update(saved)

    return {"optimizer_build": build, "optimizer_reset": reset}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="quickstart", choices=sorted(WORKLOADS), help="the defaults below")
    parser.add_argument("--backbone", choices=["smallcnn", "plain"])
    parser.add_argument("--kinds", nargs="+", choices=["latent", "full"])
    parser.add_argument("--image-size", type=int, help="image height and width")
    parser.add_argument("--clients", type=int, help="clients per round")
    parser.add_argument("--population", type=int, help="clients in all")
    parser.add_argument("--per-client", type=int, help="samples per client")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per fit (default 3: 2 timed)")
    parser.add_argument("--threads", type=int, default=1)
    add_arguments(parser, repeats=5)  # --repeats: fits
    args = parser.parse_args()
    for key, value in WORKLOADS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning_fl").setLevel(logging.ERROR)
    before = machine()
    dm = make_data(args)
    results = {"settings": {k: v for k, v in vars(args).items() if k != "json"}}
    for kind in args.kinds:
        module = make_module(kind, args)
        with tempfile.TemporaryDirectory() as root:
            batches = client_batches(dm, args.clients)
            trainer_run(module, dm, 1, args.clients, root)  # warm-up: imports, caches, first-call costs
            floor = functools.partial(floor_run, module, batches)
            fits = [trainer_run(module, dm, args.rounds, args.clients, root, floor) for _ in range(args.repeats)]
        paired = {"trainer": [s for fit in fits for s in fit.rounds], "floor": [s for fit in fits for s in fit.floors]}
        summary = summarise(paired, per=args.clients)
        ratio = ratios(paired, "trainer", "floor")
        optimizer = summarise(alternate(optimizer_sides(module, 1000), args.repeats), per=1000)
        results[kind] = {"per_client_seconds": summary, "trainer_over_floor": ratio, "optimizer_seconds": optimizer}
        print(
            f"{kind}: trainer CPU per client {fmt(summary['trainer']['cpu'], ' ms', 1e3, 2)}; floor "
            f"{fmt(summary['floor']['cpu'], ' ms', 1e3, 2)}; ratio CPU {fmt(ratio['cpu'], 'x', 1, 2)}, wall "
            f"{fmt(ratio['wall'], 'x', 1, 2)}; optimiser build "
            f"{fmt(optimizer['optimizer_build']['cpu'], ' ms', 1e3, 3)}, reset "
            f"{fmt(optimizer['optimizer_reset']['cpu'], ' ms', 1e3, 4)} per client"
        )
    report("client_overhead", before, results, args.json)


if __name__ == "__main__":
    main()
