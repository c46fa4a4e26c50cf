"""The parts of a round checkpoint that only some runs have: the compressed broadcast's memory
(``trainer.compressed_downloads``) and FedBuff's clients in flight (``trainer.buffered``). A checkpoint with such a part
resumes only a run of the same kind, and a run of that kind only from a checkpoint that has it: one line says which
key to set or remove."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_fl.errors import CheckpointError


def saved(trainer: Any) -> dict[str, Any]:
    """The parts ``trainer``'s run has, to be saved with its round checkpoint."""
    out = {}
    if trainer.downlink is not None:  # its memory and which state each client holds
        out["downlink"] = trainer.downlink.state_dict()
    if trainer.buffered is not None:  # the clients in flight with their updates, the clock, the server version
        out["buffered"] = trainer.round_runner.collection.arrivals.state_dict()
    return out


def restore(trainer: Any, path: Path, ckpt: dict[str, Any]) -> None:
    """Load the parts of ``ckpt`` into ``trainer``, refusing a checkpoint of another kind of run."""
    _restore_downlink(trainer.downlink, path, ckpt)
    if trainer.buffered is None and "buffered" in ckpt:
        raise CheckpointError(f"cannot resume from {path}: it was written with trainer.buffered (FedBuff's clients in "
                              "flight); set the same trainer.buffered")  # fmt: skip
    if trainer.buffered is not None and "buffered" not in ckpt:
        raise CheckpointError(f"cannot resume from {path}: it was written with synchronous rounds (no FedBuff clients "
                              "in flight); remove trainer.buffered, or start afresh")  # fmt: skip
    if trainer.buffered is not None:
        trainer.round_runner.collection.arrivals.load_state_dict(ckpt["buffered"], str(path))


def _restore_downlink(downlink: Any, path: Path, ckpt: dict[str, Any]) -> None:
    """The server's downlink memory and what each client holds, from a checkpoint of the same kind of run."""
    if downlink is None:
        if "downlink" in ckpt:
            raise CheckpointError(
                f"cannot resume from {path}: it was written with trainer.compressed_downloads (its clients hold "
                "the broadcasts' state, the server a downlink memory); set trainer.compressed_downloads true"
            )
        return
    if "downlink" not in ckpt:
        raise CheckpointError(
            f"cannot resume from {path}: it was written without trainer.compressed_downloads (no downlink memory "
            "to continue); remove the key, or start afresh"
        )
    try:
        downlink.load_state_dict(ckpt["downlink"], int(ckpt["round"]))
    except (ValueError, TypeError, KeyError) as err:
        raise CheckpointError(f"cannot resume from {path}: {err}") from None
