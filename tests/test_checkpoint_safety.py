"""Every checkpoint or cached file the package reads goes through one safe reader.

A malicious pickle (its ``__reduce__`` creates a marker file) and truncated files are handed to each entry point
with ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` set (torch then unpickles anything for calls that leave
``weights_only`` out). An explicit path must fail with one line naming the file; a corrupt cache is a warned-about
cache miss and is rebuilt. The marker file must never appear.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from conftest import CONFIGS, run_cli
from lightning_fl.checkpoint import read_checkpoint
from lightning_fl.data import Digits
from lightning_fl.errors import CheckpointError
from lightning_fl.methods import Classifier
from lightning_fl.models import SmallCNN
from lightning_fl.oneshot import (
    FederatedTasks,
    FMPMetaLearner,
    GeneratorTraining,
    PixelFeatures,
    PMASummariser,
    PredictiveGenerator,
)
from lightning_fl.oneshot.features import ExtractedFeatures


class Evil:
    """Unpickling it opens (creates) the marker file: code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(autouse=True)
def unsafe_env(monkeypatch):
    """torch reads the variable at each load: it forces weights_only=False where a call leaves it out."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "PWNED"
    yield path
    assert not path.exists(), "a checkpoint ran code while being read"


def evil_file(path: Path, marker: Path, wrap=lambda evil: {"state_dict": {"w": evil}}) -> Path:
    torch.save(wrap(Evil(marker)), path)
    return path


def truncated_file(path: Path, obj) -> Path:
    torch.save(obj, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def resealed(ckpt: dict) -> dict:
    """A round checkpoint's dict with its content digest recomputed (well formed, whatever it holds)."""
    from lightning_fl.checkpoint import content_digest
    from lightning_fl.federated.persistence.checkpoint import DIGEST

    body = {k: v for k, v in ckpt.items() if k != DIGEST}
    return {**body, DIGEST: content_digest(body)}


def error_line(capsys) -> str:
    """The CLI's error: one line (the next one is the hint)."""
    lines = capsys.readouterr().err.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    assert lines[at + 1].startswith("Run with --print_config"), lines[at : at + 2]
    return lines[at]


def test_the_payload_is_live_without_the_safe_reader(tmp_path):
    # The environment variable is honoured in-process: a load that leaves weights_only out runs the payload.
    path = evil_file(tmp_path / "evil.pt", tmp_path / "ran")
    with pytest.warns(UserWarning, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        torch.load(path)
    assert (tmp_path / "ran").exists()


def bad_files(tmp_path: Path, marker: Path) -> dict[str, tuple[object, str]]:
    """Each bad source and a phrase its error must hold."""
    folder = tmp_path / "folder.pt"
    folder.mkdir()
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": Evil(marker)}, legacy, _use_new_zipfile_serialization=False)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    evil = evil_file(tmp_path / "evil.pt", marker)
    return {
        "malicious": (evil, "needs the Python object io.open"),
        "malicious legacy format": (legacy, "needs the Python object io.open"),
        "malicious bytes": (evil.read_bytes(), "needs the Python object io.open"),
        "truncated": (truncated_file(tmp_path / "cut.pt", {"w": torch.ones(50)}), "truncated or corrupt"),
        "junk": (junk, "not a file written by torch.save"),
        "empty": (empty, "empty or truncated"),
        "folder": (folder, "is a folder"),
        "missing": (tmp_path / "gone.pt", "does not exist"),
    }


def test_reader_turns_every_failure_into_one_line(tmp_path, marker):
    for label, (source, reason) in bad_files(tmp_path, marker).items():
        with pytest.raises(CheckpointError) as info:
            read_checkpoint(source, "some.key", fix="do the fix")
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith("some.key ") and reason in msg and msg.endswith("; do the fix"), label
        if isinstance(source, Path):
            assert str(source) in msg, label
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer)
    assert read_checkpoint(buffer.getvalue())["w"].sum() == 2  # bytes and file objects read like files
    buffer.seek(0)
    assert read_checkpoint(buffer)["w"].sum() == 2


# ------------------------------------------------------------------------------ lightning.Trainer --ckpt_path
DIGITS = str(CONFIGS / "pretrain_digits.yaml")
TINY_FIT = ["--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]
TINY_FIT += ["--trainer.enable_model_summary", "false"]


@pytest.mark.parametrize("subcommand", ["fit", "test"])
def test_lightning_ckpt_path_is_checked_before_lightning_reads_it(in_tmp, marker, capsys, subcommand):
    evil = evil_file(in_tmp / "evil.ckpt", marker)
    assert run_cli(subcommand, "--config", DIGITS, "--ckpt_path", str(evil)) == 2
    line = error_line(capsys)
    assert f"ckpt_path {evil} could not be read safely" in line and "io.open" in line
    cut = truncated_file(in_tmp / "cut.ckpt", {"state_dict": {"w": torch.ones(100)}})
    assert run_cli(subcommand, "--config", DIGITS, "--ckpt_path", str(cut)) == 2
    assert f"ckpt_path {cut} could not be read safely (weights_only=True): it is truncated" in error_line(capsys)
    torch.save([1, 2], in_tmp / "list.ckpt")
    assert run_cli(subcommand, "--config", DIGITS, "--ckpt_path", str(in_tmp / "list.ckpt")) == 2
    assert "is not a Lightning checkpoint" in error_line(capsys)
    for remote in ("https://example.com/evil.ckpt", "registry:model"):  # cannot be checked before Lightning reads it
        assert run_cli(subcommand, "--config", DIGITS, "--ckpt_path", remote) == 2
        assert f"ckpt_path {remote}: remote checkpoints are not read" in error_line(capsys)


def test_a_legitimate_lightning_checkpoint_still_resumes(in_tmp):
    assert run_cli("fit", "--config", DIGITS, "--trainer.max_epochs", "1", *TINY_FIT) == 0
    (last,) = (in_tmp / "runs" / "pretrain_digits").glob("**/last.ckpt")
    assert read_checkpoint(last)["epoch"] == 0  # written by lightning.Trainer, readable with weights_only=True
    last = last.rename(in_tmp / "first.ckpt")
    assert run_cli("fit", "--config", DIGITS, "--trainer.max_epochs", "2", "--ckpt_path", str(last), *TINY_FIT) == 0
    (resumed,) = (in_tmp / "runs" / "pretrain_digits").glob("**/last.ckpt")
    state = read_checkpoint(resumed)
    assert state["epoch"] == 1 and state["global_step"] == 4


# ------------------------------------------------------------------------------ FMP
FMP = str(CONFIGS / "fmp_digits.yaml")
FMP_SHRINK = [
    "--trainer.max_steps",
    "2",
    "--trainer.val_check_interval",
    "2",
    "--model.generator_training.steps",
    "2",
    "--model.generator_training.eval_tasks",
    "1",
    "--data.val_tasks",
    "1",
    "--data.test_tasks",
    "1",
    "--model.num_generated",
    "10",
    "--model.test_samples",
    "2",
    "--data.meta_tasks",
    "20",
    "--trainer.logger",
    "false",
    "--trainer.enable_checkpointing",
    "false",
    "--trainer.callbacks",
    "[]",
]


def test_fmp_ckpt_path_and_generator_checkpoint_refuse_bad_files(in_tmp, marker, capsys, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    monkeypatch.setattr(FMPMetaLearner, "_train_generator", lambda *a: pytest.fail("a bad file was replaced"))
    evil = evil_file(in_tmp / "evil.ckpt", marker)
    assert run_cli("test", "--config", FMP, *FMP_SHRINK, "--ckpt_path", str(evil)) == 2
    assert f"ckpt_path {evil} could not be read safely" in error_line(capsys)
    gen = evil_file(in_tmp / "gen.pt", marker, wrap=lambda e: {"generator": {"w": e}})
    assert run_cli("fit", "--config", FMP, *FMP_SHRINK, "--model.generator_checkpoint", str(gen)) == 2
    line = error_line(capsys)
    assert f"model.generator_checkpoint {gen} could not be read safely" in line and "io.open" in line
    cut = truncated_file(in_tmp / "cut.pt", {"generator": {"w": torch.ones(100)}})
    assert run_cli("fit", "--config", FMP, *FMP_SHRINK, "--model.generator_checkpoint", str(cut)) == 2
    assert f"model.generator_checkpoint {cut} could not be read safely" in error_line(capsys)
    torch.save({"generator": {"w": torch.ones(3)}}, in_tmp / "other.pt")
    assert run_cli("fit", "--config", FMP, *FMP_SHRINK, "--model.generator_checkpoint", str(in_tmp / "other.pt")) == 2
    assert "does not fit the generator: missing" in error_line(capsys)


def fmp_learner(cache: Path) -> FMPMetaLearner:
    return FMPMetaLearner(
        summariser=PMASummariser(4, hidden=16, num_heads=2),
        generator=PredictiveGenerator(16, 2),
        generator_training=GeneratorTraining(steps=2, tasks_per_step=2, num_samples=2, eval_tasks=1),
        num_generated=10,
        test_samples=2,
        cache_dir=str(cache),
    )


def fmp_fit(model: FMPMetaLearner, root: Path) -> None:
    data = FederatedTasks(
        PixelFeatures(),
        num_clients=2,
        points_per_client=20,
        meta_tasks=20,
        tasks_per_step=2,
        val_tasks=1,
        test_tasks=1,
        heldout_points=20,
        min_classes=6,
    )
    trainer = L.Trainer(
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(model, datamodule=data)


def test_a_bad_fmp_generator_cache_is_a_warned_cache_miss(tmp_path, marker, caplog):
    fmp_fit(fmp_learner(tmp_path / "cache"), tmp_path)
    (cached,) = (tmp_path / "cache" / "generators").glob("*/generator.pt")
    good = read_checkpoint(cached)["generator"]
    for spoil in (
        lambda: evil_file(cached, marker, wrap=lambda e: {"generator": {"w": e}}),
        lambda: truncated_file(cached, {"generator": good}),
        lambda: torch.save({"generator": {"w": torch.ones(3)}}, cached),  # readable, but not this generator's
    ):
        spoil()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lightning_fl.oneshot.meta_learner"):
            fmp_fit(model := fmp_learner(tmp_path / "cache"), tmp_path)
        assert f"FMP generator cache {cached}" in caplog.text and "treated as a cache miss" in caplog.text
        assert torch.equal(model.generator.state_dict()["out.weight"].cpu(), good["out.weight"])
        assert torch.equal(read_checkpoint(cached)["generator"]["out.weight"], good["out.weight"])  # rewritten


# ------------------------------------------------------------------------------ FederatedTrainer --ckpt_path
QUICK = ["--config", str(CONFIGS / "quickstart.yaml"), "--model.base", "scratch", "--trainer.rounds", "1"]
QUICK += ["--trainer.enable_progress_bar", "false"]


@pytest.mark.parametrize("subcommand", ["fit", "test"])
def test_federated_ckpt_path_refuses_bad_files(in_tmp, marker, capsys, subcommand):
    evil = evil_file(in_tmp / "evil.ckpt", marker, wrap=lambda e: {"format": "x", "global_state": {"w": e}})
    assert run_cli(subcommand, *QUICK, "--ckpt_path", str(evil)) == 2
    line = error_line(capsys)
    assert f"{evil} could not be read safely" in line and "io.open" in line
    cut = truncated_file(in_tmp / "cut.ckpt", {"global_state": {"w": torch.ones(100)}})
    assert run_cli(subcommand, *QUICK, "--ckpt_path", str(cut)) == 2
    assert f"{cut} could not be read safely (weights_only=True): it is truncated" in error_line(capsys)


# ------------------------------------------------------------------------------ feature caches and checkpoints
def digits_cnn() -> SmallCNN:
    torch.manual_seed(0)
    return SmallCNN(in_channels=1, image_size=8, channels=[8, 16], feature_dim=32, norm_groups=4)


def test_features_checkpoint_is_refused_and_a_bad_cache_is_recomputed(tmp_path, marker, caplog, monkeypatch):
    monkeypatch.setattr(ExtractedFeatures, "_train", lambda *a, **k: pytest.fail("should not train"))
    evil = evil_file(tmp_path / "evil.ckpt", marker)
    with pytest.raises(CheckpointError, match=f"^data.features.checkpoint={evil} could not be read safely"):
        ExtractedFeatures(Digits(), digits_cnn(), feature_dim=None, checkpoint=str(evil)).prepare()
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": Classifier(digits_cnn(), num_classes=10).state_dict()}, ckpt)

    def build() -> ExtractedFeatures:
        return ExtractedFeatures(
            Digits(), digits_cnn(), feature_dim=None, checkpoint=str(ckpt), cache_dir=str(tmp_path / "cache")
        )

    first = build()
    first.prepare()
    cached = Path(first.info["cache_path"])
    expected = first.load("test").h
    for spoil in (
        lambda: evil_file(cached, marker, wrap=lambda e: {"key": "x", "train_h": e}),
        lambda: truncated_file(cached, {"train_h": torch.ones(100)}),
        lambda: torch.save({"key": "another"}, cached),  # readable, but not this cache's
    ):
        spoil()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lightning_fl.oneshot.features"):
            again = build()
            again.prepare()
        assert f"features cache {cached}" in caplog.text and "treated as a cache miss" in caplog.text
        assert not again.info["cached"] and torch.equal(again.load("test").h, expected)
        assert build().load("test") is not None and read_checkpoint(cached)["key"]  # rewritten, readable


# ------------------------------------------------------------------------------ pretrained base cache, init_from
def test_init_from_is_refused_and_a_bad_base_cache_is_pretrained_again(tmp_path, marker, caplog, monkeypatch):
    from conftest import make_model, public_pretraining

    evil = evil_file(tmp_path / "evil.ckpt", marker)
    with pytest.raises(CheckpointError, match=f"^model.init_from={evil} could not be read safely"):
        Classifier(SmallCNN(image_size=8, channels=[8, 16], norm_groups=4), num_classes=10, init_from=str(evil))
    dm, recipe = public_pretraining(tmp_path)
    model = make_model(base="pretrained", pretraining=recipe)
    model.prepare_base(dm)
    cached = model.base_cache_path(dm)
    good = read_checkpoint(cached)["state_dict"]
    for spoil in (lambda: evil_file(cached, marker), lambda: truncated_file(cached, {"state_dict": good})):
        spoil()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lightning_fl.methods.recipe"):
            again = make_model(base="pretrained", pretraining=recipe)
            again.prepare_base(dm)
        assert f"pretrained base cache {cached}" in caplog.text and "treated as a cache miss" in caplog.text
        assert all(torch.equal(read_checkpoint(cached)["state_dict"][k], v) for k, v in good.items())
    evil_file(cached, marker)
    with pytest.raises(CheckpointError, match=f"^pretrained base cache {cached} could not be read safely"):
        make_model(base="pretrained", pretraining=recipe).prepare_base(dm, allow_training=False)


# ------------------------------------------------------------------------------ bytes: a Flower node's codec memory
def test_flower_codec_memory_is_read_with_the_same_reader(tmp_path, marker):
    from lightning_fl.compress import TopK
    from lightning_fl.flower.node import _CODEC_STATE, _load_codec_state, _save_codec_state

    codec, context = TopK(density=0.5), SimpleNamespace(state={})
    codec.residuals[3] = {"w": torch.arange(4.0)}
    _save_codec_state(codec, context)
    restored = TopK(density=0.5)
    _load_codec_state(restored, context)  # the node's own memory still loads
    assert torch.equal(restored.residuals[3]["w"], torch.arange(4.0))
    context.state[_CODEC_STATE] = {"state": evil_file(tmp_path / "evil.pt", marker).read_bytes()}
    with pytest.raises(CheckpointError, match=r"codec memory .* \(in-memory bytes\) could not be read safely"):
        _load_codec_state(restored, context)


# ------------------------------------------------------------------------------ round checkpoint integrity
ROUNDS = [
    "--config",
    str(CONFIGS / "quickstart.yaml"),
    "--trainer.rounds",
    "2",
    "--data.num_clients",
    "4",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.logger",
    "false",
    "--model.init_args.pretraining.epochs",
    "2",
]


@pytest.fixture
def round_checkpoint(in_tmp) -> Path:
    assert run_cli("fit", *ROUNDS, "--trainer.default_root_dir", "runs", "--trainer.name", "good") == 0
    (path,) = (in_tmp / "runs" / "good").glob("*/checkpoints/last.ckpt")
    return path


def resume(path: Path, good: dict) -> dict:
    """``path`` read as the trainer reads a checkpoint to resume from (for the run that wrote ``good``)."""
    from lightning_fl.federated.persistence import checkpoint as round_ckpt

    expect = {"seed": 0, "num_clients": 4, "fingerprint": good["fingerprint"], "strategy": "FedAvg"}
    return round_ckpt.load_round(path, expect, list(good["global_state"]), 2)


def test_every_flipped_bit_of_a_round_checkpoint_is_refused_or_harmless(in_tmp, round_checkpoint):
    """200 single-bit flips at random offsets: each is refused in one line, or the file still holds exactly what
    was written (its content digest verifies; a flip in the zip's padding or headers that changes nothing)."""
    import random

    from lightning_fl.checkpoint import content_digest

    data, good = round_checkpoint.read_bytes(), read_checkpoint(round_checkpoint)
    original = content_digest(good)
    rng, refused, harmless = random.Random(0), 0, 0
    for i in range(200):
        flipped = bytearray(data)
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        path = in_tmp / f"flip{i}.ckpt"
        path.write_bytes(bytes(flipped))
        ckpt, error = None, ""
        try:
            ckpt = resume(path, good)
        except CheckpointError as err:
            error = str(err)
        if ckpt is None:
            assert "\n" not in error and str(path) in error
            refused += 1
        else:
            assert content_digest(ckpt) == original
            harmless += 1
        path.unlink()
    assert refused > 100 and refused + harmless == 200


def test_a_round_checkpoint_with_a_nan_state_or_missing_keys_is_refused_with_exit_code_2(
    in_tmp, round_checkpoint, capsys
):
    """Well-formed files (their digests recomputed) whose content cannot be resumed: one line and exit code 2."""
    from lightning_fl.checkpoint import atomic_save, content_digest
    from lightning_fl.federated.persistence.checkpoint import DIGEST

    good = read_checkpoint(round_checkpoint)
    name = next(iter(good["global_state"]))
    cases = {
        "nan": (
            {"global_state": {**good["global_state"], name: good["global_state"][name] * float("nan")}},
            "the global state has NaN or Inf values",
        ),
        "no-seed": ({"seed": None}, "'seed' must be a int, it is missing"),
        "text-round": ({"round": "2"}, "'round' must be a int, it is a str"),
        "edited": ({}, "is corrupt: its content differs from the digest"),
        "old-layout": ({"version": 2}, "has layout version 2, this lightning_fl reads 3"),
        "no-strategy-state": ({"strategy": None}, "'strategy' must be a dict, it is missing"),
    }
    for case, (change, message) in cases.items():
        ckpt = {k: v for k, v in good.items() if k != DIGEST}
        ckpt.update({k: v for k, v in change.items() if v is not None})
        for k in [k for k, v in change.items() if v is None]:
            del ckpt[k]
        ckpt[DIGEST] = content_digest(ckpt) if case != "edited" else good[DIGEST]
        if case == "edited":
            ckpt["history"] = [*ckpt["history"][:-1], {**ckpt["history"][-1], "val/acc": 1.0}]
        path = atomic_save(ckpt, in_tmp / f"{case}.ckpt")
        assert run_cli("fit", *ROUNDS, "--trainer.default_root_dir", "runs", "--ckpt_path", str(path)) == 2, case
        line = error_line(capsys)
        assert message in line and str(path) in line, (case, line)
    assert not list((in_tmp / "runs" / "quickstart").glob("version_*"))  # the failed fits left no empty folder


def test_validate_prints_its_metrics_and_refuses_files_that_do_not_fit(in_tmp, round_checkpoint, capsys):
    """``validate --ckpt_path``: a run's checkpoint prints every metric; a bare tensor, a dict without a state dict
    and a state dict of other shapes are one line and exit code 2, and leave no run folder behind; a finished run
    leaves no lock file."""
    assert not list((in_tmp / "runs").rglob(".lock"))
    base = [*ROUNDS, "--trainer.default_root_dir", "eval"]
    assert run_cli("validate", *base, "--ckpt_path", str(round_checkpoint)) == 0
    out = capsys.readouterr().out
    assert "validate: " in out and "val/acc" in out and "val/loss" in out
    good = read_checkpoint(round_checkpoint)
    name = next(iter(good["global_state"]))
    bad = {
        "tensor": (torch.ones(3), "holds no state dict of tensors"),
        "dict": ({"weights": [1, 2]}, "holds no state dict of tensors"),
        "shapes": ({"state_dict": {"w": torch.ones(2)}}, "its state_dict does not fit this model"),
        "round-shapes": (resealed({**good, "global_state": {name: torch.ones(3)}}), "its global state does not fit"),
    }
    folders = sorted(p.name for p in (in_tmp / "eval").rglob("version_*"))
    for case, (obj, message) in bad.items():
        path = in_tmp / f"{case}.ckpt"
        torch.save(obj, path)
        assert run_cli("validate", *base, "--ckpt_path", str(path)) == 2, case
        line = error_line(capsys)
        assert message in line and str(path) in line, (case, line)
    assert sorted(p.name for p in (in_tmp / "eval").rglob("version_*")) == folders  # no empty folders left


def test_a_full_disk_is_one_line_and_exit_code_2_and_the_last_checkpoint_survives(in_tmp, capsys, monkeypatch):
    """Round 2's checkpoint meets a full disk (ENOSPC after part of the file was written): one line naming the file,
    the bytes needed and the fix; exit code 2; round 1's last.ckpt intact and no temp file left."""
    import errno

    from lightning_fl import checkpoint

    real, calls = torch.save, []

    def full_disk(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("round") == 2 and not isinstance(f, io.BytesIO):  # the file, not a size
            calls.append(obj["round"])
            f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    assert run_cli("fit", *ROUNDS, "--trainer.default_root_dir", "runs", "--trainer.name", "full") == 2
    line = error_line(capsys)
    assert calls == [2] and "no space left to write" in line and "bytes needed" in line and "is intact" in line
    (folder,) = (in_tmp / "runs" / "full").glob("*/checkpoints")
    assert read_checkpoint(folder / "last.ckpt")["round"] == 1 and not list(folder.glob(".*.tmp"))
