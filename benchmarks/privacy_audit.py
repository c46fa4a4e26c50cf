"""What a private run leaks, measured by its privacy audit, against what its accountant says: FLITE's latent and
full weights under central DP over a range of noise multipliers, with positive controls the audit must catch.

Both sides are the digits setting of ``configs/quickstart.yaml`` (FLITE's latent, 192 floats) and
``configs/fedavg_digits.yaml`` (full weights, 51,808 floats): 8 clients, half of them per round (``client_fraction
0.5``), 30 rounds, central DP with clip bound ``--clip``, noise multiplier ``z`` in ``--z`` (0: no noise), seeded
noise and canaries; ``trainer.privacy_audit`` with ``--canaries`` canary clients per side. Each row is its own
population (its own privacy ledger), so one row's releases never charge the next row's accountant.

A row can contradict its accountant by proof only where the one-run bound's ceiling (what all its guesses right
would show: 2.55 for 200 canaries, 4.17 for 1,000) exceeds the accountant's epsilon, so the default rows go up to z
= 32 (epsilon 1.46 here) and the sides use as many canaries as they can see: 1,000 in the full weights' 51,808
dimensions, 200 in the latent's 192 (at 1,000, about 250 canaries a round crowd the latent's 192 dimensions and
hide each other). ``--noise-cut K`` adds, per side, a positive control at the largest z: central DP releasing
``1 / K`` of the noise it accounts (``benchmarks/_noise_cut.py``), which an audit whose rows can fail must catch.

Each run's ``privacy_audit.json`` (epsilon-hat from every round and from the final model, the interval, the one-run
lower bound and the largest bound its guesses could give) and its accuracy are collected into one JSON file and
printed as a table with which check could fail in each row and what the audit said.

    python benchmarks/privacy_audit.py --noise-cut 100 --json docs/results/privacy_audit.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import command_line

from lightning_fl.privacy.audit import one_run_ceiling

REPO = Path(__file__).resolve().parents[1]
SIDES = {"latent": "configs/quickstart.yaml", "full": "configs/fedavg_digits.yaml"}


def run(side: str, z: float, args: argparse.Namespace, root: Path, cut: float = 1.0) -> dict:
    """One audited run; ``cut`` > 1: the positive control, releasing ``1 / cut`` of the noise it accounts."""
    name = f"{side}_z{z:g}" + (f"_cut{cut:g}" if cut != 1 else "")
    launcher = ["-m", "lightning_fl"] if cut == 1 else [str(REPO / "benchmarks" / "_noise_cut.py"), f"{cut:g}"]
    command = [
        sys.executable,
        *launcher,
        "fit",
        "--config",
        SIDES[side],
        "--trainer.client_fraction",
        "0.5",
        "--trainer.max_update_norm_ratio",
        "null",
        "--trainer.privacy",
        "CentralDP",
        "--trainer.privacy.clip_norm",
        str(args.clip),
        "--trainer.privacy.noise_multiplier",
        str(z),
        "--trainer.privacy.noise_seed",
        "0",
        "--trainer.privacy_audit",
        "PrivacyAudit",
        "--trainer.privacy_audit.canaries",
        str(args.canaries[side]),
        "--trainer.privacy_audit.max_memory_mb",
        "4096",
        "--trainer.privacy_audit.seed",
        "1",
        "--trainer.default_root_dir",
        str(root),
        "--trainer.name",
        name,
        "--trainer.logger",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.rounds",
        str(args.rounds),
    ]
    # each row is its own population: the ledger of one row must not charge the next row's accountant
    env = {**os.environ, "LIGHTNING_FL_PRIVACY_LEDGER": str(root / name / "ledger")}
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True, env=env).stdout
    (folder,) = (root / name).glob("version_*")
    report = json.loads((folder / "privacy_audit.json").read_text())
    accuracy = next(line for line in out.splitlines() if line.strip().startswith("val/acc:")).strip()
    return {"side": side, "z": z, "noise_cut": cut, "val_acc": accuracy, **report}


def ceiling(row: dict) -> float:
    """The largest one-run lower bound the row's guesses could give (all right): a report's ``one_run_ceiling``, or
    from its canaries, guesses, delta and confidence (reports written before it was stored)."""
    if "one_run_ceiling" in row:
        return row["one_run_ceiling"]
    return one_run_ceiling(row["canaries"], row["one_run_guesses"], row["delta"], row["confidence"])


def could_fail(row: dict) -> str:
    """Which of the audit's two checks could have contradicted the row's accountant: the proof (the one-run bound's
    ceiling above the accountant's epsilon), the estimate (the estimator's cap, 100, above it), both or neither."""
    proof = row.get("one_run_can_fail", ceiling(row) > row["accountant_epsilon"])
    estimate = row["accountant_epsilon"] < 100
    return {(True, True): "proof and estimate", (False, True): "estimate only", (False, False): "no"}[proof, estimate]


def verdict(row: dict) -> str:
    """What the audit said of the row (the report's ``violation``): the proof contradicts the accountant, the
    estimate does, or neither."""
    if row.get("violation") is None:
        return "consistent"
    return "contradicted (proof)" if row["violation"].startswith("the one-run") else "contradicted (estimate)"


def table(rows: list[dict]) -> str:
    head = "| side | z | noise released | canaries | accountant epsilon | epsilon-hat, every round (95% interval) | "
    head += "epsilon-hat, final model | one-run lower bound | largest it can show | could fail | verdict | val/acc |"
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    for r in rows:
        lo, hi = r["interval_every_round"]
        cut = r.get("noise_cut", 1.0)
        cells = [r["side"], f"{r['z']:g}", "all" if cut == 1 else f"1/{cut:g}", str(r["canaries"])]
        cells += [f"{r['accountant_epsilon']:.4g}", f"{r['epsilon_hat_every_round']:.3g} ({lo:.3g}-{hi:.3g})"]
        cells += [f"{r.get('epsilon_hat_final_model', float('nan')):.3g}", f"{r['one_run_lower_bound']:.3g}"]
        cells += [f"{ceiling(r):.3g}", could_fail(r), verdict(r), r["val_acc"].removeprefix("val/acc: ")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def canaries_of(values: list[str]) -> dict[str, int]:
    """``--canaries``: one ``N`` for every side, or ``SIDE=N`` pairs (a side not named keeps its default)."""
    if len(values) == 1 and "=" not in values[0]:
        return dict.fromkeys(SIDES, int(values[0]))
    out = {"full": 1000, "latent": 200}
    for value in values:
        side, _, n = value.partition("=")
        if side not in SIDES or not n.isdigit():
            raise SystemExit(f"--canaries takes N or SIDE=N with SIDE in {sorted(SIDES)}, got {value!r}")
        out[side] = int(n)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--z", type=float, nargs="+", default=[0.0, 2.0, 8.0, 16.0, 24.0, 32.0])
    parser.add_argument(
        "--canaries",
        nargs="+",
        default=["full=1000", "latent=200"],
        help="canary clients per side (SIDE=N), or one N for every side",
    )
    parser.add_argument(
        "--noise-cut",
        type=float,
        nargs="*",
        default=[],
        help="positive controls: for each K, a row at the largest z that releases 1/K of the noise it accounts",
    )
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.canaries = canaries_of(args.canaries)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for side in args.sides:
            for z in args.z:
                rows.append(run(side, z, args, Path(tmp)))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
            for cut in args.noise_cut:
                rows.append(run(side, max(args.z), args, Path(tmp), cut))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    if args.json is not None:
        command = command_line("privacy_audit.py", sys.argv[1:])
        args.json.write_text(json.dumps({"command": command, "rows": rows}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
