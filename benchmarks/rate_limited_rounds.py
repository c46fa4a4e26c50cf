"""A Flower deployment's round time on a rate-limited network, against what the clock's model predicts.

For each rate (no limit, then ``--rates`` Mbit/s, default 100, 10 and 1) it makes a fresh network namespace whose
loopback a token bucket shapes to that rate (``benchmarks/_netns.py``: one ``tbf`` on ``lo``, MTU 1500), and inside
it runs a whole Flower deployment (a SuperLink and ``--clients`` SuperNodes on 127.0.0.1, started with
``tests/deployment.py``; ``--workers``, the default, puts a warm worker beside each SuperNode) and, one after the
other, ``flwr run`` of each method on the same small task (the digits, the same pretrained base, the same clients):

- ``flite``: configs/quickstart.yaml (FLITE latents, 768-byte payloads);
- ``lora``: configs/lora_digits.yaml (LoRA rank 4, 12,432-byte payloads);
- ``fedavg``: configs/fedavg_digits.yaml (full-weight FedAvg, 207,232-byte payloads),

each with ``--data.num_clients K --trainer.rounds R`` (every client in every round). Every process (the SuperLink,
SuperNodes, workers, SuperExecs, the ServerApp and ClientApps, and ``flwr``) runs in the namespace, so every byte
they exchange crosses the one shaped loopback: the namespace is a single bottleneck of the rate, shared by all
clients and both directions, and by Flower's relaying (ServerApp -> SuperLink -> SuperNode -> ClientApp and back).

Measured per round (from the run's checkpointed history, and a callback, :class:`RoundStamps`, that the ServerApp
runs): the round's wall time without evaluation (``time/clients_and_server_s``), the ledger's payload bytes
(``comm/round_*_bytes``) and Flower message bytes (``comm/msg_round_*_bytes``, all clients), and the bytes that
crossed the namespace's loopback from one round's end to the next (``/proc/self/net/dev`` in the ServerApp, packet
headers and every process's traffic included). Round 1 is warm-up; rounds 2..R are timed (min and median).

Predicted round time at rate B, from the same method's median round without a limit ``T0`` (compute, Flower's
polls and processes) plus transfer time:

- ``clock``: ``T0 + 8 (msg_down + msg_up) / B`` per client: the clock's formula
  (``lightning_fl/federated/arrivals/clock.py``) with latency 0 and every client on a link of its own at B (clients in
  parallel);
- ``shared``: ``T0 + 8 (sum over clients of msg_down + msg_up) / B``: the same messages through one bottleneck;
- ``relayed``: ``T0 + 8 * relayed bytes / B``, the relayed bytes being the round's loopback bytes without a limit
  less the idle deployment's traffic over ``T0`` (``--idle`` seconds of it are counted before the first run): every
  hop of every message, once each, through the one bottleneck, and no polls;
- ``loopback``: ``T0 + 8 * loopback bytes of the round / B``: everything the bottleneck carried in that round,
  polls included (which mostly overlap the compute, so this over-predicts).

Usage (as root; needs ``ip netns`` and ``tc``)::

    python benchmarks/rate_limited_rounds.py                         # 3 methods x (none, 100, 10, 1 Mbit/s), R=3
    python benchmarks/rate_limited_rounds.py --methods flite --rates 10 --rounds 2   # quicker
    python benchmarks/rate_limited_rounds.py --from-json docs/results/rate_limited_rounds.json   # tables only

It writes ``OUT.csv`` and ``OUT.md`` (default docs/results/rate_limited_rounds), with the command in the header, and
``OUT.json``: every round's time and bytes, each rate's idle traffic and tc's counters, and the settings.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import command_line

from lightning_fl.federated.trainer.callbacks import Callback

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
STAMPS = "LIGHTNING_FL_ROUND_STAMPS"  # the folder RoundStamps writes into (an environment variable)
METHODS = {
    "flite": ("configs/quickstart.yaml", "FLITE latents (d=64, r=32)"),
    "lora": ("configs/lora_digits.yaml", "LoRA rank 4"),
    "fedavg": ("configs/fedavg_digits.yaml", "full-weight FedAvg"),
}
APP = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "lightning-fl-rate-limited"
version = "0.1.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "lightning-fl"

[tool.flwr.app.components]
serverapp = "lightning_fl.flower.server:app"
clientapp = "lightning_fl.flower.client:app"

[tool.flwr.app.config]
config = "configs/quickstart.yaml"
overrides = ""
round-timeout = 0.0
wait-for-nodes = 60.0
hello-timeout = 60.0
max-silent-rounds = 3
"""


def lo_bytes() -> int:
    """Bytes sent over ``lo`` in this process's network namespace (``/proc/self/net/dev``)."""
    with open("/proc/self/net/dev", encoding="ascii") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])  # receive: 8 fields, then transmit bytes
    raise RuntimeError("no lo in /proc/self/net/dev")


class RoundStamps(Callback):
    """Writes the wall time and the loopback's byte counter at the start of the rounds and at each round's end, one
    JSON line each, to ``$LIGHTNING_FL_ROUND_STAMPS/<run name>.jsonl`` (nothing when the variable is unset)."""

    def _write(self, trainer: Any, round: int) -> None:
        folder = os.environ.get(STAMPS)
        if folder:
            with open(Path(folder) / f"{trainer.name}.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({"round": round, "time": time.time(), "lo_bytes": lo_bytes()}) + "\n")

    def on_rounds_start(self, trainer: Any, start: int) -> None:
        self._write(trainer, start)

    def on_round_end(self, trainer: Any, round: int, metrics: dict[str, float]) -> None:
        self._write(trainer, round)


# ------------------------------------------------------------------------------------ inside the namespace
def inside(args: argparse.Namespace) -> None:
    """Run every method once on one deployment in this (already shaped) namespace; write the rounds as JSON."""
    sys.path.insert(0, str(REPO / "tests"))
    import deployment  # tests/deployment.py: the SuperLink/SuperNode harness

    from lightning_fl.checkpoint import read_checkpoint

    work = args.workdir.resolve()
    app, stamps = work / "app", work / "stamps"
    app.mkdir(parents=True, exist_ok=True)
    stamps.mkdir(exist_ok=True)
    (app / "pyproject.toml").write_text(APP, encoding="utf-8")  # the app: a pyproject only (a FAB of ~1 KB)
    deployment.enable_subreaper()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the deployment (finally below)
    pythonpath = os.pathsep.join([str(REPO), str(BENCHMARKS), os.environ.get("PYTHONPATH", "")])
    env = {
        "OMP_NUM_THREADS": "1",
        "LIGHTNING_FL_CACHE": str(args.cache),
        "PYTHONPATH": pythonpath,
        "TQDM_DISABLE": "1",
        STAMPS: str(stamps),
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(args.superexec_poll),
    }
    out: dict[str, list[dict]] = {}
    with deployment.FlowerDeployment(
        work / "flower", num_supernodes=args.clients, extra_env=env, workers=args.workers
    ) as d:
        before, t0 = lo_bytes(), time.perf_counter()  # the deployment's idle traffic: its polls
        time.sleep(args.idle)
        idle_bps = 8 * (lo_bytes() - before) / (time.perf_counter() - t0)
        print(f"[{args.label}] idle: {idle_bps / 1e3:.1f} kbit/s over lo", flush=True)
        for method in args.methods:
            config, _ = METHODS[method]
            name = f"{method}-{args.label}"
            overrides = [
                "--data.num_clients",
                str(args.clients),
                "--trainer.rounds",
                str(args.rounds),
                "--trainer.logger",
                "false",
                "--trainer.enable_progress_bar",
                "false",
                "--trainer.default_root_dir",
                str(work / "runs"),
                "--trainer.name",
                name,
                "--trainer.callbacks+=rate_limited_rounds.RoundStamps",
            ]
            run_config = (
                f"config='{REPO / config}' overrides='{shlex.join(overrides)}' round-timeout={args.round_timeout}"
            )
            t0 = time.perf_counter()
            run_id = d.run_app(app, run_config)
            status = d.wait_run(run_id, timeout=args.run_timeout, poll=2.0)
            if status["status"] != "finished:completed":
                raise RuntimeError(f"{name}: {status['status']}\n{d.run_logs(run_id)[-3000:]}")
            (ckpt,) = sorted((work / "runs" / name).glob("**/checkpoints/last.ckpt"))[-1:]
            history = {h["round"]: h for h in read_checkpoint(ckpt)["history"] if h["round"] >= 1}
            marks = [json.loads(line) for line in (stamps / f"{name}.jsonl").read_text().splitlines()]
            rows = []
            for before, after in itertools.pairwise(marks):
                h = history[after["round"]]
                rows.append(
                    {
                        "round": after["round"],
                        "round_s": h["time/clients_and_server_s"],
                        "lo_bytes": after["lo_bytes"] - before["lo_bytes"],
                        **{
                            k: h.get(f"comm/{k}")
                            for k in (
                                "round_up_bytes",
                                "round_down_bytes",
                                "msg_round_up_bytes",
                                "msg_round_down_bytes",
                                "msg_client_up_bytes",
                                "msg_client_down_bytes",
                            )
                        },
                    }
                )
            out[method] = rows
            times = ", ".join(f"{r['round_s']:.2f}" for r in rows)
            print(f"[{args.label}] {method}: rounds {times} s (run {time.perf_counter() - t0:.0f} s)", flush=True)
    args.result.write_text(json.dumps({"idle_bps": idle_bps, "methods": out}), encoding="utf-8")


# ------------------------------------------------------------------------------------ outside: the rates
def prepare_base(cache: Path, work: Path, timeout: float) -> None:
    """Pretrain the digits base once (the three configs share it) into ``cache``, in process, before any deployment:
    else the ServerApp and every ClientApp would each build it at once."""
    env = dict(os.environ, OMP_NUM_THREADS="1", LIGHTNING_FL_CACHE=str(cache), TQDM_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "lightning_fl",
        "fit",
        "--config",
        str(REPO / METHODS["flite"][0]),
        "--trainer.rounds",
        "1",
        "--data.num_clients",
        "2",
        "--trainer.logger",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.default_root_dir",
        str(work / "prepare"),
    ]
    with open(work / "prepare.log", "wb") as log:
        subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=True)


def measure(args: argparse.Namespace, work: Path) -> dict[str, dict[str, Any]]:
    """Per rate (``none`` first): a namespace at that rate, this script ``--inside`` it; its rounds and tc's stats."""
    import _netns

    results: dict[str, dict[str, Any]] = {}
    for rate in [None, *args.rates]:
        label = "none" if rate is None else f"{rate:g}"
        folder = work / f"rate-{label}"
        folder.mkdir(parents=True, exist_ok=True)
        result = folder / "rounds.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--inside",
            "--label",
            label,
            "--workdir",
            str(folder),
            "--result",
            str(result),
            "--cache",
            str(args.cache),
            "--methods",
            *args.methods,
            "--clients",
            str(args.clients),
            "--rounds",
            str(args.rounds),
            "--round-timeout",
            str(args.round_timeout),
            "--run-timeout",
            str(args.run_timeout),
            "--idle",
            str(args.idle),
            "--superexec-poll",
            str(args.superexec_poll),
            "--workers" if args.workers else "--no-workers",
        ]
        t0 = time.perf_counter()
        with _netns.Namespace(rate) as ns, open(folder / "inside.log", "wb") as log:
            limit = args.run_timeout * len(args.methods) + 180
            done = ns.run(cmd, timeout=limit, capture_output=False, stdout=log, stderr=subprocess.STDOUT, cwd=folder)
            qdisc = ns.qdisc()
        if done.returncode != 0:
            tail = (folder / "inside.log").read_text(errors="replace")[-4000:]
            raise RuntimeError(f"rate {label}: the deployment exited with {done.returncode}:\n{tail}")
        inner = json.loads(result.read_text())
        results[label] = {
            "rate_mbit": rate,
            "rounds": inner["methods"],
            "idle_bps": inner["idle_bps"],
            "qdisc": qdisc,
            "seconds": time.perf_counter() - t0,
        }
        for line in (folder / "inside.log").read_text(errors="replace").splitlines():
            if line.startswith(f"[{label}]"):
                print(line, flush=True)
    return results


def summarise(results: dict[str, dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    """One row per method and rate: measured rounds 2..R (min, median), bytes per round, the four predictions.

    ``T0`` is the method's median round without a limit. The relayed bytes of a round are its loopback bytes without
    a limit less the idle deployment's traffic over ``T0`` (its polls): what the round itself moves, every hop."""
    rows = []
    for method in methods:
        none = results["none"]
        base = none["rounds"][method][1:]
        t0 = statistics.median(r["round_s"] for r in base)
        relayed = max(statistics.median(r["lo_bytes"] for r in base) - none["idle_bps"] / 8 * t0, 0.0)
        for res in results.values():
            rounds = res["rounds"][method]
            timed = rounds[1:]

            def median(key: str, timed: list[dict] = timed) -> float:
                return float(statistics.median(r[key] for r in timed))

            msg_round = median("msg_round_up_bytes") + median("msg_round_down_bytes")
            msg_client = median("msg_client_up_bytes") + median("msg_client_down_bytes")
            lo = median("lo_bytes")
            measured = [r["round_s"] for r in timed]
            row: dict[str, Any] = {
                "method": method,
                "rate_mbit": res["rate_mbit"],
                "rounds_timed": len(timed),
                "round1_s": rounds[0]["round_s"],
                "round_min_s": min(measured),
                "round_median_s": statistics.median(measured),
                "payload_round_bytes": median("round_up_bytes") + median("round_down_bytes"),
                "msg_round_bytes": msg_round,
                "msg_client_bytes": msg_client,
                "lo_round_bytes": lo,
                "lo_over_msg": lo / msg_round,
                "relayed_round_bytes": relayed,
                "relayed_over_msg": relayed / msg_round,
                "idle_kbit_s": res["idle_bps"] / 1e3,
            }
            if res["rate_mbit"] is not None:
                bps = res["rate_mbit"] * 1e6
                row["pred_clock_s"] = t0 + 8 * msg_client / bps
                row["pred_shared_s"] = t0 + 8 * msg_round / bps
                row["pred_relayed_s"] = t0 + 8 * relayed / bps
                row["pred_loopback_s"] = t0 + 8 * lo / bps
                row["median_over_shared"] = row["round_median_s"] / row["pred_shared_s"]
                row["median_over_relayed"] = row["round_median_s"] / row["pred_relayed_s"]
            rows.append(row)
    return rows


def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return ""
    if isinstance(x, float) and digits == 0:
        return f"{x:,.0f}"
    return f"{x:,.{digits}f}" if isinstance(x, float) else str(x)


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| method | rate (Mbit/s) | round 1 | min | median | message bytes / round | relayed / message "
        "| loopback bytes / round | idle (kbit/s) | predicted: clock | predicted: shared | predicted: relayed "
        "| predicted: loopback | median / shared | median / relayed |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    predicted = (
        "pred_clock_s",
        "pred_shared_s",
        "pred_relayed_s",
        "pred_loopback_s",
        "median_over_shared",
        "median_over_relayed",
    )
    for r in rows:
        rate = "none" if r["rate_mbit"] is None else f"{r['rate_mbit']:g}"
        cells = [fmt(r[k]) for k in ("round1_s", "round_min_s", "round_median_s")]
        cells += [fmt(r["msg_round_bytes"], 0), fmt(r["relayed_over_msg"]), fmt(r["lo_round_bytes"], 0)]
        cells += [fmt(r["idle_kbit_s"], 0), *(fmt(r.get(k)) for k in predicted)]
        out.append(f"| {r['method']} | {rate} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def cell(v: Any) -> Any:
    if isinstance(v, float):
        return int(v) if v.is_integer() else f"{v:.6g}"
    return "" if v is None else v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--rates", nargs="+", type=float, default=[100.0, 10.0, 1.0], help="Mbit/s (default 100 10 1)")
    parser.add_argument("--clients", type=int, default=2, help="clients = SuperNodes (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per run (default 3; round 1 is warm-up)")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds the idle deployment's traffic is counted")
    parser.add_argument(
        "--workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a warm worker beside each SuperNode (default); --no-workers: a fresh ClientApp per message",
    )
    parser.add_argument("--round-timeout", type=float, default=600.0, help="Flower run config round-timeout (s)")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="longest wait for one run (s)")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "docs" / "results" / "rate_limited_rounds",
        help="writes OUT.csv, OUT.md and OUT.json (default: docs/results/rate_limited_rounds)",
    )
    parser.add_argument("--machine", default=f"{os.cpu_count()} CPU cores, shared")
    parser.add_argument("--workdir", type=Path, default=None, help="keep runs and logs here (default: a temp folder)")
    parser.add_argument(
        "--superexec-poll",
        type=float,
        default=0.05,
        help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL in seconds (default 0.05, as tests/deployment.py; Flower's default 1)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="measure nothing: write OUT.csv and OUT.md from this JSON (an earlier run's OUT.json)",
    )
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # one rate, in its namespace
    parser.add_argument("--label", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside(args)
        return
    if args.from_json is not None:
        raw = json.loads(args.from_json.read_text(encoding="utf-8"))
        write(raw, args.out, regenerated=command_line("rate_limited_rounds.py", sys.argv[1:]))
        return
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (round 1 is warm-up)")
    sys.path.insert(0, str(BENCHMARKS))
    import _netns

    if reason := _netns.unavailable():
        sys.exit(f"rate_limited_rounds.py: {reason}")
    command = command_line("rate_limited_rounds.py", sys.argv[1:])
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="rate_limited-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    args.cache = work / "cache"
    load = os.getloadavg()
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the namespaces' clean-up runs on a kill too
    try:
        prepare_base(args.cache, work, timeout=600)
        results = measure(args, work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    settings = {
        "methods": args.methods,
        "clients": args.clients,
        "rounds": args.rounds,
        "workers": args.workers,
        "superexec_poll": args.superexec_poll,
    }
    raw = {
        "command": command,
        "date": date,
        "machine": args.machine,
        "load_before": load,
        "settings": settings,
        "total_min": (time.perf_counter() - started) / 60,
        "rates": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n", encoding="utf-8")
    write(raw, args.out)


def write(raw: dict[str, Any], out: Path, regenerated: str | None = None) -> None:
    """Print the table and write ``out.csv`` and ``out.md`` from the measurements ``raw`` (as ``out.json`` holds)."""
    settings, results, command = raw["settings"], raw["rates"], raw["command"]
    rows = summarise(results, settings["methods"])
    text = table(rows)
    print()
    print(text)
    with open(out.with_suffix(".csv"), "w", newline="", encoding="utf-8") as f:
        f.write(f"# {command}\n")
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        for r in rows:
            writer.writerow({k: cell(v) for k, v in r.items()})
    drops = {
        label: next((line.strip() for line in res["qdisc"].splitlines() if "dropped" in line), "")
        for label, res in results.items()
        if res["rate_mbit"] is not None
    }
    clients, rounds = settings["clients"], settings["rounds"]
    header = [
        "# Flower rounds on a rate-limited loopback, against the clock's model",
        "",
        f"Produced by `{command}` on {raw['date']}; machine: {raw['machine']}; load average before "
        f"{raw['load_before'][0]:.2f}; total {raw['total_min']:.1f} min"
        + (f"; tables regenerated from the JSON by `{regenerated}`" if regenerated else "")
        + f". {clients} clients = {clients} SuperNodes{' (warm workers)' if settings['workers'] else ''}, "
        f"SuperExec poll {settings['superexec_poll']:g} s, {rounds} rounds per run (round 1 is warm-up; rounds "
        f"2..{rounds} timed), every process with OMP_NUM_THREADS=1, all in one network namespace whose loopback "
        "one tbf shapes to the rate (benchmarks/_netns.py). Seconds of wall time per round without evaluation "
        "(`time/clients_and_server_s`); bytes are medians per round, all clients, both directions; idle = the "
        "idle deployment's traffic over the loopback (its polls).",
        "",
        "tc's counters at the end of each rate: " + "; ".join(f"{k} Mbit/s: `{v}`" for k, v in drops.items()),
        "",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(header) + text + "\n", encoding="utf-8")
    print(f"\ntotal {raw['total_min']:.1f} min\nwrote {out.with_suffix('.csv')} and .md")


if __name__ == "__main__":
    main()
