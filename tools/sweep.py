"""Run a grid of federated runs (configs x overrides x seeds) through the real CLI and collect one CSV.

A sweep file lists runs; each run is a config plus CLI overrides, repeated for every seed:

```yaml
name: flite_claims                 # runs go to <out>/<run>__seed<k>/version_0/
out: runs/sweeps/flite_claims
seeds: [0, 1, 2]
common: ["--trainer.rounds", "5"]  # overrides for every run
runs:
  - label: latent_d64              # one row label in the CSV (and the tables)
    config: configs/flite_fashion_mnist.yaml
    args: []
    tags: {method: latent, d: 64}  # free columns for tools/report.py
  - label: latent_d{d}             # a grid: one run per combination of the values
    config: configs/flite_fashion_mnist.yaml
    args: ["--model.latent_dim", "{d}"]
    grid: {d: [16, 256]}
    tags: {method: latent, d: "{d}"}
```

    python tools/sweep.py SWEEP.yaml            # run what is missing, resume what is unfinished, collect
    python tools/sweep.py SWEEP.yaml --collect  # only (re)build the CSV from the finished checkpoints
    python tools/sweep.py SWEEP.yaml --dry-run  # print the commands
    python tools/sweep.py SWEEP.yaml --seeds 0  # only seed 0 now (the other seeds on a later call)
    python tools/sweep.py SWEEP.yaml --only A --no-collect  # one worker of several; --collect once they end

A run is finished when its ``last.ckpt`` has done all ``trainer.rounds``; unfinished runs continue from
it (``--trainer.resume auto``). When a run fails, the sweep goes on with the others, collects what finished,
and exits with status 1 naming the failed runs. A run may list its own ``seeds`` (e.g. a side check on one
seed). ``seed_args`` (e.g. ``["--data.seed", "{seed}"]``) are added to every command with the seed filled in,
for configs whose data or caches have seeds of their own.

A run may list ``seed_args`` of its own too (a method's seed of its factors or adapters: ``["--model.init_args.
factor_seed", "{seed}"]``), added after the sweep's. ``metrics`` lists metric columns the CSV adds to the standard
ones (e.g. ``val/exact_match``, ``test/exact_match``).

``config_args`` (``{config path: [arguments]}``) puts arguments right after ``--config`` for the runs of that
config, before ``common`` and the run's own arguments, which override them: a sweep pins there the settings its
configs had when it ran, so it reruns as it ran after the configs change.

``kind: oneshot`` is for configs run by ``lightning.Trainer`` whose numbers come from ``test`` (FMP and
its baselines): each run is ``fit`` (until ``trainer.max_steps``, resuming from ``last.ckpt``) then
``test --ckpt_path last.ckpt``; the CSV has one row per run with every scalar the test logged, plus the
last value of every ``val/*`` and ``generator/*`` scalar of the fit. A run with ``fit_from: <label>`` only
tests, from the checkpoint of that run with the same seed: for runs whose arguments change only what ``test``
reads (FMP's meta-training does not depend on the target tasks' ``data.alpha``, tested), so the fit is not
repeated; the label must name a run listed before it that fits itself.

For federated runs the CSV (``<out>/results.csv``) has one row per run and round, with the
run's label, seed and tags, ``final`` (1 on the last round), and the logged metrics: ``val/acc``,
``val/ece``, ``comm/cum_client_bytes``, ``comm/client_up_bytes``, ``fed/identity_error``, ``time/elapsed_s``...
A private run (its history logs ``privacy/epsilon`` or ``privacy/record_epsilon_max``) leaves the columns of
:data:`UNPROTECTED_COLUMNS` blank, statistics of the clients' updates outside the mechanism (a run now keeps them out
of its history, unless ``trainer.unprotected_statistics`` renames them ``unprotected/*``; checkpoints of older runs
hold them), and a sweep with private runs leaves out those of them no row has.

Every row also has ``environment``: the machine its run ran on, as the run folder's ``environment.json`` records it
(``torch=... device=cpu cpu=AVX512 threads=1``; `` + `` between two when a run resumed on another machine; empty
for a folder from before it was recorded). A base pretrained on another machine is another base (its cache key
holds the environment too), and a sweep's rows are compared seed by seed, so collecting refuses a sweep whose
finished runs ran on different machines: give those runs a sweep of their own.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from lightning_fl.checkpoint import atomic_write_text, environment_label
from lightning_fl.trainer_api import read_environments

METRIC_COLUMNS = [
    "val/acc",
    "val/ece",
    "val/ppl",
    "val/loss",
    "train/loss",
    "comm/client_up_bytes",
    "comm/client_down_bytes",
    "comm/cum_client_bytes",
    "comm/cum_client_up_bytes",
    "comm/cum_rejected_bytes",
    "fed/identity_error",
    "fed/update_norm_median",
    "fed/update_norm_max_ratio",
    "privacy/epsilon",
    "privacy/clip_norm",
    "privacy/noise_multiplier",
    "privacy/unclipped_fraction",
    "privacy/record_epsilon_max",
    "privacy/record_noise_multiplier_max",
    "fed/clients",
    "fed/dropped_clients",
    "fed/attacked_clients",
    "fed/unavailable_clients",
    "fed/round_skipped",
    "time/round_s",
    "time/elapsed_s",
    "time/simulated_round_s",
    "time/simulated_elapsed_s",
    "time/client_download_s",
    "time/client_compute_s",
    "time/client_upload_s",
    "fed/late_clients",
    "fed/staleness_mean",
    "fed/staleness_max",
]


#: What a private run's rows never carry (docs/privacy.md, "What is not protected"): the clients' logged loss, their
#: update norms, the averaging identity error of their uploads, and the uploads refused.
UNPROTECTED_COLUMNS = (
    "train/loss",
    "comm/cum_rejected_bytes",
    "fed/identity_error",
    "fed/update_norm_median",
    "fed/update_norm_max_ratio",
    "fed/dropped_clients",
)


def private(history: list[dict]) -> bool:
    """Whether a run's history is a private run's (user-level or record-level DP)."""
    return any("privacy/epsilon" in h or "privacy/record_epsilon_max" in h for h in history)


def expand(spec: dict) -> list[dict]:
    """Every run of the sweep: grids expanded, then one entry per seed."""
    runs = []
    for entry in spec["runs"]:
        grid = entry.get("grid") or {}
        keys = list(grid)
        for values in itertools.product(*(grid[k] for k in keys)) if keys else [()]:
            fill = dict(zip(keys, values, strict=True))

            def sub(x, fill=fill):
                return x.format(**fill) if isinstance(x, str) else x

            label = sub(entry["label"])
            runs.append(
                {
                    "label": label,
                    "config": sub(entry["config"]),
                    "args": [sub(a) for a in entry.get("args", [])],
                    "tags": {k: sub(v) for k, v in (entry.get("tags") or {}).items()},
                    "fit_from": sub(entry["fit_from"]) if entry.get("fit_from") is not None else None,
                    "seed_args": list(entry.get("seed_args", [])),  # filled with the seed only
                    "seeds": entry.get("seeds"),  # a run's own seeds (a check on one seed), else the sweep's
                }
            )
    labels = [r["label"] for r in runs]
    duplicates = sorted({x for x in labels if labels.count(x) > 1})
    if duplicates:
        raise SystemExit(f"error: duplicate run labels in the sweep: {duplicates}")
    for i, run in enumerate(runs):
        base = run["fit_from"]
        if base is None:
            continue
        if spec.get("kind") != "oneshot":
            raise SystemExit(f"error: run {run['label']}: fit_from is only for kind: oneshot sweeps")
        earlier = {r["label"]: r for r in runs[:i]}
        if base not in earlier or earlier[base]["fit_from"] is not None:
            raise SystemExit(
                f"error: run {run['label']}: fit_from {base!r} must name a run listed before it that fits itself"
            )
    seeds = spec.get("seeds", [0])
    return [{**r, "seed": s, "id": f"{r['label']}__seed{s}"} for r in runs for s in r["seeds"] or seeds]


def run_dir(out: Path, run: dict) -> Path:
    return out / run["id"] / "version_0"


def fit_dir(out: Path, run: dict) -> Path:
    """Where the run's fit is: its own run folder, or that of its ``fit_from`` run (same seed)."""
    if run.get("fit_from") is None:
        return run_dir(out, run)
    return out / f"{run['fit_from']}__seed{run['seed']}" / "version_0"


def seed_args(spec: dict, run: dict) -> list[str]:
    """The sweep's ``seed_args`` and then the run's own (e.g. a method's factor or adapter seed), the seed filled in."""
    return [str(a).format(seed=run["seed"]) for a in [*spec.get("seed_args", []), *run.get("seed_args", [])]]


def metric_columns(spec: dict) -> list[str]:
    """The CSV's metric columns: :data:`METRIC_COLUMNS`, then the sweep's ``metrics`` (e.g. ``val/exact_match``)."""
    return [*METRIC_COLUMNS, *(m for m in spec.get("metrics", []) if m not in METRIC_COLUMNS)]


def config_args(spec: dict, run: dict) -> list[str]:
    """``config_args[run's config]``: arguments right after ``--config`` (before ``common`` and the run's own), so a
    sweep can pin settings a config has since changed and still rerun as it ran."""
    return [str(a) for a in (spec.get("config_args") or {}).get(run["config"], [])]


def command(spec: dict, out: Path, run: dict) -> list[str]:
    if spec.get("kind") == "oneshot":
        return oneshot_command(spec, out, run, "test" if run.get("fit_from") else "fit")
    return [
        sys.executable,
        "-m",
        "lightning_fl",
        "fit",
        "--config",
        run["config"],
        *config_args(spec, run),
        *[str(a) for a in spec.get("common", [])],
        *[str(a) for a in run["args"]],
        "--seed_everything",
        str(run["seed"]),
        *seed_args(spec, run),
        "--trainer.default_root_dir",
        str(out),
        "--trainer.name",
        run["id"],
        "--trainer.version",
        "version_0",
        "--trainer.resume",
        "auto",
        "--trainer.enable_progress_bar",
        "false",
    ]


# ------------------------------------------------------------------------------ one-shot runs (lightning.Trainer)
def oneshot_command(spec: dict, out: Path, run: dict, stage: str) -> list[str]:
    """``fit`` into ``<out>/<id>/version_0`` or ``test`` from its ``last.ckpt`` into ``<out>/<id>/test``."""
    cmd = [
        sys.executable,
        "-m",
        "lightning_fl",
        stage,
        "--config",
        run["config"],
        *config_args(spec, run),
        *[str(a) for a in spec.get("common", [])],
        *[str(a) for a in run["args"]],
        "--seed_everything",
        str(run["seed"]),
        *seed_args(spec, run),
        "--trainer.default_root_dir",
        str(out / run["id"]),
        "--trainer.logger.init_args.save_dir",
        str(out),
        "--trainer.logger.init_args.name",
        run["id"],
        "--trainer.logger.init_args.version",
        "version_0" if stage == "fit" else "test",
        "--trainer.enable_progress_bar",
        "false",
    ]
    ckpt = fit_dir(out, run) / "checkpoints" / "last.ckpt"
    if stage == "test" or ckpt.is_file():
        cmd += ["--ckpt_path", str(ckpt)]
    return cmd


def scalars(folder: Path) -> dict[str, float]:
    """The last value of every scalar in a TensorBoard run folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not folder.is_dir():
        return {}
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"]}


def oneshot_status(spec: dict, out: Path, run: dict) -> tuple[str, dict | None]:
    test = scalars(out / run["id"] / "test")
    if any(k.startswith("test/") for k in test):
        return "done", test
    if run.get("fit_from") is not None:
        return "missing", None
    ckpt = run_dir(out, run) / "checkpoints" / "last.ckpt"
    return ("partial" if ckpt.is_file() else "missing"), None


def write_csv(path: Path, header: list, rows: list[list]) -> Path:
    """The whole CSV through a temp file and a rename: two workers of one spec may collect at once, and a reader
    (or an error midway) sees the previous CSV or the new one, never half of one."""
    f = io.StringIO(newline="")
    writer = csv.writer(f)
    writer.writerow(header)
    writer.writerows(rows)
    return atomic_write_text(path, f.getvalue())


def oneshot_collect(spec: dict, out: Path, runs: list[dict]) -> Path:
    tag_names = sorted({k for r in runs for k in r["tags"]})
    rows = []
    for run in runs:
        state, test = oneshot_status(spec, out, run)
        if state != "done":
            continue
        fit = {k: v for k, v in scalars(fit_dir(out, run)).items() if k.startswith(("val/", "generator/"))}
        rows.append((run, {**fit, **test}))
    columns = sorted({k for _, metrics in rows for k in metrics})
    machines = one_machine(spec, [(run, [fit_dir(out, run), out / run["id"] / "test"]) for run, _ in rows])
    path = write_csv(
        out / "results.csv",
        ["sweep", "label", "seed", "environment", *tag_names, "round", "final", *columns],
        [
            [
                spec["name"],
                run["label"],
                run["seed"],
                machines[run["id"]],
                *[run["tags"].get(t, "") for t in tag_names],
                0,
                1,
                *[metrics.get(c, "") for c in columns],
            ]
            for run, metrics in rows
        ],
    )
    print(f"wrote {len(rows)} rows to {path}")
    return path


def run_oneshot(spec: dict, out: Path, run: dict, log) -> int:
    if run.get("fit_from") is not None and not (fit_dir(out, run) / "checkpoints" / "last.ckpt").is_file():
        log.write(f"error: the fit of {run['fit_from']}__seed{run['seed']} is not there: run that run first\n")
        return 2
    for stage in ("test",) if run.get("fit_from") is not None else ("fit", "test"):
        proc = subprocess.run(
            oneshot_command(spec, out, run, stage), stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
        if proc.returncode != 0:
            return proc.returncode
    return 0


def target_rounds(spec: dict, out: Path, run: dict) -> int:
    """``trainer.rounds`` the run's command asks for, resolved by the CLI's own parser."""
    from lightning_fl.cli import build_parser

    cfg = build_parser().parse_args(command(spec, out, run)[3:])
    return int(cfg.fit.trainer.init_args.rounds)


def status(spec: dict, out: Path, run: dict) -> tuple[str, dict | None]:
    """``done``, ``partial`` or ``missing``, with the checkpoint when there is one."""
    if spec.get("kind") == "oneshot":
        return oneshot_status(spec, out, run)
    ckpt_path = run_dir(out, run) / "checkpoints" / "last.ckpt"
    if not ckpt_path.is_file():
        return "missing", None
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    return ("done" if ckpt["round"] >= target_rounds(spec, out, run) else "partial"), ckpt


def machine(folders: list[Path]) -> str:
    """The environments the run folders record (``environment.json``), one label each, `` + ``-joined."""
    found = []
    for folder in folders:
        found += [e for e in read_environments(folder) if e not in found]
    return " + ".join(environment_label(e) for e in found)


def one_machine(spec: dict, runs: list[tuple[dict, list[Path]]]) -> dict[str, str]:
    """Each finished run's machine (:func:`machine` of its folders), by run id; a sweep whose runs ran on different
    machines is refused in one line (their bases differ, and its rows are paired seed by seed)."""
    machines = {run["id"]: machine(folders) for run, folders in runs}
    by_machine: dict[str, list[str]] = {}
    for run_id, where in machines.items():
        if where:
            by_machine.setdefault(where, []).append(run_id)
    if len(by_machine) > 1:
        listed = "; ".join(f"{len(ids)} on {where} (e.g. {ids[0]})" for where, ids in by_machine.items())
        raise SystemExit(
            f"error: sweep {spec['name']}'s runs ran on different machines, whose bases and rows must not be paired "
            f"or mixed in one CSV: {listed}; rerun them on one machine, or give the others a sweep of their own"
        )
    return machines


def collect(spec: dict, out: Path, runs: list[dict]) -> Path:
    if spec.get("kind") == "oneshot":
        return oneshot_collect(spec, out, runs)
    tag_names = sorted({k for r in runs for k in r["tags"]})
    columns = metric_columns(spec)
    done = [(run, ckpt) for run in runs for state, ckpt in [status(spec, out, run)] if state == "done"]
    machines = one_machine(spec, [(run, [run_dir(out, run)]) for run, _ in done])
    rows, any_private = [], False
    for run, ckpt in done:
        history = ckpt["history"]
        last = max(h["round"] for h in history)
        tags = [run["tags"].get(t, "") for t in tag_names]
        withheld = UNPROTECTED_COLUMNS if private(history) else ()
        any_private = any_private or bool(withheld)
        for h in history:
            first = [spec["name"], run["label"], run["seed"], machines[run["id"]], *tags]
            rows.append(
                [*first, int(h["round"]), int(h["round"] == last)]
                + ["" if m in withheld else h.get(m, "") for m in columns]
            )
    header = ["sweep", "label", "seed", "environment", *tag_names, "round", "final", *columns]
    if any_private:  # (a column no row has stays out, as the committed CSVs of the DP studies have it)
        empty = {i for i, c in enumerate(header) if c in UNPROTECTED_COLUMNS and all(r[i] == "" for r in rows)}
        header = [c for i, c in enumerate(header) if i not in empty]
        rows = [[v for i, v in enumerate(r) if i not in empty] for r in rows]
    path = write_csv(out / "results.csv", header, rows)
    print(f"wrote {len(rows)} rows to {path}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--collect", action="store_true", help="only rebuild the CSV")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument(
        "--no-collect",
        action="store_true",
        help="run, but leave the CSV to a later --collect (several workers on one sweep)",
    )
    parser.add_argument("--only", default=None, help="run only labels containing this text")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="run only these seeds (e.g. 0 first)")
    args = parser.parse_args()
    spec = yaml.safe_load(args.sweep.read_text())
    out = Path(spec.get("out", f"runs/sweeps/{spec['name']}"))
    runs = expand(spec)
    failed = []
    if not args.collect:
        todo = [
            r
            for r in runs
            if (args.only is None or args.only in r["label"]) and (args.seeds is None or r["seed"] in args.seeds)
        ]
        for i, run in enumerate(todo, 1):
            state, _ = status(spec, out, run)
            if state == "done":
                print(f"[{i}/{len(todo)}] {run['id']}: done, skipped")
                continue
            cmd = command(spec, out, run)
            print(f"[{i}/{len(todo)}] {run['id']}: {'resuming' if state == 'partial' else 'running'}")
            if args.dry_run:
                print("  " + " ".join(cmd))
                continue
            out.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            with (out / f"{run['id']}.log").open("w") as log:
                if spec.get("kind") == "oneshot":
                    code = run_oneshot(spec, out, run, log)
                else:
                    code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()).returncode
            if code != 0:
                print(f"  failed (exit {code}); see {out / (run['id'] + '.log')}")
                failed.append(run["id"])
            else:
                print(f"  finished in {time.perf_counter() - t0:.0f} s")
    if not (args.dry_run or args.no_collect):
        collect(spec, out, runs)
    if failed:
        runs_word = "run" if len(failed) == 1 else "runs"
        sys.exit(f"error: {len(failed)} {runs_word} failed: {', '.join(failed)} (logs: {out}/<run>.log)")


if __name__ == "__main__":
    main()
