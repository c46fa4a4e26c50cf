"""Two-round CPU runs of every baseline config through the CLI, shrunk by overrides."""

import pytest
import torch

from conftest import CONFIGS, run_cli

SHRINK = [
    "--data.source",
    "Synthetic",
    "--data.source.image_size",
    "28",
    "--data.source.train_size",
    "400",
    "--data.source.test_size",
    "100",
    "--trainer.rounds",
    "2",
    "--model.pretraining.epochs",
    "1",
    "--trainer.enable_progress_bar",
    "false",
]
RUNS = {
    "fedavg": ("fedavg_fashion_mnist", []),
    "fedavg_int4": ("fedavg_fashion_mnist", ["--trainer.codec", "Quantize", "--trainer.codec.bits", "4"]),
    "fedavg_textbook": ("fedavg_textbook_fashion_mnist", []),
    "powersgd_r2": ("powersgd_fashion_mnist", []),
    "powersgd_r8": ("powersgd_fashion_mnist", ["--trainer.codec.rank", "8"]),
    "topk_1pct": ("topk_fashion_mnist", []),
    "topk_10pct": ("topk_fashion_mnist", ["--trainer.codec.density", "0.1"]),
    "fedprox": ("fedprox_fashion_mnist", ["--data.partition.min_partition_size", "2"]),
}


def last_checkpoint(root, name):
    (path,) = (root / "runs" / name).glob("version_*/checkpoints/last.ckpt")
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("case", list(RUNS), ids=list(RUNS))
def test_baseline_config_runs_two_rounds(case, in_tmp, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    config, extra = RUNS[case]
    assert run_cli("fit", "--config", str(CONFIGS / f"{config}.yaml"), *SHRINK, *extra, "--trainer.name", case) == 0
    ckpt = last_checkpoint(in_tmp, case)
    history = ckpt["history"]
    assert ckpt["round"] == 2 and history[-1]["fed/dropped_clients"] == 0
    assert 0 < history[-1]["comm/client_up_bytes"] <= history[-1]["comm/client_down_bytes"]
    if case.startswith(("powersgd", "topk")):
        assert set(ckpt["codec"]["residuals"]) == {str(c) for c in range(8)}  # error feedback is checkpointed


def test_matched_fedavg_reads_flite_base_from_the_same_cache(in_tmp, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    for config in ("flite_fashion_mnist", "fedavg_fashion_mnist"):
        assert run_cli("fit", "--config", str(CONFIGS / f"{config}.yaml"), *SHRINK, "--trainer.rounds", "1") == 0
    assert len(list((in_tmp / "cache" / "bases").iterdir())) == 1
    flite, fedavg = (last_checkpoint(in_tmp, n)["history"][0] for n in ("flite_fashion_mnist", "fedavg_fashion_mnist"))
    assert flite["val/acc"] == fedavg["val/acc"]  # round 0 of both is the same base
