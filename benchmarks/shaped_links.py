"""A Flower deployment with a shaped link per client, against the round time the clock predicts.

The testbed (``benchmarks/_netns.py``, :class:`_netns.Star`): the SuperLink, its SuperExec and the ServerApp run in
one network namespace, and each SuperNode, with its SuperExec, its ClientApps and its warm worker, in a namespace of
its own, joined to the server's by a veth pair of its own. Each pair is shaped at both ends by a token bucket
(``tbf``: the server's end carries what the client downloads, the client's end what it uploads), whose bucket holds
two full frames (3,028 bytes: smaller than every message but FLITE's, so a message meets the rate rather than
crossing at once) and whose queue holds 200 ms of the rate (at least 64 KiB). Only Flower's Fleet API, the
SuperNode's pulls and pushes to the SuperLink, crosses a shaped link; the ServerApp talks to the SuperLink, and a
ClientApp to its SuperNode, on their own namespace's loopback: as on a real network, where those live on one machine.

One deployment (``--clients`` SuperNodes with warm workers) runs, ``--repeats`` times over, each method on the same
small task (the digits, the same pretrained base):

- ``flite``: configs/quickstart.yaml; ``lora``: configs/lora_digits.yaml; ``fedavg``: configs/fedavg_digits.yaml;

each as one ``flwr run`` of ``--rounds`` rounds (every client in every round) per *case*: no limit, then every client
at each of ``--rates`` Mbit/s both ways, then (``--drawn``) every client at the down and up rates that the clock's own
link model draws for it (``Clock(down_mbps, up_mbps, link_sigma).links(seed, clients)``). Round 1 of a run is
warm-up; rounds 2..R are timed.

Measured per round: its wall time without evaluation (``time/clients_and_server_s``, the ServerApp's clock), the
messages' bytes (``comm/msg_client_*``), the bytes each link carried (the server end's counters, read by a callback
the ServerApp runs, :class:`LinkStamps`), each warm worker's "served in" time (decoding, training, encoding), and
each client's phases, from its SuperNode's log with every line time-stamped (:func:`node_timeline`,
:func:`phases`): the download (from the message's metadata to its content pulled), the *setup* (from the metadata
to the ClientApp's process up: Flower starts it at once, so it runs while the content downloads), the *app* time
after both (the ClientApp pulls the message from its SuperNode, its worker trains, it pushes the reply, and the
SuperNode notices it within 0.5 s), and the upload.

Predicted per round, by the clock (:meth:`lightning_fl.federated.arrivals.clock.Clock.timing` with the round's links
given, :func:`predict_round`): every client downloads its message at its down rate while its setup runs, computes,
and uploads at its up rate; the round closes when the last has reported::

    finish_c = latency + max(8 * down_bytes / down_bps_c, setup_c) + app_c + latency + 8 * up_bytes / up_bps_c

Its inputs: the messages' bytes, each client's rates, and

- its setup and compute terms: each client's setup and app times, measured in that same round (so the machine's
  load, which makes them vary by a factor of 2 or more, is the same as in the round they predict); or their
  medians in the method's rounds without a limit ("ahead": a prediction made before the limited run, which carries
  the load's noise); or ("without setup", the clock before ``setup_s``) setup + app as compute, after the download;
- its latency: Flower's waits outside the client, per message (the SuperNode's 3 s sleep between polls, the
  ServerApp's pushes, polls and aggregation): half the median of (round - the longest client's download-to-upload
  time) over the method's rounds without a limit (:func:`latency_from`, the calibration).

Reported per method and case: (predicted - measured) / measured of the median round, and the error per round (min,
max). Usage (as root; needs ``ip netns`` and ``tc``)::

    python benchmarks/shaped_links.py --drawn 4 2 1             # 3 methods x (none, 100, 10, 1 Mbit/s, drawn)
    python benchmarks/shaped_links.py --methods fedavg --rates 1 --rounds 3 --repeats 1   # quicker
    python benchmarks/shaped_links.py --from-json docs/results/shaped_links.json          # tables only

It writes ``OUT.csv``, ``OUT.md`` and ``OUT.json`` (default docs/results/shaped_links): every round's times and
bytes, each case's rates, the links' transfer check (one TCP transfer per rate and direction), tc's counters.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
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
import time
from pathlib import Path
from typing import Any

import numpy as np
from _harness import command_line, machine, portable

from lightning_fl.federated.trainer.callbacks import Callback

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
STAMPS = "LIGHTNING_FL_LINK_STAMPS"  # the folder LinkStamps writes into (an environment variable)
SERVED = re.compile(r"\] (\S+) \(round (\d+)\) served in ([\d.]+) s")  # a warm worker's line per message
STAMP_LINES = r"""
import signal, subprocess, sys, time
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
signal.signal(signal.SIGTERM, lambda *_: p.terminate())
for line in p.stdout:
    sys.stdout.buffer.write(b"%.3f " % time.time() + line)
    sys.stdout.buffer.flush()
sys.exit(p.wait())
"""  # runs a command, each line of its output prefixed with the wall time (the SuperNodes' logs have none)
ROUND_LINE = re.compile(r"\[RUN \d+, ROUND (\d+)\]")
STEPS = (  # (the event before, the line, the event): a training message's four events in its SuperNode's log
    (None, "Receiving: train", "receiving"),
    ("receiving", "Received successfully", "received"),
    (None, "Sending: train", "sending"),
    ("sending", "Sent successfully", "sent"),
)


def net_dev() -> dict[str, list[int]]:
    """Bytes received and sent so far by each interface of this process's network namespace."""
    out = {}
    with open("/proc/self/net/dev", encoding="ascii") as f:
        for line in f.readlines()[2:]:
            name, _, counters = line.partition(":")
            fields = counters.split()
            out[name.strip()] = [int(fields[0]), int(fields[8])]  # receive bytes, transmit bytes
    return out


class LinkStamps(Callback):
    """Writes the wall time and every interface's byte counters at the start of the rounds and at each round's end,
    one JSON line each, to ``$LIGHTNING_FL_LINK_STAMPS/<run name>.jsonl`` (nothing when the variable is unset)."""

    def _write(self, trainer: Any, round: int) -> None:
        folder = os.environ.get(STAMPS)
        if folder:
            with open(Path(folder) / f"{trainer.name}.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({"round": round, "time": time.time(), "dev": net_dev()}) + "\n")

    def on_rounds_start(self, trainer: Any, start: int) -> None:
        self._write(trainer, start)

    def on_round_end(self, trainer: Any, round: int, metrics: dict[str, float]) -> None:
        self._write(trainer, round)


# ------------------------------------------------------------------------------------ the prediction
def predict_round(
    compute_s: list[float],
    down_bytes: list[float],
    up_bytes: list[float],
    down_mbit: list[float | None],
    up_mbit: list[float | None],
    latency_s: float,
    setup_s: list[float] | None = None,
) -> float:
    """The clock's round time (wait for all) for clients that compute ``compute_s`` seconds each, download
    ``down_bytes`` at ``down_mbit`` and upload ``up_bytes`` at ``up_mbit`` Mbit/s (``None``: no limit), with
    ``latency_s`` added to every message and ``setup_s`` seconds of setup each while they download (``None``:
    none): :meth:`Clock.timing` with these links."""
    from lightning_fl.federated.arrivals.clock import Clock, Links

    def bps(rates: list[float | None]) -> np.ndarray:
        return np.array([np.inf if r is None else r * 1e6 for r in rates], dtype=np.float64)

    k = len(compute_s)
    links = Links(
        step_s=np.asarray(compute_s, dtype=np.float64),
        down_bps=bps(down_mbit),
        up_bps=bps(up_mbit),
        setup_s=None if setup_s is None else np.asarray(setup_s, dtype=np.float64),
    )
    clock = Clock(latency_s=latency_s)
    timing = clock.timing(0, list(range(k)), np.ones(k), np.asarray(down_bytes), np.asarray(up_bytes), links=links)
    return timing.close_s


def latency_from(rounds: list[dict[str, Any]]) -> float:
    """The calibrated latency per message: half the median, over ``rounds`` (rounds without a limit), of the round's
    time less the longest client's time from the start of its download to the end of its upload (``busy_s``):
    Flower's waits outside the client (its SuperNode's sleep between polls, the server's pushes, polls and
    aggregation), two messages a round."""
    return max(statistics.median(r["round_s"] - max(r["busy_s"]) for r in rounds) / 2, 0.0)


# ------------------------------------------------------------------------------------ inside the server namespace
def attach_star(desc: dict[str, Any]) -> Any:
    import _netns

    return _netns.Star.attach(desc)


def make_deployment(folder: Path, star_desc: dict[str, Any], clients: int, env: dict[str, str]) -> Any:
    """A :class:`tests/deployment.FlowerDeployment` whose SuperLink listens on every address of the server's
    namespace and whose SuperNode ``i`` (with its worker, SuperExec and ClientApps) runs in client ``i``'s namespace,
    reaching the SuperLink over its own link."""
    sys.path.insert(0, str(REPO / "tests"))
    import deployment

    star = attach_star(star_desc)

    class StarDeployment(deployment.FlowerDeployment):
        def _spawn(self, name: str, cmd: list[str], home: Path, cwd: Path, env: dict[str, str] | None = None):
            if match := re.fullmatch(r"(supernode|worker)(\d+)", name):
                i = int(match.group(2))
                if "--superlink" in cmd:
                    cmd = list(cmd)
                    cmd[cmd.index("--superlink") + 1] = f"{star.server_ip(i)}:{self.port}"
                    cmd = [sys.executable, "-c", STAMP_LINES, *cmd]  # its log's lines with their times
                cmd = star.clients[i].inside(cmd)  # ip netns exec execs: the PID is the command's
            return super()._spawn(name, cmd, home, cwd, env)

        def start_supernode(self, idx: int, timeout: float = 30.0, **kwargs: Any) -> int:
            kwargs["wait"] = False  # its Runtime API is on its own namespace's loopback: start() waits for the node
            return super().start_supernode(idx, timeout, **kwargs)

    deployment.enable_subreaper()
    return StarDeployment(
        folder, num_supernodes=clients, extra_env=env, workers=True, superlink_args=["--host", "0.0.0.0"]
    )


def worker_compute(log: Path, offset: int) -> dict[int, float]:
    """Round -> seconds a warm worker took to serve that round's training message, from its log after ``offset``."""
    with open(log, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    return {int(m.group(2)): float(m.group(3)) for m in SERVED.finditer(text) if m.group(1) == "train"}


def node_timeline(log: Path, offset: int) -> dict[int, dict[str, float]]:
    """Round -> when a SuperNode began pulling that round's training message (``receiving``: its metadata in, its
    content next), had it (``received``), began pushing the reply (``sending``) and had pushed it (``sent``), and
    when the ClientApp's process had started (``started``: Flower starts it once the message's metadata is in), from
    its time-stamped log after ``offset``."""
    with open(log, "rb") as f:
        f.seek(offset)
        lines = f.read().decode("utf-8", "replace").splitlines()
    out: dict[int, dict[str, float]] = {}
    round_, kind = None, None
    for line in lines:
        stamp, _, text = line.partition(" ")
        try:
            t = float(stamp)
        except ValueError:
            continue
        if "[RUN " in text:  # a message's first line: its run and round (none for a query without one)
            m = ROUND_LINE.search(text)
            round_, kind = (int(m.group(1)) if m else None), None
        elif round_ is not None:
            for before, marker, event in STEPS:
                if marker in text and kind == before:
                    out.setdefault(round_, {})[event] = t
                    kind = event
            if "Start `flwr-clientapp` process" in text and kind in ("receiving", "received"):
                out[round_]["started"] = t  # the ClientApp's process is up (its start overlaps the download)
    return out


def inside(args: argparse.Namespace) -> None:
    """Run the plan (methods x cases x repeats) on one deployment in the star; write every round as JSON."""
    from rate_limited_rounds import APP, METHODS

    from lightning_fl.checkpoint import read_checkpoint

    star = attach_star(json.loads(args.star))
    plan = json.loads(args.plan)
    work = args.workdir.resolve()
    app, stamps = work / "app", work / "stamps"
    app.mkdir(parents=True, exist_ok=True)
    stamps.mkdir(exist_ok=True)
    (app / "pyproject.toml").write_text(APP, encoding="utf-8")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the deployment (finally below)
    env = {
        "OMP_NUM_THREADS": "1",
        "LIGHTNING_FL_CACHE": str(args.cache),
        "PYTHONPATH": os.pathsep.join([str(REPO), str(BENCHMARKS), os.environ.get("PYTHONPATH", "")]),
        "TQDM_DISABLE": "1",
        STAMPS: str(stamps),
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(args.superexec_poll),
    }
    runs: list[dict[str, Any]] = []
    result = Path(args.result)
    with make_deployment(work / "flower", json.loads(args.star), args.clients, env) as d:
        for n, step in enumerate(plan):
            method, case, rates = step["method"], step["case"], step["rates"]
            for i, (down, up) in enumerate(rates):
                star.set_rates(i, down, up)
            name = f"{method}-{case}-{n}"
            overrides = [
                *("--data.num_clients", str(args.clients), "--trainer.rounds", str(args.rounds)),
                *("--trainer.logger", "false", "--trainer.enable_progress_bar", "false"),
                *("--trainer.default_root_dir", str(work / "runs"), "--trainer.name", name),
                "--trainer.callbacks+=shaped_links.LinkStamps",
            ]
            run_config = f"config='{REPO / METHODS[method][0]}' overrides='{shlex.join(overrides)}' round-timeout=600.0"
            offsets = {i: d.logs[f"worker{i}"].stat().st_size for i in range(args.clients)}
            node_offsets = {i: d.logs[f"supernode{i}"].stat().st_size for i in range(args.clients)}
            load, t0 = os.getloadavg()[0], time.perf_counter()
            run_id = d.run_app(app, run_config)
            status = d.wait_run(run_id, timeout=args.run_timeout, poll=2.0)
            if status["status"] != "finished:completed":
                raise RuntimeError(f"{name}: {status['status']}\n{d.run_logs(run_id)[-3000:]}")
            (ckpt,) = sorted((work / "runs" / name).glob("**/checkpoints/last.ckpt"))[-1:]
            history = {h["round"]: h for h in read_checkpoint(ckpt)["history"] if h["round"] >= 1}
            compute = {i: worker_compute(d.logs[f"worker{i}"], offsets[i]) for i in range(args.clients)}
            nodes = {i: node_timeline(d.logs[f"supernode{i}"], node_offsets[i]) for i in range(args.clients)}
            marks = [json.loads(line) for line in (stamps / f"{name}.jsonl").read_text().splitlines()]
            rounds = []
            for before, after in itertools.pairwise(marks):
                r, h = after["round"], history[after["round"]]
                wire = [
                    [after["dev"][dev][k] - before["dev"][dev][k] for k in (1, 0)]  # (down = sent, up = received)
                    for dev in star.server_dev
                ]
                rounds.append(
                    {
                        "round": r,
                        "round_s": h["time/clients_and_server_s"],
                        "start": before["time"],
                        "end": after["time"],
                        "worker_s": [compute[i].get(r) for i in range(args.clients)],
                        "node": [nodes[i].get(r, {}) for i in range(args.clients)],
                        "wire_down_bytes": [w[0] for w in wire],
                        "wire_up_bytes": [w[1] for w in wire],
                        **{k: h.get(f"comm/{k}") for k in ("msg_client_down_bytes", "msg_client_up_bytes")},
                        **{k: h.get(f"comm/{k}") for k in ("client_down_bytes", "client_up_bytes")},
                    }
                )
            runs.append({**step, "load_before": load, "seconds": time.perf_counter() - t0, "rounds": rounds})
            times = ", ".join(f"{r['round_s']:.2f}" for r in rounds)
            comp = "; ".join(", ".join(f"{c:.2f}" if c else "?" for c in r["worker_s"]) for r in rounds)
            print(f"[{case}] {method}: rounds {times} s; compute {comp} s", flush=True)
            result.write_text(json.dumps({"runs": runs}), encoding="utf-8")  # what is done so far, kept


# ------------------------------------------------------------------------------------ outside: the plan
def cases(args: argparse.Namespace) -> dict[str, list[tuple[float | None, float | None]]]:
    """Each case's (down, up) Mbit/s per client: no limit, each fixed rate, the clock's drawn links."""
    out: dict[str, list[tuple[float | None, float | None]]] = {"none": [(None, None)] * args.clients}
    for rate in args.rates:
        out[f"{rate:g}"] = [(rate, rate)] * args.clients
    if args.drawn:
        from lightning_fl.federated.arrivals.clock import Clock

        clock = Clock(down_mbps=args.drawn[0], up_mbps=args.drawn[1], link_sigma=args.drawn[2])
        links = clock.links(args.seed, list(range(args.clients)))
        out["drawn"] = [
            (round(float(d) / 1e6, 3), round(float(u) / 1e6, 3))
            for d, u in zip(links.down_bps, links.up_bps, strict=True)
        ]
    return out


def link_check(star: Any, rates: list[float], size: int) -> list[dict[str, Any]]:
    """One TCP transfer of ``size`` bytes each way over client 0's link at each rate: seconds against bytes / rate."""
    import _netns

    out = []
    for rate in rates:
        star.set_rates(0, rate, rate)
        for up in (False, True):
            took = _netns.link_seconds(star, 0, size, up=up)
            out.append({"rate_mbit": rate, "direction": "up" if up else "down", "bytes": size, "seconds": took})
            ideal = 8 * size / (rate * 1e6)
            way = "up" if up else "down"
            print(f"link check: {size:,} bytes {way} at {rate:g} Mbit/s in {took:.3f} s (bytes / rate {ideal:.3f} s)")
    star.set_rates(0, None, None)
    return out


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import _netns
    from rate_limited_rounds import prepare_base

    prepare_base(args.cache, work, timeout=600)
    rates = cases(args)
    plan = [
        {"repeat": rep, "method": m, "case": c, "rates": rates[c]}
        for rep in range(args.repeats)
        for m in args.methods
        for c in rates
    ]
    folder = work / "inside"
    folder.mkdir(parents=True, exist_ok=True)
    result = folder / "runs.json"
    with _netns.Star(args.clients) as star:
        check = link_check(star, args.rates, args.check_bytes)
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--inside",
            *("--star", json.dumps(star.describe()), "--plan", json.dumps(plan)),
            *("--workdir", str(folder), "--result", str(result), "--cache", str(args.cache)),
            *("--clients", str(args.clients), "--rounds", str(args.rounds)),
            *("--run-timeout", str(args.run_timeout), "--superexec-poll", str(args.superexec_poll)),
        ]
        with open(folder / "inside.log", "wb") as log:
            limit = args.run_timeout * len(plan) + 300
            done = star.server.run(cmd, timeout=limit, capture_output=False, stdout=log, stderr=subprocess.STDOUT)
        qdiscs = star.qdiscs()
    for line in (folder / "inside.log").read_text(errors="replace").splitlines():
        if line.startswith("["):
            print(line, flush=True)
    if done.returncode != 0:
        tail = (folder / "inside.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"the deployment exited with {done.returncode}:\n{tail}")
    return {"cases": rates, "link_check": check, "qdiscs": qdiscs, **json.loads(result.read_text())}


# ------------------------------------------------------------------------------------ the table
def pred(
    r: dict[str, Any],
    rates: list[tuple[float | None, float | None]],
    latency: float,
    setup: bool = True,
    wire: bool = False,
    ahead: dict[str, list[float]] | None = None,
) -> float:
    """:func:`predict_round` for the measured round ``r`` (:func:`phases`) with the clients' (down, up) ``rates``:
    each client's setup (its ClientApp's start, overlapping the download) and the rest of its time (``setup``), or
    both as compute (``setup=False``: the clock without a setup); the messages' bytes, or (``wire``) the bytes each
    link carried in the round; the round's own times, or (``ahead``) each client's medians without a limit."""
    times = ahead or r
    k = len(times["setup_s"])
    if wire:
        d, u = r["wire_down_bytes"], r["wire_up_bytes"]
    else:
        d, u = [r["msg_client_down_bytes"]] * k, [r["msg_client_up_bytes"]] * k
    down, up = [x for x, _ in rates], [y for _, y in rates]
    if setup:
        return predict_round(times["app_s"], d, u, down, up, latency, setup_s=times["setup_s"])
    return predict_round(
        [a + b for a, b in zip(times["setup_s"], times["app_s"], strict=True)], d, u, down, up, latency
    )


def phases(r: dict[str, Any]) -> dict[str, Any] | None:
    """A measured round's per-client phases from its SuperNodes' timelines (``None`` if one is missing): the
    download (pulling the message's content), the setup (from the message's metadata to its ClientApp's process up;
    Flower starts it at once, so it runs while the content downloads), the ClientApp's work after both (``app_s``:
    pulling the message from its SuperNode, the warm worker's decoding, training and encoding, pushing the reply, the
    SuperNode's 0.5 s checks for it), the upload, and the whole (``busy_s``: from the download's start to the
    upload's end)."""
    if not all({"receiving", "received", "started", "sending", "sent"} <= set(n) for n in r["node"]):
        return None
    return {
        **r,
        "down_s": [n["received"] - n["receiving"] for n in r["node"]],
        "setup_s": [n["started"] - n["receiving"] for n in r["node"]],
        "app_s": [n["sending"] - max(n["received"], n["started"]) for n in r["node"]],
        "up_s": [n["sent"] - n["sending"] for n in r["node"]],
        "busy_s": [n["sent"] - n["receiving"] for n in r["node"]],
    }


def slowest(rounds: list[dict[str, Any]], key: str) -> float:
    """The median over ``rounds`` of the largest client's ``key``."""
    return statistics.median(max(r[key]) for r in rounds)


def summarise(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method and case: measured rounds (min, median) and phases, the predictions and their errors."""
    rows = []
    methods = list(dict.fromkeys(run["method"] for run in raw["runs"]))
    for method in methods:
        runs = [run for run in raw["runs"] if run["method"] == method]
        timed = {case: [r for run in runs if run["case"] == case for r in run["rounds"][1:]] for case in raw["cases"]}
        timed = {case: [p for r in rs if (p := phases(r)) is not None] for case, rs in timed.items()}
        base = timed["none"]
        if not base:  # nothing to calibrate on: say so, and go on with the other methods
            print(f"{method}: no timed round without a limit has every client's phases; not predicted")
            continue
        latency = latency_from(base)
        k = len(base[0]["setup_s"])
        ahead = {key: [statistics.median(r[key][i] for r in base) for i in range(k)] for key in ("setup_s", "app_s")}
        t0 = statistics.median(r["round_s"] for r in base)
        for case, rounds in timed.items():
            if not rounds:
                continue
            rates = raw["cases"][case]
            measured = [r["round_s"] for r in rounds]
            med = statistics.median(measured)

            def error(predicted: list[float], med: float = med) -> float:
                return (statistics.median(predicted) - med) / med

            with_setup = [pred(r, rates, latency) for r in rounds]
            without = [pred(r, rates, latency, setup=False) for r in rounds]
            errors = [(p - m) / m for p, m in zip(with_setup, measured, strict=True)]
            msg = statistics.median(r["msg_client_down_bytes"] for r in rounds)
            row = {
                "method": method,
                "case": case,
                "down_mbit": "/".join("none" if d is None else f"{d:g}" for d, _ in rates),
                "up_mbit": "/".join("none" if u is None else f"{u:g}" for _, u in rates),
                "rounds_timed": len(rounds),
                "round_min_s": min(measured),
                "round_median_s": med,
                "added_s": med - t0,
                "msg_down_bytes": msg,
                "msg_up_bytes": statistics.median(r["msg_client_up_bytes"] for r in rounds),
                "wire_over_msg": statistics.median(
                    (sum(r["wire_down_bytes"]) + sum(r["wire_up_bytes"]))
                    / (k * (r["msg_client_down_bytes"] + r["msg_client_up_bytes"]))
                    for r in rounds
                ),
                "down_s": slowest(rounds, "down_s"),
                "down_ideal_s": max(0.0 if d is None else ideal(msg, d) for d, _ in rates),
                "up_s": slowest(rounds, "up_s"),
                "setup_s": slowest(rounds, "setup_s"),
                "app_s": slowest(rounds, "app_s"),
                "worker_s": slowest(rounds, "worker_s"),
                "busy_s": slowest(rounds, "busy_s"),
                "latency_s": latency,
                "pred_no_setup_s": statistics.median(without),
                "error_no_setup": error(without),
                "pred_s": statistics.median(with_setup),
                "error": error(with_setup),
                "error_min": min(errors),
                "error_max": max(errors),
                "pred_ahead_s": statistics.median(pred(r, rates, latency, ahead=ahead) for r in rounds),
                "pred_wire_s": statistics.median(pred(r, rates, latency, wire=True) for r in rounds),
                "load_median": statistics.median(run["load_before"] for run in runs if run["case"] == case),
            }
            row["error_ahead"] = (row["pred_ahead_s"] - med) / med
            row["error_wire"] = (row["pred_wire_s"] - med) / med
            rows.append(row)
    return rows


def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return ""
    if isinstance(x, float) and digits == 0:
        return f"{x:,.0f}"
    return f"{x:,.{digits}f}" if isinstance(x, float) else str(x)


def pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| method | case | down / up, Mbit/s per client | rounds | round, s (min / median) "
        "| download, s (bytes / rate) | upload, s | setup / app, s | predicted without setup (error) "
        "| predicted (error) | error per round (min / max) | predicted ahead (error) | wire / message | load |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        rates = "none" if r["case"] == "none" else f"{r['down_mbit']} / {r['up_mbit']}"
        cells = [
            r["method"],
            r["case"],
            rates,
            str(r["rounds_timed"]),
            f"{fmt(r['round_min_s'])} / {fmt(r['round_median_s'])}",
            f"{fmt(r['down_s'])} ({fmt(r['down_ideal_s'])})",
            fmt(r["up_s"]),
            f"{fmt(r['setup_s'])} / {fmt(r['app_s'])}",
            f"{fmt(r['pred_no_setup_s'])} ({pct(r['error_no_setup'])})",
            f"{fmt(r['pred_s'])} (**{pct(r['error'])}**)",
            f"{pct(r['error_min'])} / {pct(r['error_max'])}",
            f"{fmt(r['pred_ahead_s'])} ({pct(r['error_ahead'])})",
            fmt(r["wire_over_msg"]),
            fmt(r["load_median"]),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def ideal(nbytes: float, rate_mbit: float) -> float:
    """Seconds ``nbytes`` take at ``rate_mbit`` Mbit/s: bytes / rate."""
    return 8 * nbytes / (rate_mbit * 1e6)


def cell(v: Any) -> Any:
    if isinstance(v, float):
        return int(v) if v.is_integer() else f"{v:.6g}"
    return "" if v is None else v


def write(raw: dict[str, Any], out: Path, regenerated: str | None = None) -> None:
    """Print the table and write ``out.csv`` and ``out.md`` from the measurements ``raw`` (as ``out.json`` holds)."""
    settings, command = raw["settings"], raw["command"]
    rows = summarise(raw)
    text = table(rows)
    print()
    print(text)
    with open(out.with_suffix(".csv"), "w", newline="", encoding="utf-8") as f:
        f.write(f"# {command}\n")
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        for r in rows:
            writer.writerow({k: cell(v) for k, v in r.items()})
    checks = "; ".join(
        f"{c['rate_mbit']:g} Mbit/s {c['direction']}: {c['seconds']:.3f} s ({ideal(c['bytes'], c['rate_mbit']):.3f})"
        for c in raw["link_check"]
    )
    drops = "; ".join(
        f"`{dev}`: {m.group(0)})"
        for dev, text_ in raw["qdiscs"].items()
        if (m := re.search(r"Sent \d+ bytes \d+ pkt \(dropped \d+", text_))
    )
    clients, rounds = settings["clients"], settings["rounds"]
    header = [
        "# Flower rounds on a shaped link per client, against the clock's prediction",
        "",
        f"Produced by `{command}` on {raw['date']}; machine: {raw['machine']}; load average before "
        f"{raw['load_before'][0]:.2f}, after {raw['load_after'][0]:.2f}; total {raw['total_min']:.1f} min"
        + (f"; tables regenerated from the JSON by `{regenerated}`" if regenerated else "")
        + f". {clients} clients = {clients} SuperNodes with warm workers, each in a network namespace of its own "
        "joined to the server's by a veth pair shaped at both ends (tbf, bucket 2 frames = 3,028 bytes, queue 200 ms "
        f"of the rate and at least 64 KiB: benchmarks/_netns.py); SuperExec poll {settings['superexec_poll']:g} s; "
        f"{rounds} rounds per run (round 1 warm-up), {settings['repeats']} run(s) per method and case, the cases "
        "alternated; every process with OMP_NUM_THREADS=1. Round = `time/clients_and_server_s`; the phases are the "
        "slowest client's per round (median over the rounds), from its SuperNode's time-stamped log: download (bytes / "
        "rate of the message in brackets), upload, setup (the ClientApp's process start, which overlaps the download) "
        "and app (the ClientApp's work after both); predicted = the clock (Clock.timing) with each client's setup and "
        "app of that round, its message bytes and rates, and a latency per message calibrated per method on the "
        "rounds without a limit (latency_s in the CSV); without setup = the same with setup + app as compute after "
        "the download (the clock before setup_s); ahead = with each client's median setup and app without a limit; "
        "error = (predicted - measured) / measured of the median round; load = the 1-minute load average when the "
        "case's runs started (median).",
        "",
        f"Link check (one TCP transfer of {raw['link_check'][0]['bytes']:,} bytes over client 0's link; bytes / "
        f"rate in brackets): {checks}.",
        "",
        f"Cases' rates (down, up Mbit/s per client): {json.dumps(raw['cases'])}. tc at the end: {drops}.",
        "",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(header) + text + "\n", encoding="utf-8")
    print(f"\ntotal {raw['total_min']:.1f} min\nwrote {out.with_suffix('.csv')} and .md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--methods", nargs="+", choices=["flite", "lora", "fedavg"], default=["flite", "lora", "fedavg"]
    )
    parser.add_argument("--rates", nargs="+", type=float, default=[100.0, 10.0, 1.0], help="Mbit/s (default 100 10 1)")
    parser.add_argument(
        "--drawn",
        nargs=3,
        type=float,
        default=None,
        metavar=("DOWN", "UP", "SIGMA"),
        help="also a case whose rates the clock's link model draws per client: median down and up Mbit/s, spread",
    )
    parser.add_argument("--seed", type=int, default=0, help="the seed the drawn links come from (default 0)")
    parser.add_argument("--clients", type=int, default=2, help="clients = SuperNodes (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per run (default 3; round 1 is warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per method and case, alternated (default 2)")
    parser.add_argument("--check-bytes", type=int, default=210_000, help="the link check's transfer (bytes)")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="longest wait for one run (s)")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "docs" / "results" / "shaped_links",
        help="writes OUT.csv, OUT.md and OUT.json (default: docs/results/shaped_links)",
    )
    parser.add_argument("--machine", default=f"{os.cpu_count()} CPU cores, shared")
    parser.add_argument("--workdir", type=Path, default=None, help="keep runs and logs here (default: a temp folder)")
    parser.add_argument("--superexec-poll", type=float, default=0.05, help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL (s)")
    parser.add_argument("--from-json", type=Path, default=None, help="measure nothing: the tables from this JSON")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # the plan, in the server namespace
    parser.add_argument("--star", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside(args)
        return
    if args.from_json is not None:
        raw = json.loads(args.from_json.read_text(encoding="utf-8"))
        write(raw, args.out, regenerated=command_line("shaped_links.py", sys.argv[1:]))
        return
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (round 1 is warm-up)")
    sys.path.insert(0, str(BENCHMARKS))
    import _netns

    if reason := _netns.unavailable():
        sys.exit(f"shaped_links.py: {reason}")
    command = command_line("shaped_links.py", sys.argv[1:])
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="shaped_links-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    args.cache = work / "cache"
    load = os.getloadavg()
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the namespaces' clean-up runs on a kill too
    try:
        measured = measure(args, work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    settings = {k: getattr(args, k) for k in ("methods", "rates", "drawn", "seed", "clients", "rounds", "repeats")}
    raw = {
        "command": command,
        "date": date,
        "machine": args.machine,
        "load_before": load,
        "load_after": os.getloadavg(),
        "torch_threads": machine()["torch_threads"],
        "settings": {**settings, "superexec_poll": args.superexec_poll},
        "total_min": (time.perf_counter() - started) / 60,
        **measured,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(portable(raw), indent=1) + "\n", encoding="utf-8")
    write(raw, args.out)


if __name__ == "__main__":
    main()
