"""A budget that cannot be un-spent: what a private run has released, and the checks a resume passes.

Privacy spent is never un-spent. Every completed round of a private run (``trainer.privacy`` or
``trainer.dp_sgd``) releases a noised global state, and the accountant's epsilon counts it. Two ways to lose
count, both closed here:

- **Resuming behind a release.** Each completed round appends one line to ``<run>/releases.csv`` (round,
  epsilon, delta, time) before its checkpoint is written; the file is only ever appended to. A resume into the
  run's folder from a checkpoint behind the last recorded round (``--ckpt_path .../round_0002.ckpt`` of a run that
  reached round 6) is refused: it would draw rounds 3-6 again with fresh noise, releasing them twice, while the
  budget restarted from round 2. A run without privacy may resume from an earlier checkpoint; it is warned that
  the later checkpoints will be replaced.
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
import warnings
from pathlib import Path
from typing import Any

from lightning_fl.privacy.base import Privacy
from lightning_fl.privacy.dpsgd import DPSGD

RELEASES = "releases.csv"
HEADER = "round,epsilon,delta,record_epsilon_max,unix_time\n"


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


def check_release(folder: Path, completed: int, path: Path, is_private: bool) -> str | None:
    """Why resuming ``folder`` from ``path`` (``completed`` rounds) must not happen (``None``: it may); warns when a
    run without privacy will replace later checkpoints."""
    released = last_release(folder)
    if is_private and released > completed:
        return (f"{path.name} holds round {completed} but this run released rounds up to {released} ({RELEASES} in "
                f"{folder}): resuming would draw rounds {completed + 1}-{released} again with fresh noise and release "
                "them twice, while the budget restarts from the older checkpoint; resume from the run's last.ckpt, "
                "or start a new run")  # fmt: skip
    later = sorted(p.name for p in (folder / "checkpoints").glob("round_*.ckpt") if _round_of(p) > completed)
    if later:
        names = ", ".join(later)
        warnings.warn(f"resuming round {completed + 1} from {path.name}: the run's later checkpoints ({names}) and "
                      "its last.ckpt will be replaced as the rounds are run again", stacklevel=3)  # fmt: skip
    return None


def _round_of(path: Path) -> int:
    digits = path.stem.removeprefix("round_")
    return int(digits) if digits.isdigit() else -1


def budget_problem(privacy: Privacy | None, dp_sgd: DPSGD | None, ckpt: dict[str, Any]) -> str | None:
    """Why the budgets just restored from ``ckpt`` (user-level ``privacy``, DP-SGD's ``dp_sgd``) are not the ones the
    run logged (``None``: they are)."""
    completed = int(ckpt["round"])
    logged = next((h for h in reversed(ckpt["history"]) if int(h.get("round", -1)) == completed), {})
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
