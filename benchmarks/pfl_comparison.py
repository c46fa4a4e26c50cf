"""A simulated round against pfl-research's, side by side: CPU seconds per round of the same federated workload.

The workload (issue 39's cross-device comparison): a CNN on 28x28 images, ``--population`` clients of
``--per-client`` images (Fashion-MNIST's training split from the IDX files in /usr/share/datasets/fashion-mnist/,
split IID by our data module; ``--data synthetic``: Synthetic images of the same size), ``--clients`` clients per
round, one local epoch of batch ``--batch`` (3 local steps), FedAvg (server learning rate 1), one torch thread per
side. What each setting chooses (issue 77; the defaults are the published runs' workload):

- ``--model plain`` (default): the plain CNN of benchmarks/client_overhead.py (two 3x3 conv stages of 32 and 64
  channels with biases, ReLU and 2x2 max-pool, a 128-feature linear layer, a trainable linear head: 421,642 values);
  ``--model groupnorm``: the quickstart's SmallCNN at the same widths (convs without biases, each followed by
  GroupNorm of 8 groups, in-place ReLU, max-pool; the same linear layers: 421,738 values);
- ``--optimizer adam`` (default; lr 0.01) or ``sgd-momentum`` (``torch.optim.SGD``, lr 0.05, ``--momentum`` 0.9, no
  Nesterov), on both sides, both without weight decay; ``--lr`` sets the learning rate;
- ``--evaluate``: the server evaluates on ``--eval-images`` held-out images (Fashion-MNIST's test split; default all
  10,000) in batches of ``--eval-batch`` after every round, on both sides: ours through the trainer's validation
  (``limit_val_batches`` unset, ``val_every_n_rounds`` 1, the test split as ``val``), pfl through
  ``CentralEvaluationCallback`` with ``frequency=1`` (pfl's images transformed once beforehand, as its benchmarks
  make their central data set; ours through our data module's loader, as a run of ours does);
- ``--identity-check on`` (default, our trainer's default) or ``off``: ``check_identity`` (ours only; neither
  module here defines ``averaging_identity_error``, so it adds no stage: the setting is there to show it);
- ``--pfl-feed slices`` (default: ``FederatedDataset.from_slices`` of per-user numpy arrays) or ``dataset`` (pfl's
  documented path for PyTorch data: the images held as torch tensors made by pfl's ``to_tensor``, as pfl's PyTorch
  benchmarks hold theirs, and ``FederatedDataset(make_dataset_fn, user_sampler)`` whose ``make_dataset_fn`` gathers
  the sampled user's rows into a ``PyTorchTensorDataset``).

Both sides do the same work: the same initial weights (seed 0; pfl gets them as a state dict, loaded strictly into
the same network, benchmarks/_pfl_side.py), the same clients in every round (our trainer's cohorts, which pfl's user
sampler replays), the same batches in the same order (each client's images as our client's loader serves them in that
round, written before any timing), the same number of steps and the same optimiser. After the last round each side
writes its global weights, and the report gives the largest difference between ours and pfl's (float32 rounding:
the two sum in different orders). (The runs docs/results-systems.md publishes predate this: pfl drew its users with
the ``minimize_reuse`` sampler and read each user's images in a fixed order, and ours trained with Adam's weight decay
of 5e-4, pfl's without.) The sides:

- **ours**: ``FederatedTrainer`` with full weights (everything a round does: sampling, the client runner, encoding,
  the gate, the fold, the ledger, the round checkpoint, and with ``--evaluate`` the validation);
- **pfl**: pfl-research 0.6.0's simulation: ``PyTorchModel`` (the local optimiser above, central SGD at 1.0),
  ``FederatedAveraging``, ``SimulatedBackend``, fed as ``--pfl-feed`` says;
- **latent**: ``FederatedTrainer`` with FLITE's latent over the same initial backbone (d=64, r=32 over conv+linear,
  the run's default factor family ``stored``, FLITE's own recipe whatever ``--optimizer`` says: Adam 1e-2, weight
  decay 1e-4, clipping 1.0), clients one at a time;
- **lockstep**: the same latent with ``client_batching: lockstep`` (the round's clients step together, sharing the
  mapping's matrix products; cohorts of ``--clients``).

Each side is its own process (pfl's in a virtual environment with ``pfl[pytorch]==0.6.0``, made once under
``--venv`` and seeing our torch through a ``.pth`` file; our sides in this interpreter). Each runs one untimed
warm-up round, then waits; the sides then take turns one round at a time (the order rotated every round), each
reporting the CPU seconds (``time.process_time``) of its round from the end of its previous one, so a neighbour's
load falls on all sides alike. The report: CPU seconds per round (min and median over ``--rounds`` rounds) and per
round of the alternation the ratios ours / pfl, latent / ours and lockstep / ours (min and median). Goals (issue on
time, section 6): ours <= pfl; latent <= 1.3x ours. ``--sides`` picks the sides that run (all four by default: pfl's
is left out, said in one line, where pfl cannot be installed); ``--table`` writes the table, ``--json`` every round's
numbers, the machine and the commit.

``--grid`` runs the settings of ``GRID`` one after another (each its own processes and its own alternation of
``--rounds`` rounds; give at least 4), from the published workload to the one users run (SGD with momentum, GroupNorm,
evaluation every round, the identity check on, pfl fed as its documentation feeds it), one factor at a time, and
writes one table: a row per setting, with ours / pfl, latent / ours and lockstep / ours (min / median) and the
weights' difference; ``--json`` holds every round of every setting.

    python benchmarks/pfl_comparison.py --rounds 8 --grid --json docs/results/pfl_comparison_grid.json \\
        --table docs/results/pfl_comparison_grid.md
    python benchmarks/pfl_comparison.py --rounds 8 --json pfl.json --table pfl.md
    python benchmarks/pfl_comparison.py --optimizer sgd-momentum --model groupnorm --evaluate --pfl-feed dataset
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
#: Each optimiser's learning rate unless ``--lr`` says otherwise.
LEARNING_RATES = {"adam": 0.01, "sgd-momentum": 0.05}
#: What a setting chooses (the flags of the same names).
CHOICES = ("optimizer", "model", "evaluate", "identity_check", "pfl_feed")
#: ``--grid``: from the published runs' workload to the one users run, one factor at a time.
GRID = tuple(
    dict(zip(CHOICES, row, strict=True))
    for row in (
        ("adam", "plain", False, "off", "slices"),  # the published runs (their identity check: off)
        ("sgd-momentum", "plain", False, "off", "slices"),
        ("sgd-momentum", "groupnorm", False, "off", "slices"),
        ("sgd-momentum", "groupnorm", True, "off", "slices"),
        ("sgd-momentum", "groupnorm", True, "on", "slices"),  # the users' workload, pfl fed as the runs fed it
        ("sgd-momentum", "groupnorm", True, "on", "dataset"),  # ... and as pfl's documentation feeds it
    )
)


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


def data_settings(args: argparse.Namespace) -> dict:
    """What every setting shares: the data, the population, the round's shape, the evaluation's size."""
    keys = ("data", "population", "per_client", "clients", "batch", "image_size", "eval_images", "eval_batch")
    return {k: getattr(args, k) for k in keys}


def setting_of(choice: dict, args: argparse.Namespace, tag: str) -> dict:
    """One setting in full: ``choice`` (optimizer, model, evaluate, identity_check, pfl_feed), its learning rate and
    momentum, and ``tag`` (names its files)."""
    lr = args.lr if args.lr is not None else LEARNING_RATES[choice["optimizer"]]
    return {**choice, "lr": lr, "momentum": args.momentum, "tag": tag}


def make_data(settings: dict):
    from lightning_fl.data import FashionMNIST, FederatedDataModule, Synthetic

    n = settings["population"] * settings["per_client"]
    if settings["data"] == "synthetic":
        source = Synthetic(
            image_size=settings["image_size"], channels=1, train_size=n, test_size=settings["eval_images"]
        )
    else:
        source = FashionMNIST()
    dm = FederatedDataModule(
        source,
        num_clients=settings["population"],
        batch_size=settings["batch"],
        eval_batch_size=settings["eval_batch"],
        max_eval_samples=settings["eval_images"],
        seed=0,
    )
    dm.prepare_data()
    dm.setup("fit")
    return dm


def recipe_of(setting: dict):
    """Our recipe for ``setting``'s optimiser: the same optimiser pfl's side builds, no weight decay, no schedule."""
    from lightning_fl.methods import Recipe

    optimizer = "adam" if setting["optimizer"] == "adam" else "sgd"
    return Recipe(
        optimizer=optimizer,
        lr=setting["lr"],
        momentum=setting["momentum"],
        weight_decay=0.0,
        warmup_epochs=0,
        schedule="constant",
    )


def make_module(kind: str, settings: dict, setting: dict):
    """The full-weight classifier (seed 0) with ``setting``'s optimiser, or FLITE's latent (its own recipe) over the
    same initial backbone."""
    from client_overhead import make_module as module_of

    backbone = "plain" if setting["model"] == "plain" else "smallcnn"
    args = argparse.Namespace(backbone=backbone, image_size=settings["image_size"])
    full = module_of("full", args)
    full.use_recipe(recipe_of(setting))
    if kind == "ours":
        return full
    latent = module_of("latent", args)  # factors: the default, stored
    latent.backbone.load_state_dict(full.backbone.state_dict())
    return latent


def write_inputs(folder: Path, settings: dict, rounds: int, settings_list: list[dict]) -> None:
    """What pfl's side reads: the images of every client of every round (warm-up included) in the order our client's
    loader serves them in that round, the held-out images our validation serves, and each model's initial weights."""
    from lightning_fl.federated.clients.local import client_loader
    from lightning_fl.federated.server.strategies import FedAvg

    dm = make_data(settings)
    images, labels, bounds, cohorts, start = [], [], [], [], 0
    for r in range(rounds + 1):
        cohort = FedAvg().sample(r, settings["population"], settings["clients"], 0)  # the trainer's: seed 0
        cohorts.append(cohort)
        for client in cohort:
            batches = list(client_loader(dm, client, r, 0))  # (what run_client trains on: the same seeds)
            images += [x for x, _ in batches]
            labels += [y for _, y in batches]
            bounds.append((start, start + sum(len(y) for _, y in batches)))
            start = bounds[-1][1]
    inputs = {
        "x": torch.cat(images),
        "y": torch.cat(labels),
        "bounds": bounds,
        "cohorts": cohorts,
        "settings": settings,
    }
    if any(s["evaluate"] for s in settings_list):
        test, transform = dm.source.load("test"), dm.source.transform(train=False)
        held_out = dm.split_indices("test")
        inputs["eval_x"] = torch.stack([transform(test.images[int(i)]) for i in held_out])
        inputs["eval_y"] = torch.as_tensor(test.targets)[torch.as_tensor(held_out)]
    torch.save(inputs, folder / "clients.pt")
    first = {s["model"]: s for s in reversed(settings_list)}  # (the initial weights do not depend on the optimiser)
    for model, setting in first.items():
        torch.save(make_module("ours", settings, setting).state_dict(), folder / f"init_{model}.pt")


def our_side(kind: str, rounds: int, settings: dict, setting: dict, folder: Path) -> None:
    """Our trainer with one side's module, alternating through stdin and stdout as _pfl_side.py does; the full-weight
    side then writes its global weights to ``folder``."""
    from lightning_fl.federated import FederatedTrainer
    from lightning_fl.federated.clients.transport import InProcess

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning_fl").setLevel(logging.ERROR)
    dm = make_data(settings)
    module = make_module(kind, settings, setting)

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
            limit_val_batches=None if setting["evaluate"] else 0,
            val_every_n_rounds=1,
            check_identity=setting["identity_check"] == "on",
            default_root_dir=root,
            name="pfl",
            seed=0,
            client_batching="lockstep" if kind == "lockstep" else "sequential",
            cohort_size=settings["clients"],
        )
        trainer.transport = transport
        trainer.fit(module, datamodule=dm)
    if kind == "ours":
        torch.save(module.federated_state(), folder / f"final_{setting['tag']}_ours.pt")


def protocol():
    """The alternation's own channel (this process's stdout); whatever else writes to stdout goes to stderr."""
    lines = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return lines


def alternate(processes: dict[str, subprocess.Popen], rounds: int, logs: dict) -> dict[str, list[float]]:
    """Rounds taken in turns (the order rotated every round); each side's CPU seconds per round."""
    for name, proc in processes.items():
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {name} side did not start: {log_tail(logs[name])}")
    seconds: dict[str, list[float]] = {name: [] for name in processes}
    names = list(processes)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            processes[name].stdin.write("go\n")
            processes[name].stdin.flush()
            line = processes[name].stdout.readline().strip()
            if not line:
                raise RuntimeError(f"the {name} side stopped: {log_tail(logs[name])}")
            seconds[name].append(float(line))
    return seconds


def log_tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-2000:]


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run_setting(folder: Path, settings: dict, setting: dict, sides: list[str], python, rounds: int) -> dict:
    """One setting: every side in its own process, ``rounds`` rounds in turns after a warm-up each; their CPU
    seconds per round, the ratios per round of the alternation and how far ours and pfl's weights ended apart."""
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    ours = [sys.executable, __file__, "--rounds", str(rounds), "--settings", json.dumps(settings)]
    ours += ["--setting", json.dumps(setting), "--folder", str(folder), "--worker"]
    pfl = [str(python), str(HERE / "_pfl_side.py"), str(folder), str(rounds), json.dumps(setting)]
    commands = {side: pfl if side == "pfl" else [*ours, side] for side in sides}
    logs = {side: open(folder / f"{setting['tag']}_{side}.log", "w+") for side in commands}  # noqa: SIM115
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
        seconds = alternate(processes, rounds, logs)
    finally:
        for proc in processes.values():
            proc.stdin.close()
        for side, proc in processes.items():
            if proc.wait(timeout=600) != 0:
                print(f"[pfl_comparison] the {side} side ended with {proc.returncode}: {log_tail(logs[side])}")
            logs[side].close()
    results = {"setting": setting, "sides": sides, "rounds": rounds, "cpu_seconds_per_round": seconds}
    results["summary"] = {side: spread(values) for side, values in seconds.items()}
    pairs = [("ours", "pfl"), ("latent", "ours"), ("lockstep", "ours"), ("latent", "pfl"), ("lockstep", "pfl")]
    results["ratios"] = {
        f"{a}/{b}": spread([x / y for x, y in zip(seconds[a], seconds[b], strict=True)])
        for a, b in pairs
        if a in seconds and b in seconds
    }
    if "ours" in sides and "pfl" in sides:
        results["weights"] = agreement(folder, setting, rounds + 1)
    return results


def agreement(folder: Path, setting: dict, rounds: int) -> dict:
    """How far our global weights and pfl's are apart after ``rounds`` rounds: the largest absolute difference over
    every value, beside how far training moved ours from the initial weights and the largest weight (the two sides
    are the same network, trained on the same batches)."""
    ours = torch.load(folder / f"final_{setting['tag']}_ours.pt")
    pfl = torch.load(folder / f"final_{setting['tag']}_pfl.pt")
    start = torch.load(folder / f"init_{setting['model']}.pt")
    if ours.keys() != pfl.keys():
        raise RuntimeError(f"ours and pfl's weights differ in names: {sorted(ours.keys() ^ pfl.keys())}")
    return {
        "rounds": rounds,
        "max_abs_difference": max(float((ours[k] - pfl[k]).abs().max()) for k in ours),
        "max_abs_update": max(float((ours[k] - start[k]).abs().max()) for k in ours),
        "max_abs_weight": max(float(v.abs().max()) for v in ours.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "lightning_fl" / "pfl-venv")
    parser.add_argument("--data", choices=["fashion-mnist", "synthetic"], default="fashion-mnist")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per side (after one warm-up round)")
    parser.add_argument("--population", type=int, default=1000)
    parser.add_argument("--per-client", type=int, default=60)
    parser.add_argument("--clients", type=int, default=50, help="clients per round")
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--optimizer", choices=sorted(LEARNING_RATES), default="adam", help="the clients' optimiser")
    parser.add_argument("--lr", type=float, help="the clients' learning rate (default: Adam 0.01, SGD 0.05)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum (with --optimizer sgd-momentum)")
    parser.add_argument("--model", choices=["plain", "groupnorm"], default="plain")
    parser.add_argument("--evaluate", action="store_true", help="the server evaluates after every round")
    parser.add_argument("--eval-images", type=int, default=10000, help="held-out images evaluated (--evaluate)")
    parser.add_argument("--eval-batch", type=int, default=512, help="evaluation batch size (--evaluate)")
    parser.add_argument("--identity-check", choices=["on", "off"], default="on", help="our check_identity")
    parser.add_argument("--pfl-feed", choices=["slices", "dataset"], default="slices", help="how pfl gets its users")
    parser.add_argument("--grid", action="store_true", help="run every setting of GRID (the flags above aside)")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--table", type=Path, help="also write the markdown table here")
    parser.add_argument("--worker", choices=["ours", "latent", "lockstep"], help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    add_arguments(parser, repeats=None)
    args = parser.parse_args()
    if args.worker:  # (written by this script's parent)
        our_side(args.worker, args.rounds, json.loads(args.settings), json.loads(args.setting), args.folder)
        return
    if args.grid and args.lr is not None:
        parser.error("--lr sets one optimiser's learning rate: give it without --grid")
    torch.set_num_threads(1)  # (each side sets its own; this one only writes the inputs)
    settings = data_settings(args)
    if args.grid:
        settings_list = [setting_of(choice, args, f"s{i}") for i, choice in enumerate(GRID)]
    else:
        choice = {k: getattr(args, k) for k in CHOICES}
        settings_list = [setting_of(choice, args, "s0")]
    sides = list(args.sides)
    python = pfl_python(args.venv) if "pfl" in sides else None
    if "pfl" in sides and python is None:
        sides.remove("pfl")
    before = machine()
    with tempfile.TemporaryDirectory() as folder:
        write_inputs(Path(folder), settings, args.rounds, settings_list)
        runs = [run_setting(Path(folder), settings, s, sides, python, args.rounds) for s in settings_list]
    common = {"torch": torch.__version__, "commit": commit(), "pfl": "0.6.0" if python is not None else None}
    if args.grid:
        results = {"settings": settings, "sides": sides, "rounds": args.rounds, "grid": runs, **common}
        lines = grid_table(runs)
    else:
        results = {"settings": settings, **runs[0], **common}
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
    """One setting: CPU seconds per round by side, the ratios, and how far ours and pfl's weights ended apart."""
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
    if "weights" in results:
        lines += ["", weights_line(results["weights"])]
    return lines


def weights_line(weights: dict) -> str:
    return (
        f"Global weights after {weights['rounds']} rounds, ours against pfl's: largest difference "
        f"{weights['max_abs_difference']:.2e} (largest change from the initial weights "
        f"{weights['max_abs_update']:.3f}, largest weight {weights['max_abs_weight']:.3f})."
    )


def grid_table(runs: list[dict]) -> list[str]:
    """Every setting in one table: what it chose, each side's CPU seconds per round and the ratios (min / median)."""
    pairs = [("ours", "pfl"), ("latent", "ours"), ("lockstep", "ours")]
    sides = [side for side in SIDES if side in runs[0]["summary"]]
    header = ["optimizer", "model", "evaluate", "identity check", "pfl feed"]
    header += [f"{side} CPU s" for side in sides]
    header += [f"**{a} / {b}**" for a, b in pairs if f"{a}/{b}" in runs[0]["ratios"]]
    header += ["weights apart"] if "weights" in runs[0] else []
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(["---"] * 5 + ["--:"] * (len(header) - 5)) + " |"]
    for run in runs:
        s = run["setting"]
        cells = [
            s["optimizer"],
            s["model"],
            "every round" if s["evaluate"] else "no",
            s["identity_check"],
            s["pfl_feed"],
        ]
        cells += [f"{run['summary'][side]['min']:.3f} / {run['summary'][side]['median']:.3f}" for side in sides]
        for a, b in pairs:
            if (r := run["ratios"].get(f"{a}/{b}")) is not None:
                cells.append(f"{r['min']:.3f} / **{r['median']:.3f}**")
        if "weights" in run:
            cells.append(f"{run['weights']['max_abs_difference']:.1e}")
        lines.append("| " + " | ".join(cells) + " |")
    rounds = runs[0]["rounds"]
    lines += [
        "",
        f"CPU seconds per round and ratios per round of the alternation: min / median over {rounds} rounds. "
        f"Weights apart: the largest absolute difference between ours and pfl's global weights after "
        f"{rounds + 1} rounds.",
    ]
    return lines


if __name__ == "__main__":
    main()
