"""What a federated run prints: plain progress lines when output is not a terminal, and a summary at the end."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import make_dm, make_model, make_trainer
from lightning_fl.federated.trainer.callbacks import ProgressReport
from lightning_fl.federated.trainer.summary import best_round, run_summary


def test_best_round_follows_the_metric_direction():
    history = [
        {"round": 0, "val/acc": 0.99, "val/loss": 0.01},  # round 0 (the base) is not a federated round
        {"round": 1, "val/acc": 0.5, "val/loss": 0.9},
        {"round": 2, "val/acc": 0.7, "val/loss": 0.4},
        {"round": 3, "val/acc": 0.6, "val/loss": 0.6},
    ]
    assert best_round(history, "val/acc") == (2, 0.7)
    assert best_round(history, "val/loss") == (2, 0.4)
    assert best_round(history, "val/ppl") is None


@pytest.mark.parametrize("bar", [True, False])
def test_a_run_ends_with_a_summary_and_prints_plain_progress_lines(tmp_path, capsys, bar):
    """Output to a file or a CI log gets the plain lines whatever ``enable_progress_bar`` says (17 of the configs set it
    false, and printed nothing for minutes)."""
    trainer = make_trainer(tmp_path, rounds=4, enable_progress_bar=bar)
    trainer.fit(make_model(), datamodule=make_dm())
    out = capsys.readouterr().out
    progress = [line for line in out.splitlines() if line.startswith("round ")]
    h = trainer.history
    expected = [
        f"round {r}/4: val/acc {h[r]['val/acc']:.4f}, MiB/client {h[r]['comm/cum_client_bytes'] / 2**20:.3f}"
        for r in range(1, 5)
    ]
    assert progress == expected
    summary = out[out.index("Finished round 4") :]
    test_data = "  val/* is the test split (no validation split: data.val_fraction 0): each best round below is chosen"
    assert summary.splitlines()[1] == test_data + " on test data"  # (make_dm's val_fraction is 0)
    acc = [h["val/acc"] for h in trainer.history]
    best = max(range(1, 5), key=lambda r: acc[r])
    assert f"val/acc: {acc[0]:.4f} at round 0, {acc[4]:.4f} at the end, best {acc[best]:.4f} (round {best})" in summary
    sent = trainer.history[-1]["comm/cum_client_bytes"]
    assert f"bytes per client (uploads and downloads, mean over clients): {sent:,.0f}" in summary
    assert f"run folder: {trainer.log_dir} (config.yaml, checkpoints/last.ckpt)" in summary
    assert f"TensorBoard: tensorboard --logdir {trainer.log_dir.parent}" in summary
    assert "\r" not in out  # no carriage-return bars when output is not a terminal


@pytest.mark.parametrize(
    ("terminal", "bar", "lines"), [(False, True, True), (False, False, True), (True, True, False), (True, False, True)]
)
def test_progress_is_a_bar_on_a_terminal_if_enabled_else_a_line_every_tenth_of_the_run(
    monkeypatch, capsys, terminal, bar, lines
):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    trainer = SimpleNamespace(rounds=20, enable_progress_bar=bar, fabric=SimpleNamespace(is_global_zero=True))
    report = ProgressReport()
    report.on_rounds_start(trainer, 0)
    for r in range(1, 21):
        report.on_round_end(trainer, r, {"val/acc": 0.5, "comm/cum_client_bytes": 2.0**20 * r})
    report.on_rounds_end(trainer)
    shown = [f"round {r}/20: val/acc 0.5000, MiB/client {r:.3f}" for r in range(2, 21, 2)]
    out, err = capsys.readouterr()
    assert out.splitlines() == (shown if lines else [])
    assert ("round: 100%" in err) is (terminal and bar)  # the bar


def test_the_summary_says_when_the_best_rounds_are_chosen_on_test_data(tmp_path):
    from lightning_fl.data import FederatedDataModule, Synthetic
    from lightning_fl.data.text import FederatedTextDataModule

    history = [{"round": 0, "val/acc": 0.5}, {"round": 1, "val/acc": 0.7}]
    on_test = run_summary(history, tmp_path, logger=False, val_is_test=True).splitlines()
    assert (
        on_test[1] == "  val/* is the test split (no validation split: data.val_fraction 0): each best round "
        "below is chosen on test data"
    )
    assert on_test[2:] == run_summary(history, tmp_path, logger=False).splitlines()[1:]
    assert "test split" not in run_summary([{"round": 1}], tmp_path, False, val_is_test=True)  # no val/*
    source = Synthetic(train_size=40, test_size=10)
    assert FederatedDataModule(source, val_fraction=0).val_is_test
    assert not FederatedDataModule(source, val_fraction=0.25).val_is_test
    assert FederatedTextDataModule(None, val_fraction=0).val_is_test is True
    assert FederatedTextDataModule(None, val_fraction=0.1).val_is_test is False


def test_a_federated_evaluation_writes_a_new_folder_of_its_own_and_says_where(tmp_path, capsys):
    """``validate`` and ``test`` never reuse the fit's folder, even one named by ``version``, nor take a fit's
    ``version_N``: they write ``validate_N`` and ``test_N`` and print where."""
    fit = make_trainer(tmp_path, rounds=1, version="named")
    fit.fit(make_model(), datamodule=make_dm())
    ckpt = str(fit.log_dir / "checkpoints" / "last.ckpt")
    capsys.readouterr()
    runs = tmp_path / "runs" / "federated"
    for command, folder in [("validate", "validate_0"), ("test", "test_0"), ("validate", "validate_1")]:
        evaluation = make_trainer(tmp_path, version="named")
        (metrics,) = getattr(evaluation, command)(make_model(), datamodule=make_dm(), ckpt_path=ckpt)
        assert evaluation.log_dir == runs / folder and (runs / folder / "config.yaml").exists() is False
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == f"{command}: 3 metric(s), written to {runs / folder} (a new folder for this evaluation)"
        if command == "validate":  # (make_dm's val_fraction is 0)
            assert lines[1] == "  val/* is the test split (no validation split: data.val_fraction 0)"
        assert len(lines) == 1 + (command == "validate") + len(metrics)
    assert sorted(p.name for p in runs.iterdir()) == ["named", "test_0", "validate_0", "validate_1"]


def test_the_summary_of_a_run_without_rounds_says_so():
    assert run_summary([], Path("runs/x/version_0"), logger=False) == "No round ran. Run folder: runs/x/version_0"


def test_a_lightning_trainer_fit_ends_with_a_summary(in_tmp, capsys):
    from conftest import CONFIGS, run_cli

    quiet = ["--trainer.enable_model_summary", "false", "--trainer.enable_progress_bar", "false"]
    assert run_cli("fit", "--config", str(CONFIGS / "pretrain_digits.yaml"), "--trainer.max_epochs", "1", *quiet) == 0
    out = capsys.readouterr().out
    summary = out[out.index("Finished after 1 epoch(s)") :]
    run = Path("runs") / "pretrain_digits" / "version_0"
    assert "  val/acc: " in summary and "  val/loss: " in summary
    assert "  val/* is the test split (no validation split: data.val_fraction 0)\n" in summary
    assert f"  checkpoint: {run / 'checkpoints' / 'last.ckpt'}" in summary
    assert f"  run folder: {run} (config.yaml)" in summary


def test_a_run_prints_none_of_lightnings_noise(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import CONFIGS

    env = {**os.environ, "LIGHTNING_FL_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "lightning_fl", "fit", "--config", str(CONFIGS / "pretrain_digits.yaml")]
    cmd += ["--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout + done.stderr
    assert "Finished after 1 epoch(s)" in out  # what a user needs is still there
    for noise in ("Tip:", "GPU available: False", "TPU available: False", "LeafSpec", "in eval mode at the start"):
        assert noise not in out, noise


def test_pretraining_a_base_shows_progress(in_tmp, capsys, monkeypatch):
    from conftest import CONFIGS, run_cli

    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    args = ["--trainer.rounds", "1", "--model.pretraining.epochs", "2", "--trainer.enable_progress_bar", "false"]
    assert run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), *args) == 0
    err = capsys.readouterr().err
    assert "Pretraining the base for 2 epochs" in err
    lines = [line for line in err.splitlines() if line.startswith("pretraining epoch ")]
    assert [line.split(":")[0] for line in lines] == ["pretraining epoch 1/2", "pretraining epoch 2/2"]
    assert all("val/acc " in line for line in lines)


def test_the_summary_counts_the_rounds_that_kept_the_global_state(tmp_path, capsys):
    """Two of four clients a round, client 0 hostile (NaN uploads, dropped by the gate) and FedAvg needing two
    uploads: every round that sampled client 0 keeps the global state. The summary counts and names those rounds;
    ``fed/clients`` is the round's sample (2) and ``fed/aggregated_clients`` the uploads it aggregated."""
    from lightning_fl.federated import FedAvg, NaNUpload

    trainer = make_trainer(
        tmp_path,
        rounds=6,
        clients_per_round=2,
        client_fraction=None,
        strategy=FedAvg(min_clients=2),
        attack=NaNUpload(clients=[0]),
        max_update_norm_ratio=None,
    )
    with pytest.warns(UserWarning, match="the global state is unchanged"):
        trainer.fit(make_model(), datamodule=make_dm(num_clients=4))
    rounds = trainer.history[1:]
    skipped = [int(h["round"]) for h in rounds if h["fed/round_skipped"]]
    assert 0 < len(skipped) < 6  # (the seeded cohorts sample client 0 in some rounds, not all)
    assert all(h["fed/clients"] == 2 for h in rounds)
    assert [h["fed/aggregated_clients"] for h in rounds] == [1.0 if r in skipped else 2.0 for r in range(1, 7)]
    line = f"  rounds skipped (the global state kept: too few accepted uploads, or a refused aggregate): {len(skipped)}"
    shown = ", ".join(map(str, skipped))
    assert f"{line} of 6 (round{'s' if len(skipped) > 1 else ''} {shown})" in capsys.readouterr().out.splitlines()
    assert "rounds skipped" not in run_summary([{"round": 0}, {"round": 1, "fed/round_skipped": 0.0}], tmp_path, False)
