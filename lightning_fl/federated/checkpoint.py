"""Round checkpoints: what a federated run saves after every round, where it finds one, and how it resumes.

A round checkpoint holds everything the next round depends on (global state, strategy state, codec state
such as error-feedback residuals, the byte ledger, history, round, seed, number of clients, the model's
fingerprint), written atomically, loaded with ``weights_only=True``. Resuming checks that the run matches
(seed, clients, fingerprint, state layout, strategy), so a resumed run ends equal to an uninterrupted one.

Each checkpoint carries the SHA-256 of its content: it catches a flipped bit or a damaged copy, not a deliberate
edit (whoever edits the file can recompute it). With the environment variable ``LIGHTNING_FL_CHECKPOINT_KEY``
set, every checkpoint also carries an HMAC-SHA256 of that digest under the key, and reading one requires a
valid HMAC under the same key: an edit by anyone without the key is refused (keep the key away from whoever can
write the run folder). A private run's budget is also checked against what it logged on every resume, and a resume of
any copy of any checkpoint is charged to the population's privacy ledger (:mod:`lightning_fl.federated.budget`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_fl import runs
from lightning_fl.checkpoint import (
    atomic_save,
    content_digest,
    read_checkpoint,
    remove_stale_temps,
    state_mismatch,
    tensor_state,
    zip_problem,
)
from lightning_fl.errors import CheckpointError
from lightning_fl.federated import budget, checkpoint_parts

FORMAT = "lightning_fl.federated"
VERSION = 3  # the layout read and written here; a file of another version is refused
DIGEST = "content_sha256"
KEYED = "content_hmac_sha256"
KEY_ENV = "LIGHTNING_FL_CHECKPOINT_KEY"


def keyed_digest(digest: str) -> str | None:
    """HMAC-SHA256 of ``digest`` under ``LIGHTNING_FL_CHECKPOINT_KEY`` (``None`` when it is not set)."""
    key = os.environ.get(KEY_ENV)
    return hmac.new(key.encode(), digest.encode(), hashlib.sha256).hexdigest() if key else None


def save_round(state: dict[str, Any], folder: Path, completed: int, every: int) -> None:
    """Write ``last.ckpt`` (and ``round_NNNN.ckpt`` every ``every`` rounds, if ``every``), with the SHA-256 of
    everything it holds (:func:`~lightning_fl.checkpoint.content_digest`), verified when it is read."""
    payload = {"format": FORMAT, "version": VERSION, "round": completed, **state}
    payload[DIGEST] = content_digest(payload)
    if (keyed := keyed_digest(payload[DIGEST])) is not None:
        payload[KEYED] = keyed
    atomic_save(payload, folder / "last.ckpt")
    if every and completed % every == 0:
        atomic_save(payload, folder / f"round_{completed:04d}.ckpt")


def find_resume(ckpt_path: str | None, resume: bool | str, root: Path, version: int | str | None) -> Path | None:
    """The checkpoint to resume from: ``ckpt_path``, else with ``resume`` the newest ``last.ckpt`` under ``root``.

    Runs that a live process is writing (their folder is locked, :mod:`lightning_fl.runs`) are never resumed.
    """
    if ckpt_path is not None:
        return Path(ckpt_path).expanduser()
    if resume not in ("auto", True):
        return None
    if version is not None:
        folder = root / (version if isinstance(version, str) else f"version_{version}")
        candidates = [folder / "checkpoints" / "last.ckpt"]
    else:
        candidates = list(root.glob("*/checkpoints/last.ckpt"))
    candidates = [c for c in candidates if c.is_file()]
    busy = {c: runs.holder(c.parent.parent) for c in candidates}
    free = [c for c in candidates if busy[c] is None]
    if free:
        return max(free, key=lambda p: p.stat().st_mtime)
    if resume is True:
        if candidates:
            writers = "; ".join(f"{c.parent.parent} by {busy[c]}" for c in candidates)
            raise CheckpointError(
                f"trainer.resume is true but every run with a checkpoint under {root} is being written ({writers}); "
                "wait for it to finish"
            )
        raise CheckpointError(f"trainer.resume is true but no checkpoint was found under {root}")
    return None


def load_round(path: Path, expect: dict[str, Any], state_keys: list[str], rounds: int) -> dict[str, Any]:
    """Read ``path`` and check it belongs to this run; raise naming every difference.

    ``expect`` holds ``seed``, ``num_clients``, ``fingerprint`` and ``strategy`` (class name) of this run.
    """
    ckpt = read_checkpoint(path, "trainer checkpoint", fix=FIX)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a FederatedTrainer checkpoint (no 'format' marker)")
    check_integrity(path, ckpt)
    problems = []
    if ckpt["seed"] != expect["seed"]:
        problems.append(f"seed {ckpt['seed']} in the checkpoint, {expect['seed']} now")
    if ckpt["num_clients"] != expect["num_clients"]:
        problems.append(f"{ckpt['num_clients']} clients in the checkpoint, {expect['num_clients']} now")
    if ckpt.get("fingerprint") != expect["fingerprint"]:
        problems.append("the model fingerprint (factors or base) differs")
    if sorted(ckpt["global_state"]) != sorted(state_keys):
        problems.append(f"federated state keys differ ({sorted(ckpt['global_state'])} vs {sorted(state_keys)})")
    saved_strategy = ckpt["strategy_class"]
    if saved_strategy != expect["strategy"]:
        problems.append(f"strategy {saved_strategy} in the checkpoint, {expect['strategy']} now")
    if ckpt["round"] > rounds:
        problems.append(f"the checkpoint has {ckpt['round']} rounds done but trainer.rounds is {rounds}")
    if problems:
        raise CheckpointError(f"cannot resume from {path}: " + "; ".join(problems))
    return ckpt


FIX = "resume from an earlier round_NNNN.ckpt of the run (trainer.save_every_n_rounds), or start afresh"

#: What a round checkpoint must hold, and of which type (beyond ``format``).
REQUIRED = {"round": int, "seed": int, "num_clients": int, "global_state": dict, "codec": dict, "ledger": dict,
            "history": list, "strategy": dict, "strategy_class": str, "privacy": dict, "dp_sgd": dict}  # fmt: skip


def check_integrity(path: Path, ckpt: dict[str, Any]) -> None:
    """Refuse a round checkpoint that is damaged or cannot be this package's: a zip member failing its CRC, a
    content digest that does not match, a missing key or one of the wrong type, a non-finite global state."""
    name = f"trainer checkpoint {path}"
    if (problem := zip_problem(path)) is not None:
        raise CheckpointError(f"{name}: {problem}; {FIX}")
    if DIGEST in ckpt and ckpt[DIGEST] != content_digest({k: v for k, v in ckpt.items() if k not in (DIGEST, KEYED)}):
        raise CheckpointError(f"{name} is corrupt: its content differs from the digest written with it (a flipped "
                              f"bit or a damaged copy); {FIX}")  # fmt: skip
    if (problem := _keyed_problem(ckpt)) is not None:
        raise CheckpointError(f"{name}: {problem}")
    if ckpt.get("version") != VERSION:
        raise CheckpointError(f"{name} has layout version {ckpt.get('version')!r}, this lightning_fl reads {VERSION}; "
                              "resume it with the lightning_fl that wrote it, or start afresh")  # fmt: skip
    if DIGEST not in ckpt:
        raise CheckpointError(f"{name} lacks its content digest ({DIGEST!r}); {FIX}")
    for key, kind in REQUIRED.items():
        value = ckpt.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            got = "missing" if key not in ckpt else f"a {type(value).__name__}"
            raise CheckpointError(f"{name}: {key!r} must be a {kind.__name__}, it is {got}; {FIX}")
    state = ckpt["global_state"]
    if not state or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise CheckpointError(f"{name}: 'global_state' holds no named tensors; {FIX}")
    bad = sorted(k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
    if bad:
        raise CheckpointError(f"{name}: the global state has NaN or Inf values in {bad[:4]} (the run diverged before "
                              f"it was saved); {FIX}")  # fmt: skip


def _keyed_problem(ckpt: dict[str, Any]) -> str | None:
    want, have = keyed_digest(str(ckpt.get(DIGEST))), ckpt.get(KEYED)
    if want is None:
        return None if have is None else (f"it carries a keyed digest: set {KEY_ENV} to the key it was written with "
                                          "to read it")  # fmt: skip
    if have is None:
        return f"{KEY_ENV} is set but the checkpoint has no keyed digest (written without the key): {FIX}"
    if not hmac.compare_digest(str(have), want):
        return (f"its keyed digest does not match {KEY_ENV}: it was edited after it was written, or written under "
                f"another key; {FIX}")  # fmt: skip
    return None


def to_cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu() for n, t in state.items()}


def run_folder_of(ckpt: Path) -> Path | None:
    """The run folder a checkpoint belongs to (``<run>/checkpoints/<file>``), or ``None`` if it is elsewhere."""
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None


# ------------------------------------------------------------------------ a FederatedTrainer's round checkpoint
def save_trainer(trainer: Any, completed: int, seed: int, fingerprint: str | None, num_clients: int) -> None:
    """Write ``trainer``'s round checkpoint after round ``completed`` (from rank 0; every process calls it, as the
    codec's per-client state is gathered from all of them)."""
    fabric, codec = trainer.fabric, trainer.codec
    codec_state = codec.gathered_state_dict(_gather(fabric) if fabric.world_size > 1 else None)
    every = trainer.save_every_n_rounds
    if fabric.is_global_zero:
        state = {
            "seed": seed,
            "num_clients": num_clients,
            "fingerprint": fingerprint,
            "global_state": to_cpu(trainer.global_state),
            "strategy_class": trainer.strategy.name,
            "strategy": trainer.strategy.state_dict(),
            "codec": codec_state,
            "privacy": trainer.privacy.state_dict() if trainer.privacy is not None else {},
            "dp_sgd": trainer.dp_sgd.state_dict() if trainer.dp_sgd is not None else {},
            "ledger": trainer.ledger.state_dict(),
            "history": [{k: float(v) for k, v in h.items()} for h in trainer.history],
        }
        state.update(checkpoint_parts.saved(trainer))  # the downlink's memory, FedBuff's clients in flight
        if budget.private(trainer):  # the release is recorded before the checkpoint that could rewind it
            budget.record_release(trainer.log_dir, completed, trainer.history[-1])
        save_round(state, trainer.log_dir / "checkpoints", completed, every)
    codec.client_state_saved(pin=bool(every) and completed % every == 0)
    fabric.barrier()


def restore_trainer(trainer: Any, path: Path, model: Any, seed: int, fingerprint: str | None, num_clients: int) -> int:
    """Load the round checkpoint ``path`` into ``trainer`` and ``model`` (rank 0 reads and checks it, every process
    receives it); the number of rounds it has done."""
    fabric = trainer.fabric
    expect = {"seed": seed, "num_clients": num_clients, "fingerprint": fingerprint, "strategy": trainer.strategy.name}
    ckpt, error = None, None
    if fabric.is_global_zero:
        try:
            ckpt = load_round(path, expect, list(trainer.global_state), trainer.rounds)
            budget.warn_rewind(trainer.log_dir, int(ckpt["round"]), path, budget.private(trainer))
        except CheckpointError as err:
            error = str(err)
    ckpt, error = fabric.broadcast((ckpt, error))
    if error is not None:
        raise CheckpointError(error)
    trainer.global_state = {n: t.to(fabric.device) for n, t in ckpt["global_state"].items()}
    model.load_federated_state(trainer.global_state)
    trainer.strategy.load_state_dict(ckpt["strategy"])
    rank, world = fabric.global_rank, fabric.world_size
    keep = (lambda c: trainer.round_runner.process_of(c, world) == rank) if world > 1 else None
    trainer.codec.load_client_state(ckpt["codec"], source=run_folder_of(path), keep=keep)
    trainer.ledger.load_state_dict(ckpt["ledger"])
    checkpoint_parts.restore(trainer, path, ckpt)
    budgets = (("privacy", trainer.privacy, "a private run", "its budget"),
               ("dp_sgd", trainer.dp_sgd, "a run with trainer.dp_sgd", "its clients' budgets"))  # fmt: skip
    for key, plugin, writer, spent in budgets:
        if plugin is not None:
            plugin.load_state_dict(ckpt[key])
        elif ckpt[key]:
            raise CheckpointError(f"cannot resume from {path}: it was written by {writer} (trainer.{key}); set the "
                                  f"same trainer.{key} to continue {spent}")  # fmt: skip
    if (problem := budget.budget_problem(trainer, ckpt)) is not None:
        raise CheckpointError(f"cannot resume from {path}: {problem}: the checkpoint was edited after it was written "
                              f"(its plain digest recomputed; {KEY_ENV} catches that); {FIX}")  # fmt: skip
    trainer.history = list(ckpt["history"])
    if fabric.is_global_zero:
        remove_stale_temps(path.parent)
    return int(ckpt["round"])


def _gather(fabric: Any):
    def gather(obj: Any) -> list[Any]:
        everyone: list[Any] = [None] * fabric.world_size
        dist.all_gather_object(everyone, obj)
        return everyone

    return gather


def load_for_evaluation(model: Any, path: Path, device: torch.device, fingerprint: str | None = None) -> int | None:
    """A round checkpoint's global state (checked as a resume checks it) or a module's ``state_dict`` (names,
    shapes, finite values), into ``model``; anything else is one line naming the file. ``fingerprint``: the model's
    (its factors and base), which a round checkpoint's must equal (a FLITE latent means another model over other
    factors). Returns the round checkpoint's round (``None`` for a state dict)."""
    name, fix = f"--ckpt_path {path}", "pass a last.ckpt or round_NNNN.ckpt of a run, or a module state_dict"
    ckpt = read_checkpoint(path, "--ckpt_path", fix=fix)
    if isinstance(ckpt, dict) and ckpt.get("format") == FORMAT:
        check_integrity(path, ckpt)
        if (problem := state_mismatch(ckpt["global_state"], model.federated_state())) is not None:
            raise CheckpointError(f"{name}: its global state does not fit this model ({problem}); {fix}")
        saved = ckpt.get("fingerprint")
        if fingerprint is not None and saved is not None and saved != fingerprint:
            raise CheckpointError(
                f"{name}: the run's model fingerprint differs from this config's (its factors or base: model."
                "factor_seed, layers, latent_dim, rank, adapter_seed or the base); give the config the run was "
                "trained with (its run folder's config.yaml)"
            )
        model.load_federated_state({n: t.to(device) for n, t in ckpt["global_state"].items()})
        return int(ckpt["round"])
    state = tensor_state(ckpt, name, keys=("state_dict",), fix=fix)
    if (problem := state_mismatch(state, model.state_dict())) is not None:
        raise CheckpointError(f"{name}: its state_dict does not fit this model ({problem}); {fix}")
    bad = sorted(k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
    if bad:
        raise CheckpointError(f"{name}: NaN or Inf weights in {bad[:4]}; {fix}")
    model.load_state_dict(state)
    return None
