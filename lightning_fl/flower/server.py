"""The ServerApp: our round loop (:class:`~lightning_fl.federated.FederatedTrainer`) with a Flower transport.

The run config (``[tool.flwr.app.config]`` in ``pyproject.toml``, or ``flwr run --run-config``) names our
YAML and the usual dotted overrides::

    flwr run . <superlink> --run-config "config='configs/quickstart.yaml' overrides='--trainer.rounds 5'"

Keys: ``config`` (a YAML path, relative to the app folder or absolute), ``overrides`` (CLI arguments, as
after ``python -m lightning_fl fit``), ``round-timeout`` (seconds to wait for a round's replies; 0 waits
for all), ``wait-for-nodes`` (seconds to wait before round 1 for a node to connect for every client, since the last
one connected), ``hello-timeout`` (seconds the wait for new nodes to say which client they serve may pass without
progress, a node answering or joining; default 300: raise it on a very busy machine, where a ClientApp process takes
long to import) and ``max-silent-rounds`` (a round without one reply is not done and runs again;
stop with an error after this many such attempts in a row; default 3, 0: never). ``quorum`` (a round proceeds once
this many of the messages it sent have replied; 0, the default: all), ``max-staleness`` (rounds a message a round
left behind may stay out; its reply, when it comes, is folded into the round it arrives in), ``staleness`` and
``staleness-exponent`` (the discount of a late reply, as FedBuff's): :mod:`lightning_fl.flower.late`. The trainer
is the config's ``FederatedTrainer``: same strategy, gate, ledger, checkpoints, resume and TensorBoard logs. A config
with ``trainer.buffered`` runs FedBuff asynchronously on the nodes
(:class:`~lightning_fl.federated.arrivals.sources.Delivered`: ``concurrency`` messages out, a step every
``buffer_size`` replies, ``round-timeout`` the longest wait for the next reply); its ``trainer.clock``, which times
the arrivals in process, is not used.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from lightning_fl.errors import ConfigError, UserError
from lightning_fl.federated.trainer.loop import FederatedTrainer
from lightning_fl.flower import late
from lightning_fl.flower.hello import HELLO_TIMEOUT, WAIT_FOR_NODES
from lightning_fl.flower.transport import FlowerTransport

INFO, ERROR = 20, 40  # logging.INFO, logging.ERROR


def serve(
    grid: Grid,
    config: str,
    overrides: str | list[str] = "",
    round_timeout: float | None = None,
    wait_for_nodes: float = WAIT_FOR_NODES,
    app_dir: str | Path | None = None,
    hello_timeout: float = HELLO_TIMEOUT,
    max_silent_rounds: int | None = 3,
    quorum: int = 0,
    max_staleness: int = 4,
    staleness: str = "sqrt",
    staleness_exponent: float = 0.5,
    engine: str = "deployment",
) -> FederatedTrainer:
    """Build the run from ``config`` and ``overrides`` and fit it with clients reached through ``grid`` (``engine``:
    ``"deployment"`` or ``"simulation"``, how advice names the settings)."""
    from lightning_fl.cli import build

    path = Path(config).expanduser()
    if not path.is_absolute() and not path.is_file() and app_dir is not None and (Path(app_dir) / path).is_file():
        path = Path(app_dir) / path
    if not path.is_file():
        raise UserError(f"run config 'config': {config} does not exist; give a YAML path (absolute, or in the app)")
    args = shlex.split(overrides) if isinstance(overrides, str) else list(overrides)
    run = build(["fit", "--config", str(path), *args])
    trainer = run.trainer
    if not isinstance(trainer, FederatedTrainer):
        raise ConfigError(f"trainer must be a FederatedTrainer to run on Flower, got {type(trainer).__name__}")
    if trainer.devices not in (1, "1"):
        raise ConfigError(f"trainer.devices must be 1 on Flower (clients run on the SuperNodes), got {trainer.devices}")
    late.check(quorum, max_staleness, staleness, staleness_exponent)
    if trainer.buffered is not None and quorum:
        raise ConfigError(
            f"run config 'quorum' {quorum} closes synchronous rounds at k of n, and trainer.buffered steps every "
            "buffer_size replies as they come: set quorum 0"
        )
    if quorum and (problem := late.quorum_problem(trainer)):
        raise ConfigError(f"run config 'quorum' {quorum}: {problem}")
    num_clients = getattr(run.data, "num_clients", None)
    if quorum and isinstance(num_clients, int) and (problem := late.quorum_unmet(trainer, quorum, num_clients)):
        raise ConfigError(problem)
    behind = late.late_replies(quorum, max_staleness, staleness, staleness_exponent)
    transport = FlowerTransport(
        grid,
        run.config_yaml,
        round_timeout,
        hello_timeout=hello_timeout,
        wait_for_nodes=wait_for_nodes,
        max_silent_rounds=max_silent_rounds,
        late=behind,
        engine=engine,
    )
    replaced: dict[str, Any] = {"transport": transport}
    if trainer.buffered is not None and trainer.clock is not None:  # (the nodes' replies arrive in real time)
        log(INFO, "trainer.clock is not used on Flower: FedBuff's updates arrive when the SuperNodes reply")
        replaced["clock"] = None
    trainer = dataclasses.replace(trainer, **replaced)  # the config's trainer, rounds through Flower
    trainer.log_config(run.config_yaml)
    trainer.fit(run.model, datamodule=run.data, ckpt_path=run.ckpt_path)
    return trainer


# the run config keys and their defaults; pyproject.toml's [tool.flwr.app.config] declares the same (Flower refuses
# a `flwr run --run-config` key the app does not declare)
RUN_CONFIG = {
    "config": "configs/quickstart.yaml",
    "overrides": "",
    "round-timeout": 0.0,
    "wait-for-nodes": WAIT_FOR_NODES,
    "hello-timeout": HELLO_TIMEOUT,
    "max-silent-rounds": 3,
    "quorum": 0,
    "max-staleness": 4,
    "staleness": "sqrt",
    "staleness-exponent": 0.5,
}


def settings(run_config: dict[str, Any]) -> dict[str, Any]:
    """:func:`serve`'s keyword arguments from a Flower run config (checked: one line per mistake)."""
    known = set(RUN_CONFIG)
    unknown = sorted(set(run_config) - known)
    if unknown:
        raise ConfigError(f"unknown run config key(s) {unknown}; accepted: {sorted(known)}")
    config = run_config.get("config")
    if not isinstance(config, str) or not config:
        raise ConfigError("run config 'config' must name a YAML file, e.g. --run-config \"config='configs/x.yaml'\"")
    overrides = run_config.get("overrides", "")
    if not isinstance(overrides, str):
        raise ConfigError(f"run config 'overrides' must be a string of CLI arguments, got {overrides!r}")
    numbers = {}
    for key in ("round-timeout", "wait-for-nodes", "hello-timeout"):
        value = run_config.get(key, RUN_CONFIG[key])
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise ConfigError(f"run config {key!r} must be a number of seconds >= 0, got {value!r}")
        numbers[key] = float(value)
    if numbers["hello-timeout"] <= 0:
        raise ConfigError("run config 'hello-timeout' must be a number of seconds > 0, got 0")
    silent = run_config.get("max-silent-rounds", RUN_CONFIG["max-silent-rounds"])
    if not isinstance(silent, int) or isinstance(silent, bool) or silent < 0:
        raise ConfigError(f"run config 'max-silent-rounds' must be a whole number of rounds >= 0, got {silent!r}")
    timeout, wait = numbers["round-timeout"] or None, numbers["wait-for-nodes"]
    folding = {
        key.replace("-", "_"): run_config.get(key, RUN_CONFIG[key])
        for key in ("quorum", "max-staleness", "staleness", "staleness-exponent")
    }
    late.check(*folding.values())
    return {
        "config": config,
        "overrides": overrides,
        "round_timeout": timeout,
        "wait_for_nodes": wait,
        "hello_timeout": numbers["hello-timeout"],
        "max_silent_rounds": silent or None,
        **folding,
    }


def server_app(outcome: dict | None = None, **kwargs: Any) -> ServerApp:
    """A ServerApp that runs :func:`serve` with these arguments (for ``run_simulation`` and tests).

    ``outcome`` receives ``trainer`` when the run finishes, or ``error`` (a UserError) when it cannot run.
    """
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        _run(grid, lambda: serve(grid, **kwargs), outcome if outcome is not None else {})

    return server


class RunStopped(UserError):
    """The ServerApp stopped on a user error, already logged in one line. Flower's runtime logs the exception a
    ServerApp raises with its traceback (``flwr log`` shows it); this one carries none, so the log says the line,
    Flower's "ServerApp raised an exception" and the line again, and the run still ends as failed."""

    @property
    def __traceback__(self) -> None:  # what logging and the traceback module read: no stack to print
        return None

    @__traceback__.setter
    def __traceback__(self, value: Any) -> None:  # (the interpreter keeps the real one where it needs it)
        pass


def _run(grid: Grid, fit, outcome: dict) -> None:
    try:
        outcome["trainer"] = fit()
    except UserError as err:
        outcome["error"] = err
        log(ERROR, "error: %s", err)  # one line; the run ends as failed
        raise RunStopped(str(err)) from None


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    app_dir = Path(__file__).resolve().parents[2]
    _run(grid, lambda: serve(grid, **settings(dict(context.run_config)), app_dir=app_dir), {})
