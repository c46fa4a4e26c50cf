from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TQDM_DISABLE", "1")

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
