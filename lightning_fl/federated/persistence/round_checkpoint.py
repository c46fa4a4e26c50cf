"""A fit's round checkpoint: what :class:`~lightning_fl.federated.FederatedTrainer` saves after every round and how it
resumes. The run's record (its identity, the global state, the strategy, the codec, the ledger, the history) and
every part that keeps its own state (the stages, the arrival policy: :class:`Part`), each under its key; the file
itself (its format, digests and checks) is :mod:`lightning_fl.federated.persistence.checkpoint`'s."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import lightning as L
import torch.distributed as dist

from lightning_fl.checkpoint import remove_stale_temps
from lightning_fl.compress.base import Codec
from lightning_fl.errors import CheckpointError, UserError
from lightning_fl.federated.persistence import budget
from lightning_fl.federated.persistence import checkpoint as files
from lightning_fl.federated.persistence.checkpoint import DIGEST, FIX, KEY_ENV, KEYED, load_round, run_folder_of, to_cpu
from lightning_fl.federated.persistence.ledger import ByteLedger
from lightning_fl.federated.server.state import State
from lightning_fl.federated.server.strategies import Strategy
from lightning_fl.privacy.base import Privacy
from lightning_fl.privacy.dpsgd import DPSGD


class Part(Protocol):
    """What keeps its own state in a round checkpoint beside the global state: a stage
    (:class:`~lightning_fl.federated.server.stages.Stage`) or the collection's arrival policy."""

    state_key: str | None
    without: str | None

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], completed: int) -> None: ...


@dataclass
class RunRecord:
    """What a fit's round checkpoint holds besides its parts: the run's identity, the server's state and the history.

    Args:
        seed: The run's seed.
        num_clients: Clients of the data module.
        fingerprint: The model's (its factors and base).
        global_state: The global federated state after the round.
        strategy: The server strategy (its class is checked on resume, its state saved).
        codec: The uploads' codec (its per-client state is gathered from every process).
        ledger: The byte ledger.
        history: Every round's logged metrics.
    """

    seed: int
    num_clients: int
    fingerprint: str | None
    global_state: State
    strategy: Strategy
    codec: Codec
    ledger: ByteLedger
    history: list[dict[str, float]]


def save_trainer(
    fabric: L.Fabric, run: RunRecord, parts: list[Part], folder: Path, completed: int, every: int, private: bool
) -> None:
    """Write the round checkpoint of ``run`` after round ``completed`` into ``folder/checkpoints`` (from rank 0;
    every process calls it, as the codec's per-client state is gathered from all of them), each part's state under its
    key. A ``private`` run records its release first (:mod:`lightning_fl.federated.persistence.budget`)."""
    codec_state = run.codec.gathered_state_dict(_gather(fabric) if fabric.world_size > 1 else None)
    if fabric.is_global_zero:
        state = {
            "seed": run.seed,
            "num_clients": run.num_clients,
            "fingerprint": run.fingerprint,
            "global_state": to_cpu(run.global_state),
            "strategy_class": run.strategy.name,
            "strategy": run.strategy.state_dict(),
            "codec": codec_state,
            "ledger": run.ledger.state_dict(),
            "history": [{k: float(v) for k, v in h.items()} for h in run.history],
        }
        state.update({part.state_key: part.state_dict() for part in parts if part.state_key is not None})
        if private:  # the release is recorded before the checkpoint that could rewind it
            budget.record_release(folder, completed, run.history[-1])
        files.save_round(state, folder / "checkpoints", completed, every)  # (by the module: a test stops it)
    run.codec.client_state_saved(pin=bool(every) and completed % every == 0)
    fabric.barrier()


def restore_trainer(
    fabric: L.Fabric,
    run: RunRecord,
    parts: list[Part],
    path: Path,
    *,
    rounds: int,
    folder: Path,
    keep: Callable[[int], bool] | None,
    written_with: dict[str, str],
    privacy: Privacy | None = None,
    dp_sgd: DPSGD | None = None,
) -> int:
    """Load the round checkpoint ``path`` into ``run`` (its global state, strategy, codec, ledger and history, in
    place) and ``parts`` (rank 0 reads and checks it, every process receives it); the number of rounds it has done.

    Each part loads the state under its key; a checkpoint without it resumes the part only if it may start afresh
    (its ``without`` is ``None``), and a checkpoint with state no part of this run claims is refused with
    ``written_with[key]`` (what to set to continue it). ``keep``: which clients' codec state this process holds.
    ``privacy`` and ``dp_sgd``: the budgets restored, checked against what the run logged."""
    expect = {
        "seed": run.seed,
        "num_clients": run.num_clients,
        "fingerprint": run.fingerprint,
        "strategy": run.strategy.name,
    }
    is_private = privacy is not None or dp_sgd is not None
    ckpt, error = None, None
    if fabric.is_global_zero:
        try:
            ckpt = load_round(path, expect, list(run.global_state), rounds)
            budget.warn_rewind(folder, int(ckpt["round"]), path, is_private)
        except CheckpointError as err:
            error = str(err)
    ckpt, error = fabric.broadcast((ckpt, error))
    if error is not None:
        raise CheckpointError(error)
    completed = int(ckpt["round"])
    run.global_state.clear()
    run.global_state.update({n: t.to(fabric.device) for n, t in ckpt["global_state"].items()})
    run.strategy.load_state_dict(ckpt["strategy"])
    run.codec.load_client_state(ckpt["codec"], source=run_folder_of(path), keep=keep)
    run.ledger.load_state_dict(ckpt["ledger"])
    _restore_parts(parts, path, ckpt, completed, written_with)
    if (problem := budget.budget_problem(privacy, dp_sgd, ckpt)) is not None:
        raise CheckpointError(
            f"cannot resume from {path}: {problem}: the checkpoint was edited after it was written "
            f"(its plain digest recomputed; {KEY_ENV} catches that); {FIX}"
        )
    run.history[:] = list(ckpt["history"])
    if fabric.is_global_zero:
        remove_stale_temps(path.parent)
    return completed


#: A round checkpoint's keys that are not a part's state.
CORE = {
    "format",
    "version",
    "round",
    "seed",
    "num_clients",
    "fingerprint",
    "global_state",
    "strategy_class",
    "strategy",
    "codec",
    "ledger",
    "history",
    DIGEST,
    KEYED,
}


def _restore_parts(parts: list[Part], path: Path, ckpt: dict[str, Any], completed: int, written_with: dict[str, str]):
    """Every part's state from ``ckpt``, refusing a checkpoint of another kind of run in one line. (An empty state
    under a key is no state: version-3 files hold ``privacy`` and ``dp_sgd`` always.)"""
    mine = {part.state_key: part for part in parts if part.state_key is not None}
    for key in sorted(k for k in ckpt if k not in CORE and k not in mine and ckpt[k] != {}):
        why = written_with.get(key, f"it holds state under {key!r}, which this run has no part for; start afresh")
        raise CheckpointError(f"cannot resume from {path}: {why}")
    for key, part in mine.items():
        if part.without is not None and ckpt.get(key, {}) == {}:
            raise CheckpointError(f"cannot resume from {path}: {part.without}")
        try:
            part.load_state_dict(ckpt.get(key, {}), completed)
        except UserError:
            raise
        except (ValueError, TypeError, KeyError) as err:
            raise CheckpointError(f"cannot resume from {path}: {err}") from None


def _gather(fabric: L.Fabric) -> Callable[[Any], list[Any]]:
    def gather(obj: Any) -> list[Any]:
        everyone: list[Any] = [None] * fabric.world_size
        dist.all_gather_object(everyone, obj)
        return everyone

    return gather
