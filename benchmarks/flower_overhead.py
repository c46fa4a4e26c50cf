"""What running on Flower's deployment engine costs per round, against the same run in one process.

For two workloads, 2 clients (K clients = K SuperNodes) and R rounds each, it times the round without
evaluation (``time/clients_and_server_s`` from each round's checkpointed history) of

- ``in-process``: ``python -m lightning_fl fit --config ... [overrides]`` in a subprocess (the clients train
  one after the other in that process), and
- ``flower``: ``flwr run`` of this repository as the app on a local deployment (a SuperLink and K SuperNodes
  on 127.0.0.1, started once per workload with ``tests/deployment.py`` and reused for every repeat), with the
  run config ``config=<the YAML> overrides=<the same overrides>``,

alternating the two sides ``--repeats`` times (in-process first, then flower; the next repeat flower first).
Workloads:

- ``quickstart``: configs/quickstart.yaml (FLITE latents on digits, 768-byte payloads), as shipped.
- ``fedavg_digits``: configs/fedavg_digits.yaml (full-weight FedAvg on the same digits and CNN, 207,232-byte
  payloads), as shipped.
- ``quickstart_secagg``, ``fedavg_digits_secagg``: the same with secure aggregation (``trainer.secure_aggregation``,
  clipping range 1, 2^22 levels, sum modulo 2^32): Flower's SecAgg+ on the deployment (four message rounds per
  training round), its arithmetic in process. The cost of secure aggregation is the secagg workload's Flower
  side against the plain one's.
- ``fedavg_fmnist``: configs/fedavg_fashion_mnist.yaml (full-weight FedAvg, 1,681,792-byte payloads), shrunk
  with ``--data.max_train_samples 6000`` (a seeded subset of the 60k training images: 600 public images
  pretrain the base (cached), 2,700 per client, 43 local steps of 64) and ``--data.max_eval_samples 1000``
  (evaluation is not in the timed part; this only shortens each run). Model, codec and optimiser unchanged.

Both sides get ``--data.num_clients K --trainer.rounds R --trainer.logger false
--trainer.enable_progress_bar false``, the config's seeds (``seed_everything: 0``), and every process
(in-process run, SuperLink, SuperNodes and what they start) runs with ``OMP_NUM_THREADS=1`` and one shared
``LIGHTNING_FL_CACHE`` (the pretrained bases, built by the first in-process run).

    python benchmarks/flower_overhead.py                                 # quickstart and fedavg_fmnist, R=5, 3 repeats
    python benchmarks/flower_overhead.py --workloads quickstart --rounds 3 --repeats 1   # quicker

It prints markdown tables and writes docs/results/flower_overhead.csv (one row per workload and side) and
docs/results/flower_overhead.md (the tables, the command, the date and the machine); with ``--json PATH`` also
the rows and every run's wall and CPU time, with the torch thread count and the load average before and after
(printed too). What to look at:

- round time: min and median over rounds 2..R of every repeat (round 1 is warm-up, shown apart), and the
  ratio flower / in-process (min over min, median over median). On Flower a round includes the SuperNode's
  poll for work (3 s when idle, fixed in Flower), the SuperExec's poll for tasks (0.05 s here), a fresh
  ``flwr-clientapp`` process per message (on ``flower``: it imports torch and rebuilds the run from the
  config; on ``flower-warm``: a proxy that hands the message to the node's warm worker), the SuperNode's check
  for the reply (every 0.5 s, fixed) and the ServerApp's poll for replies (ours: 10 ms doubling to 200 ms).
  With K=2 on 2 cores the two clients train in parallel on Flower but one after the other in process;
- run time, wall and CPU: min and median over the repeats of each whole run (start to finished), and the
  per-repeat ratio flower / in-process (min and median). CPU is user + system: in process, that of the
  ``lightning_fl fit`` process (waited for); on Flower, that of every process of the deployment (SuperLink,
  SuperNodes, SuperExecs, each ClientApp and ServerApp, read from ``/proc``; the idle polling included) and
  of ``flwr run``, less the ``flwr ls`` calls this script makes to see that the run finished. Per-round
  times are wall time only (the runs' own clocks);
- bytes per client and round: the codec's payload (the ledger's ``comm/client_up_bytes``/``down``, the
  paper's numbers, equal on both sides) against the Flower messages that carry it (``comm/msg_client_*``);
- where Flower's time goes: per train message, the SuperNode's time from "Receiving" to "Sending" (its log
  lines, timestamped here as they arrive), and a cold ClientApp rebuild timed in a fresh process
  (interpreter + imports of the ClientApp module, then ``build_node`` of the server's resolved config).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from _harness import (
    Sample,
    add_arguments,
    children_cpu_seconds,
    command_line,
    descendants_cpu_seconds,
    machine,
    ratios,
    report,
    spread,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))
import deployment  # noqa: E402  (tests/deployment.py: the SuperLink/SuperNode harness)

SIDES = ("in-process", "flower", "flower-warm")
FLOWER_SIDES = SIDES[1:]
POLLS = (
    "SuperNode 3 s when idle (Flower's, fixed), SuperExec 0.05 s (FLWR_SUPEREXEC_TASK_POLL_INTERVAL, as "
    "tests/deployment.py sets it; Flower's default 1 s), ServerApp 10 ms doubling to 200 ms (ours)"
)
NODE = ("node_between_s", "node_pickup_s", "node_clientapp_s")
COLD = ("cold_interpreter_s", "cold_imports_s", "cold_build_s", "cold_total_s")
PROXY = ("proxy_process_cpu_s", "proxy_imports_cpu_s")
BYTES = ("comm/client_up_bytes", "comm/client_down_bytes", "comm/msg_client_up_bytes", "comm/msg_client_down_bytes")


# secure aggregation (trainer.secure_aggregation): each coordinate clipped to [-1, 1], 2^22 levels, sum mod 2^32
SECAGG = [
    "--trainer.secure_aggregation",
    "lightning_fl.privacy.secure.SecureAggregation",
    "--trainer.secure_aggregation.clipping_range",
    "1.0",
    "--trainer.max_update_norm_ratio",
    "null",
]


@dataclass
class Workload:
    name: str
    config: str
    overrides: list[str]
    note: str


WORKLOADS = {
    "quickstart": Workload(
        "quickstart", "configs/quickstart.yaml", [], "FLITE latents on digits (768-byte payloads), as shipped"
    ),
    "quickstart_secagg": Workload(
        "quickstart_secagg",
        "configs/quickstart.yaml",
        [*SECAGG],
        "the quickstart with secure aggregation (Flower's SecAgg+ on Flower, its arithmetic in process)",
    ),
    "fedavg_digits": Workload(
        "fedavg_digits", "configs/fedavg_digits.yaml", [], "full-weight FedAvg on digits (207,232-byte payloads)"
    ),
    "fedavg_digits_secagg": Workload(
        "fedavg_digits_secagg", "configs/fedavg_digits.yaml", [*SECAGG], "fedavg_digits with secure aggregation"
    ),
    "fedavg_fmnist": Workload(
        "fedavg_fmnist",
        "configs/fedavg_fashion_mnist.yaml",
        ["--data.max_train_samples", "6000", "--data.max_eval_samples", "1000"],
        "full-weight FedAvg on Fashion-MNIST, 6,000 training images (2,700 per client), 1,000 test images",
    ),
}


@dataclass
class Result:
    """What the runs of one workload on one side measured."""

    warmup: list[float] = field(default_factory=list)  # round 1 of each run
    rounds: list[float] = field(default_factory=list)  # rounds 2..R of every run
    walls: list[float] = field(default_factory=list)  # each run's wall time (start to finished)
    runs: list[Sample] = field(default_factory=list)  # each run's wall and CPU time (start to finished)
    bytes: dict[str, list[float]] = field(default_factory=dict)  # ledger key -> per-round values


# ------------------------------------------------------------------------------------ processes
def environment(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "NODE_RANK", "LOCAL_RANK", "WORLD_"))}
    env.update(OMP_NUM_THREADS="1", LIGHTNING_FL_CACHE=str(work / "cache"), PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _stamp(stream, log: Path) -> None:
    """Copy a process's output to ``log``, each line prefixed with its arrival time (Flower's lack one)."""
    with open(log, "ab") as out:
        for line in iter(stream.readline, b""):
            out.write(f"{time.time():.3f} ".encode() + line)
            out.flush()
    stream.close()


class TimedDeployment(deployment.FlowerDeployment):
    """The harness's deployment, with every log line timestamped (for the SuperNode's time per message)."""

    def _spawn(self, name: str, cmd: list[str], home: Path, cwd: Path) -> subprocess.Popen:
        home.mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"{name}.log"
        self.logs[name] = log
        p = subprocess.Popen(
            cmd, cwd=cwd, env=self.env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        threading.Thread(target=_stamp, args=(p.stdout, log), daemon=True).start()
        self.procs[name] = p
        return p


def run_python(args: list[str], work: Path, log: Path, timeout: float) -> float:
    """Run ``python args`` in ``work`` (output to ``log``); its wall time. Killed by PID (with children) on timeout."""
    t0 = time.perf_counter()
    with open(log, "ab") as out:
        p = subprocess.Popen(
            [sys.executable, *args], cwd=work, env=environment(work), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        deployment.kill_tree(p.pid)
        p.wait(timeout=10)
        raise RuntimeError(f"{shlex.join(args[:4])} ... ran past {timeout:.0f} s; see {log}") from None
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{shlex.join(args[:4])} ... exited with {rc}:\n{tail}")
    return time.perf_counter() - t0


def checkpoint(root: Path, name: str) -> Path | None:
    found = sorted((root / name).glob("**/checkpoints/last.ckpt"))
    return found[-1] if found else None


def history(root: Path, name: str) -> list[dict[str, float]]:
    from lightning_fl.checkpoint import read_checkpoint

    path = checkpoint(root, name)
    if path is None:
        raise RuntimeError(f"run {name} left no checkpoint under {root}")
    return sorted((h for h in read_checkpoint(path)["history"] if h["round"] >= 1), key=lambda h: h["round"])


def wait_rounds(root: Path, name: str, rounds: int, timeout: float) -> None:
    """Wait (reading the round checkpoint when it changes) until run ``name`` checkpointed round ``rounds``.

    Cheaper than polling ``flwr ls`` (a CLI process each time) while clients train on the same 2 cores.
    """
    from lightning_fl.checkpoint import read_checkpoint

    deadline, seen = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        path = checkpoint(root, name)
        if path is not None and (stamp := path.stat().st_mtime_ns) != seen:
            seen = stamp
            try:
                if read_checkpoint(path)["round"] >= rounds:
                    return
            except Exception:  # caught mid-write (it is written atomically, but be safe)
                seen = None
        time.sleep(0.5)
    raise TimeoutError(f"run {name} did not reach round {rounds} in {timeout:.0f} s")


# ------------------------------------------------------------------------------------ one run per side
def common(w: Workload, args: argparse.Namespace, root: Path, name: str) -> list[str]:
    return [
        *w.overrides,
        "--data.num_clients",
        str(args.clients),
        "--trainer.rounds",
        str(args.rounds),
        "--trainer.logger",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.default_root_dir",
        str(root),
        "--trainer.name",
        name,
    ]


def run_in_process(w: Workload, args, work: Path, root: Path, name: str) -> Sample:
    """One in-process run: its wall time and the CPU time of its process (waited for, with what it waited for)."""
    argv = ["-m", "lightning_fl", "fit", "--config", str(REPO / w.config), *common(w, args, root, name)]
    cpu = children_cpu_seconds()
    wall = run_python(argv, work, work / f"{name}.log", timeout=args.run_timeout)
    return Sample(wall, children_cpu_seconds() - cpu)


def run_flower(w: Workload, args, d: TimedDeployment, root: Path, name: str) -> Sample:
    """One Flower run: its wall time and the CPU time of the deployment's processes and of ``flwr run``."""
    overrides = shlex.join(common(w, args, root, name))
    run_config = f'config="{REPO / w.config}" overrides="{overrides}" round-timeout={args.round_timeout}'
    t0, cpu = time.perf_counter(), descendants_cpu_seconds()
    run_id = d.run_app(REPO, run_config)
    try:
        wait_rounds(root, name, args.rounds, timeout=args.run_timeout)
        polls = children_cpu_seconds()
        status = d.wait_run(run_id, timeout=120)
        polls = children_cpu_seconds() - polls  # the `flwr ls` calls that see the run finished: ours, not Flower's
    except TimeoutError:
        print(d.run_logs(run_id)[-3000:], file=sys.stderr)
        raise
    sample = Sample(time.perf_counter() - t0, descendants_cpu_seconds() - cpu - polls)
    if status["status"] != "finished:completed":
        raise RuntimeError(f"flwr run {run_id} ended {status['status']}:\n{d.run_logs(run_id)[-3000:]}")
    return sample


def record(result: Result, rounds: list[dict[str, float]], run: Sample) -> None:
    times = [h["time/clients_and_server_s"] for h in rounds]
    result.warmup.append(times[0])
    result.rounds.extend(times[1:])
    result.walls.append(run.wall)
    result.runs.append(run)
    for key in BYTES:
        result.bytes.setdefault(key, []).extend(h[key] for h in rounds if key in h)


# ------------------------------------------------------------------------------------ where Flower's time goes
REBUILD = r"""
import json, sys, time
t0 = time.time()
from lightning_fl.flower.node import build_node
t1 = time.time()
build_node(open(sys.argv[1], encoding="utf-8").read(), {"partition-id": 0})
t2 = time.time()
print(json.dumps({"cold_imports_s": t1 - t0, "cold_build_s": t2 - t1}))
"""

RESOLVE = r"""
import sys
from lightning_fl.cli import build
run = build(["fit", "--config", *sys.argv[2:]])
open(sys.argv[1], "w", encoding="utf-8").write(run.config_yaml)
"""


PROXY_IMPORT = r"""
import json, time
t0 = time.process_time()
import lightning_fl.flower.client, lightning_fl.flower.worker
print(json.dumps({"proxy_imports_cpu_s": time.process_time() - t0}))
"""


def proxy_times(work: Path, times: int = 3) -> dict[str, float]:
    """The proxy ClientApp's start (what Flower's per-message process imports of ours when a node has a worker):
    CPU seconds of a fresh interpreter importing it, whole process and the imports alone (median of 3)."""
    rows = []
    for _ in range(times):
        cpu = children_cpu_seconds()
        out = subprocess.run(
            [sys.executable, "-c", PROXY_IMPORT],
            cwd=work,
            env=environment(work),
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["proxy_process_cpu_s"] = children_cpu_seconds() - cpu
        rows.append(row)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def rebuild_times(w: Workload, args, work: Path, root: Path, times: int = 3) -> dict[str, float]:
    """A cold ClientApp's start: a fresh interpreter imports the ClientApp module and builds the run (median of 3)."""
    yaml = work / f"{w.name}-resolved.yaml"
    run_python(
        ["-c", RESOLVE, str(yaml), str(REPO / w.config), *common(w, args, root, f"{w.name}-rebuild")],
        work,
        work / f"{w.name}-rebuild.log",
        timeout=300,
    )
    rows = []
    for _ in range(times):
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", REBUILD, str(yaml)],
            cwd=work,
            env=environment(work),
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        wall = time.perf_counter() - t0
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["cold_interpreter_s"] = wall - row["cold_imports_s"] - row["cold_build_s"]  # start-up and exit
        row["cold_total_s"] = wall
        rows.append(row)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def node_timings(logs: list[Path]) -> dict[str, list[float]]:
    """Per train message, from a SuperNode's (timestamped) log lines, in seconds.

    ``node_pickup_s``: "Receiving: train message" to "Start `flwr-clientapp` process" (the SuperExec's poll for
    tasks); ``node_clientapp_s``: that start to "Sending: train message" (a fresh ClientApp process: interpreter,
    imports, rebuild, training, reply); ``node_message_s``: the two; ``node_between_s``: "Sent successfully" of one
    train reply to "Receiving" the next round's message of the same run (the ServerApp's poll for replies, the
    other client, aggregation and the SuperNode's poll for work).
    """
    out: dict[str, list[float]] = {k: [] for k in (*NODE, "node_message_s", "train_messages")}
    for log in logs:
        out["train_messages"].append(float(log.read_text(errors="replace").count("Receiving: train message")))
        run = received = started = sending = sent = sent_run = None
        for line in log.read_text(errors="replace").splitlines():
            stamp, _, text = line.partition(" ")
            try:
                t = float(stamp)
            except ValueError:
                continue
            if m := re.search(r"\[RUN (\d+)", text):
                run = m[1]
            elif "Receiving: train message" in text:
                received, started, sending = t, None, None
                if sent is not None and sent_run == run:
                    out["node_between_s"].append(t - sent)
                sent = None
            elif "Start `flwr-clientapp` process" in text and received is not None and started is None:
                started = t
            elif "Sending: train message" in text and received is not None:
                sending = t
                out["node_message_s"].append(t - received)
                if started is not None:
                    out["node_pickup_s"].append(started - received)
                    out["node_clientapp_s"].append(t - started)
                received = None
            elif "Sent successfully" in text and sending is not None:
                sent, sent_run, sending = t, run, None
    return out


# ------------------------------------------------------------------------------------ report
def cell(v: object) -> object:
    """A CSV cell: whole numbers (bytes) as integers, other floats to 6 significant digits."""
    if isinstance(v, float):
        return int(v) if v.is_integer() else f"{v:.6g}"
    return v


def fmt(x: float | None, digits: int = 2) -> str:
    return "" if x is None else f"{x:,.{digits}f}"


def summarise(results: dict[str, dict[str, Result]], extra: dict[str, dict[str, float]], args) -> list[dict]:
    rows = []
    for wname, sides in results.items():
        base = sides["in-process"]
        runs = {side: sides[side].runs for side in sides}
        for side in sides:
            r = sides[side]
            wall, cpu = spread(s.wall for s in r.runs), spread(s.cpu for s in r.runs)
            per_repeat = ratios(runs, side, "in-process")  # flower / in-process, repeat by repeat
            row: dict[str, object] = {
                "workload": wname,
                "side": side,
                "clients": args.clients,
                "rounds": args.rounds,
                "repeats": args.repeats,
                "rounds_timed": len(r.rounds),
                "round1_median_s": statistics.median(r.warmup),
                "round_min_s": min(r.rounds),
                "round_median_s": statistics.median(r.rounds),
                "ratio_min": min(r.rounds) / min(base.rounds),
                "ratio_median": statistics.median(r.rounds) / statistics.median(base.rounds),
                "run_wall_median_s": statistics.median(r.walls),
                "run_wall_min_s": wall["min"],
                "run_cpu_min_s": cpu["min"],
                "run_cpu_median_s": cpu["median"],
                "run_ratio_wall_min": per_repeat["wall"]["min"],
                "run_ratio_wall_median": per_repeat["wall"]["median"],
                "run_ratio_cpu_min": per_repeat["cpu"]["min"],
                "run_ratio_cpu_median": per_repeat["cpu"]["median"],
            }
            for key, col in (
                ("comm/client_up_bytes", "payload_up_bytes"),
                ("comm/client_down_bytes", "payload_down_bytes"),
                ("comm/msg_client_up_bytes", "msg_up_bytes"),
                ("comm/msg_client_down_bytes", "msg_down_bytes"),
            ):
                values = r.bytes.get(key, [])
                row[col] = statistics.median(values) if values else None
            for d in ("up", "down"):
                msg, pay = row[f"msg_{d}_bytes"], row[f"payload_{d}_bytes"]
                row[f"msg_overhead_{d}"] = msg / pay if msg and pay else None
            if side in FLOWER_SIDES:
                row.update(extra[(wname, side)])
            rows.append(row)
    return rows


def tables(rows: list[dict], args) -> str:
    out = [
        "Per-round time without evaluation (`time/clients_and_server_s`), seconds: min and median over rounds "
        f"2..{args.rounds} of {args.repeats} run(s) per side ({args.clients} clients; round 1 is warm-up, its median "
        "shown apart); ratio = flower / in-process.",
        "",
        "| workload | side | rounds timed | round 1 (median) | min | median | ratio (min) | ratio (median) "
        "| run wall (min / median) |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        out.append(
            f"| {r['workload']} | {r['side']} | {r['rounds_timed']} | {fmt(r['round1_median_s'])} | "
            f"{fmt(r['round_min_s'])} | {fmt(r['round_median_s'])} | {fmt(r['ratio_min'])} | "
            f"{fmt(r['ratio_median'])} | {fmt(r['run_wall_min_s'], 1)} / {fmt(r['run_wall_median_s'], 1)} |"
        )
    out += [
        "",
        f"Whole runs (start to finished), seconds: min and median over the {args.repeats} run(s) per side, wall and "
        "CPU (user + system: in process, the `lightning_fl fit` process; on Flower, every process of the deployment, "
        "idle polling included, and `flwr run`); ratio = flower / in-process, repeat by repeat (min and median).",
        "",
        "| workload | side | wall (min) | wall (median) | CPU (min) | CPU (median) | ratio wall (min / median) "
        "| ratio CPU (min / median) |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        out.append(
            f"| {r['workload']} | {r['side']} | {fmt(r['run_wall_min_s'], 1)} | {fmt(r['run_wall_median_s'], 1)} | "
            f"{fmt(r['run_cpu_min_s'], 1)} | {fmt(r['run_cpu_median_s'], 1)} | {fmt(r['run_ratio_wall_min'])} / "
            f"{fmt(r['run_ratio_wall_median'])} | {fmt(r['run_ratio_cpu_min'])} / {fmt(r['run_ratio_cpu_median'])} |"
        )
    out += [
        "",
        "Bytes per client and round (medians): the codec's payload (the ledger) against the Flower messages "
        "that carry it (under secure aggregation: the four SecAgg+ stages' messages together, and the payload is "
        "the masked int64 vector); overhead = message / payload; train messages each way = a SuperNode's train "
        "messages per round (1 plain, 4 for SecAgg+: setup, key shares, masked upload, unmask).",
        "",
        "| workload | side | payload up | payload down | message up | message down | overhead up | overhead down "
        "| train messages each way |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        out.append(
            f"| {r['workload']} | {r['side']} | {fmt(r['payload_up_bytes'], 0)} | {fmt(r['payload_down_bytes'], 0)} "
            f"| {fmt(r['msg_up_bytes'], 0)} | {fmt(r['msg_down_bytes'], 0)} | {fmt(r['msg_overhead_up'], 3)} "
            f"| {fmt(r['msg_overhead_down'], 3)} | {fmt(r.get('train_messages_per_client_round'), 1)} |"
        )
    out += [
        "",
        "Where a Flower round goes (seconds, medians over every train message of every run). From the SuperNodes' "
        "log lines (timestamped as they arrive): between = its reply to round r sent -> round r+1's message "
        "received (the ServerApp's poll for replies, the other client, aggregation, the SuperNode's poll for work); "
        "pick-up = message received -> `flwr-clientapp` started (the SuperExec's poll for tasks); ClientApp = "
        "started -> reply sending (a fresh process: interpreter, imports, rebuild from the config, training). "
        "Cold start, timed apart in a fresh process (3 times, median): interpreter start and exit, imports of "
        "`lightning_fl.flower.client`, `build_node` of the server's resolved config. Training per client: the "
        f"in-process round median / {args.clients}. Poll intervals: {POLLS}. With warm workers (flower-warm) the "
        "ClientApp is the proxy: its process imports Flower and our proxy only and hands the message to the node's "
        "worker, which trains; proxy start = CPU seconds of a fresh interpreter importing the proxy (median of 3), "
        "the whole process and the imports alone.",
        "",
        "| workload | side | Flower round | between | pick-up | ClientApp | cold: interpreter | cold: imports "
        "| cold: build_node | cold: total | proxy start: process CPU | proxy start: imports CPU "
        "| training per client |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    by = {(r["workload"], r["side"]): r for r in rows}
    for wname, side in [(r["workload"], r["side"]) for r in rows if r["side"] in FLOWER_SIDES]:
        f, i = by[(wname, side)], by[(wname, "in-process")]
        cells = [f["round_median_s"], *(f[k] for k in NODE), *(f.get(k) for k in (*COLD, *PROXY))]
        cells.append(i["round_median_s"] / args.clients)
        out.append(f"| {wname} | {side} | " + " | ".join(fmt(c) for c in cells) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["quickstart", "fedavg_fmnist"])
    parser.add_argument("--clients", type=int, default=2, help="clients = SuperNodes (default 2)")
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=SIDES[1:],
        default=list(SIDES[1:]),
        help="Flower sides to time against in-process: flower (a fresh ClientApp process per message) "
        "and flower-warm (a warm worker beside each SuperNode); default both",
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run (default 5; round 1 is warm-up)")
    add_arguments(parser, repeats=3)  # --repeats: runs per side and workload, alternated; --json
    parser.add_argument("--round-timeout", type=float, default=300.0, help="Flower run config round-timeout (s)")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="longest wait for one run (s)")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "docs" / "results" / "flower_overhead",
        help="writes OUT.csv and OUT.md (default docs/results/flower_overhead)",
    )
    parser.add_argument("--machine", default=f"{os.cpu_count()} CPU cores, shared")
    parser.add_argument("--workdir", type=Path, default=None, help="keep runs and logs here (default: a temp folder)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (round 1 is warm-up)")
    before = machine()
    command = command_line("flower_overhead.py", sys.argv[1:])
    # Absolute: the SuperLink, SuperNodes and flwr CLI run in folders under it, with FLWR_HOMEs under it.
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="flower_overhead-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started, date = time.perf_counter(), datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    deployment.enable_subreaper()  # adopt what the SuperNodes start, so the harness can reap it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill runs the clean-up below: no deployment left
    results: dict[str, dict[str, Result]] = {}
    extra: dict[str, dict[str, float]] = {}
    try:
        for wname in args.workloads:
            w = WORKLOADS[wname]
            sides = ["in-process", *args.sides]
            results[wname] = {side: Result() for side in sides}
            root = work / "runs"
            env = environment(work)
            keep = {k: env[k] for k in ("OMP_NUM_THREADS", "LIGHTNING_FL_CACHE", "PYTHONPATH", "TQDM_DISABLE")}
            with contextlib.ExitStack() as stack:  # one deployment per Flower side, up for the whole workload
                deployments = {
                    side: stack.enter_context(
                        TimedDeployment(
                            work / f"{side}-{wname}",
                            num_supernodes=args.clients,
                            extra_env=keep,
                            workers=side == "flower-warm",
                        )
                    )
                    for side in args.sides
                }
                for i in range(args.repeats):
                    for side in sides if i % 2 == 0 else sides[::-1]:
                        name = f"{wname}-{side}-{i}"
                        t = time.perf_counter()
                        if side == "in-process":
                            run = run_in_process(w, args, work, root, name)
                        else:
                            run = run_flower(w, args, deployments[side], root, name)
                        hist = history(root, name)
                        record(results[wname][side], hist, run)
                        times = ", ".join(f"{h['time/clients_and_server_s']:.2f}" for h in hist)
                        print(
                            f"[{time.perf_counter() - started:6.0f} s] {name}: rounds {times} s "
                            f"(run {time.perf_counter() - t:.1f} s, CPU {run.cpu:.1f} s)",
                            flush=True,
                        )
                logs = {
                    side: [d.logs[n] for n in d.logs if n.startswith("supernode")] for side, d in deployments.items()
                }
            for side in args.sides:
                spans = node_timings(logs[side])
                messages = spans.pop("train_messages")  # per SuperNode, over every Flower run of this workload
                extra[(wname, side)] = {k: statistics.median(v) if v else None for k, v in spans.items()}
                runs = args.clients * args.rounds * args.repeats
                extra[(wname, side)]["train_messages_per_client_round"] = sum(messages) / runs
            if "flower" in args.sides:
                extra[(wname, "flower")].update(rebuild_times(w, args, work, root))
            if "flower-warm" in args.sides:
                extra[(wname, "flower-warm")].update(proxy_times(work))
            print(
                f"[{time.perf_counter() - started:6.0f} s] {wname}: starts "
                f"{ {side: extra[(wname, side)] for side in args.sides} }",
                flush=True,
            )
    finally:
        deployment.reap_orphans()
        left = [p for p in deployment.descendants(os.getpid()) if deployment._alive(p)]
        if left:
            print(f"warning: processes left running: {left}", file=sys.stderr)
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    total = time.perf_counter() - started
    rows = summarise(results, extra, args)
    text = tables(rows, args)
    print()
    print(text)
    print(f"\ntotal {total / 60:.1f} min")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        for r in rows:
            writer.writerow({k: cell(v) for k, v in r.items()})
    settings = "; ".join(f"`{w}`: {shlex.join([WORKLOADS[w].config, *WORKLOADS[w].overrides])}" for w in args.workloads)
    header = [
        "# Flower deployment engine vs in process: round time and bytes",
        "",
        f"Produced by `{command}` on {date}; machine: {args.machine}; total {total / 60:.1f} min.",
        "",
        f"Every process with OMP_NUM_THREADS=1, the configs' seeds, {args.clients} clients = {args.clients} "
        f"SuperNodes on 127.0.0.1 (one deployment per workload and Flower side, all up for the whole workload and "
        f"reused for every repeat; flower-warm: a warm worker beside each SuperNode), {args.rounds} rounds, "
        f"{args.repeats} run(s) per side, alternated. Workloads: {settings}. Both sides add "
        f"`--data.num_clients {args.clients} --trainer.rounds {args.rounds} --trainer.logger false "
        "--trainer.enable_progress_bar false`.",
        "",
        "",
    ]
    args.out.with_suffix(".md").write_text("\n".join(header) + text + "\n", encoding="utf-8")
    raw = {
        w: {side: {"runs": r.runs, "rounds": r.rounds, "round1": r.warmup} for side, r in sides.items()}
        for w, sides in results.items()
    }
    report("flower_overhead", before, {"command": command, "rows": rows, "raw": raw}, args.json)
    print(f"wrote {args.out.with_suffix('.csv')} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
