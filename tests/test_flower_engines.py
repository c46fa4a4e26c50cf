"""Flower's own engines: the simulation engine (Ray) and the deployment engine (SuperLink, SuperNodes, flwr run).

Every process is started here on 127.0.0.1 with free ports, every wait is bounded, and everything started
is stopped by PID (with its children). Bitwise comparisons run both sides with one intra-op thread: float
sums depend on how many threads split them, and Ray gives each ClientApp one CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("flwr")

from conftest import CONFIGS, REPO  # noqa: E402

from lightning_fl.checkpoint import read_checkpoint  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SMALL = [
    "--trainer.rounds", "2", "--data.num_clients", "4", "--trainer.enable_progress_bar", "false",
    "--model.init_args.pretraining.epochs", "2",
]  # fmt: skip


def environment(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "NODE_RANK", "LOCAL_RANK", "WORLD_"))}
    env.update(OMP_NUM_THREADS="1", LIGHTNING_FL_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def run(args: list[str], tmp_path, timeout: float = 420) -> None:
    """Run a Python module in a child process (killed by PID on timeout)."""
    with subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=environment(tmp_path),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:  # fmt: skip
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


@pytest.mark.parametrize("config", ["quickstart.yaml", "fedavg_digits.yaml"])
def test_simulation_engine_equals_in_process_bitwise(tmp_path, config):
    """Latent and full-weight FedAvg, 2 rounds, 4 clients, same seeds: Ray's virtual SuperNodes == one process."""
    common = ["--config", str(CONFIGS / config), *SMALL, "--trainer.default_root_dir", str(tmp_path / "runs")]
    run(["-m", "lightning_fl", "fit", *common, "--trainer.name", "inproc", "--trainer.logger", "false"], tmp_path)
    run(["-m", "lightning_fl.flower", "--supernodes", "4", *common, "--trainer.name", "sim"], tmp_path)
    a, b = final_state(tmp_path, "inproc"), final_state(tmp_path, "sim")
    for name in a["global_state"]:
        assert torch.equal(a["global_state"][name], b["global_state"][name]), name
    assert torch.equal(a["ledger"]["up"], b["ledger"]["up"])
    assert (b["ledger"]["msg_up"] > b["ledger"]["up"]).all()
    assert list((tmp_path / "runs" / "sim" / "version_0").glob("events.out.tfevents.*"))  # TensorBoard, as in process
