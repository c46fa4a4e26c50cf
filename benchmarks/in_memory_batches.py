"""What InMemoryBatches buys: clients' batches sliced from the in-memory split against the DataLoader it replaces.

:class:`~lightning_fl.data.datamodule.InMemoryBatches` (what ``FederatedDataModule.client_dataloader`` serves for a
split held in memory, without loader workers, with a seed) yields what ``DataLoader(TransformedSubset(images,
indices, transform), batch_size, shuffle=True, generator=generator)`` yields, value for value, without the loader's
Python call per sample. Three workloads (``--workload``; an option given wins):

- ``fashion_mnist`` (the default): ``configs/flite_fashion_mnist.yaml``'s data: Fashion-MNIST's 60,000 28x28 grey
  images (synthetic ones of that size with ``--data synthetic`` or when the files are not installed), a 10 %
  public split, 8 IID clients of 6,750 images, batch 64; one client timed per repeat.
- ``quickstart``: ``benchmarks/client_overhead.py``'s: Synthetic 8x8 images, 200 clients of 64, batch 32 (2 steps
  per client); 100 clients timed per repeat.
- ``cross_device``: ``client_overhead.py --workload cross-device``'s data: Synthetic 28x28 images, 1,000 clients of
  60, batch 20 (3 steps); 50 clients timed per repeat (on the SmallCNN below, not issue 39's plain CNN).

The network is SmallCNN (3x3 convolutions of 32 and 64 channels with GroupNorm, a 128-feature linear layer) on the
workload's image size, as FLITE's latent (``latent``: d=64, r=32 over conv+linear of a random base, the configs'
recipe) or trained whole (``full``: Adam at 0.01). Three comparisons, each alternating the two sides
(``in_memory``, ``data_loader``) ``--repeats`` times, CPU and wall time per client (min and median) and the
per-repeat ratio data_loader / in_memory:

- **batches**: each timed client's loader built and its ``--epochs`` epochs of batches iterated, nothing else;
- **client epoch**: each timed client's batches through the module's ``training_step``, backward, the recipe's
  gradient clipping and the optimiser step, from the starting state with a new optimiser (as a client does);
- **federated round** (``--round``): ``FederatedTrainer`` rounds of the timed clients, one local epoch, no
  evaluation, with the data module as it is and with one whose client loader is the DataLoader; each fit runs 2
  rounds and the second is timed (from the end of round 1 to the end of round 2). Both sides end at the same global
  state, bit for bit (checked).

Before any timing, both sides' batches of the first timed client are compared value for value over ``--epochs``
epochs (checked).

    python benchmarks/in_memory_batches.py                           # Fashion-MNIST, one client of 6,750 images
    python benchmarks/in_memory_batches.py --workload quickstart --round
    python benchmarks/in_memory_batches.py --workload cross_device --round --json in_memory_batches.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import tempfile
import time
import warnings

import torch
from _harness import Sample, add_arguments, alternate, cpu_seconds, fmt, machine, ratios, report, summarise
from torch.utils.data import DataLoader

from lightning_fl.data import FashionMNIST, FederatedDataModule, Synthetic
from lightning_fl.data.datamodule import InMemoryBatches, TransformedSubset
from lightning_fl.errors import DatasetNotFoundError
from lightning_fl.federated import FederatedTrainer
from lightning_fl.federated.clients.transport import InProcess
from lightning_fl.methods import Classifier, LatentClassifier, Recipe
from lightning_fl.models import SmallCNN

WORKLOADS = {
    "fashion_mnist": {
        "data": "fashion_mnist",
        "image_size": 28,
        "population": 8,
        "per_client": 6750,
        "batch": 64,
        "clients": 1,
        "kinds": ["latent", "full"],
    },
    "quickstart": {
        "data": "synthetic",
        "image_size": 8,
        "population": 200,
        "per_client": 64,
        "batch": 32,
        "clients": 100,
        "kinds": ["latent", "full"],
    },
    "cross_device": {
        "data": "synthetic",
        "image_size": 28,
        "population": 1000,
        "per_client": 60,
        "batch": 20,
        "clients": 50,
        "kinds": ["full"],
    },
}
SEED = 7  # the clients' shuffling seed in the batches and client-epoch comparisons


class DataLoaderClients(FederatedDataModule):
    """The data module with every client's batches from ``DataLoader(TransformedSubset(...), shuffle=True,
    generator=...)``: what ``client_dataloader`` served before InMemoryBatches."""

    def client_dataloader(self, cid: int, seed: int | None = None):
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        if self._client_transform is None:
            self._client_transform = self.source.transform(train=True, augment=self.augment)
        subset = TransformedSubset(self._train, self.client_indices(cid), self._client_transform)
        return DataLoader(subset, batch_size=self.batch_size, shuffle=True, generator=generator)


def make_data(args: argparse.Namespace, cls: type[FederatedDataModule] = FederatedDataModule) -> FederatedDataModule:
    """Fashion-MNIST's split (10 % public, the clients IID) or ``population x per_client`` synthetic images."""
    if args.workload == "fashion_mnist":
        if args.data == "fashion_mnist":
            source = FashionMNIST(download=False)  # the installed files, or the synthetic fallback
        else:
            source = Synthetic(image_size=28, channels=1, train_size=60_000, test_size=64)
        split = {"public_fraction": 0.1, "train_split": "public"}
    else:
        n = args.population * args.per_client
        source = Synthetic(image_size=args.image_size, channels=1, train_size=n, test_size=64)
        split = {}
    dm = cls(source, num_clients=args.population, batch_size=args.batch, seed=0, **split)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def loaders(dm: FederatedDataModule) -> dict:
    """Builders of the two loaders of a client (seed ``SEED``)."""

    def in_memory(client: int):
        loader = dm.client_dataloader(client, seed=SEED)
        assert isinstance(loader, InMemoryBatches), type(loader)
        return loader

    def data_loader(client: int):
        transform = dm.source.transform(train=True, augment=dm.augment)
        subset = TransformedSubset(dm._train, dm.client_indices(client), transform)
        return DataLoader(subset, batch_size=dm.batch_size, shuffle=True, generator=torch.Generator().manual_seed(SEED))

    return {"in_memory": in_memory, "data_loader": data_loader}


def batches(make, clients: int, epochs: int) -> list:
    torch.manual_seed(0)  # the transform's draws (none without augmentation) come from the global generator
    out = []
    for client in range(clients):
        loader = make(client)
        out += [batch for _ in range(epochs) for batch in loader]
    return out


def make_module(kind: str, image_size: int) -> Classifier:
    """FLITE's latent (``latent``) or the SmallCNN trained whole (``full``), from seed 0."""
    torch.manual_seed(0)
    backbone = SmallCNN(in_channels=1, image_size=image_size, channels=[32, 64], feature_dim=128, norm_groups=8)
    if kind == "latent":
        return LatentClassifier(backbone, 10, base="scratch", latent_dim=64, rank=32, layers="conv+linear")
    return Classifier(
        backbone, 10, head="trainable", recipe=Recipe(optimizer="adam", lr=0.01, warmup_epochs=0, schedule="constant")
    )


def client_epochs(module: Classifier, make, clients: int, epochs: int) -> None:
    """Each client's ``epochs`` local epochs: the starting state, a new optimiser, every batch through a step."""
    start = module.federated_state()
    clip = module.recipe.grad_clip
    module.train()
    torch.manual_seed(0)
    for client in range(clients):
        module.load_federated_state(start)
        optimizer = module.configure_optimizers()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        loader = make(client)
        for _ in range(epochs):
            for batch_idx, batch in enumerate(loader):
                loss = module.training_step(batch, batch_idx)
                loss.backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(params, clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        module.federated_state()
    module.load_federated_state(start)


class TimeRoundTwo(InProcess):
    """The in-process transport, timing the second round (from the end of round 1 to the end of round 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.mark: tuple[float, float] | None = None
        self.sample: Sample | None = None

    def finished_round(self, round: int, metrics: dict[str, float]) -> None:
        wall, cpu = time.perf_counter(), cpu_seconds()
        if self.mark is not None:
            self.sample = Sample(wall - self.mark[0], cpu - self.mark[1])
        self.mark = wall, cpu


def federated_round(module: Classifier, dm: FederatedDataModule, args: argparse.Namespace, root: str, out: list):
    """A 2-round fit of ``module`` (left as it was) on ``dm``; its second round's time."""
    start = module.federated_state()
    trainer = FederatedTrainer(
        rounds=2,
        clients_per_round=args.clients,
        local_epochs=args.epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        check_identity=False,
        default_root_dir=root,
        name="bench",
        seed=0,
    )
    trainer.transport = timed = TimeRoundTwo()
    with contextlib.redirect_stdout(io.StringIO()):  # the run's end-of-run summary
        trainer.fit(module, datamodule=dm)
    out.append({k: v.clone() for k, v in trainer.global_state.items()})
    module.load_federated_state(start)
    return timed.sample


def row(name: str, samples: dict[str, list[Sample]], per: int) -> tuple[str, dict]:
    """A table row (ms per client) and the numbers behind it."""
    summary, ratio = summarise(samples, per=per), ratios(samples, "data_loader", "in_memory")
    line = (
        f"| {name} | {fmt(summary['in_memory']['cpu'], ' ms', 1e3, 2)} | "
        f"{fmt(summary['data_loader']['cpu'], ' ms', 1e3, 2)} | {fmt(ratio['cpu'], 'x', 1, 2)} | "
        f"{fmt(ratio['wall'], 'x', 1, 2)} |"
    )
    return line, {"seconds_per_client": summary, "ratio": ratio, "raw": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="fashion_mnist", choices=sorted(WORKLOADS), help="the defaults below")
    parser.add_argument("--data", choices=["fashion_mnist", "synthetic"], help="fashion_mnist's images")
    parser.add_argument("--image-size", type=int, help="synthetic workloads' image height and width")
    parser.add_argument("--population", type=int, help="clients in all")
    parser.add_argument("--per-client", type=int, help="synthetic workloads' images per client")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--clients", type=int, help="clients timed per repeat (and per federated round)")
    parser.add_argument("--kinds", nargs="*", choices=["latent", "full"], help="modules trained (none: batches only)")
    parser.add_argument("--epochs", type=int, default=1, help="local epochs per client (default 1)")
    parser.add_argument("--round", action="store_true", help="also time federated rounds")
    parser.add_argument("--threads", type=int, default=1)
    add_arguments(parser, repeats=5)
    args = parser.parse_args()
    for key, value in WORKLOADS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning_fl").setLevel(logging.ERROR)
    before = machine()
    try:
        dm = make_data(args)
    except DatasetNotFoundError as exc:
        print(f"Fashion-MNIST is not installed ({str(exc).splitlines()[0]}): synthetic 28x28 images instead")
        args.data = "synthetic"
        dm = make_data(args)
    args.image_size = dm.source.input_shape[-1]
    build = loaders(dm)
    got, want = (batches(build[name], 1, args.epochs) for name in ("in_memory", "data_loader"))
    if len(got) != len(want) or not all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want, strict=True)
    ):
        raise SystemExit("InMemoryBatches and the DataLoader yielded different batches")
    sizes = [dm.client_num_samples(c) for c in range(args.clients)]
    print(
        f"{args.workload} ({args.data} {args.image_size}x{args.image_size}): {args.clients} client(s) of "
        f"{min(sizes):,}-{max(sizes):,} images timed per repeat, batch {args.batch}, {args.epochs} epoch(s); both "
        f"sides' batches identical; torch threads {args.threads}; {args.repeats} alternated repeats; per client"
    )
    print("| what | in_memory CPU | data_loader CPU | ratio CPU (data_loader / in_memory) | ratio wall |")
    print("| --- | --- | --- | --- | --- |")
    results: dict = {"settings": {k: v for k, v in vars(args).items() if k != "json"}, "client_samples": sizes}
    sides = {name: (lambda make=make: batches(make, args.clients, args.epochs)) for name, make in build.items()}
    line, results["batches"] = row("batches", alternate(sides, args.repeats), args.clients)
    print(line)
    loader_dm = make_data(args, DataLoaderClients) if args.round else None
    for kind in args.kinds:
        module = make_module(kind, args.image_size)
        client_epochs(module, build["in_memory"], 1, 1)  # warm-up: first-call costs
        sides = {
            name: (lambda make=make, module=module: client_epochs(module, make, args.clients, args.epochs))
            for name, make in build.items()
        }
        line, results[f"client_epoch_{kind}"] = row(
            f"client epoch, {kind}", alternate(sides, args.repeats), args.clients
        )
        print(line)
        if loader_dm is None:
            continue
        finals: dict[str, list] = {"in_memory": [], "data_loader": []}
        data = {"in_memory": dm, "data_loader": loader_dm}
        rounds: dict[str, list[Sample]] = {name: [] for name in data}
        with tempfile.TemporaryDirectory() as root:
            federated_round(module, dm, args, root, [])  # warm-up
            for _ in range(args.repeats):
                for name, datamodule in data.items():
                    rounds[name].append(federated_round(module, datamodule, args, root, finals[name]))
        pairs = zip(finals["in_memory"], finals["data_loader"], strict=True)
        if not all(torch.equal(a[k], b[k]) for a, b in pairs for k in a):
            raise SystemExit("the federated rounds with InMemoryBatches and with the DataLoader ended apart")
        line, results[f"round_{kind}"] = row(f"federated round, {kind}", rounds, args.clients)
        print(line)
    report("in_memory_batches", before, results, args.json)


if __name__ == "__main__":
    main()
