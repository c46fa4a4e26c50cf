"""Reliability: run folders claimed atomically and locked, authoritative data roots, the update-norm gate, a
refused aggregate that names its cause, the ledger of rejected uploads, and empty clients refused."""

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, make_dm, make_model, make_trainer
from lightning_fl import runs
from lightning_fl.data import Dirichlet, FashionMNIST, FederatedDataModule, Partitioner, Synthetic
from lightning_fl.errors import CheckpointError, ConfigError, DatasetNotFoundError
from lightning_fl.federated import NaNUpload, Scaling, UploadRejectedError
from lightning_fl.federated.server import round as round_module
from lightning_fl.federated.server.strategies import Strategy


def latent(trainer) -> torch.Tensor:
    return trainer.global_state["mapping.latent"].detach().cpu()


def fit(trainer, model=None, dm=None, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(model or make_model(), datamodule=dm or make_dm(), **kwargs)
    return trainer


# ------------------------------------------------------------------------------------------ run folders
def _claim_after(parent: str, start: float, queue) -> None:
    time.sleep(max(0.0, start - time.time()))
    lock = runs.claim(parent)
    queue.put(lock.folder.name)
    time.sleep(0.5)  # hold the lock while the others claim
    lock.release()


def test_processes_claiming_at_once_get_distinct_folders(tmp_path):
    ctx = mp.get_context("fork")  # the claim needs no torch: forking is safe and fast
    queue = ctx.Queue()
    start = time.time() + 1.0  # every process is started and waiting by then
    procs = [ctx.Process(target=_claim_after, args=(str(tmp_path), start, queue)) for _ in range(6)]
    for p in procs:
        p.start()
    names = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sorted(names) == [f"version_{i}" for i in range(6)]


def test_a_lock_is_held_until_released_and_dies_with_its_process(tmp_path):
    lock = runs.claim(tmp_path)
    assert runs.holder(lock.folder) == f"pid {os.getpid()} on {os.uname().nodename}"
    assert not runs.RunLock(lock.folder).acquire()  # a second claimant, even in the same process, is refused
    lock.release()
    assert runs.holder(lock.folder) is None
    # a process killed with -9 while holding the lock leaves the file but no lock: not stale, just free
    ctx = mp.get_context("fork")
    held = ctx.Event()
    proc = ctx.Process(target=_hold_forever, args=(str(lock.folder), held))
    proc.start()
    try:
        assert held.wait(timeout=60)
        assert runs.holder(lock.folder) == f"pid {proc.pid} on {os.uname().nodename}"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
    assert runs.holder(lock.folder) is None and runs.RunLock(lock.folder).acquire()


def _hold_forever(folder: str, held) -> None:
    assert runs.RunLock(folder).acquire()
    held.set()
    time.sleep(600)


def test_runs_of_one_experiment_never_share_a_folder(tmp_path):
    one = fit(make_trainer(tmp_path, rounds=1, name="x", local_steps=1))
    two = fit(make_trainer(tmp_path, rounds=1, name="x", local_steps=2))
    assert one.log_dir != two.log_dir
    for t in (one, two):
        assert (t.log_dir / "checkpoints" / "last.ckpt").is_file()
        assert runs.holder(t.log_dir) is None  # released at the end of the run


def test_a_run_that_starts_while_another_is_setting_up_gets_its_own_folder(tmp_path):
    # run A has started (Fabric launched) but writes nothing yet; run B starts and finishes meanwhile
    a = make_trainer(tmp_path, rounds=1, name="x", local_steps=1)
    inside, go = threading.Event(), threading.Event()
    prepare = a._prepare

    def slow_prepare(*args, **kwargs):
        inside.set()
        assert go.wait(timeout=60)
        return prepare(*args, **kwargs)

    a._prepare = slow_prepare
    thread = threading.Thread(target=fit, args=(a,))
    thread.start()
    try:
        assert inside.wait(timeout=60)
        b = fit(make_trainer(tmp_path, rounds=1, name="x", local_steps=2))
    finally:
        go.set()
        thread.join(timeout=120)
    assert a.log_dir != b.log_dir
    configs = {t.log_dir: torch.load(t.log_dir / "checkpoints" / "last.ckpt", weights_only=True) for t in (a, b)}
    assert len(configs) == 2 and all(c["round"] == 1 for c in configs.values())


def test_lightning_trainers_started_together_get_their_own_folders(tmp_path):
    import lightning as L

    def trainer():
        return L.Trainer(default_root_dir=str(tmp_path), enable_progress_bar=False, enable_model_summary=False)

    first, second = trainer(), trainer()  # neither has written anything yet
    locks = [runs.claim_for_lightning(t) for t in (first, second)]
    try:
        assert first.log_dir != second.log_dir
        assert [Path(t.log_dir).name for t in (first, second)] == ["version_0", "version_1"]
        assert runs.holder(first.log_dir) is not None  # held until the run ends
    finally:
        for lock in locks:
            lock.release()


def test_an_explicit_version_that_holds_a_run_is_never_overwritten(tmp_path):
    first = fit(make_trainer(tmp_path, rounds=1, name="x", version="mine"))
    saved = (first.log_dir / "checkpoints" / "last.ckpt").read_bytes()
    with pytest.raises(
        runs.RunFolderError, match=r"x/mine already holds a run; resume it .*choose another trainer.version"
    ):
        fit(make_trainer(tmp_path, rounds=1, name="x", version="mine", local_steps=3))
    assert (first.log_dir / "checkpoints" / "last.ckpt").read_bytes() == saved
    resumed = fit(make_trainer(tmp_path, rounds=2, name="x", version="mine", resume=True))  # resuming it is fine
    assert resumed.log_dir == first.log_dir and resumed.history[-1]["round"] == 2


def test_resume_auto_never_attaches_to_a_live_run(tmp_path):
    first = fit(make_trainer(tmp_path, rounds=1, name="x"))
    busy = runs.RunLock(first.log_dir)
    assert busy.acquire()  # as if another process were still writing it
    try:
        fresh = fit(make_trainer(tmp_path, rounds=2, name="x", resume="auto"))
        assert fresh.log_dir != first.log_dir and fresh.history[0]["round"] == 0  # started over elsewhere
        with pytest.raises(CheckpointError, match=r"every run with a checkpoint under .* is being written"):
            fit(make_trainer(tmp_path, rounds=2, name="x", resume=True, version=first.log_dir.name))
        with pytest.raises(runs.RunFolderError, match=rf"{first.log_dir.name} is being written by pid {os.getpid()}"):
            fit(make_trainer(tmp_path, rounds=2, name="x"), ckpt_path=str(first.log_dir / "checkpoints" / "last.ckpt"))
    finally:
        busy.release()
    later = fit(make_trainer(tmp_path, rounds=2, name="x", resume=True, version=first.log_dir.name))
    assert later.log_dir == first.log_dir and [h["round"] for h in later.history] == [0, 1, 2]


@pytest.mark.distributed
def test_two_cli_runs_started_together_keep_both_results(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LIGHTNING_FL_CACHE": str(tmp_path / "cache")}
    common = [
        sys.executable,
        "-m",
        "lightning_fl",
        "fit",
        "--config",
        str(REPO / "configs" / "quickstart.yaml"),
        "--trainer.rounds",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path / "runs"),
        "--model.pretraining.epochs",
        "2",
    ]
    procs = [
        subprocess.Popen([*common, "--model.recipe.lr", lr], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
        for lr in ("0.011", "0.022")
    ]
    try:
        errors = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], errors
    folders = sorted((tmp_path / "runs").glob("*/version_*"))
    assert len(folders) == 2
    configs = sorted((f / "config.yaml").read_text() for f in folders)
    assert "lr: 0.011" in configs[0] and "lr: 0.022" in configs[1]  # each run kept its own config
    assert all((f / "checkpoints" / "last.ckpt").is_file() for f in folders)
    assert len(list((tmp_path / "cache").rglob("*.pt"))) >= 1  # the base both pretrained, written once and whole


# ------------------------------------------------------------------------------------------ data roots
def _fake_fashion_mnist(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for split, n in (("train", 20), ("t10k", 10)):
        images = np.zeros((n, 28, 28), dtype=np.uint8)
        labels = np.arange(n, dtype=np.uint8) % 10
        (folder / f"{split}-images-idx3-ubyte").write_bytes(
            (2051).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in images.shape) + images.tobytes()
        )
        (folder / f"{split}-labels-idx1-ubyte").write_bytes(
            (2049).to_bytes(4, "big") + n.to_bytes(4, "big") + labels.tobytes()
        )
    return folder


def test_an_explicit_root_is_the_only_place_searched(tmp_path, monkeypatch):
    system = _fake_fashion_mnist(tmp_path / "system")
    monkeypatch.setattr(FashionMNIST, "system_paths", (str(system),))
    monkeypatch.setenv("LIGHTNING_FL_DATA", str(tmp_path / "nothing"))
    assert FashionMNIST(download=False).locate() == system  # no root: the system copy is found
    with pytest.raises(
        DatasetNotFoundError, match=r"the root given \(.*typo\) does not exist and download is off; fix the path"
    ):
        FashionMNIST(root=str(tmp_path / "typo"), download=False).locate()
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetNotFoundError, match=r"Fashion-MNIST was not found") as err:
        FashionMNIST(root=str(tmp_path / "empty"), download=False).locate()
    assert str(system) not in str(err.value)  # not searched, not offered
    given = _fake_fashion_mnist(tmp_path / "given")
    assert FashionMNIST(root=str(given), download=False).locate() == given


# ------------------------------------------------------------------------------------------ the norm gate
def test_a_scaled_upload_is_dropped_by_the_default_norm_gate(tmp_path):
    dm = make_dm(num_clients=4)
    scaled = make_trainer(tmp_path / "a", rounds=2, attack=Scaling([0], factor=1e6))
    gate = r"client 0: upload rejected: update norm .* is more than trainer.max_update_norm_ratio=10 times"
    with pytest.warns(UserWarning, match=gate):
        scaled.fit(make_model(), datamodule=dm)
    nan = fit(make_trainer(tmp_path / "b", rounds=2, attack=NaNUpload([0])), dm=dm)  # client 0 left out another way
    assert torch.equal(latent(scaled), latent(nan))
    assert scaled.history[-1]["fed/dropped_clients"] == 1 and latent(scaled).abs().max() < 10
    off = fit(
        make_trainer(tmp_path / "c", rounds=2, attack=Scaling([0], factor=1e6), max_update_norm_ratio=None), dm=dm
    )
    assert latent(off).abs().max() > 1e3  # without the gate the scaled upload takes over the model


def test_the_logged_max_ratio_is_the_tightest_gate_that_refuses_nothing(tmp_path):
    """``fed/update_norm_max_ratio`` of a gate-free round: a ratio just under it refuses one upload, just over none."""
    dm = make_dm(num_clients=4)
    free = fit(make_trainer(tmp_path / "a", rounds=1, max_update_norm_ratio=None), dm=dm)
    ratio = free.history[-1]["fed/update_norm_max_ratio"]
    assert ratio > 1 and free.history[-1]["fed/dropped_clients"] == 0
    over = fit(make_trainer(tmp_path / "b", rounds=1, max_update_norm_ratio=ratio * (1 + 1e-6)), dm=dm)
    assert over.history[-1]["fed/dropped_clients"] == 0 and torch.equal(latent(over), latent(free))
    under = make_trainer(tmp_path / "c", rounds=1, max_update_norm_ratio=ratio * (1 - 1e-6))
    with pytest.warns(UserWarning, match=r"upload rejected: update norm .* is more than trainer.max_update_norm_ratio"):
        under.fit(make_model(), datamodule=dm)
    assert under.history[-1]["fed/dropped_clients"] == 1


def test_the_absolute_bound_and_the_raise_policy(tmp_path):
    with pytest.raises(
        UploadRejectedError,
        match=r"round 1, client 0: upload rejected: update norm .* exceeds trainer.max_update_norm=1e-09",
    ):
        fit(make_trainer(tmp_path / "a", rounds=1, max_update_norm=1e-9, upload_policy="raise"))
    start = latent(fit(make_trainer(tmp_path / "b", rounds=1, limit_val_batches=0, local_steps=1), dm=make_dm()))
    kept = fit(make_trainer(tmp_path / "c", rounds=2, max_update_norm=1e-9))
    assert torch.equal(latent(kept), torch.zeros_like(latent(kept)))  # every upload refused: the base is kept
    assert [h["fed/dropped_clients"] for h in kept.history[1:]] == [4, 4]
    assert not torch.equal(start, torch.zeros_like(start))
    with pytest.raises(ConfigError, match="max_update_norm_ratio must be a positive number, 'auto' or null, got 0"):
        make_trainer(tmp_path, max_update_norm_ratio=0)


class Runaway(Strategy):
    """A server algorithm with a bug: its step goes ``size`` along the first coordinate (NaN: a NaN)."""

    linear = False

    def __init__(self, size: float) -> None:
        super().__init__()
        self.size = size

    def aggregate(self, r, current, uploads, num_samples, clients):
        out = uploads.double().mean(0)
        out[0] = current[0] + self.size
        return out, {}


@pytest.mark.parametrize(
    ("size", "kwargs", "why"),
    [
        (float("nan"), {}, "Runaway produced non-finite values"),
        (1e3, {"max_update_norm": 10.0}, "Runaway's step has norm 1000, which exceeds trainer.max_update_norm=10"),
    ],
)
def test_an_unusable_aggregate_is_refused_and_names_the_largest_update(tmp_path, size, kwargs, why):
    dm = make_dm(num_clients=4)
    trainer = make_trainer(tmp_path, rounds=2, strategy=Runaway(size), attack=Scaling([2], factor=3.0), **kwargs)
    with pytest.warns(UserWarning, match="aggregate refused") as record:
        trainer.fit(make_model(), datamodule=dm)
    messages = [str(w.message) for w in record if "aggregate refused" in str(w.message)]
    assert len(messages) == 2 and why in messages[0]
    assert "the largest update came from client 2" in messages[0] and messages[0].endswith(
        "the global state is unchanged"
    )
    assert torch.equal(latent(trainer), torch.zeros_like(latent(trainer)))
    assert [h["fed/round_skipped"] for h in trainer.history[1:]] == [1.0, 1.0]


# ------------------------------------------------------------------------------------------ accounting
def test_rejected_uploads_are_counted_apart_and_left_out_of_the_round_metrics(tmp_path, monkeypatch):
    seen = []
    mean = round_module.mean_over_clients
    monkeypatch.setattr(round_module, "mean_over_clients", lambda logged: seen.append(len(logged)) or mean(logged))
    trainer = fit(make_trainer(tmp_path, rounds=2, attack=NaNUpload([0])))
    ckpt = torch.load(trainer.log_dir / "checkpoints" / "last.ckpt", weights_only=True)
    per_client = 4 * sum(t.numel() for t in trainer.global_state.values())  # an FP32 upload
    assert ckpt["ledger"]["up"].tolist() == [0, 2 * per_client, 2 * per_client, 2 * per_client]
    assert ckpt["ledger"]["rejected"].tolist() == [2 * per_client, 0, 0, 0]
    last = trainer.history[-1]
    assert last["comm/rejected_bytes"] == per_client and last["comm/cum_rejected_bytes"] == 2 * per_client
    assert last["comm/round_up_bytes"] == 3 * per_client and last["fed/dropped_clients"] == 1
    assert seen == [3, 3]  # train/loss and the other client metrics average the aggregated clients only
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trainer.log_dir), size_guidance={"tensors": 0})
    events.Reload()
    texts = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("fed/dropped_clients/text_summary")]
    assert texts == ["0", "0"] and [e.step for e in events.Tensors("fed/dropped_clients/text_summary")] == [1, 2]


# ------------------------------------------------------------------------------------------ empty clients
class LeavesOneEmpty(Partitioner):
    def split(self, targets, num_clients, rng):
        return [np.arange(len(targets)), *[np.array([], dtype=np.int64)] * (num_clients - 1)]


def test_a_split_that_leaves_a_client_empty_is_refused_up_front():
    with pytest.raises(ConfigError, match=r"min_partition_size must be >= 1 \(an empty client cannot train\), got 0"):
        Dirichlet(alpha=0.1, min_partition_size=0)
    dm = FederatedDataModule(source=Synthetic(train_size=60, test_size=10), num_clients=3, partition=LeavesOneEmpty())
    with pytest.raises(
        ConfigError, match=r"data.partition \(LeavesOneEmpty\(\)\) left 2 of 3 clients with no samples \(client 1, 2\)"
    ):
        dm.setup("fit")


# ------------------------------------------------------------------------------------------ chaos
@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_ends_bitwise_equal(tmp_path):
    """``LIGHTNING_FL_CHAOS_KILLS`` (default 5) kills at random moments; every resume ends equal to one run."""
    kills = int(os.environ.get("LIGHTNING_FL_CHAOS_KILLS", "5"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LIGHTNING_FL_CACHE": str(tmp_path / "cache")}
    rounds = 20

    def command(root: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "lightning_fl",
            "fit",
            "--config",
            str(REPO / "configs" / "quickstart.yaml"),
            "--trainer.rounds",
            str(rounds),
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.resume",
            "auto",
            "--trainer.default_root_dir",
            str(tmp_path / root),
            "--model.pretraining.epochs",
            "2",
        ]

    subprocess.run(command("reference"), env=env, check=True, timeout=600, capture_output=True)  # caches the base
    reference = torch.load(next((tmp_path / "reference").rglob("last.ckpt")), weights_only=True)
    started, first = time.perf_counter(), None  # a whole run with the base cached, and when it finishes round 1
    timing = subprocess.Popen(command("timing"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while timing.poll() is None and time.perf_counter() - started < 600:
        if first is None and any((tmp_path / "timing").rglob("last.ckpt")):
            first = time.perf_counter() - started
        time.sleep(0.02)
    span = time.perf_counter() - started
    assert timing.wait(timeout=60) == 0 and first is not None
    start_up = max(0.0, first - 0.5 * (span - first) / rounds)  # kills land from the middle of round 1 on
    rng = np.random.default_rng(int(os.environ.get("LIGHTNING_FL_CHAOS_SEED", "0")))
    killed = attempts = mid_run = 0
    while killed < kills:
        attempts += 1
        assert attempts <= 4 * kills, f"only {killed} of {attempts} runs were killed before they finished"
        proc = subprocess.Popen(command("chaos"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            proc.wait(timeout=float(rng.uniform(start_up, span)))
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            killed += 1
            done_rounds = [torch.load(c, weights_only=True)["round"] for c in (tmp_path / "chaos").rglob("*.ckpt")]
            assert all(r >= 1 for r in done_rounds)  # never a corrupt checkpoint
            mid_run += bool(done_rounds) and max(done_rounds) < rounds
        else:  # it finished before the kill: start the chaos over from scratch
            assert proc.returncode == 0
            shutil.rmtree(tmp_path / "chaos")
    subprocess.run(command("chaos"), env=env, check=True, timeout=600, capture_output=True)
    finals = [torch.load(p, weights_only=True) for p in (tmp_path / "chaos").rglob("last.ckpt")]
    done = [c for c in finals if c["round"] == rounds]
    assert len(done) == 1 and killed >= 1
    for name, tensor in reference["global_state"].items():
        assert torch.equal(done[0]["global_state"][name], tensor), name
    assert torch.equal(done[0]["ledger"]["up"], reference["ledger"]["up"])
    print(f"chaos: {killed} kills ({mid_run} after a round checkpoint), {attempts} starts, {span:.1f} s per run")


def test_a_named_run_that_died_before_its_first_checkpoint_restarts_only_when_resuming(tmp_path):
    folder = tmp_path / "runs" / "x" / "version_0"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("left by a run killed in its first round\n")
    with pytest.raises(runs.RunFolderError, match="already holds a run"):
        fit(make_trainer(tmp_path, rounds=1, name="x", version=0))
    restarted = fit(make_trainer(tmp_path, rounds=1, name="x", version=0, resume="auto"))
    assert restarted.log_dir == folder and (folder / "checkpoints" / "last.ckpt").is_file()
