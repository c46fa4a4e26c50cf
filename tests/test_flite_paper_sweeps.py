"""FLITE's paper-scale sweeps run end to end on fake files: tools/sweeps/flite_cifar100.yaml (Tables 1, 2, 3, 5,
sections 5.5-5.7), tools/sweeps/flite_cifar10.yaml (Table 2's CIFAR-10 column, Figs. 2 right, 3 and 4) and
tools/sweeps/flite_tinyimagenet.yaml (Table 4).

Neither CIFAR nor TinyImageNet can be had here, so every run of each sweep (one seed) runs on fake files in the real
on-disk layout, with the ResNet four channels wide, one round, one local epoch and one epoch of base pretraining;
the configs, the sweeps' arguments, the sweep tool's commands and CSV, and the report specs are the shipped ones.
A run's own ``--trainer.rounds`` (Fig. 4's 150 and 1) would override the test's, so it is checked and then dropped.
The bytes each client uploads are checked exactly against the tiny models' parameter counts and the codecs' layouts.
"""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import CONFIGS, REPO, fake_cifar, run_cli, sweep_tool

SWEEPS = REPO / "tools" / "sweeps"
WIDTH = 4  # the tiny ResNets' first stage (features: 8 x WIDTH)
SHRINK = [
    "--trainer.rounds",
    "1",
    "--trainer.local_epochs",
    "1",
    "--trainer.accelerator",
    "cpu",
    "--model.pretraining.epochs",
    "1",
    "--model.pretraining.accelerator",
    "cpu",
    "--model.backbone.init_args.width",
    str(WIDTH),
    "--model.backbone.init_args.norm_groups",
    "2",
    "--data.batch_size",
    "64",
    "--data.num_workers",
    "0",
]


# ------------------------------------------------------------------------------ fake data sets in the real layout
def cifar100_files(data: Path) -> None:
    fake_cifar(data / "cifar-100-python", ["train"], b"fine_labels", n=1600, classes=100)
    fake_cifar(data / "test_batches", ["test"], b"fine_labels", n=200, classes=100)
    (data / "test_batches" / "test").rename(data / "cifar-100-python" / "test")


def cifar10_files(data: Path) -> None:
    fake_cifar(data / "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], b"labels", n=160)
    fake_cifar(data / "test_batches", ["test_batch"], b"labels", n=200)
    (data / "test_batches" / "test_batch").rename(data / "cifar-10-batches-py" / "test_batch")


def fake_tinyimagenet(root: Path, classes: int = 200, train_per_class: int = 4, val_per_class: int = 1) -> None:
    """``root/tiny-imagenet-200`` in the real layout (as in test_data.py): ``wnids.txt``,
    ``train/<wnid>/images/*.JPEG`` and ``val/images`` with ``val/val_annotations.txt``; 64x64 flat-colour JPEGs."""
    from PIL import Image

    folder = root / "tiny-imagenet-200"
    wnids = [f"n{k:08d}" for k in range(classes)]
    (folder / "val" / "images").mkdir(parents=True)
    (folder / "wnids.txt").write_text("\n".join(wnids))
    lines = []
    for k, w in enumerate(wnids):
        images = folder / "train" / w / "images"
        images.mkdir(parents=True)
        for i in range(train_per_class):
            Image.new("RGB", (64, 64), (k % 256, 32 * i % 256, 0)).save(images / f"{w}_{i}.JPEG")
        for i in range(val_per_class):
            name = f"val_{k * val_per_class + i}.JPEG"
            Image.new("RGB", (64, 64), (k % 256, 0, 32 * i % 256)).save(folder / "val" / "images" / name)
            lines.append(f"{name}\t{w}\t0\t0\t63\t63")
    (folder / "val" / "val_annotations.txt").write_text("\n".join(lines))


# ------------------------------------------------------------------------------ exact bytes of the tiny models
def backbone_weights(name: str, stem: str) -> dict:
    """The trainable backbone weights of the tiny ResNet the test runs (what full-weight FedAvg sends)."""
    from lightning_fl import models

    net = getattr(models, name)(in_channels=3, stem=stem, norm_groups=2, width=WIDTH)
    return {n: p.detach() for n, p in net.named_parameters()}


def numel(state: dict) -> int:
    return sum(t.numel() for t in state.values())


def layout_bytes(codec, state: dict) -> int:
    """Bytes of what ``codec`` sends for a state laid out like ``state`` (its declared wire parts)."""
    import torch

    return sum(
        math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        for layout in codec.layout(state).values()
        for dtype, shape in layout.parts.values()
    )


def check_cifar100(up: dict, cum: dict) -> None:
    assert up["latent"] == 20 * 64 * 4 and up["latent_int4"] == 648 and up["latent_d1024"] == 20 * 1024 * 4
    # the ladder: the update and the weights cost the same bytes; the textbook head travels too
    assert up["fedavg_int4_update"] == up["fedavg_int4_weights"] < up["fedavg_textbook_int4_update"]
    assert up["fedavg_int8_update"] > up["fedavg_int4_update"] and up["fedavg"] > up["fedavg_int8_update"]
    assert up["fedavg"] == 4 * numel(backbone_weights("ResNet18", "cifar"))


def check_cifar10(up: dict, cum: dict) -> None:
    from lightning_fl.compress import PowerSGD

    weights = backbone_weights("ResNet18", "cifar")
    n, head = numel(weights), 8 * WIDTH * 10 + 10
    latent = [label for label in up if label.startswith("latent")]
    fedavg = ["fedavg", "fedavg_dir0.5", "fedavg_dir0.1", "fedavg_dir0.5_R1"]
    assert len(latent) == 4 and all(up[label] == 20 * 64 * 4 for label in latent)  # 1,280 floats, whatever the width
    assert all(up[label] == 4 * n for label in fedavg)  # the backbone, not the frozen head
    assert up["fedavg_textbook"] == up["fedavg_textbook_dir0.1"] == 4 * (n + head)  # and the trainable head
    for rank in (2, 8):
        assert up[f"powersgd_r{rank}"] == layout_bytes(PowerSGD(rank=rank), weights)
    for label, density in (("topk_1pct", 0.01), ("topk_10pct", 0.1)):
        assert up[label] == 8 * math.ceil(density * n)  # a float32 value and an int32 index each
    assert up["latent"] < up["powersgd_r2"] < up["powersgd_r8"] < up["fedavg"]
    assert up["topk_1pct"] < up["topk_10pct"] < up["fedavg"] < up["fedavg_textbook"]
    # one round, both directions: the state comes down whole (the compressors compress only the upload)
    assert cum["latent_dir0.5_R150"] == 2 * up["latent"] and cum["fedavg_dir0.5_R1"] == 2 * up["fedavg"]
    assert cum["powersgd_r2"] == up["powersgd_r2"] + 4 * n and cum["topk_1pct"] == up["topk_1pct"] + 4 * n


def check_tinyimagenet(up: dict, cum: dict) -> None:
    n = numel(backbone_weights("ResNet34", "tinyimagenet"))
    assert up["latent"] == up["latent_dir0.5"] == 36 * 1024 * 4 == 147_456  # the paper's 144 KB, whatever the width
    assert up["fedavg"] == up["fedavg_dir0.5"] == 4 * n
    assert cum["latent"] == 2 * up["latent"] and cum["fedavg"] == 2 * up["fedavg"]


CASES = {  # sweep: (data files, runs in the sweep, pretrained bases per seed, byte checks)
    "flite_cifar100": (cifar100_files, 41, 5, check_cifar100),
    "flite_cifar10": (cifar10_files, 14, 2, check_cifar10),
    "flite_tinyimagenet": (fake_tinyimagenet, 4, 1, check_tinyimagenet),
}


def without_rounds(args: list) -> list:
    """``args`` less any ``--trainer.rounds N`` (a run's own comes after ``common`` and would override it)."""
    out, skip = [], False
    for a in args:
        if skip or a == "--trainer.rounds":
            skip = not skip
            continue
        out.append(a)
    return out


# CIFAR-100's sweep (41 runs, 5 bases) is the default suite's longest test (160-600 s on 2 cores): it runs with
# ``-m slow``; CIFAR-10's and TinyImageNet's take the same path (sweep, configs, CSV, report) in the default suite.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "flite_cifar100" else n for n in sorted(CASES)]
)
def test_every_run_of_the_paper_sweep_runs_and_reports_on_fake_files(name, tmp_path, monkeypatch):
    make_data, count, bases, check = CASES[name]
    data = tmp_path / "data"
    make_data(data)
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(REPO)  # the sweep names its configs relative to the repository

    sweep = sweep_tool()
    spec = yaml.safe_load((SWEEPS / f"{name}.yaml").read_text())
    spec["seeds"], spec["common"] = [0], [*SHRINK, "--data.source.init_args.root", str(data)]
    out = tmp_path / "out"
    full = {r["label"]: r for r in sweep.expand(spec)}
    if "latent_dir0.5_R150" in full:  # Fig. 4's budget: the run's own rounds override the config's and common's
        assert sweep.target_rounds(spec, out, full["latent_dir0.5_R150"]) == 150
        assert sweep.target_rounds(spec, out, full["fedavg_dir0.5_R1"]) == 1
    for entry in spec["runs"]:  # shrink those too: every run does one round here
        entry["args"] = without_rounds(entry.get("args", []))
    runs = sweep.expand(spec)
    assert len(runs) == count  # the header's count
    for run in runs:
        assert run_cli(*sweep.command(spec, out, run)[3:]) == 0, run["id"]
    table = sweep.collect(spec, out, runs)
    with table.open() as f:
        final = {r["label"]: r for r in csv.DictReader(f) if r["final"] == "1"}
    assert set(final) == {r["label"] for r in runs}
    up = {label: float(r["comm/client_up_bytes"]) for label, r in final.items()}
    cum = {label: float(r["comm/cum_client_bytes"]) for label, r in final.items()}
    check(up, cum)
    assert all(float(final[label]["fed/identity_error"]) <= 1e-6 for label in final if label.startswith("latent"))
    # the matched FedAvg runs read the latent's cached base: one base per head (and seed), and per other recipe
    assert len(list((tmp_path / "cache" / "bases").iterdir())) == bases

    report = yaml.safe_load((SWEEPS / f"{name}_report.yaml").read_text())
    report.update(csv=str(table), figures_dir=str(tmp_path / "figures"), tensorboard=str(tmp_path / "tb"))
    (tmp_path / "report.yaml").write_text(yaml.safe_dump(report))
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "report.py"),
            str(tmp_path / "report.yaml"),
            "--markdown",
            str(tmp_path / "tables.md"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "tables.md").read_text()
    for table_spec in report["tables"]:
        assert table_spec["title"] in text
        assert all(f"| {label} | 1 |" in text for label in table_spec["labels"])
    figure_labels = {label for f in report["figures"] for label in f.get("labels", [])}
    assert figure_labels <= set(final)  # every figure draws runs the sweep has
    assert {p.name for p in (tmp_path / "figures").iterdir()} == {f"{f['name']}.png" for f in report["figures"]}


@pytest.mark.parametrize(
    ("config", "stated"),
    [
        ("fedavg_cifar10.yaml", ["11,168,832", "44,675,328"]),
        ("fedavg_textbook_cifar10.yaml", ["11,173,962", "44,695,848"]),
        ("fedavg_tinyimagenet.yaml", ["21,276,992", "85,107,968"]),
        ("fedavg_cifar100.yaml", ["11,168,832", "44,675,328"]),
        ("fedavg_textbook_cifar100.yaml", ["11,220,132", "44,880,528"]),
    ],
)
def test_the_bytes_in_the_headers_are_the_real_models(config, stated):
    """What a header says a client sends per round is what the config's real model sends (float32)."""
    from lightning_fl.cli import build_parser

    parser = build_parser()
    cfg = parser.parse_args(["fit", "--config", str(CONFIGS / config)])
    model = (parser.instantiate(cfg) if hasattr(parser, "instantiate") else parser.instantiate_classes(cfg)).fit.model
    weights = numel(model.federated_state())
    assert [f"{weights:,}", f"{4 * weights:,}"] == stated
    assert all(number in header(CONFIGS / config) for number in stated)
    for sweep in ("flite_cifar10", "flite_tinyimagenet"):  # and the sweeps' headers say the same
        if f"configs/{config}" in (SWEEPS / f"{sweep}.yaml").read_text():
            assert f"{weights:,} weights = {4 * weights:,} B" in header(SWEEPS / f"{sweep}.yaml")


def header(path: Path) -> str:
    """A YAML file's leading comment as one line."""
    return " ".join(line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#"))
