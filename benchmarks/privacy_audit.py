"""What a private run leaks, measured by its privacy audit, against what its accountant says: FLITE's latent and
full weights under central DP over a range of noise multipliers.

Both sides are the digits setting of ``configs/quickstart.yaml`` (FLITE's latent, 192 floats) and
``configs/fedavg_digits.yaml`` (full weights, 51,808 floats): 8 clients, half of them per round (``client_fraction
0.5``), 30 rounds, central DP with clip bound ``--clip``, noise multiplier ``z`` in ``--z`` (0: no noise), seeded
noise and canaries; ``trainer.privacy_audit`` with ``--canaries`` canary clients. Each run's ``privacy_audit.json``
(epsilon-hat from every round and from the final model, the interval, the one-run lower bound and the largest bound
its guesses could give) and its accuracy are collected into one JSON file and printed as a table.

    python benchmarks/privacy_audit.py --json docs/results/privacy_audit.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import command_line

from lightning_fl.privacy.audit import one_run_ceiling

REPO = Path(__file__).resolve().parents[1]
SIDES = {"latent": "configs/quickstart.yaml", "full": "configs/fedavg_digits.yaml"}


def run(side: str, z: float, args: argparse.Namespace, root: Path) -> dict:
    name = f"{side}_z{z:g}"
    command = [
        sys.executable,
        "-m",
        "lightning_fl",
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
        str(args.canaries),
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
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout
    (folder,) = (root / name).glob("version_*")
    report = json.loads((folder / "privacy_audit.json").read_text())
    accuracy = next(line for line in out.splitlines() if line.strip().startswith("val/acc:")).strip()
    return {"side": side, "z": z, "val_acc": accuracy, **report}


def ceiling(row: dict) -> float:
    """The largest one-run lower bound the row's guesses could give (all right): a report's ``one_run_ceiling``, or
    from its canaries, guesses, delta and confidence (reports written before it was stored)."""
    if "one_run_ceiling" in row:
        return row["one_run_ceiling"]
    return one_run_ceiling(row["canaries"], row["one_run_guesses"], row["delta"], row["confidence"])


def table(rows: list[dict]) -> str:
    head = "| side | z | accountant epsilon | epsilon-hat, every round (95% interval) | epsilon-hat, final model | "
    head += "one-run lower bound | largest it can show | val/acc |"
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lo, hi = r["interval_every_round"]
        cells = [r["side"], f"{r['z']:g}", f"{r['accountant_epsilon']:.4g}"]
        cells += [f"{r['epsilon_hat_every_round']:.3g} ({lo:.3g}-{hi:.3g})"]
        cells += [f"{r.get('epsilon_hat_final_model', float('nan')):.3g}", f"{r['one_run_lower_bound']:.3g}"]
        cells += [f"{ceiling(r):.3g}", r["val_acc"].removeprefix("val/acc: ")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--z", type=float, nargs="+", default=[0.0, 1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--canaries", type=int, default=200)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for side in args.sides:
            for z in args.z:
                rows.append(run(side, z, args, Path(tmp)))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    if args.json is not None:
        command = command_line("privacy_audit.py", sys.argv[1:])
        args.json.write_text(json.dumps({"command": command, "rows": rows}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
