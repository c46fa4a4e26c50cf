"""Importable plug-ins for CLI tests."""

from __future__ import annotations

from typing import Any

from lightning_fl import TrainerLike


class RecordingTrainer(TrainerLike):
    """A non-Lightning trainer: records what the CLI hands it."""

    last: RecordingTrainer | None = None

    def __init__(self, rounds: int = 1, tag: str = "x") -> None:
        self.rounds, self.tag = rounds, tag
        self.calls: list[tuple[str, Any, Any, Any]] = []
        self.config_yaml: str | None = None
        RecordingTrainer.last = self

    def log_config(self, config_yaml: str) -> None:
        self.config_yaml = config_yaml

    def fit(self, model: Any, *, datamodule: Any = None, ckpt_path: Any = None) -> Any:
        self.calls.append(("fit", model, datamodule, ckpt_path))
        return "fitted"

    def validate(self, model: Any, *, datamodule: Any = None, ckpt_path: Any = None) -> Any:
        self.calls.append(("validate", model, datamodule, ckpt_path))
        return [{}]

    def test(self, model: Any, *, datamodule: Any = None, ckpt_path: Any = None) -> Any:
        self.calls.append(("test", model, datamodule, ckpt_path))
        return [{}]
