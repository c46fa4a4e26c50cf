"""A simulated round against pfl-research's, side by side: CPU seconds per round of the same federated workload.

The workload (issue 39's cross-device comparison): the plain CNN of benchmarks/client_overhead.py (two 3x3 conv
stages of 32 and 64 channels with biases, ReLU and 2x2 max-pool, a 128-feature linear layer, a linear head: 421,642
values) on 28x28 images, ``--population`` clients of ``--per-client`` images (Fashion-MNIST's training split from
the IDX files in /usr/share/datasets/fashion-mnist/, split IID by our data module; ``--data synthetic``: Synthetic
images of the same size), ``--clients`` clients per round, one local epoch of batch ``--batch`` (3 local steps),
FedAvg (server learning rate 1), one torch thread per side. Every side starts from the same initial weights
(seed 0), shipped to pfl as a state dict, and trains on the same clients' images (pfl gets each client's images as
our data module transforms them, written before any timing). The sides:

- **ours**: ``FederatedTrainer`` with full weights, Adam at ``--lr`` (everything a round does: sampling, the client
  runner, encoding, the gate, the fold, the ledger, the round checkpoint; no evaluation);
- **pfl**: pfl-research 0.6.0's simulation: ``PyTorchModel`` (local Adam at ``--lr``, central SGD at 1.0),
  ``FederatedAveraging``, ``SimulatedBackend``, ``FederatedDataset.from_slices`` with the ``minimize_reuse`` sampler,
  no evaluation after the first round (benchmarks/_pfl_side.py);
- **latent**: ``FederatedTrainer`` with FLITE's latent (d=64, r=32 over conv+linear, the run's default factor family
  ``stored``, FLITE's recipe: Adam 1e-2, weight decay 1e-4, clipping 1.0), clients one at a time;
- **lockstep**: the same latent with ``client_batching: lockstep`` (the round's clients step together, sharing the
  mapping's matrix products; cohorts of ``--clients``).

Each side is its own process (pfl's in a virtual environment with ``pfl[pytorch]==0.6.0``, made once under
``--venv`` and seeing our torch through a ``.pth`` file; our sides in this interpreter). Each runs one untimed
warm-up round, then waits; the sides then take turns one round at a time (the order rotated every round), each
reporting the CPU seconds (``time.process_time``) of its round from the end of its previous one, so a neighbour's
load falls on all sides alike. The report: CPU seconds per round (min and median over ``--rounds`` rounds) and per
round of the alternation the ratios ours / pfl, latent / ours and lockstep / ours (min and median). Goals (issue on
time, section 6): ours <= pfl; latent <= 1.3x ours.

    python benchmarks/pfl_comparison.py --rounds 8 --json docs/results/pfl_comparison.json \\
        --table docs/results/pfl_comparison.md
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from _harness import add_arguments, machine, report

HERE = Path(__file__).resolve().parent
PFL = "pfl[pytorch]==0.6.0"
SIDES = ("ours", "pfl", "latent", "lockstep")


def pfl_python(venv: Path) -> Path | None:
    """The Python of a virtual environment with pfl 0.6.0 and our torch, made under ``venv`` if it is not there
    (``None``, said in one line, if pfl cannot be installed)."""
    python = venv / "bin" / "python"
    check = "import pfl, torch; assert pfl.__version__ == '0.6.0', pfl.__version__; print(torch.__version__)"
    if python.exists() and subprocess.run([python, "-c", check], capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # our torch (and what it needs) without a second copy: appended to the new environment's path, after its own
    (Path(purelib) / "_lightning_fl_torch.pth").write_text(str(Path(torch.__file__).parents[1]) + "\n")
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", PFL], capture_output=True, text=True)
    if install.returncode != 0 or subprocess.run([python, "-c", check], capture_output=True).returncode != 0:
        print(f"[pfl_comparison] {PFL} could not be installed in {venv}: {install.stderr.strip()[-300:]}")
        return None
    return python


def settings_of(args: argparse.Namespace) -> dict:
    keys = ("data", "population", "per_client", "clients", "batch", "lr", "image_size")
    return {k: getattr(args, k) for k in keys}


def make_data(settings: dict):
    from lightning_fl.data import FashionMNIST, FederatedDataModule, Synthetic

    n = settings["population"] * settings["per_client"]
    if settings["data"] == "synthetic":
        source = Synthetic(image_size=settings["image_size"], channels=1, train_size=n, test_size=64)
    else:
        source = FashionMNIST()
    dm = FederatedDataModule(source, num_clients=settings["population"], batch_size=settings["batch"], seed=0)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def make_module(kind: str, settings: dict):
    """The full-weight classifier (seed 0) or FLITE's latent over the same initial backbone."""
    from client_overhead import make_module as module_of

    args = argparse.Namespace(backbone="plain", image_size=settings["image_size"])
    full = module_of("full", args)
    if kind == "ours":
        return full
    latent = module_of("latent", args)  # factors: the default, stored
    latent.backbone.load_state_dict(full.backbone.state_dict())
    return latent


def write_inputs(folder: Path, settings: dict) -> None:
    """The clients' transformed images and the initial weights, for pfl's side."""
    dm = make_data(settings)
    train = dm.source.load("train")
    transform = dm.source.transform(train=True, augment=False)
    clients = [torch.tensor(dm.client_indices(c)) for c in range(settings["population"])]
    used = torch.cat(clients).unique()
    x = torch.stack([transform(train.images[int(i)]) for i in used])
    y = torch.as_tensor(train.targets)[used]
    position = torch.full((int(used.max()) + 1,), -1, dtype=torch.long)
    position[used] = torch.arange(len(used))
    torch.save({"x": x, "y": y, "clients": [position[c] for c in clients], "settings": settings}, folder / "clients.pt")
    torch.save(make_module("ours", settings).state_dict(), folder / "init.pt")


def our_side(kind: str, rounds: int, settings: dict) -> None:
    """Our trainer with one side's module, alternating through stdin and stdout as _pfl_side.py does."""
    from lightning_fl.federated import FederatedTrainer
    from lightning_fl.federated.clients.transport import InProcess

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning_fl").setLevel(logging.ERROR)
    dm = make_data(settings)
    module = make_module(kind, settings)

    lines = protocol()

    class Alternate(InProcess):
        def finished_round(self, round: int, metrics: dict) -> None:
            elapsed = time.process_time() - self.mark if round > 1 else None
            print("ready" if elapsed is None else f"{elapsed!r}", file=lines, flush=True)
            if round <= rounds and sys.stdin.readline().strip() != "go":
                os._exit(1)  # the parent stopped
            self.mark = time.process_time()

    transport = Alternate(settings["clients"], "lockstep" if kind == "lockstep" else "sequential")
    with tempfile.TemporaryDirectory() as root:
        trainer = FederatedTrainer(
            rounds=rounds + 1,
            clients_per_round=settings["clients"],
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            limit_val_batches=0,
            check_identity=False,
            default_root_dir=root,
            name="pfl",
            seed=0,
            client_batching="lockstep" if kind == "lockstep" else "sequential",
            cohort_size=settings["clients"],
        )
        trainer.transport = transport
        trainer.fit(module, datamodule=dm)


def protocol():
    """The alternation's own channel (this process's stdout); whatever else writes to stdout goes to stderr."""
    lines = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return lines


def alternate(processes: dict[str, subprocess.Popen], rounds: int, logs: dict) -> dict[str, list[float]]:
    """Rounds taken in turns (the order rotated every round); each side's CPU seconds per round."""

    def log(name: str) -> str:
        logs[name].flush()
        logs[name].seek(0)
        return logs[name].read()[-2000:]

    for name, proc in processes.items():
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {name} side did not start: {log(name)}")
    seconds: dict[str, list[float]] = {name: [] for name in processes}
    names = list(processes)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            processes[name].stdin.write("go\n")
            processes[name].stdin.flush()
            line = processes[name].stdout.readline().strip()
            if not line:
                raise RuntimeError(f"the {name} side stopped: {log(name)}")
            seconds[name].append(float(line))
    return seconds


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "lightning_fl" / "pfl-venv")
    parser.add_argument("--data", choices=["fashion-mnist", "synthetic"], default="fashion-mnist")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per side (after one warm-up round)")
    parser.add_argument("--population", type=int, default=1000)
    parser.add_argument("--per-client", type=int, default=60)
    parser.add_argument("--clients", type=int, default=50, help="clients per round")
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.01, help="local Adam's learning rate (full weights)")
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--table", type=Path, help="also write the markdown table here")
    parser.add_argument("--worker", choices=["ours", "latent", "lockstep"], help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    add_arguments(parser, repeats=None)
    args = parser.parse_args()
    if args.worker:
        our_side(args.worker, args.rounds, json.loads(args.settings))  # (written by this script's parent)
        return
    torch.set_num_threads(1)  # (each side sets its own; this one only writes the inputs)
    settings = settings_of(args)
    sides = list(args.sides)
    python = pfl_python(args.venv) if "pfl" in sides else None
    if "pfl" in sides and python is None:
        sides.remove("pfl")
    before = machine()
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as folder:
        write_inputs(Path(folder), settings)
        ours = [sys.executable, __file__, "--rounds", str(args.rounds), "--settings", json.dumps(settings), "--worker"]
        commands = {
            side: [str(python), str(HERE / "_pfl_side.py"), folder, str(args.rounds)]
            if side == "pfl"
            else [*ours, side]
            for side in sides
        }
        logs = {side: open(Path(folder) / f"{side}.log", "w+") for side in commands}  # noqa: SIM115
        processes = {
            side: subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logs[side],
                text=True,
                env={**os.environ, **env},
            )
            for side, command in commands.items()
        }
        try:
            seconds = alternate(processes, args.rounds, logs)
        finally:
            for side, proc in processes.items():
                proc.stdin.close()
                proc.wait(timeout=600)
                logs[side].close()
    results = {"settings": settings, "sides": sides, "rounds": args.rounds, "cpu_seconds_per_round": seconds}
    results["summary"] = {side: spread(values) for side, values in seconds.items()}
    pairs = [("ours", "pfl"), ("latent", "ours"), ("lockstep", "ours"), ("latent", "pfl"), ("lockstep", "pfl")]
    results["ratios"] = {
        f"{a}/{b}": spread([x / y for x, y in zip(seconds[a], seconds[b], strict=True)])
        for a, b in pairs
        if a in seconds and b in seconds
    }
    results["torch"] = torch.__version__
    results["commit"] = commit()
    results["pfl"] = "0.6.0" if python is not None else None
    lines = table(results)
    print("\n".join(lines))
    if args.table:
        args.table.write_text("\n".join(lines) + "\n")
    report("pfl_comparison", before, results, args.json)


def commit() -> str | None:
    """The checkout's commit, with ``+changes`` when its tracked files differ from it (``None``: not a checkout)."""
    git = ["git", "-C", str(HERE)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return None
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", ":/"], capture_output=True).returncode != 0
    return head.stdout.strip() + ("+changes" if dirty else "")


def table(results: dict) -> list[str]:
    names = {
        "ours": "ours, full weights",
        "pfl": "pfl-research 0.6.0, full weights",
        "latent": "ours, FLITE latent (stored), one client at a time",
        "lockstep": "ours, FLITE latent (stored), client_batching lockstep",
    }
    lines = ["| side | CPU s per round, min / median |", "| --- | --: |"]
    for side, s in results["summary"].items():
        lines.append(f"| {names[side]} | {s['min']:.3f} / {s['median']:.3f} |")
    lines += ["", "| ratio, per round of the alternation | min / median |", "| --- | --: |"]
    for pair, s in results["ratios"].items():
        lines.append(f"| {pair} | {s['min']:.3f} / {s['median']:.3f} |")
    return lines


if __name__ == "__main__":
    main()
