"""A budget that cannot be un-spent: what a private run has released, and the checks a resume passes.

Privacy spent is never un-spent. Every completed round of a private run (``trainer.privacy`` or
``trainer.dp_sgd``) releases a noised global state, and the accountant's epsilon counts it. Three ways to lose
count, all closed here:

- **Drawing the same rounds again.** A budget belongs to the private population (the data set and its partition),
  not to a run folder: each released round is appended to the population's ledger
  (:mod:`lightning_fl.privacy.population`, outside the run folder) before its checkpoint is written, and the budget
  (``max_epsilon``'s stop, ``privacy/population_epsilon``, the summary) is what every line of it spends together.
  A resume from any copy of any checkpoint (an earlier ``round_NNNN.ckpt``, a copy in another folder or under
  another run name, one copied over ``last.ckpt``) draws the rounds after it again with fresh noise: that is
  accounted, not refused (issue 72, item 2). A run killed between the ledger's line and its checkpoint resumes from
  its last checkpoint, the lost round counted as spent (item 3). The run folder's ``releases.csv`` (round, epsilon,
  delta, time) stays as the run's own record.
- **An accountant that disagrees with its checkpoint.** After a resume, the budget must be the one the run
  logged: central DP's accountant holds one round per completed round, every mechanism's epsilon equals the
  ``privacy/epsilon`` logged at that round, its delta the one logged, and no client has taken part in more
  rounds than were run. A checkpoint edited with its plain digest recomputed fails these checks unless the
  history was edited to match: against a deliberate edit only the keyed digest protects
  (:mod:`lightning_fl.federated.checkpoint`, ``LIGHTNING_FL_CHECKPOINT_KEY``).
"""

from __future__ import annotations

import math
import os
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from lightning_fl.privacy import population

RELEASES = "releases.csv"
HEADER = "round,epsilon,delta,record_epsilon_max,unix_time\n"


def private(trainer: Any) -> bool:
    return trainer.privacy is not None or trainer.dp_sgd is not None


def last_release(folder: Path) -> int:
    """The last round ``folder``'s release record names (0: none)."""
    path = folder / RELEASES
    if not path.is_file():
        return 0
    rounds = [line.split(",", 1)[0] for line in path.read_text().splitlines()[1:]]
    return max((int(r) for r in rounds if r.strip().isdigit()), default=0)


def record_release(folder: Path, completed: int, metrics: dict[str, float]) -> None:
    """Append round ``completed`` to ``folder``'s release record (written through to the disk)."""
    path = folder / RELEASES
    fresh = not path.is_file()
    values = [metrics.get(k, math.nan) for k in ("privacy/epsilon", "privacy/delta", "privacy/record_epsilon_max")]
    with path.open("a") as f:
        f.write((HEADER if fresh else "") + f"{completed},{','.join(f'{v:.17g}' for v in values)},{time.time():.3f}\n")
        f.flush()
        os.fsync(f.fileno())


def warn_rewind(folder: Path, completed: int, path: Path, is_private: bool) -> None:
    """Say what resuming ``folder`` from ``path`` (``completed`` rounds) draws again or replaces."""
    released = last_release(folder) if is_private else 0
    if released > completed:
        warnings.warn(
            f"resuming round {completed + 1} from {path.name}: this run released rounds up to {released} already "
            f"({RELEASES}); they are drawn again with fresh noise and charged to the population's privacy ledger again",
            stacklevel=3,
        )
    later = sorted(p.name for p in (folder / "checkpoints").glob("round_*.ckpt") if _round_of(p) > completed)
    if later:
        names = ", ".join(later)
        warnings.warn(f"resuming round {completed + 1} from {path.name}: the run's later checkpoints ({names}) and "
                      "its last.ckpt will be replaced as the rounds are run again", stacklevel=3)  # fmt: skip


def _round_of(path: Path) -> int:
    digits = path.stem.removeprefix("round_")
    return int(digits) if digits.isdigit() else -1


def budget_problem(trainer: Any, ckpt: dict[str, Any]) -> str | None:
    """Why the budget just restored from ``ckpt`` is not the one the run logged (``None``: it is)."""
    completed = int(ckpt["round"])
    logged = next((h for h in reversed(ckpt["history"]) if int(h.get("round", -1)) == completed), {})
    privacy, dp_sgd = trainer.privacy, trainer.dp_sgd
    if privacy is not None and completed > 0:
        if (counted := privacy.rounds_accounted()) is not None and counted != completed:
            return f"its privacy accountant holds {counted} rounds, the checkpoint {completed}"
        most = max(getattr(privacy, "uploads", {}).values(), default=0)
        if most > completed:
            return f"a client uploaded {most} times in {completed} rounds"
        now, then = privacy.epsilon(), logged.get("privacy/epsilon")
        if then is None or not (now == then or math.isclose(now, then, rel_tol=1e-9)):
            return f"its budget gives epsilon {now:.6g} after round {completed}, the run logged {then}"
        if logged.get("privacy/delta") != privacy.delta:
            return f"its delta is {privacy.delta:g}, the run logged {logged.get('privacy/delta')}"
    if dp_sgd is not None and max(dp_sgd.participations.values(), default=0) > completed:
        return f"a client took part in {max(dp_sgd.participations.values())} rounds of {completed} (DP-SGD)"
    return None


# ---------------------------------------------------------------------------------------- the population's ledger
#: What a data module's ``describe()`` holds that decides batches, not who holds which record (left out of the key).
NOT_THE_DATA = ("batch_size", "eval_batch_size", "augment", "train_split", "num_workers", "max_eval_samples")


def identity(datamodule: Any) -> dict[str, Any]:
    """What identifies the private population a data module serves: its ``population()`` if it has one, else its
    class, number of clients, partition and ``describe()`` without the keys that only decide batches. A data module
    with neither names its class and clients only (two such populations then share one budget: over-counted, never
    under)."""
    own = getattr(datamodule, "population", None)
    if callable(own):
        return {"population": own()}
    described = datamodule.describe() if callable(getattr(datamodule, "describe", None)) else {}
    plain = (int, float, str, bool, type(None))
    data = {k: v if isinstance(v, plain) else repr(v) for k, v in described.items() if k not in NOT_THE_DATA}
    clients, partition = getattr(datamodule, "num_clients", None), repr(getattr(datamodule, "partition", None))
    return {"class": type(datamodule).__qualname__, "num_clients": clients, "partition": partition, **data}


def ledger_problems(a: dict[str, Any]) -> list[str]:
    """What is wrong with ``trainer.privacy_ledger`` and ``trainer.population`` (``a``: the trainer's arguments)."""
    problems = []
    for key, what in (("privacy_ledger", "a folder"), ("population", "a label")):
        value = a[key]
        if value is not None and (not isinstance(value, str) or not value.strip() or "\n" in value):
            problems.append(f"trainer.{key} must be {what} (a non-empty string on one line) or null, got {value!r}")
        elif value is not None and a["privacy"] is None and a["dp_sgd"] is None:
            problems.append(
                f"trainer.{key} names the ledger of a private run, and this run has no trainer.privacy "
                "or trainer.dp_sgd: remove the key"
            )
    return problems


def open_ledger(trainer: Any, datamodule: Any) -> None:
    """Open the ledger of the population ``trainer`` draws on (a private run only), for this draw (one ``fit``)."""
    trainer.population_ledger, trainer.draw = None, uuid.uuid4().hex[:12]
    if not private(trainer) or not trainer.fabric.is_global_zero:
        return
    named = trainer.privacy_ledger is not None
    folder = Path(trainer.privacy_ledger).expanduser() if named else population.default_folder()
    key = "trainer.privacy_ledger" if named else (population.ENV if population.ENV in os.environ else "user cache")
    ledger = trainer.population_ledger = population.Ledger(folder, identity(datamodule), trainer.population, key)
    if trainer.privacy is not None:  # refuses a ledger whose releases this mechanism cannot add to, before round 1
        population.user_view(trainer.privacy, ledger.releases(), ledger.path)


def charge(trainer: Any, completed: int, metrics: dict[str, float]) -> dict[str, float]:
    """Append round ``completed``'s release to the population's ledger (before its checkpoint is written); the
    population's totals over every run that drew on it, as metrics (the same on every process)."""
    privacy, dp_sgd, ledger, out = trainer.privacy, trainer.dp_sgd, trainer.population_ledger, {}
    user, record = getattr(privacy, "released", None), getattr(dp_sgd, "released", None)
    for plugin in (privacy, dp_sgd):
        if plugin is not None:
            plugin.released = None  # (consumed: a round that releases nothing leaves it unset)
    if ledger is not None:
        if user is not None or record is not None:
            spent = {"user": user, "record": record, "epsilon": metrics.get("privacy/epsilon")}
            ledger.append({"run": str(trainer.log_dir), "draw": trainer.draw, "round": completed, **spent})
        releases = ledger.releases()
        if privacy is not None:
            view = population.user_view(privacy, releases, ledger.path)
            out["privacy/population_epsilon"] = view.epsilon()
            out["privacy/population_rounds"] = float(sum(1 for r in releases if r.get("user")))
        if dp_sgd is not None:
            out["privacy/record_population_epsilon_max"] = population.record_epsilon_max(dp_sgd, releases)
    if trainer.fabric.world_size > 1:
        out = trainer.fabric.broadcast(out)
    return out


def stop_reason(trainer: Any) -> str | None:
    """Why the next round must not run: the privacy budget, read from the population's ledger (every run that drew
    on it), not from this run's accountant alone. ``None``: it may run."""
    privacy, ledger = trainer.privacy, trainer.population_ledger
    if privacy is None:
        return None
    if ledger is not None and getattr(privacy, "max_epsilon", None) is not None:
        reason = population.user_view(privacy, ledger.releases(), ledger.path).stop_reason()
        reason = f"{reason} (the population's privacy ledger: {ledger.path})" if reason is not None else None
    else:
        reason = privacy.stop_reason()
    if trainer.fabric.world_size > 1:
        reason = trainer.fabric.broadcast(reason)
    return reason
