"""``python -m lightning_fl.flower --config FILE [--supernodes N] [overrides ...]``: Flower's simulation engine.

Runs the same ServerApp and ClientApp that ``flwr run`` deploys, on Flower's simulation engine (Ray) on this
machine: one virtual SuperNode per client (``partition-id`` 0..N-1). Anything after the options is passed
on as overrides, e.g. ``--trainer.rounds 5``. Exit code 2 and one line for a mistake in the arguments.
Ray's processes listen on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings

from lightning_fl.errors import UserError
from lightning_fl.flower.hello import HELLO_TIMEOUT


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_fl.flower", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="Our YAML config (as for `python -m lightning_fl fit`).")
    parser.add_argument("--supernodes", type=int, default=None, help="Virtual SuperNodes (default: data.num_clients).")
    parser.add_argument("--cpus-per-client", type=float, default=1.0, help="Ray CPUs per ClientApp (default 1).")
    parser.add_argument("--round-timeout", type=float, default=0.0, help="Seconds to wait for replies (0: all).")
    parser.add_argument(
        "--hello-timeout",
        type=float,
        default=HELLO_TIMEOUT,
        help="Seconds the wait for the nodes to say their client may pass without progress (default %(default)g).",
    )
    parser.add_argument(
        "--max-silent-rounds",
        type=int,
        default=3,
        help="Stop after this many attempts in a row at a round no client replied to (0: never; default 3).",
    )
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        from flwr.simulation import run_simulation

        from lightning_fl.cli import build
        from lightning_fl.flower.client import app as client_app
        from lightning_fl.flower.server import server_app

        run = build(["fit", "--config", args.config, *overrides])  # config mistakes surface before Ray starts
        supernodes = args.supernodes if args.supernodes is not None else int(run.data.num_clients)
        if supernodes < 1 or args.cpus_per_client <= 0:
            raise UserError("--supernodes must be >= 1 and --cpus-per-client > 0")
        for name in ("round_timeout", "hello_timeout"):
            value = getattr(args, name)
            if not 0 <= value < float("inf") or (name == "hello_timeout" and value == 0):
                raise UserError(
                    f"--{name.replace('_', '-')} must be a finite number of seconds "
                    f"{'> 0' if name == 'hello_timeout' else '>= 0'}, got {value}"
                )
        if args.max_silent_rounds < 0:
            raise UserError(f"--max-silent-rounds must be a whole number >= 0, got {args.max_silent_rounds}")
        outcome: dict = {}
        server = server_app(
            config=args.config,
            overrides=overrides,
            round_timeout=args.round_timeout or None,
            outcome=outcome,
            hello_timeout=args.hello_timeout,
            max_silent_rounds=args.max_silent_rounds or None,
            engine="simulation",
        )
        resources = {"client_resources": {"num_cpus": args.cpus_per_client, "num_gpus": 0.0}}
        # Ray's servers (GCS, raylet, workers, runtime-env agent) listen on all interfaces unless Ray's node IP is
        # the loopback, and on Linux Ray turns even `_node_ip_address="127.0.0.1"` into the routable address unless
        # this is 0 (its default on macOS and Windows). Ray reads it when imported, i.e. inside run_simulation.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        with _without_deprecation_notices():
            run_simulation(
                server_app=server, client_app=client_app, num_supernodes=supernodes, backend_config=resources
            )
        if "error" in outcome:
            raise outcome["error"]
        if "trainer" not in outcome:
            print("error: the simulation ended before the ServerApp finished; see the log above", file=sys.stderr)
            raise SystemExit(1)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _not_the_run_simulation_notice(record: logging.LogRecord) -> bool:
    return "`run_simulation` function is deprecated" not in record.getMessage()


@contextlib.contextmanager
def _without_deprecation_notices():
    """Hide two notices addressed to us, not to whoever runs this command (docs/deploy.md, simulation engine).

    flwr 1.42 logs that ``run_simulation`` is deprecated in favour of ``flwr run``; its only replacement runs a
    packaged copy of the app (installed under ``FLWR_HOME``) on a SuperLink in simulation mode, in another
    process, without our exit codes or our ServerApp's outcome, so this command stays on ``run_simulation``
    (``flwr run . <superlink>`` remains the way to deploy). Ray warns that it will stop hiding GPUs from a
    ClientApp that asks for none; until then it hides them, as we want.
    """
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addFilter(_not_the_run_simulation_notice)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
            yield
    finally:
        flwr_logger.removeFilter(_not_the_run_simulation_notice)


if __name__ == "__main__":
    main()
