"""tools/sweep.py runs, skips and resumes runs and writes one CSV; tools/report.py turns it into tables and figures."""

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import CONFIGS, REPO, sweep_tool, tool_module
from forking import run_python

SHRINK = [
    "--data.source",
    "Synthetic",
    "--data.source.image_size",
    "28",
    "--data.source.train_size",
    "320",
    "--data.source.test_size",
    "64",
    "--model.pretraining.epochs",
    "1",
]


def sweep_file(tmp_path, rounds):
    spec = {
        "name": "tiny",
        "out": str(tmp_path / "sweep"),
        "seeds": [0],
        "common": [*SHRINK, "--trainer.rounds", str(rounds)],
        "runs": [
            {
                "label": "latent_d{d}",
                "config": str(CONFIGS / "flite_fashion_mnist.yaml"),
                "args": ["--model.latent_dim", "{d}"],
                "grid": {"d": [4, 8]},
                "tags": {"method": "latent", "d": "{d}"},
            },
        ],
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def tool(*args, cwd):
    """``python *args`` (a tool, or ``-m lightning_fl``) in ``cwd``, forked from this process (``forking``): the tool
    is our code as a user runs it; the runs a sweep starts are fresh processes of their own."""
    env = {"PYTHONPATH": str(REPO), "PATH": "", "LIGHTNING_FL_CACHE": str(cwd / "cache")}
    return run_python(args, cwd=cwd, env=env, timeout=900)


class ForkedRuns:
    """Stands in for ``subprocess`` inside tools/sweep.py: each run's command (``python -m lightning_fl ...``) runs as
    a child forked from the test process (tests/forking.py), its output written to the run's log."""

    STDOUT = subprocess.STDOUT

    @staticmethod
    def run(cmd, *, stdout, stderr, env):
        done = run_python(cmd[1:], cwd=Path.cwd(), env=env, timeout=600)
        stdout.write(done.stdout + done.stderr)
        return done


@pytest.fixture
def sweep_main(tmp_path, monkeypatch, capsys):
    """``python tools/sweep.py ARGS`` in ``tmp_path``: the tool's own ``main`` in this process (skipping, resuming,
    the one-shot stages, the CSV), its runs forked (``ForkedRuns``); the exit code and what it printed.
    ``test_a_failed_run_makes_the_sweep_exit_non_zero_and_name_it`` runs the tool forked and its run as a fresh
    process."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(tmp_path / "cache"))

    def main(*args) -> subprocess.CompletedProcess:
        sweep = sweep_tool()
        monkeypatch.setattr(sweep, "subprocess", ForkedRuns)
        monkeypatch.setattr(sys, "argv", ["sweep.py", *map(str, args)])
        code = 0
        try:
            sweep.main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
            if not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return main


def test_sweep_runs_skips_resumes_and_reports(tmp_path, sweep_main):
    first = sweep_main(sweep_file(tmp_path, rounds=1), "--no-collect")
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.count("running") == 2
    assert not (tmp_path / "sweep" / "results.csv").exists()  # --no-collect: the runs, not the CSV
    again = sweep_main(sweep_file(tmp_path, rounds=1))
    assert again.stdout.count("done, skipped") == 2
    assert (tmp_path / "sweep" / "results.csv").is_file()
    longer = sweep_main(sweep_file(tmp_path, rounds=2))
    assert longer.returncode == 0 and longer.stdout.count("resuming") == 2, longer.stdout
    with (tmp_path / "sweep" / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["label"] for r in rows} == {"latent_d4", "latent_d8"}
    assert len(rows) == 2 * 3  # rounds 0, 1, 2 per run
    finals = {r["label"]: r for r in rows if r["final"] == "1"}
    assert finals["latent_d4"]["d"] == "4" and finals["latent_d8"]["method"] == "latent"
    assert float(finals["latent_d8"]["comm/client_up_bytes"]) == 4 * 8 * 3
    assert float(finals["latent_d4"]["fed/identity_error"]) <= 1e-6
    (machine,) = {r["environment"] for r in rows}  # every row records the machine its run ran on
    assert machine.startswith("torch=") and "device=cpu" in machine and "threads=" in machine

    report = {
        "csv": str(tmp_path / "sweep" / "results.csv"),
        "figures_dir": str(tmp_path / "figures"),
        "tensorboard": str(tmp_path / "tb"),
        "tables": [{"title": "tiny", "columns": ["val/acc", "comm/client_up_bytes"]}],
        "figures": [
            {"name": "pareto", "kind": "pareto"},
            {"name": "dims", "kind": "sweep", "x": "d", "where": {"method": "latent"}},
            {"name": "bars", "kind": "bars", "labels": ["latent_d4", "latent_d8"]},
            {"name": "budget", "kind": "budget", "budget_mb": 0.01},
        ],
    }
    (tmp_path / "report.yaml").write_text(yaml.safe_dump(report))
    out = tool(REPO / "tools" / "report.py", tmp_path / "report.yaml", "--markdown", tmp_path / "t.md", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "t.md").read_text()
    assert "| latent_d8 | 1 |" in text and "| 96 |" in text  # 24 floats = 96 bytes per upload
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == [
        "bars.png",
        "budget.png",
        "dims.png",
        "pareto.png",
    ]
    assert any((tmp_path / "tb").iterdir())


def test_a_runs_own_seed_args_follow_the_sweeps_and_extra_metrics_become_columns(tmp_path, monkeypatch):
    """A method's own seed (FLITE's factors, LoRA's adapters) varies with the run's seed; ``metrics`` adds columns."""
    sweep = sweep_tool()
    spec = {
        "name": "s",
        "seeds": [0, 2],
        "seed_args": ["--data.init_args.seed", "{seed}"],
        "metrics": ["val/exact_match", "val/acc"],
        "runs": [
            {
                "label": "lora_lr{lr}",
                "config": "c.yaml",
                "grid": {"lr": [0.1]},
                "args": ["--lr", "{lr}"],
                "seed_args": ["--model.init_args.adapter_seed", "{seed}"],
            },
            {"label": "plain", "config": "c.yaml"},
        ],
    }
    runs = {(r["label"], r["seed"]): r for r in sweep.expand(spec)}
    lora = sweep.command(spec, tmp_path, runs[("lora_lr0.1", 2)])
    i = lora.index("--seed_everything")
    assert lora[i : i + 6] == [
        "--seed_everything",
        "2",
        "--data.init_args.seed",
        "2",
        "--model.init_args.adapter_seed",
        "2",
    ]
    assert "--model.init_args.adapter_seed" not in sweep.command(spec, tmp_path, runs[("plain", 0)])
    assert sweep.metric_columns(spec)[-1] == "val/exact_match" and sweep.metric_columns(spec).count("val/acc") == 1
    history = [{"round": 0, "val/exact_match": 0.25}, {"round": 1, "val/exact_match": 0.5}]
    monkeypatch.setattr(sweep, "status", lambda spec, out, run: ("done", {"history": history}))
    sweep.collect(spec, tmp_path, [runs[("plain", 0)]])
    with (tmp_path / "results.csv").open() as f:
        assert [r["val/exact_match"] for r in csv.DictReader(f)] == ["0.25", "0.5"]


def test_collect_replaces_the_csv_whole_or_not_at_all(tmp_path, monkeypatch):
    """Two sweeps of one spec (two workers) collect into the same results.csv: the CSV is built whole, then written
    through a temp file and a rename, so an error midway (or a reader at that moment) finds the previous CSV intact."""
    sweep = sweep_tool()
    spec = {"name": "s"}
    runs = [{"label": x, "seed": 0, "tags": {}, "id": f"{x}__seed0"} for x in ("a", "b")]
    history = [{"round": 0, "val/acc": 0.5}, {"round": 1, "val/acc": 0.75}]

    def status(spec, out, run):
        if run["label"] == "b":
            raise RuntimeError("checkpoint being written")
        return "done", {"history": history}

    monkeypatch.setattr(sweep, "status", status)
    (tmp_path / "results.csv").write_text("the previous CSV\n")
    with pytest.raises(RuntimeError):
        sweep.collect(spec, tmp_path, runs)
    assert (tmp_path / "results.csv").read_text() == "the previous CSV\n"
    assert [p.name for p in tmp_path.iterdir()] == ["results.csv"]
    sweep.collect(spec, tmp_path, runs[:1])
    assert [p.name for p in tmp_path.iterdir()] == ["results.csv"]  # no temporary file left behind
    with (tmp_path / "results.csv").open() as f:
        rows = [(r["label"], r["round"], r["final"], r["val/acc"]) for r in csv.DictReader(f)]
    assert rows == [("a", "0", "0", "0.5"), ("a", "1", "1", "0.75")]


def test_collect_leaves_a_private_runs_unprotected_statistics_out_of_the_csv(tmp_path, monkeypatch):
    """A checkpoint of a private run written before runs withheld them still holds train/loss, update norms and
    the identity error: the CSV leaves them blank for its rows and, when no row has them, out; a sweep without
    private runs keeps them."""
    sweep = sweep_tool()
    raw = {"train/loss": 2.0, "fed/update_norm_median": 0.4, "fed/update_norm_max_ratio": 1.5}
    raw |= {"fed/identity_error": 3e-7, "fed/dropped_clients": 0.0, "comm/cum_rejected_bytes": 0.0}
    start = {"round": 0, "val/acc": 0.5}
    histories = {
        "dp": [start, {"round": 1, "val/acc": 0.6, "privacy/epsilon": 1.0, **raw}],
        "plain": [start, {"round": 1, "val/acc": 0.7, **raw}],
    }
    monkeypatch.setattr(sweep, "status", lambda spec, out, run: ("done", {"history": histories[run["label"]]}))

    def collected(labels):
        sweep.collect(
            {"name": "s"}, tmp_path, [{"label": label, "seed": 0, "tags": {}, "id": label} for label in labels]
        )
        with (tmp_path / "results.csv").open() as f:
            return list(csv.DictReader(f))

    private = collected(["dp"])
    assert not set(private[-1]) & set(raw) and private[-1]["privacy/epsilon"] == "1.0"
    mixed = collected(["dp", "plain"])
    assert [r["train/loss"] for r in mixed] == ["", "", "", "2.0"]  # the private run's rows blank
    assert collected(["plain"])[-1]["fed/update_norm_median"] == "0.4"


def test_collect_report_and_pairing_refuse_rows_from_two_machines(tmp_path, monkeypatch):
    """A run folder lists the machines its run ran on (environment.json; a second one when it resumed elsewhere);
    collecting puts that in an ``environment`` column and refuses, in one line, a sweep whose runs ran on different
    machines (their bases differ); tools/report.py and tools/paired_seeds.py refuse a CSV that mixes them."""
    import json

    import lightning_fl.checkpoint
    from lightning_fl.trainer_api import record_environment

    sweep = sweep_tool()
    spec = {"name": "s"}
    runs = [{"label": label, "seed": 0, "tags": {}, "id": f"{label}__seed0"} for label in ("a", "b")]
    history = [{"round": 0, "val/acc": 0.5}, {"round": 1, "val/acc": 0.75}]
    monkeypatch.setattr(sweep, "status", lambda spec, out, run: ("done", {"history": history}))
    one = {"torch": "2.14.1", "device": "cpu", "cpu": "AVX512", "threads": 1}
    other = {**one, "cpu": "AVX2"}
    for run, env in zip(runs, (one, other), strict=True):
        sweep.run_dir(tmp_path, run).mkdir(parents=True)
        monkeypatch.setattr(lightning_fl.checkpoint, "compute_environment", lambda device, env=env: env)
        record_environment(sweep.run_dir(tmp_path, run))
        record_environment(sweep.run_dir(tmp_path, run))  # the same machine again: listed once
    with pytest.raises(
        SystemExit,
        match=r"^error: sweep s's runs ran on different machines, .*: 1 on torch=2\.14\.1 "
        r"device=cpu cpu=AVX512 threads=1 \(e\.g\. a__seed0\); 1 on .*cpu=AVX2 .*b__seed0",
    ):
        sweep.collect(spec, tmp_path, runs)
    assert not (tmp_path / "results.csv").exists()
    record_environment(sweep.run_dir(tmp_path, runs[0]))  # a resumes on b's machine: it ran on both
    assert sweep.machine([sweep.run_dir(tmp_path, runs[0])]).count(" + ") == 1
    with pytest.raises(SystemExit, match="ran on different machines"):
        sweep.collect(spec, tmp_path, runs)
    (sweep.run_dir(tmp_path, runs[0]) / "environment.json").write_text(json.dumps([one]))
    (sweep.run_dir(tmp_path, runs[1]) / "environment.json").write_text(json.dumps([one]))
    sweep.collect(spec, tmp_path, runs)
    with (tmp_path / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["environment"] for r in rows} == {"torch=2.14.1 device=cpu cpu=AVX512 threads=1"}
    report, paired = tool_module("report"), tool_module("paired_seeds")
    assert len(report.spec_rows({"csv": str(tmp_path / "results.csv")})) == 4
    rows[-1]["environment"] = "torch=2.14.1 device=cuda name=NVIDIA H100"
    with (tmp_path / "mixed.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with pytest.raises(SystemExit, match=r"^error: .*mixed\.csv hold rows from 2 machines \(column environment: "):
        report.spec_rows({"csv": str(tmp_path / "mixed.csv")})
    with pytest.raises(SystemExit, match="hold rows from 2 machines"):
        paired.accuracies(tmp_path / "mixed.csv")


@pytest.mark.distributed  # the sweep tool as a user runs it: its run is a fresh process
def test_a_failed_run_makes_the_sweep_exit_non_zero_and_name_it(tmp_path):
    spec = {
        "name": "broken",
        "out": str(tmp_path / "sweep"),
        "seeds": [0],
        "runs": [{"label": "typo", "config": str(CONFIGS / "quickstart.yaml"), "args": ["--model.lrr", "0.1"]}],
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    result = tool(REPO / "tools" / "sweep.py", tmp_path / "sweep.yaml", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "error: 1 run failed: typo__seed0" in result.stderr
    assert "model.lrr" in (tmp_path / "sweep" / "typo__seed0.log").read_text()


def test_oneshot_sweep_fits_tests_and_collects(tmp_path, sweep_main):
    shrink = [
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "1",
        "--model.generator_training.steps",
        "2",
        "--model.generator_training.eval_tasks",
        "1",
        "--data.val_tasks",
        "1",
        "--data.test_tasks",
        "1",
        "--model.num_generated",
        "10",
        "--model.test_samples",
        "2",
        "--data.meta_tasks",
        "8",
    ]
    spec = {
        "name": "fmp_tiny",
        "kind": "oneshot",
        "out": str(tmp_path / "sweep"),
        "seeds": [0, 1],
        "seed_args": ["--data.seed", "{seed}"],
        "common": shrink,
        "runs": [
            {"label": "digits", "config": str(CONFIGS / "fmp_digits.yaml"), "tags": {"data": "digits"}},
            {
                "label": "skewed",
                "config": str(CONFIGS / "fmp_digits.yaml"),
                "args": ["--data.alpha", "0.1"],
                "fit_from": "digits",
                "tags": {"data": "digits"},
            },
        ],
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    first = sweep_main(path)
    assert first.returncode == 0 and "failed" not in first.stdout, first.stdout + first.stderr
    with (tmp_path / "sweep" / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["label"], r["seed"]) for r in rows] == [(x, s) for x in ("digits", "skewed") for s in ("0", "1")]
    for column in ["test/acc", "test/ece", "test/mp/acc", "comm/kb_per_client", "val/theta_dist", "generator/erm_nll"]:
        assert all(r[column] for r in rows), column
    assert rows[0]["test/acc"] != rows[1]["test/acc"]  # the data seed reached the run
    (machine,) = {r["environment"] for r in rows}  # lightning.Trainer's run folders record it too
    assert machine.startswith("torch=") and "device=cpu" in machine
    # fit_from: the skewed runs tested digits' fits (same seed) on their own target tasks, and fitted nothing
    assert not (tmp_path / "sweep" / "skewed__seed0" / "version_0").exists()
    assert rows[2]["val/theta_dist"] == rows[0]["val/theta_dist"] and rows[2]["test/acc"] != rows[0]["test/acc"]
    again = sweep_main(path)
    assert again.stdout.count("done, skipped") == 4, again.stdout
    spec["runs"][1]["fit_from"] = "nothing"
    path.write_text(yaml.safe_dump(spec))
    wrong = sweep_main(path)
    assert wrong.returncode != 0 and "fit_from 'nothing' must name a run listed before it" in wrong.stderr
    # A methods table (rows are methods) and a per-method sweep figure from the same CSV.
    report = {
        "csv": str(tmp_path / "sweep" / "results.csv"),
        "figures_dir": str(tmp_path / "figures"),
        "tables": [
            {
                "title": "T",
                "methods": ["fmp", "mp", "cann"],
                "labels": ["digits"],
                "metrics": ["acc", "ece"],
                "comm": "comm/{method}/kb_per_client",
            }
        ],
        "figures": [
            {
                "name": "by_seed",
                "kind": "sweep",
                "x": "seed",
                "xscale": "linear",
                "metric": "test/{method}/acc",
                "methods": ["fmp", "mp"],
            }
        ],
    }
    (tmp_path / "report.yaml").write_text(yaml.safe_dump(report))
    out = tool(REPO / "tools" / "report.py", tmp_path / "report.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {line.split("|")[1].strip(): line for line in out.stdout.splitlines() if line.startswith("| ")}
    assert "+/-" in lines["fmp"] and "+/-" in lines["cann"] and lines["cann"].rstrip(" |").endswith("2.56")
    assert lines["mp"].rstrip(" |").endswith("-")  # MP uploads nothing
    assert (tmp_path / "figures" / "by_seed.png").is_file()


def test_method_table_means_over_labels():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import report
    finally:
        sys.path.pop(0)
    rows = [
        {"label": "a", "seed": "0", "final": 1, "test/m/acc": 0.5, "test/m/ece": 0.1},
        {"label": "a", "seed": "1", "final": 1, "test/m/acc": 0.7, "test/m/ece": 0.3},
        {"label": "b", "seed": "0", "final": 1, "test/m/acc": 0.9, "test/m/ece": 0.0},
        {"label": "a", "seed": "0", "final": 1, "test/n/acc": 0.2, "test/n/ece": 0.1},
    ]
    text = report.method_table(rows, {"methods": ["m", "n"], "labels": ["a", "b"], "mean": True})
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| mean acc | mean ece |" in lines["method"]
    # m: acc (0.6 + 0.9) / 2 = 0.75, ece (0.2 + 0.0) / 2 = 0.1; n has no row for label b.
    assert lines["m"].endswith("| 0.7500 | 0.1000 |") and lines["n"].endswith("| - | - |")


def test_method_table_can_show_the_standard_error_over_seeds():
    report = tool_module("report")
    rows = [
        {"label": "a", "seed": "0", "final": 1, "test/m/acc": 0.5},
        {"label": "a", "seed": "1", "final": 1, "test/m/acc": 0.7},
        {"label": "a", "seed": "2", "final": 1, "test/m/acc": 0.9},
    ]
    sem = report.method_table(rows, {"methods": ["m"], "labels": ["a"], "metrics": ["acc"], "spread": "sem"})
    std = report.method_table(rows, {"methods": ["m"], "labels": ["a"], "metrics": ["acc"]})
    # std 0.2 over 3 seeds, standard error 0.2 / sqrt(3) = 0.1155
    assert "(mean +/- standard error over seeds)" in sem and "| m | 0.7000 +/- 0.1155 |" in sem
    assert "(mean +/- std over seeds)" in std and "| m | 0.7000 +/- 0.2000 |" in std
    with pytest.raises(SystemExit, match="spread must be std or sem"):
        report.method_table(rows, {"methods": ["m"], "labels": ["a"], "spread": "var"})


def test_a_table_of_columns_can_show_the_standard_error_over_seeds():
    report = tool_module("report")
    rows = [{"label": "a", "seed": str(s), "round": 1, "final": 1, "test/em": v} for s, v in enumerate((0.5, 0.7, 0.9))]
    sem = report.table(rows, {"columns": ["test/em"], "spread": "sem"})
    std = report.table(rows, {"columns": ["test/em"]})
    assert "mean +/- standard error over seeds)" in sem and "| a | 3 | 0.7000 +/- 0.1155 |" in sem
    assert "mean +/- std over seeds)" in std and "| a | 3 | 0.7000 +/- 0.2000 |" in std
    with pytest.raises(SystemExit, match="spread must be std or sem"):
        report.table(rows, {"columns": ["test/em"], "spread": "var"})


def test_best_table_takes_each_runs_best_round_in_the_metrics_direction():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import report
    finally:
        sys.path.pop(0)
    curve = {0: (9.0, 0.9), 1: (6.0, 0.3), 2: (5.0, 0.5), 3: (7.0, 0.4)}  # round: (ppl, acc); round 0 is the base
    rows = [
        {"label": "x", "seed": seed, "round": r, "final": int(r == 3), "val/ppl": p + seed, "val/acc": a + seed / 10}
        for seed in (0, 1)
        for r, (p, a) in curve.items()
    ]
    text = report.table(rows, {"labels": ["x"], "columns": ["val/ppl", "val/acc"], "best": True})
    # best ppl: 5.0 and 6.0 (round 2); best acc over rounds 1..3: 0.5 and 0.6 (the base's 0.9 is not a round)
    assert "best over rounds 1 to R" in text and "| x | 2 | 5.5000 +/- 0.7071 | 0.5500 +/- 0.0707 |" in text
    final = report.table(rows, {"labels": ["x"], "columns": ["val/ppl", "val/acc"]})
    assert "| x | 2 | 7.5000 +/- 0.7071 | 0.4500 +/- 0.0707 |" in final


def test_budget_takes_each_seeds_best_round_within_the_bytes_and_never_the_base():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import report
    finally:
        sys.path.pop(0)
    curve = {0: (0, 0.9), 1: (100, 0.3), 2: (200, 0.5), 3: (300, 0.7)}  # round: (cumulative bytes, acc)
    rows = [
        {"label": "x", "seed": seed, "round": r, "comm/cum_client_bytes": b or "", "val/acc": a + seed / 10}
        for seed in (0, 1)
        for r, (b, a) in curve.items()
    ]
    # within 250 bytes: rounds 1 and 2 (the base's 0.9 at round 0 costs nothing but is not a round)
    assert report.best_within_budget(rows, 250) == pytest.approx([0.5, 0.6])
    assert report.best_within_budget(rows, 300) == pytest.approx([0.7, 0.8])
    assert report.best_within_budget(rows, 50) == []


def test_pivot_table_puts_tags_on_rows_and_columns():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import report
    finally:
        sys.path.pop(0)
    rows = [
        {
            "label": f"{s}_{a}_{f}",
            "seed": seed,
            "final": 1,
            "strategy": s,
            "attack": a,
            "f": float(f),
            "val/acc": acc + 0.01 * seed,
        }
        for s, a, f, acc in [
            ("avg", "none", 0, 0.9),
            ("avg", "flip", 1, 0.5),
            ("med", "none", 0, 0.8),
            ("med", "flip", 1, 0.7),
        ]
        for seed in (0, 1)
    ] + [{"label": "avg_none_0", "seed": 0, "final": 0, "strategy": "avg", "attack": "none", "f": 0.0, "val/acc": 0.1}]
    rows += [{**r, "sweep": "other", "val/acc": 0.0} for r in rows]  # another sweep with the same labels
    for r in rows[: len(rows) // 2]:
        r["sweep"] = "this"
    spec = {"pivot": {"rows": "strategy", "columns": ["attack", "f"]}, "metric": "val/acc", "where": {"sweep": "this"}}
    text = report.pivot_table(rows, spec)
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert lines["strategy"] == "| strategy | none f=0 | flip f=1 |"
    # mean over the two seeds of the final rounds only (the round-0 row of 0.1 is not final)
    assert lines["avg"] == "| avg | 0.905 (0.007) | 0.505 (0.007) |"
    assert lines["med"] == "| med | 0.805 (0.007) | 0.705 (0.007) |"
    # two sweeps that share labels stay apart
    by_sweep = report.pivot_table(
        rows, {"pivot": {"rows": "strategy", "columns": ["sweep"]}, "where": {"attack": "flip"}}
    )
    assert "| strategy | this | other |" in by_sweep and "| avg | 0.505 (0.007) | 0.000 (0.000) |" in by_sweep


def test_a_best_pivot_takes_each_runs_best_round_and_keeps_its_tags():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import report
    finally:
        sys.path.pop(0)
    curve = {0: 0.9, 1: 0.3, 2: 0.6, 3: 0.5}  # round 0 (the base) is not a round of the run
    rows = [
        {
            "label": f"{m}_{e}",
            "seed": seed,
            "round": r,
            "final": int(r == 3),
            "method": m,
            "epsilon": e,
            "val/acc": acc + (0.1 if m == "b" else 0.0) + 0.01 * seed,
        }
        for m in ("a", "b")
        for e in (1.0, float("inf"))
        for seed in (0, 1)
        for r, acc in curve.items()
    ]
    spec = {"pivot": {"rows": "method", "columns": ["epsilon"]}, "metric": "val/acc", "best": True}
    lines = {
        line.split(" | ")[0].strip("| "): line
        for line in report.pivot_table(rows, spec).splitlines()
        if line.startswith("| ")
    }
    assert lines["method"] == "| method | epsilon=1 | epsilon=inf |"
    assert lines["a"] == "| a | 0.605 (0.007) | 0.605 (0.007) |" and lines["b"].startswith("| b | 0.705 (0.007)")
    final = report.pivot_table(rows, {**spec, "best": False})
    assert "| a | 0.505 (0.007) | 0.505 (0.007) |" in final
    assert "| a | 0.5050 (0.0071) | 0.5050 (0.0071) |" in report.pivot_table(rows, {**spec, "best": False, "digits": 4})


def test_a_gain_pivot_subtracts_each_runs_own_round_0():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import report
    finally:
        sys.path.pop(0)
    curve = {1: 0.3, 2: 0.6, 3: 0.5}
    rows = [
        {
            "label": "a",
            "seed": seed,
            "round": r,
            "final": int(r == 3),
            "method": "a",
            "epsilon": 1.0,
            "val/acc": (0.5 - 0.02 * seed) if r == 0 else curve[r] + 0.01 * seed,
        }
        for seed in (0, 1)
        for r in (0, 1, 2, 3)
    ]
    spec = {"pivot": {"rows": "method", "columns": ["epsilon"]}, "metric": "val/acc", "gain": True, "scale": 100}
    # best: seed 0 0.60 - 0.50, seed 1 0.61 - 0.48 (points: +10, +13); final: 0.50 - 0.50, 0.51 - 0.48 (0, +3)
    assert "| a | +11.500 (2.121) |" in report.pivot_table(rows, {**spec, "best": True})
    final = report.pivot_table(rows, {**spec, "digits": 2})
    assert "| a | +1.50 (2.12) |" in final and "less the run's round 0, x 100" in final


def test_fmp_label_probe_scores_summaries_of_a_checkpoint(tmp_path):
    """Uniform labels on the k-means centres cost FMP most of what the centres give (the read-out study)."""
    args = [
        "fit",
        "--config",
        str(CONFIGS / "fmp_digits.yaml"),
        "--model.generator",
        "PolyaUrn",
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "1",
        "--data.val_tasks",
        "2",
        "--data.meta_tasks",
        "8",
        "--model.num_generated",
        "20",
        "--model.test_samples",
        "2",
        "--model.summariser.readout",
        "linear",
    ]
    fit = tool("-m", "lightning_fl", *args, cwd=tmp_path)
    assert fit.returncode == 0, fit.stdout + fit.stderr
    ckpt = tmp_path / "runs/fmp_digits/version_0/checkpoints/last.ckpt"
    out = tool(REPO / "tools" / "fmp_label_probe.py", *args, "--ckpt_path", ckpt, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    scores = {line.split()[0]: float(line.split()[1]) for line in out.stdout.splitlines() if line.strip()}
    assert scores["kmeans"] < scores["kmeans_uniform_labels"]
    uniform = scores["uniform_label_entropy"]
    assert 0 < scores["summariser_label_entropy"] <= uniform == pytest.approx(math.log(10), abs=1e-4)


def test_config_args_pin_a_configs_settings_before_everything_else(tmp_path):
    """``config_args`` go right after ``--config`` (for that config's runs only); ``common`` and the run's own
    arguments come later and override them, and the CLI resolves the pinned value."""
    sweep = sweep_tool()
    spec = {
        "name": "pins",
        "kind": "oneshot",
        "config_args": {"configs/fmp_digits.yaml": ["--trainer.max_steps", "300", "--model.lr", "0.001"]},
        "common": ["--data.test_tasks", "2"],
        "runs": [
            {"label": "pinned", "config": "configs/fmp_digits.yaml"},
            {"label": "own", "config": "configs/fmp_digits.yaml", "args": ["--trainer.max_steps", "50"]},
            {"label": "other", "config": "configs/fmp_fashion_mnist.yaml"},
        ],
    }
    pinned, own, other = (sweep.command(spec, tmp_path, run) for run in sweep.expand(spec))
    assert pinned[4:10] == ["--config", "configs/fmp_digits.yaml", "--trainer.max_steps", "300", "--model.lr", "0.001"]
    assert pinned.index("--data.test_tasks") > pinned.index("--model.lr")
    assert "--model.lr" not in other
    from lightning_fl.cli import build_parser

    parser = build_parser()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        assert parser.parse_args(pinned[3:]).fit.trainer.init_args.max_steps == 300
        assert parser.parse_args(own[3:]).fit.trainer.init_args.max_steps == 50
        assert parser.parse_args(other[3:]).fit.trainer.init_args.max_steps == 1600  # the config's own


def test_a_run_may_have_its_own_seeds():
    sweep = sweep_tool()
    spec = {
        "name": "s",
        "seeds": [0, 1, 2],
        "runs": [
            {"label": "all", "config": "c.yaml"},
            {"label": "check_{x}", "config": "c.yaml", "grid": {"x": [1, 2]}, "seeds": [0]},
        ],
    }
    ids = [run["id"] for run in sweep.expand(spec)]
    assert ids == ["all__seed0", "all__seed1", "all__seed2", "check_1__seed0", "check_2__seed0"]


def test_seeds_option_runs_only_those_seeds(tmp_path):
    """``--seeds 1``: only the seed-1 runs are started (here printed by --dry-run), in the sweep's order."""
    runs = [{"label": "a", "config": "c.yaml"}, {"label": "b", "config": "c.yaml", "seeds": [0, 1]}]
    spec = {"name": "s", "out": str(tmp_path / "out"), "seeds": [0, 1, 2], "runs": runs}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    done = tool(REPO / "tools" / "sweep.py", path, "--dry-run", "--seeds", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    started = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("[")]
    assert started == ["a__seed1:", "b__seed1:"]


def test_dp_noise_probe_shares_against_closed_forms():
    """Isotropic noise puts k / D of its energy in a k-dimensional input subspace; a weight built in it puts all."""
    probe = tool_module("dp_noise_probe")
    g = torch.Generator().manual_seed(0)
    D, k, n = 400, 10, 2000
    basis = torch.linalg.qr(torch.randn(D, k, generator=g, dtype=torch.float64))[0].T  # (k, D) orthonormal rows
    X = torch.randn(n, k, generator=g, dtype=torch.float64) @ basis  # inputs of rank k
    W = torch.randn(32, k, generator=g, dtype=torch.float64) @ basis  # a weight that reads only that subspace
    N = torch.randn(32, D, generator=g, dtype=torch.float64)  # isotropic noise
    out = probe.subspace_shares(X, W, N, fractions=(0.999999,))
    assert out["k0.999999"] == k
    assert out["W_share0.999999"] == pytest.approx(1.0, abs=1e-9)
    assert out["N_share0.999999"] == pytest.approx(k / D, rel=0.15)  # chi-square of 320 of 12,800 entries
    assert out["N_norm"] == pytest.approx(float(N.norm()))
    ratio = ((X @ N.T).norm(dim=1) / (X @ W.T).norm(dim=1)).mean()
    assert out["output_ratio"] == pytest.approx(float(ratio))


def test_dp_noise_probe_reads_two_checkpoints(tmp_path):
    """End to end on digits: the noise the probe reports is the difference planted between two checkpoints."""
    config, short = CONFIGS / "fedavg_digits.yaml", ["--model.pretraining.epochs", "3"]  # the base: 3 epochs, not 30
    fit = tool(
        "-m",
        "lightning_fl",
        "fit",
        "--config",
        config,
        "--trainer.rounds",
        "1",
        *short,
        "--trainer.default_root_dir",
        tmp_path / "runs",
        "--trainer.logger",
        "false",
        cwd=tmp_path,
    )
    assert fit.returncode == 0, fit.stderr[-3000:]
    clean = next((tmp_path / "runs").rglob("last.ckpt"))
    ckpt = torch.load(clean, map_location="cpu", weights_only=True)
    weight = ckpt["global_state"]["backbone.fc.weight"]
    planted = 0.01 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(1))
    ckpt["global_state"]["backbone.fc.weight"] = weight + planted
    noised = tmp_path / "noised.ckpt"
    torch.save(ckpt, noised)
    args = [REPO / "tools" / "dp_noise_probe.py", "fit", "--config", config, *short, "--noised", noised]
    args += ["--clean", clean]
    proc = tool(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.strip().split(": ") for line in proc.stdout.splitlines() if line.startswith("  "))
    assert float(lines["N_norm"]) == pytest.approx(float(planted.norm()), abs=1e-4)
    assert 0 < float(lines["N_share0.9"]) < float(lines["W_share0.9"])
    bad = tool(*args, "--layer", "backbone.nope", cwd=tmp_path)
    assert bad.returncode == 2 and "--layer backbone.nope" in bad.stderr and "backbone.fc" in bad.stderr
    (tmp_path / "corrupt.ckpt").write_bytes(b"not a checkpoint")
    corrupt = tool(*args[:-1], tmp_path / "corrupt.ckpt", cwd=tmp_path)
    assert corrupt.returncode == 2 and "--clean" in corrupt.stderr and "Traceback" not in corrupt.stderr


def test_report_label_tables_take_a_where_filter():
    """A labels table with ``where: {seed: 0}`` averages only that seed's runs (a fair row beside one-seed runs)."""
    report = tool_module("report")
    rows = [
        {"label": "a", "seed": seed, "round": 1, "final": 1, "val/acc": acc}
        for seed, acc in ((0, 0.5), (1, 0.7), (2, 0.9))
    ]
    both = report.table(rows, {"labels": ["a"], "columns": ["val/acc"]})
    assert "| a | 3 | 0.7000 +/- 0.2000 |" in both
    seed0 = report.table(rows, {"labels": ["a"], "columns": ["val/acc"], "where": {"seed": 0}})
    assert "| a | 1 | 0.5000 +/- 0.0000 |" in seed0
    best = report.table(rows, {"labels": ["a"], "columns": ["val/acc"], "where": {"seed": 2}, "best": True})
    assert "| a | 1 | 0.9000 +/- 0.0000 |" in best


def test_fmp_claims_checks_each_claim_in_its_own_column():
    """tools/fmp_claims.py: Table I's claims on the iid run alone, Fig. 2's at each alpha, ties by standard errors of
    the per-seed differences (every method of a seed is tested on that seed's target tasks)."""
    claims = tool_module("fmp_claims")

    def run(label, seed, **values):
        row = {"label": label, "seed": str(seed), "final": "1"}
        row.update({f"test/{key.replace('__', '/')}": str(v) for key, v in values.items()})
        return row

    rows = []
    for seed, wiggle in enumerate((-0.001, 0.0, 0.001)):
        # FMP moves against the others from seed to seed: its per-seed differences spread by 2 x 0.001
        side = {"fmp": -wiggle}
        # iid: FMP lowest ECE, but CFMP 0.1 pp ahead in accuracy (a tie, below)
        base = dict.fromkeys(("cann", "cbnn", "fedlpa", "bpc"), (0.9, 0.05))
        base.update(
            cfmp=(0.911, 0.04), fmp=(0.910, 0.02), mp=(0.92, 0.01), fmp_random=(0.9, 0.03), fmp_mean=(0.9, 0.01)
        )
        rows.append(
            run(
                "iid",
                seed,
                **{
                    f"{m}__{k}": v + side.get(m, wiggle)
                    for m, (a, e) in base.items()
                    for k, v in (("acc", a), ("ece", e))
                },
            )
        )
        # alpha 1: FMP ahead by 1 pp; alpha 0.1: ahead by 5 pp; ECE: FMP behind CANN at alpha 1
        for label, fmp_acc, cann_ece in (("dir1.0", 0.86, 0.01), ("dir0.1", 0.80, 0.20)):
            vals = {f"{m}__acc": 0.85 - (0.1 if label == "dir0.1" else 0) + wiggle for m in claims.ONE_SHOT}
            vals.update(
                {f"{m}__ece": 0.1 for m in claims.ONE_SHOT},
                fmp__acc=fmp_acc - wiggle,
                fmp__ece=0.05,
                cann__ece=cann_ece,
            )
            rows.append(run(label, seed, **vals))
    text = "\n".join(claims.claims(rows))
    # accuracy, FMP less CFMP per seed: -0.003, -0.001, +0.001: mean -0.001, SE 0.002 / sqrt(3) = 0.00115, -0.9 SE: a
    # tie (the claim allows one). Unpaired it would be 0.001 / sqrt(2 (0.001 / sqrt(3))^2) = 1.2 SE.
    assert (
        "tied-highest) mean accuracy among the one-shot federated methods: **tie** (-0.9 SE, CFMP): FMP 0.9100" in text
    )
    # ECE, CFMP less FMP per seed: 0.018, 0.020, 0.022: 0.02 / 0.00115 = 17.3 SE
    assert (
        "lowest mean ECE among the one-shot federated methods: **holds** (+17.3 SE, CFMP): FMP 0.0200 +/- 0.0006"
        in text
    )
    # close: 1.66 pp less the 1.00 pp gap (per seed 0.8, 1.0, 1.2 pp), over its SE 0.115 pp
    assert 'close to the centralized MP benchmark": **holds** (+5.7 SE)' in text and "-1.00 +/- 0.12 pp" in text
    assert "mean pooling at the same s: **fails** (-8.7 SE, ECE vs mean pooling)" in text  # mean pooling's ECE
    assert "highest mean accuracy across all alpha: **holds** (+8.7 SE, alpha 1 vs CANN)" in text
    assert "lowest mean ECE across all alpha: **fails** (exact, alpha 1 vs CANN)" in text  # no spread: exact
    assert "at alpha 1: +1.00 +/- 0.12 pp, 0.1: +5.00 +/- 0.12 pp" in text
    # the lead at 0.1 less the lead at 1, per seed: 0.04 each (both leads move with the seed alike): exact
    assert '"with the largest advantage ... at alpha = 0.1": accuracy: **holds** (exact, against alpha 1)' in text
    strict = claims.claims(rows, tie=0.5)[0]
    assert "tied-highest) mean accuracy among the one-shot federated methods: **fails** (-0.9 SE, CFMP)" in strict


def _events(folder, steps, name=None):
    """Write scalars through TensorBoard's writer: ``steps`` is ``{step: {tag: value}}``."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder), filename_suffix=name or "")
    for step, values in steps.items():
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)
    writer.close()


def test_run_table_prints_rounds_epochs_and_a_summary(tmp_path, capsys):
    """Per step, per 1-based epoch through the logged ``epoch`` scalar, and first/last/max/min with their steps;
    a later event file (a resumed run) overrides a step logged again."""
    run_table = tool_module("run_table")
    run = tmp_path / "version_0"
    _events(
        run,
        {
            0: {"val/acc": 0.5},
            1: {"val/acc": 0.75, "comm/cum_client_bytes": 1536.0},
            2: {"val/acc": 0.625, "comm/cum_client_bytes": 3072.0, "fed/identity_error": 3.6e-7},
        },
    )
    assert run_table.main([str(run), "--tags", "val/acc", "comm/cum_client_bytes", "fed/identity_error"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "| step | 0 | 1 | 2 |",
        "| --- | --- | --- | --- |",
        "| val/acc | 0.5000 | 0.7500 | 0.6250 |",
        "| comm/cum_client_bytes | - | 1,536 | 3,072 |",
        "| fed/identity_error | - | - | 3.6e-07 |",
    ]
    assert run_table.main([str(run), "--summary", "--tags", "val/acc"]) == 0
    assert capsys.readouterr().out.strip() == (
        "val/acc: first 0.5000 (step 0), last 0.6250 (step 2), max 0.7500 (step 1), min 0.5000 (step 0); 3 values"
    )
    private = tmp_path / "version_1"  # a non-private run logs epsilon inf
    _events(private, {1: {"privacy/epsilon": float("inf")}, 2: {"privacy/epsilon": float("inf")}})
    assert run_table.main([str(private), "--summary"]) == 0
    assert capsys.readouterr().out.strip() == (
        "privacy/epsilon: first inf (step 1), last inf (step 2), max inf (step 1), min inf (step 1); 2 values"
    )
    pretraining = tmp_path / "pretraining"
    _events(pretraining, {49: {"epoch": 0.0, "val/acc": 0.25}, 99: {"epoch": 1.0, "val/acc": 0.375}}, ".a")
    _events(pretraining, {99: {"epoch": 1.0, "val/acc": 0.875}}, ".b")  # written later: the resumed run's value
    assert run_table.main([str(pretraining), "--tags", "val/acc", "--by", "epoch"]) == 0
    assert capsys.readouterr().out.splitlines()[::2] == ["| epoch | 1 | 2 |", "| val/acc | 0.2500 | 0.8750 |"]


def test_run_table_refuses_what_it_cannot_read_with_exit_2(tmp_path, capsys):
    run_table = tool_module("run_table")
    assert run_table.main([str(tmp_path / "missing")]) == 2
    assert "no TensorBoard event files under" in capsys.readouterr().err
    _events(tmp_path / "run", {0: {"val/acc": 0.5}})
    assert run_table.main([str(tmp_path / "run"), "--tags", "val/ac"]) == 2
    assert "--tags val/ac: not logged by this run; it logged val/acc" in capsys.readouterr().err
    assert run_table.main([str(tmp_path / "run"), "--by", "epoch"]) == 2
    assert "needs the run's 'epoch' scalar" in capsys.readouterr().err


def test_latent_probe_trains_on_the_pooled_clients_from_the_public_base(tmp_path, monkeypatch, capsys):
    """The probe prepares the federated run's base (one cached base, pretrained on the public split) and then
    trains on the clients' pooled data: 288 of the 320 images, ceil(288 / 64) = 5 steps an epoch."""
    import json

    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(tmp_path / "cache"))
    probe = tool_module("latent_probe")
    out = tmp_path / "probe.json"
    config = str(CONFIGS / "flite_fashion_mnist.yaml")
    args = ["--epochs", "1", "--dims", "4:2", "--json", str(out), "fit", "--config", config, *SHRINK]
    assert probe.main(args) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert (run["latent_dim"], run["rank"], run["steps"]) == (4, 2, 5)
    assert [e["epoch"] for e in run["epochs"]] == [0, 1] and all(0 <= e["val/acc"] <= 1 for e in run["epochs"])
    assert len(list((tmp_path / "cache" / "bases").iterdir())) == 1
    assert "| 4, 2 | " in capsys.readouterr().out
    assert probe.main(["--dims", "4", "fit"]) == 2
    assert "give latent_dim:rank pairs" in capsys.readouterr().err


def test_llm_frontier_gives_each_runs_base_final_and_best_as_mean_and_standard_error(tmp_path):
    """tools/llm_frontier.py on a hand-made CSV: two seeds of one label, one of another; the numbers by hand."""
    frontier = tool_module("llm_frontier")
    header = [
        "sweep",
        "label",
        "seed",
        "method",
        "round",
        "final",
        "val/ppl",
        "val/acc",
        "comm/client_up_bytes",
        "time/round_s",
    ]
    rows = [  # label, seed, round, ppl, acc, bytes, time
        ("lora_r1", 0, 0, 100.0, 0.20, "", ""),
        ("lora_r1", 0, 1, "", "", 1000, 10.0),
        ("lora_r1", 0, 2, 80.0, 0.25, 1000, 12.0),
        ("lora_r1", 0, 3, "", "", 1000, 11.0),
        ("lora_r1", 0, 4, 90.0, 0.24, 1000, 30.0),
        ("lora_r1", 1, 0, 100.0, 0.20, "", ""),
        ("lora_r1", 1, 2, 70.0, 0.30, 1000, 10.0),
        ("lora_r1", 1, 4, 60.0, 0.32, 1000, 10.0),
        ("flite_d8", 0, 0, 100.0, 0.20, "", ""),
        ("flite_d8", 0, 4, 95.0, 0.21, 32, 9.0),
    ]
    path = tmp_path / "f.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for label, seed, rnd, ppl, acc, up, t in rows:
            method = label.split("_")[0]
            writer.writerow(["s", label, seed, method, rnd, int(rnd == 4), ppl, acc, up, t])
    text, by_label = frontier.table(frontier.runs_of([path]))
    lora = {s["final_ppl"] for s in by_label["lora_r1"]}
    assert lora == {90.0, 60.0}
    assert sorted(s["best_ppl"] for s in by_label["lora_r1"]) == [60.0, 80.0]  # seed 0's best is round 2, not 4
    # final: mean 75, SE = stdev(90, 60) / sqrt(2) = 21.2132 / 1.4142 = 15; change -10% and -40%: -25 +/- 15
    assert (
        "| lora_r1 | lora | 1,000 | 2 | 100.00 +/- 0.00 | 75.00 +/- 15.00 | -25.0 +/- 15.0% | 70.00 +/- 10.00 (2, 4) |"
        in text
    )
    assert "| flite_d8 | flite | 32 | 1 | 100.00 | 95.00 | -5.0% | 95.00 (4) | 0.2100 | 0.2100 | 9 / 9 s |" in text
    # accuracy: final 0.24 and 0.32, best 0.25 and 0.32; round times: min 10, medians 11.5 and 10 -> 10.75
    assert "| 0.2800 +/- 0.0400 | 0.2850 +/- 0.0350 | 10 / 11 s |" in text
    frontier.figure(by_label, tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 0


def test_llm_frontier_adds_epsilon_z_and_the_clip_for_private_sweeps_and_lists_no_noise_first(tmp_path):
    frontier = tool_module("llm_frontier")
    header = [
        "sweep",
        "label",
        "seed",
        "method",
        "eps",
        "round",
        "final",
        "val/ppl",
        "val/acc",
        "comm/client_up_bytes",
        "time/round_s",
        "privacy/epsilon",
        "privacy/noise_multiplier",
        "privacy/clip_norm",
    ]
    rows = [  # label, eps, round, ppl, epsilon, z
        ("flite_d8_eps8", "8", 0, 100.0, "", ""),
        ("flite_d8_eps8", "8", 1, "", 3.5, 0.5),
        ("flite_d8_eps8", "8", 2, 97.0, 7.99, 0.5),
        ("flite_d8_epsinf", "inf", 0, 100.0, "", ""),
        ("flite_d8_epsinf", "inf", 2, 90.0, "inf", 0.0),
    ]
    path = tmp_path / "dp.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for label, eps, rnd, ppl, epsilon, z in rows:
            acc = 0.2 if ppl else ""
            writer.writerow(["s", label, 0, "flite", eps, rnd, int(rnd == 2), ppl, acc, 32, 5.0, epsilon, z, 1.85])
    text, by_label = frontier.table(frontier.runs_of([path]))
    lines = text.splitlines()
    assert "| seeds | epsilon spent | z | S | base ppl |" in lines[0] and lines[1].count("---") == 14
    assert lines[2].startswith("| flite_d8_epsinf | flite | 32 | 1 | inf (no noise) | 0 | 1.85 | 100.00 | 90.00 |")
    assert lines[3].startswith("| flite_d8_eps8 | flite | 32 | 1 | 7.99 | 0.5000 | 1.85 | 100.00 | 97.00 | -3.0% |")
    frontier.figure(by_label, tmp_path / "dp.png", "t")
    assert (tmp_path / "dp.png").stat().st_size > 0


@pytest.mark.parametrize("name", ["smollm2_frontier", "smollm2_dp_frontier"])
def test_the_smollm2_frontier_tables_regenerate_from_their_csvs(name):
    """docs/results/<name>.md is what tools/llm_frontier.py makes of docs/results/<name>.csv, also on the page."""
    frontier = tool_module("llm_frontier")
    csv_path = REPO / "docs" / "results" / f"{name}.csv"
    text, _ = frontier.table(frontier.runs_of([csv_path]))
    assert text in (REPO / "docs" / "results" / f"{name}.md").read_text()
    assert text in (REPO / "docs" / "results-llm.md").read_text()  # the table quoted on the results page


def test_paired_seeds_differences_per_seed_at_the_best_and_last_round(tmp_path):
    from conftest import tool_module

    paired_seeds = tool_module("paired_seeds")
    # (label, seed, round, accuracy); seed 2 of b alone: not paired
    rows = [
        ("a", 0, 0, 0.80),
        ("a", 0, 1, 0.90),
        ("a", 0, 2, 0.85),
        ("b", 0, 0, 0.80),
        ("b", 0, 1, 0.84),
        ("b", 0, 2, 0.86),
        ("a", 1, 0, 0.70),
        ("a", 1, 1, 0.72),
        ("b", 1, 0, 0.70),
        ("b", 1, 1, 0.70),
        ("b", 2, 1, 0.99),
    ]
    path = tmp_path / "s.csv"
    path.write_text("label,seed,round,val/acc\n" + "".join(f"{name},{s},{r},{v}\n" for name, s, r, v in rows))
    got = paired_seeds.paired(paired_seeds.accuracies(path), "a", "b")
    assert got["best"]["per_seed"] == pytest.approx([4.0, 2.0])  # best after round 0: 0.90-0.86, 0.72-0.70
    assert got["last"]["per_seed"] == pytest.approx([-1.0, 2.0])  # last round: 0.85-0.86, 0.72-0.70
    assert got["best"]["mean"] == pytest.approx(3.0) and got["best"]["se"] == pytest.approx(1.0)
    assert got["best"]["ratio"] == pytest.approx(3.0)
    # --against: b from another CSV (the same label in a rerun); seeds paired across the two files
    other = tmp_path / "o.csv"
    other.write_text("label,seed,round,val/acc\na,1,0,0.7\na,1,1,0.75\na,2,1,0.5\n")
    got = paired_seeds.paired(paired_seeds.accuracies(path), "a", "a", paired_seeds.accuracies(other))
    assert got["best"]["per_seed"] == pytest.approx([-3.0]) and got["last"]["per_seed"] == pytest.approx([-3.0])
    # --metric: perplexity is lower-is-better (the best round is the lowest) and is not scaled to points
    ppl = tmp_path / "p.csv"
    ppl.write_text("label,seed,round,val/ppl\na,0,0,9\na,0,1,5\na,0,2,7\nb,0,0,9\nb,0,1,6\nb,0,2,6.5\n")
    got = paired_seeds.paired(paired_seeds.accuracies(ppl, "val/ppl"), "a", "b", metric="val/ppl")
    assert got["best"]["per_seed"] == pytest.approx([-1.0]) and got["last"]["per_seed"] == pytest.approx([0.5])
    # --each: every label against itself in the other CSV; labels without a shared seed are left out
    got = paired_seeds.each(paired_seeds.accuracies(path), paired_seeds.accuracies(other))
    assert list(got) == ["a"] and got["a"]["last"]["per_seed"] == pytest.approx([-3.0])
    other.write_text("label,seed,round,val/acc\na,0,1,0.80\na,0,2,0.80\nb,0,1,0.83\nb,0,2,0.87\nb,1,1,0.60\n")
    got = paired_seeds.each(paired_seeds.accuracies(path), paired_seeds.accuracies(other))
    assert list(got) == ["a", "b"]
    assert got["a"]["best"]["per_seed"] == pytest.approx([10.0])  # 0.90-0.80
    assert got["a"]["last"]["per_seed"] == pytest.approx([5.0])  # 0.85-0.80
    assert got["b"]["best"]["per_seed"] == pytest.approx([-1.0, 10.0])  # 0.86-0.87; 0.70-0.60


def test_suite_time_compares_two_trees_on_the_tests_they_share(tmp_path, capsys):
    """tools/suite_time.py: per run wall and CPU from /usr/bin/time, pytest's counts, and per-test seconds summed
    (setup, call and teardown) over the tests every run has; new / old per pair; mismatched or missing logs exit 2."""
    suite_time = tool_module("suite_time")

    def write(name, tests, tail, times):
        lines = ["============ slowest durations ============"]
        lines += [f"{s}s {phase}     tests/test_a.py::{t}" for t, phases in tests.items() for phase, s in phases]
        (tmp_path / f"{name}.log").write_text("\n".join([*lines, tail]) + "\n")
        (tmp_path / f"{name}.time").write_text(f"Command exited with non-zero status 1\n{times}\n")

    old_tests = {"a": [("call", 2.0), ("setup", 0.5)], "b": [("call", 1.0)]}
    write("old1", old_tests, "1 failed, 2 passed in 9.0s", "wall 10.00 user 15.00 sys 1.00")
    new_tests = {"a": [("call", 2.5)], "b": [("call", 1.5), ("teardown", 0.5)], "c": [("call", 9.0)]}
    write("new1", new_tests, "3 passed, 1 skipped in 12.0s", "wall 12.00 user 18.00 sys 2.00")
    result = suite_time.compare([suite_time.run_of(tmp_path / "old1.log")], [suite_time.run_of(tmp_path / "new1.log")])
    assert result["shared_tests"] == 2  # "c" is the new tree's only
    old, new = result["runs"]
    assert (old["wall_s"], old["cpu_s"], old["passed"], old["failed"]) == (10.0, 16.0, 2, 1)
    assert (new["passed"], new["skipped"], new["shared_tests_s"]) == (3, 1, 4.5)
    assert old["shared_tests_s"] == 3.5
    assert result["new_over_old"]["shared_tests_s"]["pairs"] == [round(4.5 / 3.5, 3)]
    assert result["new_over_old"]["cpu_s"]["median"] == 1.25
    assert suite_time.main(["--old", str(tmp_path / "old1.log"), "--new", str(tmp_path / "new1.log")]) == 0
    assert "new / old wall_s: [1.2]" in capsys.readouterr().out
    both = ["--old", str(tmp_path / "old1.log"), str(tmp_path / "old1.log"), "--new", str(tmp_path / "new1.log")]
    assert suite_time.main(both) == 2
    assert suite_time.main(["--old", str(tmp_path / "gone.log"), "--new", str(tmp_path / "new1.log")]) == 2
    assert "no log at" in capsys.readouterr().out
