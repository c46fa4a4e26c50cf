"""The population's ledger: every release drawn from a private population, by every run, and what they spent together.

A privacy budget belongs to the people whose data a run trains on (the **population**: a data set and its partition
into clients), not to a run folder. A checkpoint can be copied, renamed or resumed from an earlier round; each time
the rounds after it are drawn again with fresh noise and released again. So every released round of every private
run is appended to one ledger per population, outside any run folder, and the budget (``max_epsilon``'s stop, the
epsilon the summary prints) is what all of its lines spend together: a resume of any copy of any checkpoint is then
accounted, never refused and never forgotten.

- **Where.** One JSON-lines file per population, ``<folder>/<key>.jsonl`` (and ``<key>.json``: what identifies the
  population, for a reader). ``<folder>``: ``trainer.privacy_ledger``, else the environment variable
  ``LIGHTNING_FL_PRIVACY_LEDGER``, else ``<user cache>/lightning_fl/privacy_ledger`` (``$XDG_CACHE_HOME`` or
  ``~/.cache``). ``<key>``: a SHA-256 of the data module's identity (:func:`population_key`) and of the optional
  ``trainer.population`` label, which starts a new population deliberately (new data under the same settings).
- **What.** One line per released round: the run folder and its draw (one ``fit`` call), the round, the run's own
  epsilon, and what the round spent: user-level DP's event (``CentralDP``: the sampled Gaussian with its cohort;
  ``DistributedDP`` and ``LocalDP``: the Gaussian's precision ``mu^-2`` for each client whose upload or share was
  released) and DP-SGD's plan of each client that trained. Lines are only appended, each in one ``write`` and synced
  to the disk before the round's checkpoint is written.
- **How it adds up.** The mechanisms' own accounting, fed every line: central DP composes every line's
  dp-accounting event (:class:`~lightning_fl.privacy.accountant.Accountant`); distributed and local DP add each
  client's precisions (exact for Gaussians) and report the worst client's epsilon by Balle and Wang's curve; DP-SGD
  composes each client's subsampled Gaussians in dp-accounting's PLD accountant (distributed and local DP lines
  add up together). Central DP's lines and the per-client ones, or central DP's under another neighbouring
  relation, do not add up to one figure here: such a run is refused in one line.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from lightning_fl.errors import ConfigError
from lightning_fl.privacy.accountant import Accountant, RoundEvent
from lightning_fl.privacy.base import Privacy
from lightning_fl.privacy.central import CentralDP
from lightning_fl.privacy.distributed import DistributedDP
from lightning_fl.privacy.dpsgd import DPSGD, epsilon
from lightning_fl.privacy.dpsgd import _accountant as dpsgd_accountant
from lightning_fl.privacy.dpsgd import _event as dpsgd_event
from lightning_fl.privacy.local import LocalDP

ENV = "LIGHTNING_FL_PRIVACY_LEDGER"
FORMAT = 1
NEW_POPULATION = "set trainer.population to a new label to start a new population deliberately"


def default_folder() -> Path:
    """Where ledgers live unless ``trainer.privacy_ledger`` says: ``$LIGHTNING_FL_PRIVACY_LEDGER``, else
    ``<user cache>/lightning_fl/privacy_ledger``."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(cache) / "lightning_fl" / "privacy_ledger"


def population_key(identity: dict[str, Any], label: str | None) -> str:
    """The population's key: the first 24 hex digits of the SHA-256 of its identity and label."""
    text = json.dumps({"identity": identity, "label": label}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class Ledger:
    """The append-only record of one population's releases (module docstring)."""

    def __init__(self, folder: Path, identity: dict[str, Any], label: str | None, key_name: str) -> None:
        self.key = population_key(identity, label)
        self.path = folder / f"{self.key}.jsonl"
        self.key_name = key_name  # the setting that names the folder, for messages
        try:
            folder.mkdir(parents=True, exist_ok=True)
            about = folder / f"{self.key}.json"
            if not about.is_file():
                about.write_text(json.dumps({"identity": identity, "label": label}, indent=1, default=repr) + "\n")
            self.path.touch()
        except OSError as err:
            raise ConfigError(
                f"{key_name}: cannot write the population's privacy ledger in {folder} ({err.strerror}); set "
                f"trainer.privacy_ledger (or {ENV}) to a folder this process can write"
            ) from None

    def releases(self) -> list[dict[str, Any]]:
        """Every line so far (a last line cut short by a kill mid-write, never synced, is skipped)."""
        lines, out = self.path.read_text().splitlines(), []
        for number, line in enumerate(lines, start=1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict) and record.get("format") == FORMAT:
                out.append(record)
            elif number < len(lines) and line.strip():
                raise ConfigError(
                    f"the privacy ledger {self.path} has an unreadable line {number}: it was edited; restore it from "
                    "a backup (deleting or editing it forgets what was spent)"
                )
        return out

    def append(self, record: dict[str, Any]) -> None:
        """Add one release: one ``write`` to a file opened for appending, synced to the disk."""
        line = (json.dumps({"format": FORMAT, "time": round(time.time(), 3), **record}, sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------------- one round's release
def user_release(privacy: Privacy, participants: list[int]) -> dict[str, Any] | None:
    """What a round of user-level DP that ``privacy`` just accounted released (``None``: nothing)."""
    name = type(privacy).__name__
    if isinstance(privacy, (DistributedDP, LocalDP)):  # a Gaussian on each client whose upload or share was released
        if not participants:
            return None
        mu = privacy.sum_multiplier(len(participants)) / 2 if isinstance(privacy, DistributedDP) else privacy.z / 2
        return {"mechanism": name, "precision": mu**-2 if mu > 0 else math.inf, "clients": sorted(participants)}
    if isinstance(privacy, CentralDP):  # one sampled Gaussian on the population
        event, plan = privacy.event(), privacy.plan
        return {
            "mechanism": name,
            "event": [event.noise_multiplier, event.count_std],
            "num_clients": plan.num_clients,
            "expected_clients": float(plan.expected_clients),
            "sampling": plan.sampling,
        }
    return None


def record_release(dp_sgd: DPSGD, trained: list[int]) -> dict[str, Any] | None:
    """What a round of DP-SGD released: each client that trained, with its plan ``[client, q, steps, z]``."""
    if not trained:
        return None
    return {"plans": [[c, dp_sgd.plans[c].q, dp_sgd.plans[c].steps, dp_sgd.plans[c].z] for c in sorted(trained)]}


# ---------------------------------------------------------------------------------------------- what all lines spend
def user_view(privacy: Privacy, releases: list[dict[str, Any]], ledger: Path) -> Privacy:
    """A copy of ``privacy`` whose accounting holds every user-level release of ``releases``: its ``epsilon()`` is
    the population's, its ``stop_reason()`` the population's next round."""
    lines = [r["user"] for r in releases if r.get("user")]
    name, per_client = type(privacy).__name__, isinstance(privacy, (DistributedDP, LocalDP))
    if others := sorted({u["mechanism"] for u in lines if ("precision" in u) != per_client}):
        raise ConfigError(
            f"the privacy ledger {ledger} holds rounds released under trainer.privacy {', '.join(others)}, this run "
            f"uses {name}: their budgets do not add up to one epsilon here; use the same mechanism, or {NEW_POPULATION}"
        )
    view = copy.copy(privacy)
    if per_client:  # each line a Gaussian on every client it names (replace-one): distributed and local DP add up
        precision: dict[int, float] = {}
        for u in lines:
            for c in u["clients"]:
                precision[c] = precision.get(c, 0.0) + float(u["precision"])
        if isinstance(privacy, DistributedDP):
            view.precision = precision
        else:  # LocalDP counts uploads of its own z: a total precision is that many uploads, exactly
            view.uploads = {c: p * (privacy.z / 2) ** 2 for c, p in precision.items()}
        return view
    plan = privacy.plan
    view.accountant = Accountant(plan.num_clients, plan.expected_clients, plan.sampling, privacy.accountant_method)
    for u in lines:
        if (u["num_clients"], u["sampling"]) != (plan.num_clients, plan.sampling):
            raise ConfigError(
                f"the privacy ledger {ledger} holds rounds released with {u['num_clients']} clients and "
                f"trainer.sampling {u['sampling']}, this run has {plan.num_clients} and {plan.sampling}: they do not "
                f"compose under one neighbouring relation; use the same settings, or {NEW_POPULATION}"
            )
        view.accountant.compose(RoundEvent(float(u["event"][0]), float(u["event"][1]), float(u["expected_clients"])))
    view.scope = f"the population's round {view.accountant.num_rounds + 1} (counting every run that drew on it)"
    return view


def record_epsilon_max(dp_sgd: DPSGD, releases: list[dict[str, Any]]) -> float:
    """The worst client's record-level epsilon over every DP-SGD release of ``releases`` (at this run's delta)."""
    rounds: dict[int, Counter] = {}
    for r in releases:
        for c, q, steps, z in (r.get("record") or {}).get("plans", []):
            rounds.setdefault(int(c), Counter())[(float(q), int(steps), float(z))] += 1
    return max((_composed(plans, dp_sgd.delta) for plans in rounds.values()), default=0.0)


def _composed(plans: Counter, delta: float) -> float:
    """Epsilon of a client's rounds: ``plans`` counts each ``(q, steps, z)`` it trained under."""
    if len(plans) == 1:
        [((q, steps, z), k)] = plans.items()
        return epsilon(q, steps * k, z, delta)
    if any(z <= 0 for _, _, z in plans):
        return math.inf
    accountant = dpsgd_accountant()
    for (q, steps, z), k in plans.items():
        accountant.compose(dpsgd_event(q, z, steps * k))
    return float(accountant.get_epsilon(delta))
