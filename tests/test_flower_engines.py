"""Flower's own engines: the simulation engine (Ray) and the deployment engine (SuperLink, SuperNodes, flwr run).

Every process is started here on 127.0.0.1 with free ports, every wait is bounded, and everything started
is stopped by PID (with its children). Bitwise comparisons run both sides with one intra-op thread: float
sums depend on how many threads split them, and Ray gives each ClientApp one CPU.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from conftest import CONFIGS, REPO
from lightning_fl.checkpoint import read_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SMALL = [
    "--trainer.rounds",
    "2",
    "--data.num_clients",
    "4",
    "--trainer.enable_progress_bar",
    "false",
    "--model.init_args.pretraining.epochs",
    "2",
]


def environment(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "NODE_RANK", "LOCAL_RANK", "WORLD_"))}
    env.update(OMP_NUM_THREADS="1", LIGHTNING_FL_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def run(args: list[str], tmp_path, timeout: float = 420) -> None:
    """Run a Python module in a child process (killed by PID on timeout)."""
    with subprocess.Popen(
        [sys.executable, *args],
        cwd=tmp_path,
        env=environment(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        try:
            out, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate(timeout=30)
            raise
    assert process.returncode == 0, out[-4000:]


def final_state(tmp_path, name) -> dict:
    (path,) = (tmp_path / "runs" / name).glob("**/checkpoints/last.ckpt")
    return read_checkpoint(path)


def listening_sockets(pids) -> dict[str, str]:
    """``{"address:port": process name}`` for the TCP sockets these processes listen on (from /proc)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes[link[8:-1]] = pid
    found = {}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}", encoding="ascii") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        for row in rows:
            if row[3] != "0A" or row[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = row[1].split(":")
            words = [bytes.fromhex(hex_ip[i : i + 8])[::-1] for i in range(0, len(hex_ip), 8)]  # little-endian words
            ip = ipaddress.ip_address(b"".join(words))
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
                ip = ip.ipv4_mapped
            with contextlib.suppress(OSError), open(f"/proc/{inodes[row[9]]}/comm", encoding="utf-8") as f:
                found[f"{ip}:{int(hex_port, 16)}"] = f.read().strip()
    return found


def run_watching_sockets(args: list[str], tmp_path, timeout: float = 420) -> tuple[str, dict[str, str]]:
    """:func:`run`, sampling what its processes listen on; returns the output and every socket seen.

    Stops everything it started by PID: on timeout the whole tree, and afterwards any Ray process left behind
    (found as this process's adopted orphans), which fails the test.
    """
    import deployment as fd

    fd.enable_subreaper()
    seen: dict[str, str] = {}
    log = tmp_path / "simulation.log"
    with (
        open(log, "w", encoding="utf-8") as out,
        subprocess.Popen(
            [sys.executable, *args], cwd=tmp_path, env=environment(tmp_path), stdout=out, stderr=subprocess.STDOUT
        ) as process,
    ):
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            seen.update(listening_sockets([process.pid, *fd.descendants(process.pid)]))
            time.sleep(0.2)
        if process.poll() is None:
            fd.kill_tree(process.pid)
            pytest.fail(f"still running after {timeout} s: {log.read_text()[-4000:]}")
    text = log.read_text()
    assert process.returncode == 0, text[-4000:]
    deadline = time.monotonic() + 30  # Ray's processes end shortly after the driver
    while (left := [p for p in fd.descendants(os.getpid()) if fd._alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        fd.kill_tree(pid, grace=2.0)
    fd.reap_orphans()
    assert not left, f"processes left running after the simulation: {left}"
    return text, seen


@pytest.mark.parametrize("config", ["quickstart.yaml", "fedavg_digits.yaml"])
def test_simulation_engine_equals_in_process_bitwise(tmp_path, config):
    """Latent and full-weight FedAvg, 2 rounds, 4 clients, same seeds: Ray's virtual SuperNodes == one process.

    While it runs, Ray's processes (GCS, raylet, workers, the driver) listen on the loopback only, and the
    output carries no deprecation notice.
    """
    common = ["--config", str(CONFIGS / config), *SMALL, "--trainer.default_root_dir", str(tmp_path / "runs")]
    run(["-m", "lightning_fl", "fit", *common, "--trainer.name", "inproc", "--trainer.logger", "false"], tmp_path)
    # a busy machine may need more than the default 60 s for Ray's ClientApps to import and say their client
    sim = ["-m", "lightning_fl.flower", "--supernodes", "4", "--hello-timeout", "300", *common, "--trainer.name", "sim"]
    out, sockets = run_watching_sockets(sim, tmp_path)
    assert {"gcs_server", "raylet"} <= set(sockets.values()), sockets  # the sampling saw Ray running
    exposed = {a: name for a, name in sockets.items() if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback}
    assert not exposed, f"Ray listens beyond the loopback: {exposed}"
    assert "DEPRECATED" not in out and "FutureWarning" not in out, out[-4000:]
    a, b = final_state(tmp_path, "inproc"), final_state(tmp_path, "sim")
    for name in a["global_state"]:
        assert torch.equal(a["global_state"][name], b["global_state"][name]), name
    assert torch.equal(a["ledger"]["up"], b["ledger"]["up"])
    assert (b["ledger"]["msg_up"] > b["ledger"]["up"]).all()
    assert list((tmp_path / "runs" / "sim" / "version_0").glob("events.out.tfevents.*"))  # TensorBoard, as in process


# ------------------------------------------------------------------------------------------------ deployment
DEPLOY = [
    "--trainer.rounds",
    "2",
    "--data.num_clients",
    "2",
    "--trainer.enable_progress_bar",
    "false",
    "--model.init_args.pretraining.epochs",
    "2",
]


@pytest.fixture
def deployment(tmp_path):
    """A SuperLink and 2 SuperNodes on 127.0.0.1 (one intra-op thread each, sharing the base cache)."""
    yield from _deployment(tmp_path, workers=False)


@pytest.fixture
def warm_deployment(tmp_path):
    """The same, with a warm worker beside each SuperNode (node config ``worker``)."""
    yield from _deployment(tmp_path, workers=True)


def _deployment(tmp_path, workers: bool):
    import deployment as fd

    fd.enable_subreaper()
    env = environment(tmp_path)
    extra = {k: env[k] for k in ("OMP_NUM_THREADS", "LIGHTNING_FL_CACHE")}
    with fd.FlowerDeployment(tmp_path / "flower", num_supernodes=2, extra_env=extra, workers=workers) as d:
        yield d
    left = [p for p in fd.descendants(os.getpid()) if fd._alive(p)]
    assert not left, "processes left running: " + ", ".join(map(str, left))


def submit(deployment, tmp_path, name: str, *extra: str, timeout: str = "120", run_config: str = "") -> int:
    overrides = " ".join(
        [*DEPLOY, "--trainer.default_root_dir", str(tmp_path / "runs"), "--trainer.name", name, *extra]
    )
    config = f'config="configs/quickstart.yaml" overrides="{overrides}" round-timeout={timeout} {run_config}'
    return deployment.run_app(REPO, config.strip())


def finish(deployment, run_id: int, timeout: float = 300) -> None:
    status = deployment.wait_run(run_id, timeout=timeout)
    assert status["status"] == "finished:completed", deployment.run_logs(run_id)[-4000:]


def test_deployment_engine_equals_in_process(tmp_path, deployment):
    """flwr run of the quickstart on a real SuperLink and 2 SuperNodes: the in-process run's state and payload bytes."""
    common = [
        "--config",
        str(CONFIGS / "quickstart.yaml"),
        *DEPLOY,
        "--trainer.default_root_dir",
        str(tmp_path / "runs"),
    ]
    run(["-m", "lightning_fl", "fit", *common, "--trainer.name", "inproc"], tmp_path)
    finish(deployment, submit(deployment, tmp_path, "deployed"))
    a, b = final_state(tmp_path, "inproc"), final_state(tmp_path, "deployed")
    for name in a["global_state"]:
        assert torch.equal(a["global_state"][name], b["global_state"][name]), name
    assert torch.equal(a["ledger"]["up"], b["ledger"]["up"]) and torch.equal(a["ledger"]["down"], b["ledger"]["down"])
    assert (b["ledger"]["msg_up"] > b["ledger"]["up"]).all() and (b["ledger"]["msg_down"] > b["ledger"]["down"]).all()


def test_deployment_with_warm_workers_equals_in_process(tmp_path, warm_deployment):
    """flwr run of the quickstart with a warm worker beside each SuperNode: every message goes through the proxy
    ClientApp to the node's worker, and the run ends where the in-process one does."""
    common = [
        "--config",
        str(CONFIGS / "quickstart.yaml"),
        *DEPLOY,
        "--trainer.default_root_dir",
        str(tmp_path / "runs"),
    ]
    run(["-m", "lightning_fl", "fit", *common, "--trainer.name", "inproc"], tmp_path)
    finish(warm_deployment, submit(warm_deployment, tmp_path, "warm"))
    a, b = final_state(tmp_path, "inproc"), final_state(tmp_path, "warm")
    for name in a["global_state"]:
        assert torch.equal(a["global_state"][name], b["global_state"][name]), name
    assert torch.equal(a["ledger"]["up"], b["ledger"]["up"])
    for idx in range(2):  # each worker served its node's hello and both rounds
        log = warm_deployment.logs[f"worker{idx}"].read_text()
        assert log.count("served in") == 3 and "query (round -)" in log and "train (round 2)" in log, log


class Busy:
    """Load this machine on purpose: ``count`` busy loops at this process's own priority (they compete with the run's
    processes as a neighbour's jobs would), started here and stopped by PID; :meth:`sample` keeps the highest
    1-minute load average seen."""

    def __init__(self, count: int) -> None:
        self.count, self.processes, self.peak = count, [], 0.0

    def __enter__(self) -> Busy:
        loop = [sys.executable, "-c", "while True: pass"]
        self.processes = [subprocess.Popen(loop, stdin=subprocess.DEVNULL) for _ in range(self.count)]
        return self

    def sample(self) -> float:
        self.peak = max(self.peak, os.getloadavg()[0])
        return self.peak

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.kill()
            process.wait(timeout=10)


def test_the_tutorial_deployment_and_the_simulation_engine_pass_with_their_defaults_at_load_10(tmp_path):
    """Busy loops load the machine (5 per core, at least 10) while the Flower tutorial's deployment runs as the
    tutorial starts it (a SuperLink, two SuperNodes through ``python -m lightning_fl.flower.supernode``, the run
    through ``python -m lightning_fl.flower.submit``) and then the simulation engine, both with every wait at its
    default: each completes with both clients in every round and exits 0."""
    import deployment as fd

    fd.enable_subreaper()
    env = environment(tmp_path)
    extra = {k: env[k] for k in ("OMP_NUM_THREADS", "LIGHTNING_FL_CACHE", "PYTHONPATH")}
    with Busy(max(10, 5 * (os.cpu_count() or 1))) as busy:
        with fd.FlowerDeployment(tmp_path / "flower", num_supernodes=2, extra_env=extra, launcher=True) as d:
            overrides = " ".join([*DEPLOY, "--trainer.default_root_dir", str(tmp_path / "runs"), "--trainer.name", "d"])
            submit_ = [sys.executable, "-m", "lightning_fl.flower.submit", str(REPO), "local-test", "--run-config"]
            with subprocess.Popen(
                [*submit_, f'config="configs/quickstart.yaml" overrides="{overrides}"'],
                env={**d.env(d.cli_home), **extra},
                cwd=d.workdir,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ) as process:
                deadline = time.monotonic() + 2400
                while process.poll() is None and time.monotonic() < deadline:
                    busy.sample()
                    time.sleep(1.0)
                if process.poll() is None:
                    fd.kill_tree(process.pid)
                out = process.communicate(timeout=30)[0]
            assert process.returncode == 0, f"(peak load {busy.peak:.1f}) {out[-4000:]}"
        deployed = final_state(tmp_path, "d")["history"]
        common = ["--config", str(CONFIGS / "quickstart.yaml"), *DEPLOY, "--trainer.default_root_dir"]
        sim = ["-m", "lightning_fl.flower", *common, str(tmp_path / "runs"), "--trainer.name", "s"]
        with subprocess.Popen(
            [sys.executable, *sim], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as process:
            deadline = time.monotonic() + 2400
            while process.poll() is None and time.monotonic() < deadline:
                busy.sample()
                time.sleep(1.0)
            if process.poll() is None:
                fd.kill_tree(process.pid)
            out = process.communicate(timeout=30)[0]
        assert process.returncode == 0, f"(peak load {busy.peak:.1f}) {out[-4000:]}"
    print(f"peak 1-minute load average: {busy.peak:.1f}")
    assert busy.peak >= 10, f"the machine was not loaded enough to tell: peak load {busy.peak:.1f}"
    for history in (deployed, final_state(tmp_path, "s")["history"]):
        assert [h["fed/lost_clients"] for h in history[1:]] == [0.0, 0.0]
    deadline = time.monotonic() + 30  # (Ray's processes end shortly after the driver)
    while (left := [p for p in fd.descendants(os.getpid()) if fd._alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        fd.kill_tree(pid, grace=2.0)
    fd.reap_orphans()
    assert not left, "processes left running: " + ", ".join(map(str, left))


def test_sigterm_to_a_supernode_started_by_our_launcher_leaves_no_process(tmp_path):
    """``python -m lightning_fl.flower.supernode`` stops its SuperNode's SuperExec when the SuperNode stops, even
    while nothing has reaped the launcher yet (``flower-supernode`` alone leaves its SuperExec running then: the
    SuperExec watches a PID that a zombie still holds)."""
    import signal

    import deployment as fd

    with fd.FlowerDeployment(tmp_path / "flower", num_supernodes=1, launcher=True) as d:
        launcher = d.procs["supernode0"]
        tree = fd.descendants(launcher.pid)
        names = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in tree if fd._alive(pid)]
        assert any(b"flower-superexec" in name for name in names), names
        os.kill(launcher.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while (left := [p for p in tree if fd._alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"left running after SIGTERM: {left}"
        assert launcher.wait(timeout=30) == 0


def test_killed_supernode_misses_a_round_and_rejoins(tmp_path, deployment):
    """SIGKILL a SuperNode as round 2 starts and start it again: round 2 lacks that client, round 3 has it back."""
    import time

    run_id = submit(deployment, tmp_path, "killed", "--trainer.rounds", "3", timeout="40")
    checkpoint = tmp_path / "runs" / "killed"
    deadline = time.monotonic() + 240
    while not any(read_checkpoint(p)["round"] >= 1 for p in checkpoint.glob("**/checkpoints/last.ckpt")):
        assert time.monotonic() < deadline, "round 1 did not finish in time"
        time.sleep(0.2)
    deployment.crash_supernode(1)
    deployment.start_supernode(1)
    finish(deployment, run_id)
    history = final_state(tmp_path, "killed")["history"]
    assert [h["fed/lost_clients"] for h in history[1:]] == [0.0, 1.0, 0.0]
    assert [h["fed/round_skipped"] for h in history[1:]] == [0.0, 0.0, 0.0]
    assert all(torch.isfinite(t).all() for t in final_state(tmp_path, "killed")["global_state"].values())


# a SuperNode slow on purpose: every Python process of its tree imports this first (its PYTHONPATH). In a ClientApp
# process it wraps the ClientApp's call, so the hold runs where user code runs, after Flower's task heartbeat has
# started: the node's first train message waits for the test's go (a file), at most 1200 s, and Flower keeps the task
# alive meanwhile (a hold before the heartbeat starts is a task Flower expires or starts again after 30-60 s)
HOLD_FIRST_TRAIN = """
import os, time
with open("/proc/self/cmdline", "rb") as f:
    argv = f.read().split(b"\\0")
if any(a.endswith(b"flwr-clientapp") for a in argv[:2]):
    from flwr.clientapp.client_app import ClientApp
    here = os.path.dirname(os.path.abspath(__file__))
    call = ClientApp.__call__
    def held(self, message, context):
        if message.metadata.message_type == "train" and not os.path.exists(os.path.join(here, "holding")):
            open(os.path.join(here, "holding"), "w").close()
            deadline = time.monotonic() + 1200
            while not os.path.exists(os.path.join(here, "go")) and time.monotonic() < deadline:
                time.sleep(0.1)
        return call(self, message, context)
    ClientApp.__call__ = held
"""


def test_a_quorum_round_proceeds_without_a_slow_supernode_and_folds_its_late_reply(tmp_path):
    """Three real SuperNodes, run config quorum = 2: node 2 is held (on purpose) at its first train message until
    round 1 has closed without it; its reply, sent once released, is folded into a later round with staleness
    >= 1, its client is sent nothing while it is out, and the run completes every round with finite weights. The
    hold lasts as long as round 1 takes (on a loaded machine, minutes): it never relies on Flower's 30-60 s limits."""
    import deployment as fd

    fd.enable_subreaper()
    env = environment(tmp_path)
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(HOLD_FIRST_TRAIN, encoding="utf-8")
    extra = {k: env[k] for k in ("OMP_NUM_THREADS", "LIGHTNING_FL_CACHE")}
    node_env = {2: {"PYTHONPATH": os.pathsep.join([str(slow), env["PYTHONPATH"]])}}
    with fd.FlowerDeployment(tmp_path / "flower", num_supernodes=3, extra_env=extra, node_env=node_env) as d:
        run_id = submit(
            d,
            tmp_path,
            "quorum",
            "--trainer.rounds",
            "5",
            "--data.num_clients",
            "3",
            timeout="0",  # (a round waits for its quorum as long as that takes: round 1 never closes at 1 of 3)
            run_config="quorum=2 max-staleness=4",
        )
        checkpoint, deadline = tmp_path / "runs" / "quorum", time.monotonic() + 1200
        while not any(read_checkpoint(p)["round"] >= 1 for p in checkpoint.glob("**/checkpoints/last.ckpt")):
            assert time.monotonic() < deadline, "round 1 did not close without the held node"
            time.sleep(0.2)
        assert (slow / "holding").exists()  # round 1 closed while node 2 was still held at its train message
        (slow / "go").touch()
        finish(d, run_id, timeout=1500)
        logs = d.run_logs(run_id)
    left = [p for p in fd.descendants(os.getpid()) if fd._alive(p)]
    assert not left, "processes left running: " + ", ".join(map(str, left))
    got = final_state(tmp_path, "quorum")
    rounds = got["history"][1:]
    assert len(rounds) == 5 and all(torch.isfinite(t).all() for t in got["global_state"].values())
    assert rounds[0]["fed/lost_clients"] == 1 and rounds[0]["fed/busy_clients"] == 1  # closed without node 2
    assert "round 1: proceeds with 2 of 3 replies; client(s) [2] are still training" in logs, logs[-4000:]
    # its reply folded into a later round (other nodes may straggle too on a busy machine: at least one fold)
    assert sum(h["fed/stale_replies"] for h in rounds[1:]) >= 1 and max(h["fed/staleness_max"] for h in rounds) >= 1
    # every reply counted once in the ledger, in time or late: 768 B each (the quickstart's latent, FP32)
    ups = got["ledger"]["up"].tolist()
    assert sum(ups) == 768 * sum(h["fed/clients"] - h["fed/lost_clients"] for h in rounds), ups
    assert ups[2] > 0, ups
    # a node trains one message at a time: no client ever had two out (downloads are the same 768 B)
    downs = got["ledger"]["down"].tolist()
    assert all(0 <= down - up <= 768 for down, up in zip(downs, ups, strict=True)), (downs, ups)


# the in-process side of a FedBuff deployment: the same config, its arrivals in the order the deployment recorded
# (argv: the order as JSON, then the command line)
REPLAY = """
import json, sys
from lightning_fl.cli import main
from lightning_fl.federated.arrivals import Buffered
from lightning_fl.federated.arrivals.sources import Replayed
from lightning_fl.federated.trainer import loop
order = json.loads(sys.argv[1])
loop.round_arrivals = lambda s, local, target: Buffered(s.buffered, s.clock, local, Replayed(order))
main(sys.argv[2:])
"""


def test_fedbuff_on_a_deployment_equals_the_in_process_replay_of_its_arrivals(tmp_path):
    """FedBuff on a real SuperLink with three SuperNodes (two clients training at once, a step per update, four
    steps): the ServerApp sends each client one message at a time and folds each reply as it arrives, the second of
    each pair stale by at least a step. The order it recorded (client, version), replayed in process, reaches the
    same global state (to float32 rounding: 1e-6 absolute) and the same payload bytes."""
    import json

    import deployment as fd

    fd.enable_subreaper()
    env = environment(tmp_path)
    extra = {k: env[k] for k in ("OMP_NUM_THREADS", "LIGHTNING_FL_CACHE")}
    fedbuff = [
        *DEPLOY[4:],
        "--trainer.rounds",
        "4",
        "--data.num_clients",
        "3",
        "--trainer.buffered",
        "FedBuff",
        "--trainer.buffered.concurrency",
        "2",
        "--trainer.buffered.buffer_size",
        "1",
        "--trainer.clock",
        "Clock",
        "--trainer.default_root_dir",
        str(tmp_path / "runs"),
    ]
    overrides = " ".join([*fedbuff, "--trainer.name", "deployed"])
    with fd.FlowerDeployment(tmp_path / "flower", num_supernodes=3, extra_env=extra) as d:
        settings = "round-timeout=300 hello-timeout=300"  # (a ClientApp may take minutes to import on a busy machine)
        run_id = d.run_app(REPO, f'config="configs/quickstart.yaml" overrides="{overrides}" {settings}')
        finish(d, run_id, timeout=1200)
        logs = d.run_logs(run_id)
    left = [p for p in fd.descendants(os.getpid()) if fd._alive(p)]
    assert not left, "processes left running: " + ", ".join(map(str, left))
    got = final_state(tmp_path, "deployed")
    steps = got["history"][1:]
    assert len(steps) == 4 and max(h["fed/staleness_max"] for h in steps) >= 1, steps
    assert "trainer.clock is not used on Flower" in logs and "step 4: 1 updates aggregated" in logs, logs[-4000:]
    order = [tuple(row) for row in got["buffered"]["arrived"].tolist()]
    assert len(order) == 4
    config = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), *fedbuff, "--trainer.name", "replayed"]
    run(["-c", REPLAY, json.dumps(order), *config], tmp_path)
    reference = final_state(tmp_path, "replayed")
    assert [tuple(row) for row in reference["buffered"]["arrived"].tolist()] == order
    for name, value in reference["global_state"].items():
        torch.testing.assert_close(got["global_state"][name], value, rtol=0, atol=1e-6)
    assert torch.equal(got["ledger"]["up"], reference["ledger"]["up"])
    assert torch.equal(got["ledger"]["down"], reference["ledger"]["down"])


@pytest.mark.parametrize("database", [True, False], ids=["with-database", "in-memory"])
def test_a_superlink_crash_and_restart(tmp_path, database):
    """kill -9 of the SuperLink (and its ServerApp) after round 2, then the same SuperLink started again and the
    run resubmitted with ``--trainer.resume auto``. With ``--database`` (Flower keeps the nodes' registrations)
    the SuperNodes reconnect by themselves and the resumed run ends where an uninterrupted one does, bit for
    bit; without it the SuperNodes are refused (401) and exit, and the resumed run fails with our error naming
    the fix instead of finishing untrained, its silent attempts neither saved nor counted as rounds."""
    import time

    import deployment as fd

    fd.enable_subreaper()
    env = environment(tmp_path)
    extra = {k: env[k] for k in ("OMP_NUM_THREADS", "LIGHTNING_FL_CACHE")}
    args = ["--database", str(tmp_path / "superlink.db")] if database else []
    common = [*DEPLOY[2:], "--trainer.rounds", "4", "--trainer.default_root_dir", str(tmp_path / "runs")]
    overrides = " ".join([*common, "--trainer.name", "restarted"])
    with fd.FlowerDeployment(tmp_path / "flower", num_supernodes=2, extra_env=extra, superlink_args=args) as d:
        d.run_app(REPO, f'config="configs/quickstart.yaml" overrides="{overrides}" round-timeout=60')
        deadline = time.monotonic() + 300
        runs = tmp_path / "runs" / "restarted"
        while not any(read_checkpoint(p)["round"] >= 2 for p in runs.glob("**/checkpoints/last.ckpt")):
            assert time.monotonic() < deadline, "round 2 did not finish in time"
            time.sleep(0.2)
        d.crash_superlink()
        d.start_superlink()
        resumed = (
            f'config="configs/quickstart.yaml" overrides="{overrides} --trainer.resume auto" round-timeout=60 '
            "wait-for-nodes=10 max-silent-rounds=2"
        )
        if database:
            d.wait_nodes(2, timeout=60)
            finish(d, d.run_app(REPO, resumed))
        else:
            run_id = d.run_app(REPO, resumed)
            assert d.wait_run(run_id, timeout=300)["status"] == "finished:failed"
            logs = d.run_logs(run_id)  # our one line, and no traceback after it
            assert "no sampled client replied in 2 attempts in a row at round 3" in logs and "Traceback" not in logs
            assert all(d.procs[f"supernode{i}"].poll() is not None for i in range(2))  # refused, they exited
    got = final_state(tmp_path, "restarted")
    if not database:  # the silent attempts of round 3 were not rounds: the run stopped, loudly, at round 2
        assert got["round"] == 2 and [h["fed/lost_clients"] for h in got["history"][1:]] == [0.0, 0.0]
        return
    run(
        [
            "-m",
            "lightning_fl",
            "fit",
            "--config",
            str(CONFIGS / "quickstart.yaml"),
            *common,
            "--trainer.name",
            "straight",
            "--trainer.logger",
            "false",
        ],
        tmp_path,
    )
    reference = final_state(tmp_path, "straight")
    assert got["round"] == 4 and all(h["fed/lost_clients"] == 0.0 for h in got["history"][1:])
    for name in reference["global_state"]:
        assert torch.equal(reference["global_state"][name], got["global_state"][name]), name


def test_tls_and_supernode_authentication(tmp_path):
    """docs/deploy.md's TLS and node authentication on 127.0.0.1, with a CA, a server certificate and node keys made
    here: the SuperLink over HTTPS with ``--enable-supernode-auth``, two SuperNodes whose keys ``flwr supernode
    register`` registered run the quickstart to the in-process run's state, bit for bit. Refused, each with a 412
    or a TLS error, and each exits: a node whose key is not registered (``[code: 2004] Failed to activate
    SuperNode``), a node with no key (it asks to register itself: ``[code: 2001]``, what
    ``--enable-supernode-auth`` forbids), and a registered node that does not trust the CA (certificate verify
    failed). None of them is ever online."""
    import time

    import deployment as fd

    fd.enable_subreaper()
    env = environment(tmp_path)
    extra = {k: env[k] for k in ("OMP_NUM_THREADS", "LIGHTNING_FL_CACHE")}
    tls = fd.make_tls(tmp_path / "tls")
    common = [
        "--config",
        str(CONFIGS / "quickstart.yaml"),
        *DEPLOY,
        "--trainer.default_root_dir",
        str(tmp_path / "runs"),
    ]
    with fd.FlowerDeployment(tmp_path / "flower", num_supernodes=2, extra_env=extra, tls=tls, node_auth=True) as d:
        registered = set(d.node_ids.values())
        assert len(registered) == 2 and set(d.online_nodes()) == registered
        d.start_supernode(2, register=False, wait=False)  # its key pair exists, the SuperLink never saw it
        d.start_supernode(3, trust_ca=False, wait=False)  # registered, but trusts only the system's CAs
        d.start_supernode(4, key=False, wait=False)  # no key: Flower makes one and asks to register it
        run(["-m", "lightning_fl", "fit", *common, "--trainer.name", "inproc", "--trainer.logger", "false"], tmp_path)
        deadline = time.monotonic() + 60
        while any(d.procs[f"supernode{i}"].poll() is None for i in (2, 3, 4)):
            assert time.monotonic() < deadline, "a refused SuperNode is still running after 60 s"
            time.sleep(0.2)
        unregistered, untrusting, keyless = (d.logs[f"supernode{i}"].read_text() for i in (2, 3, 4))
        assert d.procs["supernode2"].returncode != 0 and "[code: 2004] Failed to activate SuperNode." in unregistered
        assert d.procs["supernode3"].returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in untrusting
        assert d.procs["supernode4"].returncode != 0 and "[code: 2001] SuperNode authentication is enabled." in keyless
        assert "No SuperNode found with the given public key" in d.logs["superlink"].read_text()
        assert set(d.online_nodes()) == registered
        finish(d, submit(d, tmp_path, "deployed"))
        assert set(d.online_nodes()) == registered
    left = [p for p in fd.descendants(os.getpid()) if fd._alive(p)]
    assert not left, "processes left running: " + ", ".join(map(str, left))
    a, b = final_state(tmp_path, "inproc"), final_state(tmp_path, "deployed")
    for name in a["global_state"]:
        assert torch.equal(a["global_state"][name], b["global_state"][name]), name
    assert torch.equal(a["ledger"]["up"], b["ledger"]["up"]) and torch.equal(a["ledger"]["down"], b["ledger"]["down"])


# ------------------------------------------------------------------------------------------------ SecAgg+
# Each SecAgg+ stage reaches a node as a message that its SuperNode serves in a fresh ClientApp process (imports and
# the run's build: 20-30 s each on 2 busy cores, three nodes at once), so a stage waits 90 s (the default is 120 s);
# with 20 s the nodes missed the setup or the masked upload and the deployed run summed fewer of them than in process.
SECURE = [
    "--trainer.rounds",
    "1",
    "--data.num_clients",
    "3",
    "--trainer.enable_progress_bar",
    "false",
    "--model.init_args.pretraining.epochs",
    "2",
    "--trainer.max_update_norm_ratio",
    "null",
    "--trainer.secure_aggregation",
    "lightning_fl.privacy.secure.SecureAggregation",
    "--trainer.secure_aggregation.clipping_range",
    "1.0",
    "--trainer.secure_aggregation.stage_timeout",
    "90",
    "--trainer.secure_aggregation.rounding_seed",
    "0",
]


@pytest.fixture
def secure_deployment(tmp_path):
    """A SuperLink and 3 SuperNodes on 127.0.0.1 whose ClientApp is ours plus test-only misbehaviour
    (tests/secagg_misbehave.py), steered by files in a control folder."""
    import deployment as fd

    fd.enable_subreaper()
    control = tmp_path / "control"
    control.mkdir()
    env = environment(tmp_path)
    extra = {k: env[k] for k in ("OMP_NUM_THREADS", "LIGHTNING_FL_CACHE", "PYTHONPATH")}
    extra["LIGHTNING_FL_TEST_CONTROL"] = str(control)
    with fd.FlowerDeployment(tmp_path / "flower", num_supernodes=3, extra_env=extra) as d:
        yield d, control
    left = [p for p in fd.descendants(os.getpid()) if fd._alive(p)]
    assert not left, "processes left running: " + ", ".join(map(str, left))


def secure_app(tmp_path):
    """A Flower app folder: our ServerApp, the test's ClientApp."""
    import shutil

    app = tmp_path / "app"
    app.mkdir()
    shutil.copy(REPO / "tests" / "secagg_misbehave.py", app / "secagg_misbehave.py")
    (app / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "secagg-test"\nversion = "0.1.0"\ndependencies = []\n\n'
        '[tool.flwr.app]\npublisher = "lightning-fl"\n\n'
        '[tool.flwr.app.components]\nserverapp = "lightning_fl.flower.server:app"\n'
        'clientapp = "secagg_misbehave:app"\n\n'
        '[tool.flwr.app.config]\nconfig = ""\noverrides = ""\nround-timeout = 0.0\nwait-for-nodes = 60.0\n',
        encoding="utf-8",
    )
    return app


def test_secagg_plus_deployment_equals_in_process_and_survives_dropped_and_hostile_nodes(tmp_path, secure_deployment):
    """flwr run with SecAgg+ on a real SuperLink and 3 SuperNodes, one round each:
    (1) the in-process secure run bit for bit, and plain FedAvg within the quantisation step;
    (2) a node killed after its masked upload: its mask is rebuilt from the others' shares, the sum is (1)'s;
    (3) a node whose masked upload is not an array: rejected and named, the run completes on the others' sum."""
    import signal
    import time

    deployment, control = secure_deployment
    config = str(CONFIGS / "quickstart.yaml")
    common = ["--config", config, *SECURE, "--trainer.default_root_dir", str(tmp_path / "runs")]
    run(["-m", "lightning_fl", "fit", *common, "--trainer.name", "inproc", "--trainer.logger", "false"], tmp_path)
    plain = [
        a
        for i, a in enumerate(common)  # the same run without the secure_aggregation keys and their values
        if not any(common[j].startswith("--trainer.secure_aggregation") for j in (i, i - 1))
    ]
    run(["-m", "lightning_fl", "fit", *plain, "--trainer.name", "plain", "--trainer.logger", "false"], tmp_path)
    app = secure_app(tmp_path)

    def deploy(name: str) -> int:
        overrides = " ".join([*SECURE, "--trainer.default_root_dir", str(tmp_path / "runs"), "--trainer.name", name])
        return deployment.run_app(app, f'config="{config}" overrides="{overrides}" round-timeout=120')

    reference, flat = final_state(tmp_path, "inproc"), final_state(tmp_path, "plain")
    # (1)
    finish(deployment, deploy("deployed"))
    got = final_state(tmp_path, "deployed")
    for name in reference["global_state"]:
        assert torch.equal(got["global_state"][name], reference["global_state"][name]), name
        gap = (got["global_state"][name] - flat["global_state"][name]).abs().max()
        assert float(gap) <= 2.0 / 2**22 + 1e-6, name  # one round: the mean of the roundings, under one step
    assert torch.equal(got["ledger"]["up"], reference["ledger"]["up"])
    assert (got["ledger"]["msg_up"] > got["ledger"]["up"]).all()
    # (2)
    (control / "stall-2").touch()
    run_id = deploy("dropped")
    deadline = time.monotonic() + 240
    while not (control / "stalled-2").exists():
        assert time.monotonic() < deadline, "node 2 never reached the unmask stage"
        time.sleep(0.2)
    pid = int((control / "stalled-2").read_text())
    deployment.crash_supernode(2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    finish(deployment, run_id)
    got = final_state(tmp_path, "dropped")
    for name in reference["global_state"]:
        assert torch.equal(got["global_state"][name], reference["global_state"][name]), name
    assert got["history"][-1]["fed/dropped_clients"] == 0.0 and got["history"][-1]["fed/lost_clients"] == 0.0
    # (3)
    (control / "stall-2").unlink()
    deployment.start_supernode(2)
    deployment.wait_nodes(3)
    (control / "hostile-1").touch()
    run_id = deploy("hostile")
    finish(deployment, run_id)
    got = final_state(tmp_path, "hostile")
    assert got["history"][-1]["fed/dropped_clients"] == 1.0 and got["history"][-1]["fed/round_skipped"] == 0.0
    assert (
        "client 1: upload rejected: secure aggregation, masked upload stage: malformed SecAgg+ reply"
        in deployment.run_logs(run_id)
    )
    assert all(torch.isfinite(t).all() for t in got["global_state"].values())
    assert any(not torch.equal(got["global_state"][n], reference["global_state"][n]) for n in got["global_state"])
