"""Plan a private run before starting it: the noise a budget needs, or the budget a noise spends.

    python -m lightning_fl.privacy --clients 2000 --per-round 100 --rounds 100 --epsilon 1 2 4 8
    python -m lightning_fl.privacy --clients 2000 --per-round 100 --rounds 100 --noise-multiplier 1.0
    python -m lightning_fl.privacy --clients 2000 --per-round 100 --rounds 100 --epsilon 4 --sampling poisson \
      --accountant pld
    python -m lightning_fl.privacy dp-sgd --records 6750 --batch 64 --steps 25 --rounds 10 --epsilon 1 4 8

It prints, for each setting, the noise multiplier ``z`` (noise std over the clip bound, on the clipped sum),
epsilon at delta, and the standard deviation of the noise on each coordinate of the mean update for a clip
bound ``--clip``: what ``trainer.privacy CentralDP`` would use (see docs/privacy.md). ``dp-sgd`` plans one
client's record-level DP-SGD (``trainer.dp_sgd``) instead.

Each setting can take a minute on a small machine (the accountants compose hundreds of sampled Gaussians, and a
target epsilon is met by a search over ``z``): the planner says on stderr which setting it computes, how many are
left, and every :data:`TICK` seconds that it is still at it; the table alone goes to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Iterator

from lightning_fl.errors import ConfigError, UserError
from lightning_fl.privacy.accountant import Accountant, RoundEvent
from lightning_fl.privacy.dpsgd import epsilon, noise_multiplier

#: Seconds between two "still computing" lines of one setting.
TICK = 30.0


@contextlib.contextmanager
def progress(what: str, index: int, total: int) -> Iterator[None]:
    """Say on stderr that setting ``index`` of ``total`` (``what``) is being computed, then every :data:`TICK`
    seconds that it still is, until the block ends."""
    started, done = time.perf_counter(), threading.Event()
    print(f"{index}/{total}: {what} ...", file=sys.stderr, flush=True)

    def tick() -> None:
        while not done.wait(TICK):
            elapsed = time.perf_counter() - started
            print(f"{index}/{total}: still {what}, {elapsed:.0f} s so far", file=sys.stderr, flush=True)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["dp-sgd"]:
        return plan_dp_sgd(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m lightning_fl.privacy", description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, required=True, help="the population N (data.num_clients)")
    parser.add_argument("--per-round", type=float, required=True, help="m (trainer.clients_per_round)")
    parser.add_argument("--rounds", type=int, required=True, help="trainer.rounds")
    parser.add_argument(
        "--sampling",
        choices=["poisson", "fixed"],
        default="fixed",
        help="trainer.sampling (default: fixed, as the trainer's)",
    )
    parser.add_argument("--accountant", choices=["rdp", "pld"], default="rdp", help="trainer.privacy.accountant")
    parser.add_argument("--delta", type=float, default=None, help="default: min(1e-5, N^-1.1), as CentralDP")
    parser.add_argument("--clip", type=float, default=1.0, help="the clip bound S, for the noise on the mean")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--epsilon", type=float, nargs="+", help="target epsilon(s): the z each needs")
    group.add_argument("--noise-multiplier", type=float, nargs="+", help="z: the epsilon each spends")
    args = parser.parse_args(argv)
    if args.accountant == "pld" and args.sampling == "fixed":
        print(
            "error: --accountant pld has no event for fixed-size sampling (the default, as trainer.sampling's): "
            "add --sampling poisson, or use --accountant rdp",
            file=sys.stderr,
        )
        return 2
    try:
        accountant = Accountant(args.clients, args.per_round, args.sampling, args.accountant)
        delta = args.delta if args.delta is not None else min(1e-5, args.clients**-1.1)
        rows, values, started = [], args.epsilon or args.noise_multiplier, time.perf_counter()
        how = f"{args.accountant.upper()} accounting over {args.rounds} rounds"
        for index, value in enumerate(values, 1):
            what = f"the noise multiplier for epsilon {value:g}" if args.epsilon else f"the epsilon of z = {value:g}"
            with progress(f"computing {what} ({how})", index, len(values)):
                z = accountant.calibrate(value, delta, args.rounds) if args.epsilon else value
                eps = accountant.epsilon(delta, (RoundEvent(z), args.rounds))
            rows.append((z, eps))
        print(f"planned {len(values)} setting(s) in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    how = (
        "fixed-size sampling without replacement, replace-one"
        if args.sampling == "fixed"
        else "Poisson sampling, add/remove-one"
    )
    print(
        f"N = {args.clients:,}, m = {args.per_round:g} per round ({how} neighbours), {args.rounds} rounds, "
        f"delta = {delta:.3g}, {args.accountant.upper()} accounting"
    )
    print(f"| noise multiplier z | epsilon | noise std on the mean update (S = {args.clip:g}) |")
    print("|---:|---:|---:|")
    for z, eps in rows:
        print(f"| {z:.4f} | {eps:.4f} | {z * args.clip / args.per_round:.4g} |")
    return 0


def plan_dp_sgd(argv: list[str] | None = None) -> int:
    """Plan record-level DP-SGD for one client: the noise a budget needs, or the budget a noise spends.

    python -m lightning_fl.privacy dp-sgd --records 6750 --batch 64 --steps 25 --rounds 10 --epsilon 1 4 8
    """
    parser = argparse.ArgumentParser(
        prog="python -m lightning_fl.privacy dp-sgd", description=plan_dp_sgd.__doc__.split("\n")[0]
    )
    parser.add_argument("--records", type=int, required=True, help="the client's records n")
    parser.add_argument("--batch", type=int, required=True, help="data.batch_size B (q = B / n)")
    parser.add_argument("--steps", type=int, required=True, help="local steps per round (trainer.local_steps)")
    parser.add_argument("--rounds", type=int, required=True, help="rounds the client takes part in")
    parser.add_argument("--delta", type=float, default=1e-5)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--epsilon", type=float, nargs="+", help="target epsilon(s): the z each needs")
    group.add_argument("--noise-multiplier", type=float, nargs="+", help="z: the epsilon each spends")
    args = parser.parse_args(argv)
    if bad := [
        f"--{k} must be >= 1, got {v}"
        for k, v in vars(args).items()
        if k in ("records", "batch", "steps", "rounds") and v < 1
    ]:
        print(f"error: {'; '.join(bad)}", file=sys.stderr)
        return 2
    q, total = min(1.0, args.batch / args.records), args.steps * args.rounds
    try:
        rows, values, started = [], args.epsilon or args.noise_multiplier, time.perf_counter()
        for index, value in enumerate(values, 1):
            what = f"the noise multiplier for epsilon {value:g}" if args.epsilon else f"the epsilon of z = {value:g}"
            with progress(f"computing {what} (PLD accounting over {total} steps)", index, len(values)):
                z = noise_multiplier(value, args.delta, q, total) if args.epsilon else value
                rows.append((z, epsilon(q, total, z, args.delta)))
        print(f"planned {len(values)} setting(s) in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"n = {args.records:,} records, q = {q:.5g}, {args.steps} steps x {args.rounds} rounds = {total} steps, "
        f"delta = {args.delta:.3g}, PLD accounting, replace-one-record neighbours"
    )
    print("| noise multiplier z | epsilon |")
    print("|---:|---:|")
    for z, eps in rows:
        print(f"| {z:.4f} | {eps:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
