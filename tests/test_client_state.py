"""Per-client codec state for large populations: created when a client is first sampled, kept in memory up to a
budget and in files beyond it, checkpointed incrementally, and restored bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import make_dm, make_model, make_trainer
from lightning_fl.checkpoint import read_checkpoint
from lightning_fl.compress import PowerSGD, TopK
from lightning_fl.compress.client_state import MANIFEST, ClientStateStore, file_name, import_files
from lightning_fl.errors import CheckpointError, ConfigError


def entry(value: float, n: int = 4) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), value)}  # 4 float32 values: 16 bytes


def files(folder) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*.pt")}


def test_in_memory_store_is_a_mapping_saved_in_the_old_format():
    store = ClientStateStore()
    store[7], store[2] = entry(7.0), entry(2.0)
    assert list(store) == [2, 7] and len(store) == 2 and 7 in store and 3 not in store and "7" not in store
    assert np.int64(7) in store and torch.tensor(7) in store  # any integer type names the client
    assert store.memory_bytes() == 32
    saved = store.state_dict()
    assert sorted(saved) == ["2", "7"] and torch.equal(saved["7"]["w"], entry(7.0)["w"])  # what checkpoints held
    other = ClientStateStore()
    other.load_state_dict(saved)
    assert torch.equal(other[2]["w"], entry(2.0)["w"])
    del other[2]
    assert list(other) == [7] and other.memory_bytes() == 16


def test_a_budget_keeps_the_most_recently_used_in_memory_and_the_rest_in_files(tmp_path):
    store = ClientStateStore()
    store.attach(tmp_path, budget_bytes=32)  # two entries
    for c in range(5):
        store[c] = entry(float(c))
    assert store.memory_bytes() == 32 and files(tmp_path) == {file_name(c, c + 1) for c in range(3)}
    assert torch.equal(store[0]["w"], entry(0.0)["w"])  # read back from its file, now the most recent
    store[5] = entry(5.0)  # evicts 3 (the least recently used), not 0
    assert file_name(3, 4) in files(tmp_path) and torch.equal(store[0]["w"], entry(0.0)["w"])
    assert list(store) == [0, 1, 2, 3, 4, 5] and store.memory_bytes() <= 32
    store[1] = entry(10.0)  # a new value for a client with an uncommitted file: its old file goes when it is replaced
    store[6], store[7] = entry(6.0), entry(7.0)
    assert file_name(1, 2) not in files(tmp_path) and torch.equal(store[1]["w"], entry(10.0)["w"])


def test_checkpoints_write_only_what_changed_and_a_resume_sees_the_checkpointed_values(tmp_path):
    store = ClientStateStore()
    store.attach(tmp_path, budget_bytes=16)
    store[0], store[1] = entry(0.0), entry(1.0)
    manifest = store.state_dict()  # writes the dirty entry of client 1; 0 already went to its file
    assert manifest["format"] == MANIFEST and manifest["clients"].tolist() == [0, 1]
    store.committed()
    written = files(tmp_path)
    assert store.state_dict()["serials"].tolist() == manifest["serials"].tolist() and files(tmp_path) == written
    # after the checkpoint: client 0 changes twice (the second write replaces the first, uncommitted file)
    store[0] = entry(5.0)
    store[2] = entry(2.0)
    store[0] = entry(6.0)
    store[3] = entry(3.0)
    assert len(files(tmp_path)) == len(written) + 2  # the checkpoint's files are still there: it can resume
    resumed = ClientStateStore()
    resumed.attach(tmp_path, budget_bytes=16)
    resumed.load_state_dict(manifest)  # the run died before its next checkpoint
    assert list(resumed) == [0, 1] and torch.equal(resumed[0]["w"], entry(0.0)["w"])
    # the live store's next checkpoint supersedes the old files, which are then deleted
    store.state_dict()
    store.committed()
    assert files(tmp_path) == {file_name(c, s) for c, s in store._files.items()}
    assert torch.equal(store[0]["w"], entry(6.0)["w"]) and torch.equal(store[3]["w"], entry(3.0)["w"])


def test_a_kept_checkpoint_pins_its_files(tmp_path):
    store = ClientStateStore()
    store.attach(tmp_path, budget_bytes=0)
    store[0] = entry(0.0)
    kept = store.state_dict()
    store.committed(pin=True)
    store[0] = entry(1.0)
    store.state_dict()
    store.committed()
    old = ClientStateStore()
    old.attach(tmp_path, budget_bytes=0)
    old.load_state_dict(kept)
    assert torch.equal(old[0]["w"], entry(0.0)["w"])


def test_missing_files_and_a_manifest_without_a_folder_are_named(tmp_path):
    store = ClientStateStore()
    store.attach(tmp_path / "a", budget_bytes=0)
    store[3] = entry(3.0)
    manifest = store.state_dict()
    with pytest.raises(CheckpointError, match="client_state_memory_mb was set"):
        ClientStateStore().load_state_dict(manifest)
    elsewhere = ClientStateStore()
    elsewhere.attach(tmp_path / "b", budget_bytes=0)
    with pytest.raises(CheckpointError, match="client 3's codec state file .* is missing"):
        elsewhere.load_state_dict(manifest)
    import_files(manifest, tmp_path / "a", tmp_path / "b")  # resuming into another run folder
    elsewhere.load_state_dict(manifest)
    assert torch.equal(elsewhere[3]["w"], entry(3.0)["w"])
    with pytest.raises(CheckpointError, match="client 3's codec state file"):
        import_files(manifest, tmp_path / "c", tmp_path / "d")


# ------------------------------------------------------------------------------ in a run
def topk_run(tmp_path, name, rounds, budget=None, **kwargs):
    trainer = make_trainer(
        tmp_path,
        rounds=rounds,
        codec=TopK(density=0.25),
        clients_per_round=3,
        name=name,
        client_state_memory_mb=budget,
        **kwargs,
    )
    trainer.fit(make_model(), datamodule=make_dm(num_clients=12, batch_size=8), ckpt_path=kwargs.get("ckpt_path"))
    return trainer


def test_state_exists_only_for_sampled_clients_and_files_change_nothing(tmp_path):
    memory = topk_run(tmp_path, "memory", rounds=4)
    sampled = {c for h in range(4) for c in memory.strategy.sample(h, 12, 3, 0)}
    assert sorted(memory.codec.residuals) == sorted(sampled) and len(sampled) < 12
    budget = 2 * 4 * 1704 / 2**20  # about two residuals of this model's 1,704 latent values
    spilled = topk_run(tmp_path, "files", rounds=4, budget=budget)
    store = spilled.codec.residuals
    assert store.file_backed and store.memory_bytes() <= budget * 2**20 and len(store) == len(sampled)
    assert torch.equal(memory.global_state["mapping.latent"], spilled.global_state["mapping.latent"])
    for c in sampled:
        assert torch.equal(memory.codec.residuals[c]["mapping.latent"], store[c]["mapping.latent"])
    ckpt = read_checkpoint(spilled.log_dir / "checkpoints" / "last.ckpt")
    assert ckpt["codec"]["residuals"]["format"] == MANIFEST  # a manifest, not the tensors
    folder = spilled.log_dir / "client_state" / "residuals"
    assert files(folder) == {
        file_name(c, s)
        for c, s in zip(*(ckpt["codec"]["residuals"][k].tolist() for k in ("clients", "serials")), strict=True)
    }


@pytest.mark.parametrize("codec", [TopK(density=0.25), PowerSGD(rank=1)], ids=["topk", "powersgd"])
def test_a_run_with_client_state_in_files_resumes_bit_for_bit(tmp_path, codec):
    budget = 4 * 1704 / 2**20
    full = make_trainer(
        tmp_path / "a", rounds=4, codec=codec, clients_per_round=3, client_state_memory_mb=budget, save_every_n_rounds=1
    )
    full.fit(make_model(), datamodule=make_dm(num_clients=12, batch_size=8))
    first = make_trainer(
        tmp_path / "b",
        rounds=2,
        codec=type(codec)(**vars_of(codec)),
        clients_per_round=3,
        client_state_memory_mb=budget,
    )
    first.fit(make_model(), datamodule=make_dm(num_clients=12, batch_size=8))
    ckpt = str(first.log_dir / "checkpoints" / "last.ckpt")
    resumed = make_trainer(
        tmp_path / "b",
        rounds=4,
        codec=type(codec)(**vars_of(codec)),
        clients_per_round=3,
        client_state_memory_mb=budget,
    )
    resumed.fit(make_model(), datamodule=make_dm(num_clients=12, batch_size=8), ckpt_path=ckpt)
    # and from a checkpoint kept two rounds back in the finished run (its files were superseded since, not deleted)
    again = make_trainer(
        tmp_path / "a",
        rounds=4,
        codec=type(codec)(**vars_of(codec)),
        clients_per_round=3,
        client_state_memory_mb=budget,
    )
    again.fit(
        make_model(),
        datamodule=make_dm(num_clients=12, batch_size=8),
        ckpt_path=str(full.log_dir / "checkpoints" / "round_0002.ckpt"),
    )
    for other_run in (resumed, again):
        assert torch.equal(full.global_state["mapping.latent"], other_run.global_state["mapping.latent"])
        for name, store in full.codec.client_stores().items():
            other = other_run.codec.client_stores()[name]
            assert list(store) == list(other)
            assert all(torch.equal(store[c][k], other[c][k]) for c in store for k in store[c])


def vars_of(codec) -> dict:
    return {k: v for k, v in vars(codec).items() if k in ("density", "rank", "error_feedback", "scope")}


def test_client_state_in_files_needs_one_process(tmp_path):
    with pytest.raises(ConfigError, match="client_state_memory_mb must be >= 0"):
        make_trainer(tmp_path, client_state_memory_mb=-1.0)
    trainer = make_trainer(tmp_path, codec=TopK(), client_state_memory_mb=1.0)
    trainer.fabric, trainer.log_dir = SimpleNamespace(world_size=2), tmp_path
    with pytest.raises(ConfigError, match="set trainer.devices 1"):
        trainer._attach_client_state()
