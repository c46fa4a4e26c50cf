"""The work a round's clients spent, and how much of it was thrown away (``trainer.clock``): compute seconds on the
clients' devices, their energy under a stated power model, and the bytes of clients whose update the server did not
aggregate (late, offline, unavailable, refused by the gate, or in a round the strategy skipped).

Logged per round (``work/*``) and added up in the run's summary. A device's energy is ``power_w`` times its compute
seconds (:class:`~lightning_fl.federated.arrivals.clock.Clock`): a model, the same figure for every device, with the
radio's energy left out.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_fl.federated.server.uploads import LOST, Round

#: The keys that depend on which uploads the gate refused: withheld from a private run's exports like
#: ``fed/dropped_clients`` (:attr:`~lightning_fl.federated.server.uploads.Round.unprotected`).
WASTED = ("work/wasted_compute_s", "work/wasted_energy_j", "work/wasted_bytes")


def aggregated(rnd: Round) -> set[int]:
    """The clients whose update moved the global state this round (none if the strategy skipped the round)."""
    return set() if rnd.metrics.get("fed/round_skipped") else set(rnd.folded)


def wasted_bytes(rnd: Round, kept: set[int], extra: Iterable[int] = ()) -> int:
    """The bytes of the round's clients outside ``kept``: the downloads of the unavailable, late and ``extra`` ones
    (FedBuff's lost clients), and each reply's download and upload (as the byte ledger counts them)."""
    total = sum(rnd.download_bytes(c) for c in [*rnd.away, *rnd.late, *extra])
    for e in rnd.in_order:
        if e.client in kept:
            continue
        total += rnd.download_bytes(e.client) if e.downloaded else 0
        total += e.up if e.status != LOST else 0
    return total


def record_work(rnd: Round, spent_s: list[tuple[int, float]], kept: set[int], power_w: float, nbytes: int) -> None:
    """Add the round's ``work/*`` metrics: ``spent_s`` the compute seconds of each client's training (a client may
    train twice: lost, then back), those outside ``kept`` thrown away, ``nbytes`` bytes thrown away."""
    total = sum(s for _, s in spent_s)
    wasted = sum(s for c, s in spent_s if c not in kept)
    rnd.metrics.update(
        {
            "work/compute_s": total,
            "work/wasted_compute_s": wasted,
            "work/energy_j": power_w * total,
            "work/wasted_energy_j": power_w * wasted,
            "work/wasted_bytes": float(nbytes),
        }
    )
    rnd.unprotected.update(WASTED)


def work_summary(history: list[dict[str, float]], power_w: float) -> list[str]:
    """The summary's line: the work thrown away over the rounds (none without ``work/*`` metrics)."""
    rounds = [h for h in history if "work/compute_s" in h]
    if not rounds or not all(k in rounds[-1] for k in WASTED):
        return []
    total, wasted = (sum(h[k] for h in rounds) for k in ("work/compute_s", "work/wasted_compute_s"))
    share = f"{100 * wasted / total:.1f}%" if total > 0 else "-"
    joules = sum(h["work/energy_j"] for h in rounds)
    lost_j = sum(h["work/wasted_energy_j"] for h in rounds)
    lost_bytes = sum(h["work/wasted_bytes"] for h in rounds)
    return [
        f"work thrown away (late, offline, unavailable or refused clients): {wasted:,.1f} of {total:,.1f} device "
        f"seconds of training ({share}), {lost_j:,.1f} of {joules:,.1f} J at {power_w:g} W a device (a model), "
        f"{lost_bytes:,.0f} bytes"
    ]
