"""Fabric multi-node: ``trainer.num_nodes`` with one process per node, started by hand as on separate machines."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import CONFIGS, REPO, make_dm, make_model, make_trainer
from lightning_fl.checkpoint import read_checkpoint
from lightning_fl.errors import ConfigError

SMALL = [
    "fit",
    "--config",
    str(CONFIGS / "quickstart.yaml"),
    "--trainer.rounds",
    "2",
    "--data.num_clients",
    "4",
    "--model.pretraining.epochs",
    "2",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.default_root_dir",
    "runs",  # relative: each "machine" writes under its own working folder
]
# variables that would make Fabric pick another cluster environment or skip its launcher
CLUSTER = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
CLUSTER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "LSB_", "LT_", "OMPI_", "PMI_")
TIMEOUT_S = 300


def clean_env(folder, **extra: str) -> dict[str, str]:
    """The environment of one "machine": its own base cache, no cluster variables, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER and not k.startswith(CLUSTER_PREFIXES)}
    return {
        **env,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TQDM_DISABLE": "1",
        "LIGHTNING_FL_CACHE": str(folder / "cache"),
        **extra,
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.is_file() else ""


def last_checkpoint(folder, name: str) -> dict:
    return read_checkpoint(folder / "runs" / name / "version_0" / "checkpoints" / "last.ckpt")


def run_nodes(folders, *args: str, log: str = "log.txt") -> list:
    """Start the same command on every "machine" (NODE_RANK = its index), wait (bounded), kill what is left.

    Each folder is one machine's working folder; returns the log file of each node (checked to have exited 0).
    """
    port = str(free_port())
    cmd = [sys.executable, "-m", "lightning_fl", *SMALL, "--trainer.num_nodes", str(len(folders)), *args]
    logs, procs = [], []
    try:
        for rank, folder in enumerate(folders):
            folder.mkdir(exist_ok=True)
            logs.append(folder / log)
            env = clean_env(folder, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank))
            with logs[-1].open("w") as out:
                procs.append(subprocess.Popen(cmd, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT_S
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # killed below and reported with the nodes' logs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    failed = [
        f"node {rank} exited {proc.returncode}"
        + (f" (killed after {TIMEOUT_S} s)" if proc.returncode == -signal.SIGKILL else "")
        + f":\n{tail(logs[rank])}"
        for rank, proc in enumerate(procs)
        if proc.returncode != 0
    ]
    assert not failed, "\n".join(failed)
    return logs


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> dict:
    """The last checkpoint of the uninterrupted 2-round run in 1 process: what the multi-node runs must equal."""
    folder = tmp_path_factory.mktemp("single")
    cmd = [sys.executable, "-m", "lightning_fl", *SMALL, "--trainer.name", "p1"]
    proc = subprocess.run(cmd, cwd=folder, env=clean_env(folder), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_checkpoint(folder, "p1")


def assert_same_run(one: dict, two: dict) -> None:
    """Same 2 rounds: global state and byte ledger bit for bit, same metric curves."""
    assert one["round"] == two["round"] == 2
    assert sorted(one["global_state"]) == sorted(two["global_state"])
    for name, value in one["global_state"].items():
        assert torch.equal(value, two["global_state"][name]), name
    assert sorted(one["ledger"]) == sorted(two["ledger"])
    for name, value in one["ledger"].items():
        assert torch.equal(value, two["ledger"][name]), name
    assert int(two["ledger"]["up"].sum()) == 2 * 4 * 192 * 4  # 2 rounds x 4 clients x 192 float32 latents
    metrics = ("round", "val/acc", "val/loss", "train/loss", "comm/cum_client_bytes")
    curves = [[[h.get(m) for m in metrics] for h in ckpt["history"]] for ckpt in (one, two)]
    assert curves[0] == curves[1] and len(curves[0]) == 3


@pytest.mark.distributed
def test_two_nodes_of_one_process_give_the_same_global_state_as_one_process(tmp_path, single_run):
    """2 nodes x 1 process (gloo on 127.0.0.1, NODE_RANK 0 and 1, no shared folders) equal 1 process bit for bit."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    logs = run_nodes(nodes, "--trainer.name", "n2")
    assert "All distributed processes registered. Starting with 2 processes" in logs[0].read_text()
    assert not (nodes[1] / "runs").exists()  # only global rank 0 writes the run folder
    assert_same_run(single_run, last_checkpoint(nodes[0], "n2"))
    assert "num_nodes: 2" in (nodes[0] / "runs" / "n2" / "version_0" / "config.yaml").read_text()


@pytest.mark.distributed
def test_two_nodes_resume_without_a_shared_disk(tmp_path, single_run):
    """Only node 0 holds the round checkpoint; resuming on both nodes still ends equal to the uninterrupted run.

    Node 1 finds no checkpoint of its own (no shared disk): rank 0 decides where to resume and sends the
    checkpoint's contents, so node 1 must not start again from round 0 (the processes would go out of step).
    """
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    run_nodes(nodes, "--trainer.name", "n2", "--trainer.rounds", "1", log="log1.txt")
    first = last_checkpoint(nodes[0], "n2")
    assert first["round"] == 1
    assert not (nodes[1] / "runs").exists()  # node 1 has nothing to resume from

    run_nodes(nodes, "--trainer.name", "n2", "--trainer.rounds", "2", "--trainer.resume", "auto", log="log2.txt")
    assert not (nodes[1] / "runs").exists()
    assert sorted(p.name for p in (nodes[0] / "runs" / "n2").iterdir()) == ["version_0"]  # resumed in place
    resumed = last_checkpoint(nodes[0], "n2")
    assert resumed["history"][:2] == first["history"]  # rounds 0 and 1 restored (timings too), not run again
    assert_same_run(single_run, resumed)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"num_nodes": 0}, "trainer.num_nodes must be >= 1, got 0"),
        ({"num_nodes": 2, "devices": "auto"}, "trainer.devices must be a number of processes per node when trainer"),
        ({"num_nodes": 2, "devices": -1}, "trainer.devices must be a number of processes per node when trainer"),
    ],
)
def test_bad_node_settings_are_refused(tmp_path, args, message):
    with pytest.raises(ConfigError, match=message):
        make_trainer(tmp_path, **args)


def test_several_nodes_without_node_variables_refuse_to_start(tmp_path, monkeypatch):
    for name in os.environ:
        if name in CLUSTER or name.startswith(CLUSTER_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    trainer = make_trainer(tmp_path, num_nodes=2, accelerator="cpu", logger=False)
    with pytest.raises(ConfigError, match=r"^trainer.num_nodes is 2 but MASTER_PORT, NODE_RANK are not set: on every"):
        trainer.fit(make_model(), datamodule=make_dm())
