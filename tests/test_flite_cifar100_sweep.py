"""tools/sweeps/flite_cifar100.yaml (FLITE's CIFAR-100 tables at the paper's scale) runs end to end on fake files.

CIFAR-100 cannot be had here, so every run of the sweep (one seed) runs on fake CIFAR-100 python batches in the
real on-disk layout, with a ResNet-18 four channels wide, one round and one epoch of base pretraining; the
configs, the sweep's arguments, the sweep tool's commands and CSV, and the report spec are the shipped ones.
"""

from __future__ import annotations

import csv
import subprocess
import sys

import yaml

from conftest import REPO, fake_cifar, run_cli, sweep_tool

SWEEP = REPO / "tools" / "sweeps" / "flite_cifar100.yaml"
REPORT = REPO / "tools" / "sweeps" / "flite_cifar100_report.yaml"
SHRINK = [
    "--trainer.rounds", "1", "--trainer.accelerator", "cpu", "--model.pretraining.epochs", "1",
    "--model.pretraining.accelerator", "cpu", "--model.backbone.init_args.width", "4",
    "--model.backbone.init_args.norm_groups", "2", "--data.batch_size", "64", "--data.num_workers", "0",
]  # fmt: skip


def test_every_run_of_the_cifar100_sweep_runs_and_reports_on_fake_files(tmp_path, monkeypatch):
    data = tmp_path / "data"
    fake_cifar(data / "cifar-100-python", ["train"], b"fine_labels", n=1600, classes=100)
    fake_cifar(tmp_path / "test_batches", ["test"], b"fine_labels", n=200, classes=100)
    (tmp_path / "test_batches" / "test").rename(data / "cifar-100-python" / "test")
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(REPO)  # the sweep names its configs relative to the repository

    sweep = sweep_tool()
    spec = yaml.safe_load(SWEEP.read_text())
    spec["seeds"], spec["common"] = [0], [*SHRINK, "--data.source.init_args.root", str(data)]
    out = tmp_path / "out"
    runs = sweep.expand(spec)
    assert len(runs) == 35  # the header's count
    for run in runs:
        assert run_cli(*sweep.command(spec, out, run)[3:]) == 0, run["id"]
    table = sweep.collect(spec, out, runs)
    with table.open() as f:
        final = {r["label"]: r for r in csv.DictReader(f) if r["final"] == "1"}
    assert set(final) == {r["label"] for r in runs}
    up = {label: float(r["comm/client_up_bytes"]) for label, r in final.items()}
    assert up["latent"] == 20 * 64 * 4 and up["latent_int4"] == 648 and up["latent_d1024"] == 20 * 1024 * 4
    # the ladder: the update and the weights cost the same bytes; the textbook head travels too
    assert up["fedavg_int4_update"] == up["fedavg_int4_weights"] < up["fedavg_textbook_int4_update"]
    assert up["fedavg_int8_update"] > up["fedavg_int4_update"] and up["fedavg"] > up["fedavg_int8_update"]
    assert all(float(final[label]["fed/identity_error"]) <= 1e-6 for label in final if label.startswith("latent"))

    report = yaml.safe_load(REPORT.read_text())
    report.update(csv=str(table), figures_dir=str(tmp_path / "figures"), tensorboard=str(tmp_path / "tb"))
    (tmp_path / "report.yaml").write_text(yaml.safe_dump(report))
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "report.py"), str(tmp_path / "report.yaml"), "--markdown",
         str(tmp_path / "tables.md")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "tables.md").read_text()
    for table_spec in report["tables"]:
        assert table_spec["title"] in text
        assert all(f"| {label} | 1 |" in text for label in table_spec["labels"])
    assert {p.name for p in (tmp_path / "figures").iterdir()} == {f"{f['name']}.png" for f in report["figures"]}
