"""Every script in benchmarks/ runs end to end at a tiny size, so the benchmarks cannot rot.

Each run is the script's ``__main__`` with the arguments a user gives (``python benchmarks/<script> ...``), in a child
forked from the test process (``forking.run_python``: the imports are done already), in an empty folder, with
``OMP_NUM_THREADS=1``, the package's caches under that folder and a timeout; the numbers it prints are not
checked, only that it finishes and prints its report. A new script must get a case in ``CASES``.
Flower's deployment benchmark and the threads benchmark start several full runs however small their
settings, so they are ``slow`` (``pytest -m slow``); by default only their options are checked.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from conftest import REPO, fake_mnist_folder
from forking import run_python

BENCHMARKS = REPO / "benchmarks"


@dataclass
class Case:
    args: list[str]  # the smallest sizes and steps the script offers
    expect: str  # a line of its report that it prints last, or near the end
    slow: bool = False
    timeout: float = 180.0
    outputs: list[str] = field(default_factory=list)  # files it must write (relative to the run's folder)
    needs: str | None = None  # a module of an optional extra it needs


CASES = {
    "client_overhead.py": Case(
        [
            "--clients",
            "4",
            "--population",
            "8",
            "--per-client",
            "8",
            "--rounds",
            "2",
            "--repeats",
            "1",
            "--kinds",
            "latent",
            "--json",
            "co.json",
        ],
        "[client_overhead] wrote co.json",
        outputs=["co.json"],
    ),
    "startup.py": Case(["--repeats", "1", "--sides", "torch"], "[startup] torch threads"),
    "pfl_comparison.py": Case(
        [
            "--data",
            "synthetic",
            "--population",
            "8",
            "--per-client",
            "8",
            "--clients",
            "2",
            "--batch",
            "4",
            "--rounds",
            "1",
            "--json",
            "pfl.json",
        ],
        "[pfl_comparison] wrote pfl.json",
        slow=True,  # four processes, each with its imports and a warm-up round (about 40 s); pfl's may install
        outputs=["pfl.json"],
    ),
    "wire_formats.py": Case(
        ["--repeats", "1", "--calls", "1", "--corruptions", "20", "--json", "w.json"],
        "[wire_formats] wrote w.json",
        outputs=["w.json"],
        needs="safetensors",
    ),
    "factor_families.py": Case(["--width", "8", "--repeats", "1", "--threads", "1"], '"orthonormality_error":'),
    "erm.py": Case(
        [
            "--n",
            "20",
            "--extra",
            "5",
            "--d",
            "4",
            "--classes",
            "3",
            "--samples",
            "2",
            "--repeats",
            "1",
            "--threads",
            "1",
        ],
        '"rows": [',
    ),
    "generator.py": Case(
        [
            "--data",
            "digits",
            "--steps",
            "1",
            "--hidden",
            "8",
            "--num-generated",
            "5",
            "--eval-tasks",
            "1",
            "--samples",
            "2",
            "--threads",
            "1",
        ],
        "| generator, trained |",
    ),
    "gpt_step.py": Case(
        [
            "--batch",
            "1",
            "--context",
            "8",
            "--vocab",
            "11",
            "--n-layer",
            "1",
            "--n-embd",
            "16",
            "--n-head",
            "2",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--threads",
            "1",
            "--latent",
            "4",
            "--rank",
            "2",
        ],
        "step (fwd+bwd+Adam) over 1:",
    ),
    "latent_overhead.py": Case(
        ["--batch", "2", "--steps", "1", "--threads", "1", "--width", "8", "--modes", "streamed"],
        '"streamed_extra_peak_bytes":',
    ),
    "llm_step.py": Case(
        [
            "--tiny",
            "--batch",
            "1",
            "--context",
            "8",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--kronecker",
            "--json",
            "llm.json",
        ],
        "[llm_step] wrote llm.json",
        outputs=["llm.json"],
        needs="peft",
    ),
    "round_overhead.py": Case(["--samples", "64", "--batch", "16", "--clients", "2"], '"ratio":'),
    "in_memory_batches.py": Case(
        [
            "--workload",
            "quickstart",
            "--population",
            "4",
            "--per-client",
            "8",
            "--batch",
            "4",
            "--clients",
            "2",
            "--kinds",
            "latent",
            "--repeats",
            "1",
            "--round",
            "--json",
            "imb.json",
        ],
        "[in_memory_batches] wrote imb.json",
        outputs=["imb.json"],
    ),
    "round_memory.py": Case(["--clients", "5", "--weights", "1000", "--groups", "2"], "| 5 | "),  # 3 processes
    "cohort.py": Case(
        [
            "--models",
            "digits",
            "--clients",
            "4",
            "--cohorts",
            "2",
            "4",
            "--per-client",
            "8",
            "--batch",
            "8",
            "--repeats",
            "1",
            "--json",
            "c.json",
        ],
        "[cohort] wrote c.json",
        outputs=["c.json"],
    ),
    "latent_step.py": Case(
        ["--models", "quickstart", "--steps", "1", "--repeats", "1", "--json", "ls.json"],
        "[latent_step] wrote ls.json",
        outputs=["ls.json"],
    ),
    "dp_sgd.py": Case(
        ["--clients", "2", "--steps", "1", "--batch", "4", "--repeats", "1", "--json", "dp.json"],
        "[dp_sgd] wrote dp.json",
        outputs=["dp.json"],
    ),
    "population.py": Case(
        [
            "--populations",
            "300",
            "--clients",
            "4",
            "--rounds",
            "1",
            "--codec",
            "topk",
            "--client-state-mb",
            "0.01",
            "--json",
            "pop.json",
        ],
        "[population] wrote pop.json",
        outputs=["pop.json"],
    ),
    "flower_overhead.py": Case(
        [
            "--workloads",
            "quickstart",
            "--clients",
            "2",
            "--rounds",
            "2",
            "--repeats",
            "1",
            "--round-timeout",
            "120",
            "--run-timeout",
            "300",
            "--workdir",
            "work",
            "--out",
            "flower_overhead",
        ],  # a relative workdir on purpose
        "wrote ",
        slow=True,
        timeout=900.0,
        outputs=["flower_overhead.csv", "flower_overhead.md"],
        needs="flwr",  # the "flower" extra
    ),
    "privacy_audit.py": Case(
        ["--sides", "latent", "--z", "2", "--canaries", "10", "--rounds", "2", "--json", "audit.json"],
        "| latent | 2 |",
        slow=True,  # (it pretrains the quickstart's base)
        timeout=900.0,
        outputs=["audit.json"],
    ),
    "rate_limited_rounds.py": Case(
        [
            "--methods",
            "flite",
            "--rates",
            "10",
            "--rounds",
            "2",
            "--idle",
            "1",
            "--run-timeout",
            "300",
            "--workdir",
            "work",
            "--out",
            "rate_limited_rounds",
        ],
        "wrote rate_limited_rounds.csv",
        slow=True,  # root and ip netns: a Flower deployment in a namespace per rate
        timeout=900.0,
        outputs=["rate_limited_rounds.csv", "rate_limited_rounds.md", "rate_limited_rounds.json"],
        needs="flwr",
    ),
    "shaped_links.py": Case(
        [
            "--methods",
            "flite",
            "--rates",
            "10",
            "--rounds",
            "2",
            "--repeats",
            "1",
            "--check-bytes",
            "20000",
            "--run-timeout",
            "300",
            "--workdir",
            "work",
            "--out",
            "shaped_links",
        ],
        "wrote shaped_links.csv",
        slow=True,  # root and ip netns: a Flower deployment over a namespace per client
        timeout=900.0,
        outputs=["shaped_links.csv", "shaped_links.md", "shaped_links.json"],
        needs="flwr",
    ),
    "gpu_check.py": Case(
        ["--out", "gc", "--tiny", "--accelerator", "cpu", "--parts", "flite", "smollm2", "--limit", "flite=120"],
        "every part ok",
        slow=True,  # test_gpu_check_writes_every_part_on_a_cpu_at_a_tiny_size runs every part by default
        outputs=["gc/flite.json", "gc/smollm2.json", "gc/summary.json"],
        needs="peft",
    ),
    "llm_client.py": Case(
        ["--tiny", "--steps", "2", "--repeats", "1", "--threads", "1", "--copies", "--json", "client.json"],
        "ours_full copies per round, in trained states: copy_",
        outputs=["client.json"],
        needs="peft",
    ),
    "llm_options.py": Case(
        ["--tiny", "--steps", "1", "--repeats", "1", "--threads", "1", "--method", "lora", "--json", "options.json"],
        "lora bfloat16+checkpointing:",
        outputs=["options.json"],
        needs="peft",
        timeout=300.0,
    ),
    "instruction_padding.py": Case(
        ["--tiny", "--tasks", "arithmetic", "units", "--epochs", "1", "--batch", "1", "4", "--json", "pad.json"],
        "batch   4:",
        outputs=["pad.json"],
        needs="transformers",
    ),
    "threads.py": Case(
        ["--rounds", "1", "--repeats", "1", "--root", "runs", "--out", "threads.json"],
        "wrote threads.json",
        slow=True,
        timeout=900.0,
        outputs=["threads.json"],
    ),
}

SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))  # _harness.py is shared code


def run_script(script: str, args: list[str], folder, timeout: float) -> subprocess.CompletedProcess:
    """``python benchmarks/<script> args`` in ``folder``, forked from this process (``forking.run_python``);
    its process group is killed if it outlives ``timeout``."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TQDM_DISABLE="1",
        PYTHONUNBUFFERED="1",
        LIGHTNING_FL_CACHE=str(folder / "cache"),
        LIGHTNING_FL_DATA=str(folder / "data"),
        PYTHONPATH=os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH")] if p),
    )
    try:
        return run_python([BENCHMARKS / script, *args], cwd=folder, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        output = f"--- stdout\n{exc.output[-3000:]}\n--- stderr\n{exc.stderr[-3000:]}"
        pytest.fail(f"{script} ran past {timeout:.0f} s\n{output}")


def test_every_benchmark_has_a_tiny_case():
    assert SCRIPTS, f"no scripts found in {BENCHMARKS}"
    missing = [s for s in SCRIPTS if s not in CASES]
    assert not missing, f"add a tiny run of {missing} to CASES in {__file__}"


@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=[pytest.mark.slow] if s in CASES and CASES[s].slow else []) for s in SCRIPTS]
)
def test_benchmark_runs_at_a_tiny_size(script, tmp_path):
    if script not in CASES:
        pytest.fail(f"{script} has no tiny case in CASES")
    case = CASES[script]
    if case.needs:
        pytest.importorskip(case.needs)
    proc = run_script(script, case.args, tmp_path, case.timeout)
    report = (
        f"{script} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    )
    assert proc.returncode == 0, report
    assert case.expect in proc.stdout, report
    for name in case.outputs:
        assert (tmp_path / name).is_file(), f"{script} did not write {name}\n{report}"
    last = proc.stdout.strip().splitlines()[-1]
    if last.startswith("{"):  # scripts that end with their results as JSON: every number in it is finite
        numbers = list(_numbers(json.loads(last)))
        assert numbers and all(math.isfinite(x) for x in numbers), last


@pytest.mark.parametrize(("variant", "upload"), [("lora", 2_304), ("ffa", 1_152)])
def test_gpt_step_times_a_lora_step_and_counts_its_adapters(tmp_path, variant, upload):
    """``gpt_step.py --lora 2`` on a 1-layer, 16-wide TinyGPT: the adapters on its 6 projections (4 of 16 x 16,
    16 x 64 and 64 x 16) are r (in + out) values each for LoRA, 576 floats, and r x out for FFA-LoRA (only B), 288."""
    pytest.importorskip("peft")
    args = [
        "--batch",
        "1",
        "--context",
        "8",
        "--vocab",
        "11",
        "--n-layer",
        "1",
        "--n-embd",
        "16",
        "--n-head",
        "2",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--lora",
        "2",
        "--variant",
        variant,
    ]
    proc = run_script("gpt_step.py", args, tmp_path, 180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = {"lora": "LoRA", "ffa": "FFA-LoRA"}[variant]
    assert f"{name}: r=2 on the projections: {upload // 4:,} trained values, {upload:,} bytes" in proc.stdout


def test_gpt_step_refuses_a_latent_and_lora_together(tmp_path):
    both = run_script("gpt_step.py", ["--lora", "2", "--latent", "4"], tmp_path, 180)
    assert both.returncode == 2 and "--latent and --lora are two methods" in both.stderr


def test_client_overhead_pairs_every_timed_round_with_a_floor_on_the_cross_device_network(tmp_path):
    """The cross-device workload (issue 39's plain CNN on 28x28 images) at a tiny size: 2 fits of 3 rounds give
    4 timed rounds and 4 floors, every number finite."""
    args = [
        "--workload",
        "cross-device",
        "--population",
        "4",
        "--per-client",
        "4",
        "--clients",
        "2",
        "--batch",
        "2",
        "--rounds",
        "3",
        "--repeats",
        "2",
        "--json",
        "co.json",
    ]
    proc = run_script("client_overhead.py", args, tmp_path, 180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "co.json").read_text())["results"]
    assert results["settings"]["backbone"] == "plain" and "latent" not in results
    seconds = results["full"]["per_client_seconds"]
    assert seconds["trainer"]["cpu"]["n"] == seconds["floor"]["cpu"]["n"] == 4
    assert all(math.isfinite(x) and x > 0 for x in _numbers(seconds))


def pfl_comparison():
    """benchmarks/pfl_comparison.py as a module (its folder on the path while it imports)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import pfl_comparison
    finally:
        sys.path.remove(str(BENCHMARKS))
    return pfl_comparison


def pfl_or_skip() -> None:
    """Make (once) the virtual environment with pfl 0.6.0 the benchmark runs pfl in, or skip the test."""
    from pathlib import Path

    if pfl_comparison().pfl_python(Path.home() / ".cache" / "lightning_fl" / "pfl-venv") is None:
        pytest.skip("pfl[pytorch]==0.6.0 cannot be installed here")


TINY_PFL = ["--data", "synthetic", "--population", "8", "--per-client", "12", "--clients", "4", "--batch", "4"]


@pytest.mark.slow
def test_pfl_comparison_alternates_ours_and_pfl_on_the_same_clients(tmp_path):
    """benchmarks/pfl_comparison.py at a tiny size: every side reports a CPU time per timed round, pfl's included
    (skipped if pfl 0.6.0 cannot be installed here), the ratios are per round of the alternation, and with the
    defaults (Adam, the plain CNN, pfl fed from slices) ours and pfl's global weights end equal up to float32 rounding
    (Adam's normalised steps carry it further than SGD's)."""
    pfl_or_skip()
    args = [*TINY_PFL, "--rounds", "2", "--json", "pfl.json"]
    proc = run_script("pfl_comparison.py", args, tmp_path, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "pfl.json").read_text())["results"]
    assert results["sides"] == ["ours", "pfl", "latent", "lockstep"] and results["pfl"] == "0.6.0"
    assert all(len(v) == 2 and min(v) > 0 for v in results["cpu_seconds_per_round"].values())
    assert set(results["ratios"]) == {"ours/pfl", "latent/ours", "lockstep/ours", "latent/pfl", "lockstep/pfl"}
    setting = {k: results["setting"][k] for k in ("optimizer", "lr", "model", "evaluate", "identity_check", "pfl_feed")}
    assert setting == {
        "optimizer": "adam",
        "lr": 0.01,
        "model": "plain",
        "evaluate": False,
        "identity_check": "on",
        "pfl_feed": "slices",
    }
    weights = results["weights"]
    assert weights["rounds"] == 3 and weights["max_abs_update"] > 0.01
    assert weights["max_abs_difference"] < 1e-4, weights


@pytest.mark.slow
def test_pfl_comparison_trains_the_same_weights_on_both_sides_on_the_users_workload(tmp_path):
    """The workload users run (SGD with momentum 0.9 at 0.05, the GroupNorm CNN, the server evaluating every round,
    pfl fed through its documented ``FederatedDataset(make_dataset_fn, user_sampler)`` path): after a warm-up and a
    timed round from the same initial weights, on the same clients' batches in the same order, ours and pfl's global
    weights agree to float32 rounding, while training moved them by far more than that."""
    pfl_or_skip()
    args = [*TINY_PFL, "--rounds", "1", "--sides", "ours", "pfl", "--optimizer", "sgd-momentum", "--model", "groupnorm"]
    args += ["--evaluate", "--eval-images", "16", "--pfl-feed", "dataset", "--json", "pfl.json", "--table", "pfl.md"]
    proc = run_script("pfl_comparison.py", args, tmp_path, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "pfl.json").read_text())["results"]
    assert results["setting"]["lr"] == 0.05 and results["setting"]["momentum"] == 0.9
    assert results["settings"]["eval_images"] == 16
    weights = results["weights"]
    assert weights["rounds"] == 2 and weights["max_abs_update"] > 0.01, weights
    assert weights["max_abs_difference"] < 1e-6, weights
    assert "Global weights after 2 rounds, ours against pfl's" in (tmp_path / "pfl.md").read_text()


def test_the_pfl_comparison_grid_goes_from_the_published_workload_to_the_users_one_factor_at_a_time():
    """``--grid``'s settings start at the published runs' workload, end at the users' (pfl fed as its documentation
    feeds it) and change one choice from each to the next; its table has a row per setting with every ratio."""
    module = pfl_comparison()
    grid = module.GRID
    assert grid[0] == {
        "optimizer": "adam",
        "model": "plain",
        "evaluate": False,
        "identity_check": "off",
        "pfl_feed": "slices",
    }
    assert grid[-1] == {
        "optimizer": "sgd-momentum",
        "model": "groupnorm",
        "evaluate": True,
        "identity_check": "on",
        "pfl_feed": "dataset",
    }
    assert all(sum(a[k] != b[k] for k in a) == 1 for a, b in itertools.pairwise(grid))
    spread = {"min": 1.0, "median": 1.5, "max": 2.0}
    runs = [
        {
            "setting": {**choice, "lr": 0.05, "momentum": 0.9, "tag": f"s{i}"},
            "rounds": 4,
            "summary": dict.fromkeys(("ours", "pfl", "latent", "lockstep"), spread),
            "ratios": dict.fromkeys(("ours/pfl", "latent/ours", "lockstep/ours"), spread),
            "weights": {"rounds": 5, "max_abs_difference": 2e-8, "max_abs_update": 0.1, "max_abs_weight": 1.0},
        }
        for i, choice in enumerate(grid)
    ]
    lines = module.grid_table(runs)
    rows = [line for line in lines if line.startswith("| ")]
    assert len(rows) == 2 + len(grid)
    assert rows[0].count("|") == rows[1].count("|") == rows[2].count("|") == 14
    assert "**ours / pfl**" in rows[0] and "weights apart" in rows[0]
    assert rows[-1].startswith("| sgd-momentum | groupnorm | every round | on | dataset | 1.000 / 1.500 |")
    assert rows[-1].endswith("| 1.000 / **1.500** | 2.0e-08 |")


def test_the_cohort_rule_grid_reports_each_point_with_the_rules_decision(tmp_path):
    """benchmarks/cohort.py --grid at a tiny size: every point's activations are the network's (8x8 images: the
    first convolution's 32 channels x 64 pixels per image) and its decision is the trainer's rule."""
    from lightning_fl.federated.clients.cohort import MAX_CLIENT_ACTIVATION, MAX_COHORT_ACTIVATION

    args = [
        "--grid",
        "--grid-images",
        "8",
        "--clients",
        "4",
        "--cohorts",
        "2",
        "4",
        "--repeats",
        "1",
        "--json",
        "g.json",
    ]
    proc = run_script("cohort.py", args, tmp_path, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "g.json").read_text())["results"]["grid"]["rows"]
    assert [(r["kind"], r["batch"], r["cohort"]) for r in rows] == [
        (kind, batch, k) for kind in ("latent", "full") for batch in (16, 32) for k in (2, 4)
    ]
    for r in rows:
        assert r["client_activation"] == r["batch"] * 32 * 8 * 8
        within = r["client_activation"] <= MAX_CLIENT_ACTIVATION and r["cohort_activation"] <= MAX_COHORT_ACTIVATION
        assert r["rule_runs_cohort"] == within
        assert math.isfinite(r["speedup_cpu"]["median"]) and r["speedup_cpu"]["median"] > 0


def _numbers(value):
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield float(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s in CASES and CASES[s].slow])
def test_slow_benchmarks_still_take_their_tiny_options(script, tmp_path):
    """The slow cases run only under ``-m slow``; their imports and the options they use are checked always."""
    proc = run_script(script, ["--help"], tmp_path, 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    options = [a for a in CASES[script].args if a.startswith("--")]
    assert options
    usage = proc.stdout.split("\n\n")[0]  # "usage: ... [--option VALUE] ...", before the description
    assert usage.startswith("usage:"), proc.stdout[:500]
    for option in options:
        assert re.search(rf"(?<![\w-]){option}(?![\w-])", usage), f"{script} no longer takes {option}:\n{usage}"


def test_the_harness_alternates_the_sides_and_reports_min_and_median():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import _harness
    finally:
        sys.path.remove(str(BENCHMARKS))
    calls = []
    samples = _harness.alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
    assert calls == ["a", "b"] * 3 and [len(v) for v in samples.values()] == [3, 3]
    fake = {"a": [_harness.Sample(2.0, 1.0), _harness.Sample(6.0, 3.0)], "b": [_harness.Sample(1.0, 1.0)] * 2}
    ratio = _harness.ratios(fake, "a", "b")
    assert ratio["wall"]["min"] == 2.0 and ratio["wall"]["median"] == 4.0 and ratio["cpu"]["max"] == 3.0
    assert _harness.summarise(fake, per=2)["a"]["wall"] == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 2}


def test_the_shaped_links_benchmark_predicts_with_the_clocks_formula_and_reads_its_logs(tmp_path):
    """benchmarks/shaped_links.py's pure parts: the prediction is the clock's round (latency, download at the client's
    down rate, its compute, latency, upload at its up rate; the slowest client closes it), the latency is calibrated
    from rounds without a limit, and the SuperNodes' and workers' logs are read into per-client phases."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import shaped_links
    finally:
        sys.path.remove(str(BENCHMARKS))
    # client 0: 0.5 + 1 s down (125 kB at 1 Mbit/s), 1 s, 0.5 + 1 s up = 4.0 s; client 1: 0.5 + 0.1 + 2 + 0.5 + 0
    got = shaped_links.predict_round([1.0, 2.0], [125_000, 125_000], [125_000, 0], [1.0, 10.0], [1.0, None], 0.5)
    assert got == pytest.approx(4.0)
    assert shaped_links.predict_round([1.0, 2.0], [125_000] * 2, [0, 0], [None, None], [None, None], 0.0) == 2.0
    rounds = [{"round_s": 10.0, "busy_s": [4.0, 6.0]}, {"round_s": 9.0, "busy_s": [5.0, 3.0]}]
    assert shaped_links.latency_from([*rounds, {"round_s": 20.0, "busy_s": [2.0, 2.0]}]) == pytest.approx(2.0)
    log = tmp_path / "supernode0.log"
    log.write_text(
        "100.000 INFO :      [RUN 7, ROUND 2]\n100.100 INFO :      Receiving: train message (ID: a)\n"
        "101.000 INFO :      Start `flwr-clientapp` process\n"
        "101.600 INFO :      Received successfully\nno time stamp: Sent successfully\n"
        "104.000 INFO :      [RUN 7, ROUND 2]\n104.000 INFO :      Sending: train message (ID: b)\n"
        "105.500 INFO :      Sent successfully\n106.000 INFO :      [RUN 7]\n106.100 INFO :      Receiving: query m\n"
        "106.200 INFO :      Received successfully\n",
        encoding="utf-8",
    )
    timeline = shaped_links.node_timeline(log, 0)
    assert timeline == {2: {"receiving": 100.1, "started": 101.0, "received": 101.6, "sending": 104.0, "sent": 105.5}}
    r = shaped_links.phases({"round_s": 7.0, "node": [timeline[2]], "msg_client_down_bytes": 125_000.0})
    assert r["down_s"] == pytest.approx([1.5]) and r["setup_s"] == pytest.approx([0.9])
    assert r["app_s"] == pytest.approx([2.4])  # from the download's end (after the setup's)
    assert r["up_s"] == pytest.approx([1.5]) and r["busy_s"] == pytest.approx([5.4])
    r["msg_client_up_bytes"] = 0.0  # 1 s down at 1 Mbit/s, the 0.9 s setup under it; or both, one after the other
    assert shaped_links.pred(r, [(1.0, None)], 0.5) == pytest.approx(0.5 + 1.0 + 2.4 + 0.5)
    assert shaped_links.pred(r, [(1.0, None)], 0.5, setup=False) == pytest.approx(0.5 + 1.0 + 0.9 + 2.4 + 0.5)
    assert shaped_links.phases({"round_s": 7.0, "node": [timeline[2], {"receiving": 1.0}]}) is None
    worker = tmp_path / "worker0.log"
    worker.write_text(
        "[lightning_fl.flower.worker] hello (round -) served in 0.20 s\n"
        "[lightning_fl.flower.worker] train (round 3) served in 1.25 s\n",
        encoding="utf-8",
    )
    assert shaped_links.worker_compute(worker, 0) == {3: 1.25}


def test_what_a_benchmark_writes_names_no_folder_of_the_machine_it_ran_on(tmp_path, capsys):
    """A results file quotes its command and settings with every path inside the repository relative to it and any
    other absolute path as a placeholder named after its option; threads.py's runs go to a temporary folder."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import _harness
    finally:
        sys.path.remove(str(BENCHMARKS))
    work, inside = tmp_path / "work", REPO / "docs" / "results" / "x.json"
    command = _harness.command_line("rate_limited_rounds.py", ["--workdir", str(work), "--json", str(inside), "-v"])
    assert command == "python benchmarks/rate_limited_rounds.py --workdir <workdir> --json docs/results/x.json -v"
    written = tmp_path / "out.json"
    _harness.report("b", _harness.machine(), {"json": str(tmp_path / "r.json"), "root": work, "n": 3}, written)
    results = json.loads(written.read_text())["results"]
    assert results == {"json": "<json>", "root": "<root>", "n": 3} and str(tmp_path) not in written.read_text()
    assert "/tmp/" not in (BENCHMARKS / "threads.py").read_text()


@pytest.mark.slow
def test_a_population_of_100000_clients_costs_little_memory(tmp_path):
    """10^5 clients (800,000 images): the images are generated a chunk at a time, the partition is two flat arrays
    and per-client state exists only for the clients sampled, so the run adds under 400 MiB to what the imports
    hold (148 MiB measured; before chunked generation the float64 noise alone added about 1.2 GB, a 1,961 MiB
    peak, with these settings), and top-k's residuals exist for the 100 clients sampled."""
    args = ["--populations", "100000", "--clients", "100", "--rounds", "1", "--codec", "topk", "--json", "p.json"]
    proc = run_script("population.py", args, tmp_path, 900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads((tmp_path / "p.json").read_text())["results"]["populations"]
    assert result["peak_rss_mib"] - result["rss_after_import_mib"] < 400, result
    assert result["clients_with_state"] == {"residuals": 100}, result


GPU_CHECK_PARTS = ("tests", "fmp", "flite", "rounds", "smollm2")


def test_gpu_check_writes_every_part_on_a_cpu_at_a_tiny_size(tmp_path):
    """benchmarks/gpu_check.py --tiny --accelerator cpu (issue 76's one command for a GPU machine): every part ends ok
    and writes its JSON with the environment and its figures, finite and in range; on a CPU the GPU tests are selected
    and skipped, 16-mixed is recorded as unsupported, the rounds have no GPU side and there is no GPU memory; no
    folder of this machine is written into the JSON (the work and data folders are WORK and DATA)."""
    import tempfile

    import torch

    pytest.importorskip("peft")
    fake_mnist_folder(tmp_path / "fashion", n_train=200, n_test=40)
    args = ["--out", "out", "--tiny", "--accelerator", "cpu", "--fashion-mnist", "fashion"]
    proc = run_script("gpu_check.py", args, tmp_path, 1200)
    log = tmp_path / "out" / "gpu_check.log"
    report = f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n" + (
        log.read_text()[-6000:] if log.is_file() else ""
    )
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("every part ok"), report
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([*(f"{p}.json" for p in GPU_CHECK_PARTS), "summary.json", "gpu_check.log"])
    summary = json.loads((out / "summary.json").read_text())
    assert {p: s["status"] for p, s in summary["parts"].items()} == dict.fromkeys(GPU_CHECK_PARTS, "ok"), report
    parts = {p: json.loads((out / f"{p}.json").read_text()) for p in GPU_CHECK_PARTS}
    for name, data in parts.items():
        assert data["part"] == name and data["status"] == "ok" and data["errors"] == [], (name, data["errors"])
        env = data["environment"]
        assert data["accelerator"] == env["device"] == "cpu" and data["tiny"] is True and env["device_name"]
        assert env["torch"] == torch.__version__ and env["cuda"] == torch.version.cuda
        assert 0 < data["seconds"] < data["limit_s"]
        text = (out / f"{name}.json").read_text()
        for folder in (tmp_path, REPO, tempfile.gettempdir()):
            assert str(folder) not in text, (name, folder)

    tests = parts["tests"]["results"]
    gpu, sample = tests["gpu_marked"], tests["sample"]
    assert gpu["exit_code"] == 0 and gpu["selected"] == gpu["skipped"] >= 1  # they need CUDA
    assert sample["exit_code"] == 0 and sample["selected"] == sample["passed"] >= 1 and sample["failures"] == []

    fmp = parts["fmp"]["results"]["precisions"]
    assert fmp["16-mixed"]["status"] == "unsupported"
    for precision in ("32-true", "bf16-mixed"):
        run = fmp[precision]
        assert run["status"] == "ok" and run["steps"] == len(run["loss_curve"]) == 6 and run["warmup_steps"] == 2
        assert all(math.isfinite(x) and x > 0 for x in run["loss_curve"])
        assert all(r["mean"] > 0 and r["median"] > 0 for r in run["steps_per_s"].values())
    agree = fmp["bf16-mixed"]["against_32_true"]
    assert agree["steps_compared"] == 6 and agree["warmup"]["steps"] == 2 and agree["theta_distance"]["steps"] == 4
    assert 0 <= agree["theta_distance"]["median_rel_diff"] <= agree["theta_distance"]["max_rel_diff"] < 0.05

    flite = parts["flite"]["results"]
    assert flite["modes"] == ["stored", "regenerate", "streamed", "kronecker"]
    for precision in ("32-true", "bf16-mixed"):
        run = flite["precisions"][precision]
        assert run["status"] == "ok" and set(run["step_s"]) == {"full", *flite["modes"]}
        assert all(s["median"] > 0 for s in run["step_s"].values())
        assert set(run["latent_over_full"]) == set(flite["modes"])
        assert all(math.isfinite(r["median"]) and r["median"] > 0 for r in run["latent_over_full"].values())
        assert all(set(m.values()) == {None} for m in run["memory"].values())  # GPU memory: on a GPU

    rounds = parts["rounds"]["results"]
    assert rounds["accelerators"] == ["cpu"] and rounds["rounds"] == 1
    for name in ("quickstart", "flite_fashion_mnist"):
        assert set(rounds["configs"][name]) == {"cpu"}
        run = rounds["configs"][name]["cpu"]
        (last,) = run["rounds"]
        assert run["status"] == "ok" and last["round"] == 1 and run["last_round_s"] == last["round_s"]
        assert last["round_s"] >= last["clients_and_server_s"] > 0 and 0 <= last["val_acc"] <= 1

    llm = parts["smollm2"]["results"]
    assert llm["model"].startswith("random tiny Llama") and llm["projections"] == 14
    for precision in ("32-true", "bf16-mixed"):
        per = llm["precisions"][precision]
        assert list(per) == ["full", "flite", "lora", "ffa"]
        assert all(m["status"] == "ok" and m["step_s"]["median"] > 0 for m in per.values())
        uploads = {k: m["upload_floats"] for k, m in per.items()}
        assert uploads["full"] == llm["weights"] and uploads["flite"] == llm["latent_dim"] * llm["projections"]
        assert 0 < uploads["ffa"] < uploads["lora"] < uploads["full"]


def test_gpu_check_records_a_part_past_its_limit_or_failing_and_goes_on(tmp_path):
    """A part that outruns its limit is written as timed out, keeping what it had recorded, a failing part as failed
    with its error, and the script exits 1; bad arguments exit 2 with one line."""
    (tmp_path / "bad.gguf").write_bytes(b"not a model")
    args = ["--out", "out", "--accelerator", "cpu", "--parts", "fmp", "smollm2", "--limit", "fmp=2"]
    args += ["--smollm2", "bad.gguf"]
    proc = run_script("gpu_check.py", args, tmp_path, 300)
    assert proc.returncode == 1 and proc.stdout.rstrip().endswith("not ok: fmp, smollm2"), proc.stdout[-3000:]
    fmp = json.loads((tmp_path / "out" / "fmp.json").read_text())
    assert fmp["status"] == "timeout" and fmp["errors"] == ["ran past its limit of 2 s"] and fmp["seconds"] >= 2
    assert fmp["results"]["config"] == "configs/fmp_digits.yaml"  # written before the limit
    llm = json.loads((tmp_path / "out" / "smollm2.json").read_text())
    (error,) = llm["errors"]
    assert llm["status"] == "failed" and error.startswith("smollm2 model: "), error

    parts = ", ".join(GPU_CHECK_PARTS)
    for bad, line in [
        (["--limit", "fmp=soon"], f"gpu_check: --limit fmp=soon: give PART=SECONDS, PART one of {parts}, SECONDS > 0"),
        (["--fashion-mnist", "nowhere"], "gpu_check: --fashion-mnist nowhere: no such folder"),
    ]:
        proc = run_script("gpu_check.py", ["--out", "o2", *bad], tmp_path, 120)
        assert proc.returncode == 2 and proc.stderr.strip() == line, proc.stderr
