import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import CONFIGS, REPO, make_dm, make_model, make_trainer, run_cli
from forking import run_python
from lightning_fl.checkpoint import atomic_save, content_digest
from lightning_fl.compress import FP32, Quantize
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.federated import FactorMismatchError, FedAvg, FederatedTrainer, UploadRejectedError
from lightning_fl.methods import LatentClassifier, Pretraining, Recipe, TrainingDivergedError
from lightning_fl.models import SmallCNN


def latent(trainer: FederatedTrainer) -> torch.Tensor:
    return trainer.global_state["mapping.latent"].detach().cpu()


def test_round_logs_metrics_bytes_and_identity(tmp_path):
    trainer = make_trainer(tmp_path, codec=Quantize(4))
    trainer.fit(make_model(), datamodule=make_dm())
    last = trainer.history[-1]
    assert [h["round"] for h in trainer.history] == [0, 1, 2]
    assert {"val/acc", "val/ece", "val/loss", "train/loss"} <= set(last)
    assert 0 <= last["fed/identity_error"] <= 1e-6
    d = 8 * 3
    assert last["comm/client_up_bytes"] == -(-d * 4 // 8) + 8  # int4 latent + scale and zero point
    assert last["comm/client_down_bytes"] == d * 4
    assert last["comm/cum_client_bytes"] == 2 * (d * 4 + 20)
    run = trainer.log_dir
    tags = EventAccumulator(str(run)).Reload().Tags()["scalars"]
    assert {"val/acc", "fed/identity_error", "comm/cum_client_bytes", "time/round_s"} <= set(tags)
    assert (run / "checkpoints" / "last.ckpt").is_file()


def test_one_client_equals_centralised_latent_training(tmp_path):
    dm = make_dm(num_clients=1, batch_size=512)  # one batch per epoch: the data order cannot differ
    federated = make_trainer(tmp_path, rounds=1, local_epochs=4, logger=False)
    federated.fit(make_model(), datamodule=dm)
    central = make_model()
    L.Trainer(
        max_epochs=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    ).fit(central, datamodule=dm)
    torch.testing.assert_close(latent(federated), central.mapping.latent.detach(), atol=1e-6, rtol=1e-5)
    assert central.mapping.latent.abs().max() > 1e-3  # it did train


def test_weighted_aggregation_and_client_sampling(tmp_path):
    records = {}

    class Spy(FP32):
        def decode(self, payload, reference, client):
            records[client] = super().decode(payload, reference, client)["mapping.latent"]
            return {"mapping.latent": records[client]}

    from lightning_fl.data import Dirichlet

    dm = make_dm(partition=Dirichlet(alpha=0.3, min_partition_size=5))
    trainer = make_trainer(
        tmp_path, rounds=1, strategy=FedAvg(weighted=True), codec=Spy(), clients_per_round=3, logger=False
    )
    trainer.fit(make_model(), datamodule=dm)
    assert len(records) == 3 and records.keys() == set(trainer.strategy.sample(0, 4, 3, 0))
    sizes = {c: dm.client_num_samples(c) for c in records}
    expected = sum(records[c].double() * sizes[c] for c in records) / sum(sizes.values())
    torch.testing.assert_close(latent(trainer), expected.float(), atol=1e-7, rtol=0)
    sample = trainer.strategy.sample
    assert sample(5, 10, 3, 0) == sample(5, 10, 3, 0) != sample(6, 10, 3, 0)


class Corrupt(FP32):
    """Corrupts client 1's upload in one of several ways."""

    def __init__(self, how: str) -> None:
        self.how = how

    def encode(self, state, reference, client):
        payload = super().encode(state, reference, client)
        if client == 1 and self.how == "oversized":
            enc = payload.tensors["mapping.latent"]
            enc.parts["padding"] = torch.zeros(10_000, dtype=torch.uint8)
        return payload

    def decode(self, payload, reference, client):
        out = super().decode(payload, reference, client)
        if client == 1:
            z = out["mapping.latent"]
            out = {
                "nan": {"mapping.latent": z.clone().fill_(float("nan"))},
                "shape": {"mapping.latent": z[:-1]},
                "dtype": {"mapping.latent": z.double()},
                "extra": {**out, "head.weight": torch.zeros(3)},
                "oversized": out,
            }[self.how]
        return out


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("nan", "non-finite"),
        ("shape", "expected shape"),
        ("dtype", "expected dtype"),
        ("extra", "unexpected"),
        ("oversized", "more than"),
    ],
)
def test_upload_gate_drops_or_raises(tmp_path, how, reason):
    dropped = make_trainer(tmp_path, rounds=1, codec=Corrupt(how), logger=False)
    with pytest.warns(UserWarning, match=f"client 1: upload rejected: .*{reason}"):
        dropped.fit(make_model(), datamodule=make_dm())
    assert dropped.history[-1]["fed/dropped_clients"] == 1 and dropped.history[-1]["fed/clients"] == 4
    assert torch.isfinite(latent(dropped)).all()
    strict = make_trainer(tmp_path, rounds=1, codec=Corrupt(how), upload_policy="raise", logger=False)
    with pytest.raises(UploadRejectedError, match=f"round 1, client 1: upload rejected: .*{reason}"):
        strict.fit(make_model(), datamodule=make_dm())


class FlakyClient(LatentClassifier):
    def training_step(self, batch, batch_idx):
        if self.trainer.client_id == 2:
            raise TrainingDivergedError("train/loss became nan")
        return super().training_step(batch, batch_idx)


def test_a_diverging_client_is_dropped(tmp_path):
    torch.manual_seed(0)
    model = FlakyClient(SmallCNN(image_size=8, channels=[8, 16], norm_groups=4), 10, base="scratch", latent_dim=8)
    trainer = make_trainer(tmp_path, rounds=1, logger=False)
    with pytest.warns(UserWarning, match="client 2: upload rejected: local training failed"):
        trainer.fit(model, datamodule=make_dm())
    assert trainer.history[-1]["fed/dropped_clients"] == 1


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    full = make_trainer(tmp_path / "a", rounds=4, codec=Quantize(8), name="full")
    full.fit(make_model(), datamodule=make_dm())
    first = make_trainer(tmp_path / "b", rounds=2, codec=Quantize(8), name="split")
    first.fit(make_model(), datamodule=make_dm())
    ckpt = first.log_dir / "checkpoints" / "last.ckpt"
    resumed = make_trainer(tmp_path / "b", rounds=4, codec=Quantize(8), name="split")
    resumed.fit(make_model(), datamodule=make_dm(), ckpt_path=str(ckpt))
    assert resumed.log_dir == first.log_dir  # logging continues in the same run folder
    assert torch.equal(latent(full), latent(resumed))
    assert torch.equal(full.ledger.up, resumed.ledger.up) and torch.equal(full.ledger.down, resumed.ledger.down)
    assert [h["val/acc"] for h in full.history[-2:]] == [h["val/acc"] for h in resumed.history[-2:]]
    auto = make_trainer(tmp_path / "b", rounds=5, codec=Quantize(8), name="split", resume="auto")
    auto.fit(make_model(), datamodule=make_dm())
    assert [h["round"] for h in auto.history][-2:] == [4, 5]


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    first = make_trainer(tmp_path, rounds=1)
    first.fit(make_model(), datamodule=make_dm())
    ckpt = str(first.log_dir / "checkpoints" / "last.ckpt")
    with pytest.raises(CheckpointError, match="fingerprint"):
        make_trainer(tmp_path, rounds=2).fit(make_model(factor_seed=1), datamodule=make_dm(), ckpt_path=ckpt)
    with pytest.raises(CheckpointError, match="seed 0 in the checkpoint, 3 now"):
        make_trainer(tmp_path, rounds=2, seed=3).fit(make_model(), datamodule=make_dm(), ckpt_path=ckpt)


def test_a_process_with_different_factors_refuses_to_train(tmp_path, monkeypatch):
    real = L.Fabric.broadcast

    def server_has_other_factors(self, obj, src=0):
        return "factors:0000 base:0000" if isinstance(obj, str) and obj.startswith("factors:") else real(self, obj, src)

    monkeypatch.setattr(L.Fabric, "broadcast", server_has_other_factors)
    with pytest.raises(FactorMismatchError, match="projection factors or pretrained base differ"):
        make_trainer(tmp_path, logger=False).fit(make_model(), datamodule=make_dm())


def test_atomic_save_keeps_the_old_file_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    atomic_save({"round": 1}, path)

    def crash(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"round": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"round": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_base_is_pretrained_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(tmp_path / "cache"))
    dm = make_dm(public_fraction=0.25, train_split="public")
    model = make_model(base="pretrained", pretraining=Pretraining(epochs=2))
    make_trainer(tmp_path, rounds=1, logger=False).fit(model, datamodule=dm)
    (meta,) = (tmp_path / "cache" / "bases").glob("*/meta.json")
    stamp = meta.stat().st_mtime_ns
    again = make_model(base="pretrained", pretraining=Pretraining(epochs=2))
    again.prepare_base(dm)
    assert meta.stat().st_mtime_ns == stamp  # loaded, not retrained
    for key, value in model.state_dict().items():
        if key.startswith("backbone."):
            assert torch.equal(value, again.state_dict()[key])
    other = make_model(base="pretrained", pretraining=Pretraining(epochs=3))
    assert other.base_cache_path(dm) != again.base_cache_path(dm)


def test_a_base_cache_copied_to_another_machine_misses_there(tmp_path, monkeypatch):
    """The bases' cache key holds the machine (compute_environment of the pretraining device: torch, the CPU's kernel
    level and threads, or the GPU), since the same recipe and seed pretrain other bases on another machine: a cache
    made on one machine and copied to another kind (faked here) is not read there, and the base is made again. Back
    on the first machine it is a hit. The run folder records the machine too (environment.json)."""
    import json

    from lightning_fl.checkpoint import compute_environment
    from lightning_fl.methods import bases

    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(tmp_path / "cache"))
    dm = make_dm(public_fraction=0.25, train_split="public")
    model = make_model(base="pretrained", pretraining=Pretraining(epochs=1))
    trainer = make_trainer(tmp_path, rounds=1)
    trainer.fit(model, datamodule=dm)
    here = model.base_cache_path(dm)
    key = json.loads((here.parent / "meta.json").read_text())["key"]
    assert here.is_file() and key["environment"] == compute_environment("cpu")
    assert json.loads((trainer.log_dir / "environment.json").read_text()) == [compute_environment("cpu")]
    real = bases.compute_environment
    monkeypatch.setattr(bases, "compute_environment", lambda device: {**real(device), "cpu": "AVX2", "threads": 7})
    elsewhere = make_model(base="pretrained", pretraining=Pretraining(epochs=1))
    there = elsewhere.base_cache_path(dm)
    assert there != here and not there.exists()  # the copied cache folder is not this machine's
    with pytest.raises(CheckpointError, match="is missing; it should have been prepared first"):
        elsewhere.prepare_base(dm, allow_training=False)
    monkeypatch.setattr(bases, "compute_environment", real)
    again = make_model(base="pretrained", pretraining=Pretraining(epochs=1))
    again.prepare_base(dm, allow_training=False)  # the first machine reads its own cache
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in again.state_dict().items() if k.startswith("backbone"))


QUICK = [
    "--config",
    str(CONFIGS / "quickstart.yaml"),
    "--trainer.rounds",
    "2",
    "--trainer.enable_progress_bar",
    "false",
    "--model.pretraining.epochs",
    "2",
]


def test_quickstart_through_the_cli(in_tmp, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    assert run_cli("fit", *QUICK) == 0
    run = in_tmp / "runs" / "quickstart" / "version_0"
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0}).Reload()
    assert [e.step for e in acc.Scalars("val/acc")] == [0, 1, 2]
    assert max(e.value for e in acc.Scalars("fed/identity_error")) <= 1e-6
    assert acc.Scalars("comm/cum_client_bytes")[-1].value == 2 * 2 * 192 * 4
    from lightning_fl.cli import main

    (metrics,) = main(["test", *QUICK, "--ckpt_path", str(run / "checkpoints" / "last.ckpt")])
    assert set(metrics) == {"test/acc", "test/ece", "test/loss"}


EXTRAS = [
    "--trainer.strategy",
    "FedAdam",
    "--trainer.strategy.server_lr",
    "0.01",
    "--trainer.dropout",
    "0.3",
    "--trainer.attack",
    "SignFlip",
    "--trainer.attack.clients",
    "[1]",
]


# central DP with adaptive clipping, streamed on one process (no identity check, no relative gate)
PRIVATE = [
    "--trainer.check_identity",
    "false",
    "--trainer.max_update_norm_ratio",
    "null",
    "--trainer.privacy",
    "CentralDP",
    "--trainer.privacy.noise_multiplier",
    "1.0",
    "--trainer.privacy.clip_norm",
    "0.5",
    "--trainer.privacy.adaptive",
    "AdaptiveClipping",
    "--trainer.privacy.adaptive.count_std",
    "2",
    "--trainer.privacy.noise_seed",
    "0",
]

# per-client codec memory: a client sampled again must find its residual, on whichever process trains it
ERROR_FEEDBACK = ["--trainer.rounds", "4", "--trainer.codec", "TopK", "--trainer.codec.density", "0.1"]


def two_process_fit(tmp_path, devices: str, name: str, *extra: str) -> dict:
    """``fit`` of the quickstart (Dirichlet clients, 5 of 8 per round) on ``devices`` CPU processes; its last.ckpt."""
    env = {  # one thread per process, given by --threads below (the default on 2 cores): equal bit for bit
        **{k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "LIGHTNING_FL_CACHE": str(tmp_path / f"cache{devices}"),  # each run pretrains its base (rank 0 only)
        "PYTHONPATH": str(REPO),
    }
    cmd = [
        sys.executable,
        "-m",
        "lightning_fl",
        "fit",
        *QUICK,
        "--threads",
        "1",
        "--trainer.devices",
        devices,
        "--trainer.fabric_strategy",
        "ddp" if devices == "2" else "auto",
        "--trainer.name",
        name,
        "--trainer.version",
        "version_0",
        "--data.partition",
        "Dirichlet",
        "--data.partition.alpha",
        "0.5",
        "--trainer.clients_per_round",
        "5",
        *extra,
    ]
    if devices == "1":  # forked from this process (tests/forking.py): no fresh interpreter, none of its imports
        proc = run_python(cmd[1:], cwd=tmp_path, env=env, timeout=600)
    else:  # Fabric's launcher starts the second process from this one's command line: a real, fresh one
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deprecated" not in proc.stderr and "terminate called" not in proc.stderr, proc.stderr[-3000:]
    return torch.load(tmp_path / "runs" / name / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)


def assert_same_residuals(a: dict, b: dict) -> None:
    residuals = [ckpt["codec"].get("residuals", {}) for ckpt in (a, b)]  # every client's, from all processes
    assert sorted(residuals[0]) == sorted(residuals[1])
    assert all(torch.equal(residuals[0][c][n], residuals[1][c][n]) for c in residuals[0] for n in residuals[0][c])


@pytest.mark.distributed
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="fedavg"),
        # error feedback alone: topk_compressed_downloads below and the resume test carry it over 2 processes too
        pytest.param(ERROR_FEEDBACK, id="topk_error_feedback", marks=pytest.mark.slow),
        pytest.param([*ERROR_FEEDBACK, "--trainer.compressed_downloads", "true"], id="topk_compressed_downloads"),
        pytest.param(EXTRAS, id="fedadam_dropout_attack", marks=pytest.mark.slow),
        pytest.param(PRIVATE, id="central_dp_streamed_vs_rows"),
        pytest.param([*PRIVATE, "--trainer.fold_groups", "4"], id="central_dp_fold_groups_both_stream"),
    ],
)
def test_two_processes_give_the_same_global_state_as_one(tmp_path, extra):
    """Clients spread over 2 CPU processes (gloo) end with the global state of a single process, bit for bit.

    Under central DP (no identity check, no relative gate) one process streams its uploads into a running sum
    while two processes gather rows and fold them in client order: the same sum, the same noise, bit for bit.
    With ``fold_groups`` both stream, each process its own groups' running sums."""
    one, two = (two_process_fit(tmp_path, devices, f"d{devices}", *extra) for devices in ("1", "2"))
    if "--trainer.fold_groups" in extra:
        assert [h["fed/kept_rows"] for h in one["history"] + two["history"] if "fed/kept_rows" in h] == [0.0] * 4
    assert torch.equal(one["global_state"]["mapping.latent"], two["global_state"]["mapping.latent"])
    assert torch.equal(one["ledger"]["up"], two["ledger"]["up"])
    assert torch.equal(one["ledger"]["down"], two["ledger"]["down"])
    assert ("downlink" in one) == ("--trainer.compressed_downloads" in extra) == ("downlink" in two)
    assert content_digest(one.get("downlink")) == content_digest(two.get("downlink"))  # the server's broadcast memory
    assert [h.get("val/acc") for h in one["history"]] == [h.get("val/acc") for h in two["history"]]
    assert [h.get("train/loss") for h in one["history"]] == [h.get("train/loss") for h in two["history"]]
    assert one["strategy"].keys() == two["strategy"].keys()
    for key, value in one["strategy"].items():  # server optimiser moments agree too
        assert torch.equal(value, two["strategy"][key])
    assert_same_residuals(one, two)
    assert one.get("privacy") == two.get("privacy")  # the accountant and the adaptive clip bound agree too


@pytest.mark.distributed
@pytest.mark.parametrize(
    "groups",
    [
        pytest.param([], id="client_mod_processes"),
        pytest.param(["--trainer.fold_groups", "3"], id="fold_groups_3", marks=pytest.mark.slow),
    ],
)
def test_two_processes_resume_error_feedback_bit_for_bit(tmp_path, groups):
    """2 processes, 2 rounds, then resumed to 4: the same global state and residuals as 4 rounds on 1 process
    (each resumed process keeps only its own clients' residuals and the checkpoint gathers them again). With 3
    fold groups on 2 processes, client ``c`` trains on process ``(c % 3) % 2``, not ``c % 2``."""
    one = two_process_fit(tmp_path, "1", "whole", *ERROR_FEEDBACK, *groups)
    first = [*ERROR_FEEDBACK, *groups, "--trainer.rounds", "2"]
    assert two_process_fit(tmp_path, "2", "split", *first)["round"] == 2
    resumed = two_process_fit(tmp_path, "2", "split", *ERROR_FEEDBACK, *groups, "--trainer.resume", "auto")
    assert resumed["round"] == 4
    assert torch.equal(one["global_state"]["mapping.latent"], resumed["global_state"]["mapping.latent"])
    assert [h.get("train/loss") for h in one["history"]] == [h.get("train/loss") for h in resumed["history"]]
    assert_same_residuals(one, resumed)


def test_checkpoint_files_load_with_weights_only(tmp_path):
    trainer = make_trainer(tmp_path, rounds=1)
    trainer.fit(make_model(), datamodule=make_dm())
    ckpt = torch.load(Path(trainer.log_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["format"] == "lightning_fl.federated" and ckpt["round"] == 1


@pytest.mark.parametrize("factors", ["stored", "regenerate", "kronecker"])
def test_a_latent_client_trains_under_bf16_mixed_precision(tmp_path, factors):
    """``trainer.precision bf16-mixed`` with FLITE's latent: the round runs (on a CPU the stored and regenerated
    factors failed in autocast's ``addmv``) and the server's latent stays float32."""
    trainer = make_trainer(tmp_path, rounds=1, logger=False, precision="bf16-mixed")
    trainer.fit(make_model(factors=factors), datamodule=make_dm())
    last = trainer.history[-1]
    assert torch.isfinite(torch.tensor(last["val/loss"])) and last["fed/identity_error"] <= 1e-6
    assert trainer.global_state["mapping.latent"].dtype == torch.float32


def test_full_weight_fedavg_of_a_classifier_runs_through_the_same_trainer(tmp_path):
    from lightning_fl.methods import Classifier

    torch.manual_seed(0)
    backbone = SmallCNN(image_size=8, channels=[8, 16], norm_groups=4)
    model = Classifier(backbone, 10, recipe=Recipe(lr=0.05, warmup_epochs=0, schedule="constant"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainer = make_trainer(tmp_path, rounds=1, logger=False)
    trainer.fit(model, datamodule=make_dm())
    last = trainer.history[-1]
    assert last["comm/client_up_bytes"] == last["comm/client_down_bytes"] == 4 * trainable
    assert "fed/identity_error" not in last and last["val/acc"] > 0.1


def test_a_centralised_schedule_is_refused_before_anything_trains(tmp_path):
    """Warm-up and cosine decay have no clock in a client's round: refused when the run starts, with the fix."""
    from lightning_fl.methods import Classifier

    model = Classifier(SmallCNN(image_size=8, channels=[8, 16], norm_groups=4), 10, recipe=Recipe(warmup_epochs=3))
    with pytest.raises(
        ConfigError,
        match=r"model.recipe.warmup_epochs=3 and model.recipe.schedule='cosine' .* set "
        r"model.recipe.warmup_epochs 0 and model.recipe.schedule constant",
    ):
        make_trainer(tmp_path, rounds=1, logger=False).fit(model, datamodule=make_dm())
    assert not list(tmp_path.rglob("*.ckpt"))


def _with_scheduler(interval: str):
    from lightning_fl.methods import Classifier

    class Scheduled(Classifier):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
            self.seen_optimizers.append(optimizer)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": interval}}

    torch.manual_seed(0)
    backbone = SmallCNN(image_size=8, channels=[8, 16], norm_groups=4)
    model = Scheduled(backbone, 10, recipe=Recipe(warmup_epochs=0, schedule="constant"))
    model.seen_optimizers = []
    return model


def test_a_step_scheduler_runs_over_each_clients_local_steps(tmp_path):
    model = _with_scheduler("step")
    make_trainer(tmp_path, rounds=1, logger=False).fit(model, datamodule=make_dm())
    trained = model.seen_optimizers[1:]  # the first one is the check when the run starts
    assert trained and all(o.param_groups[0]["lr"] < 0.1 for o in trained)  # halved at every local step


def test_an_epoch_scheduler_is_refused_not_ignored(tmp_path):
    with pytest.raises(ConfigError, match="stepped per epoch, which federated clients cannot follow"):
        make_trainer(tmp_path, rounds=1, logger=False).fit(_with_scheduler("epoch"), datamodule=make_dm())
