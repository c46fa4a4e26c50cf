"""Importable plug-ins for CLI tests, and clients with crafted uploads for tests of the round."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch

from lightning_fl import TrainerLike
from lightning_fl.compress import FP32
from lightning_fl.federated import ByteLedger, FedAvg, LocalTraining
from lightning_fl.federated.clients.transport import Reply, Transport
from lightning_fl.federated.server.collect import Uploads
from lightning_fl.federated.server.round import RoundRunner, RoundSettings
from lightning_fl.federated.server.stages import round_arrivals, round_stages
from lightning_fl.federated.server.state import flatten, unflatten
from lightning_fl.federated.trainer.arguments import TrainerArguments
from lightning_fl.privacy import Plan


class RecordingTrainer(TrainerLike):
    """A non-Lightning trainer: records what the CLI hands it."""

    last: RecordingTrainer | None = None

    def __init__(self, rounds: int = 1, tag: str = "x") -> None:
        self.rounds, self.tag = rounds, tag
        self.calls: list[tuple[str, Any, Any, Any]] = []
        self.config_yaml: str | None = None
        RecordingTrainer.last = self

    def log_config(self, config_yaml: str) -> None:
        self.config_yaml = config_yaml

    def fit(self, model: Any, *, datamodule: Any = None, ckpt_path: Any = None) -> Any:
        self.calls.append(("fit", model, datamodule, ckpt_path))
        return "fitted"

    def validate(self, model: Any, *, datamodule: Any = None, ckpt_path: Any = None) -> Any:
        self.calls.append(("validate", model, datamodule, ckpt_path))
        return [{}]

    def test(self, model: Any, *, datamodule: Any = None, ckpt_path: Any = None) -> Any:
        self.calls.append(("test", model, datamodule, ckpt_path))
        return [{}]


class CraftedClients(Transport):
    """A transport whose clients upload given updates: ``update(client, round)`` (a flat tensor the size of the
    state) is added to the global state; ``failing`` clients reply with a training failure. For tests of the
    round's stages with exactly known uploads."""

    def __init__(self, update, num_samples=None, failing=()) -> None:
        self.update, self.failing = update, set(failing)
        self.num_samples = num_samples or (lambda client: 10)

    def replies(self, job, clients):
        state, round = job.state, job.round
        names = sorted(state)
        for c in clients:
            if c in self.failing:
                yield Reply(c, self.num_samples(c), None, failure="local training failed: diverged")
                continue
            flat = flatten(state, names) + self.update(c, round).to(torch.float32)
            yield Reply(c, self.num_samples(c), FP32().encode(unflatten(flat, state, names), state, c))


class Population:
    """A data module that is only a number of clients (for rounds driven by :class:`CraftedClients`)."""

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients


class Durations(Population):
    """Clients that each run ``steps[c]`` local steps (one epoch of that many batches)."""

    def __init__(self, steps: list[int]) -> None:
        super().__init__(len(steps))
        self.steps = steps

    def client_dataloader(self, client: int, seed: int = 0):
        return range(self.steps[client])


def quiet_fit(trainer: Any, model: Any, dm: Any, **kwargs: Any) -> Any:
    """``trainer.fit`` with every warning silenced; the trainer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=dm, **kwargs)
    return trainer


def round_runner(
    fabric,
    transport,
    codec=None,
    *,
    strategy=None,
    local=None,
    num_clients=3,
    fold_groups=1,
    sampling="fixed",
    dropout=0.0,
    upload_policy="drop",
    **settings,
):
    """A :class:`~lightning_fl.federated.server.round.RoundRunner` over ``transport`` with the stages a trainer with
    ``settings`` (its arguments: ``attack``, ``privacy``, ``max_update_norm``, ...) would run; the relative norm gate
    is off unless ``max_update_norm_ratio`` is given."""
    strategy = strategy if strategy is not None else FedAvg()
    settings.setdefault("max_update_norm_ratio", None)
    args = TrainerArguments(strategy=strategy, sampling=sampling, **settings)
    arrivals = round_arrivals(args, local, target=None)
    collection = Uploads(transport, codec if codec is not None else FP32(), local, fold_groups, arrivals=arrivals)
    return RoundRunner(
        fabric,
        strategy,
        collection,
        round_stages(args, fabric, local),
        ByteLedger(num_clients),
        RoundSettings(sampling, dropout, upload_policy),
    )


def crafted_runner(
    update,
    num_clients,
    *,
    strategy=None,
    privacy=None,
    sampling="fixed",
    count=None,
    rounds=1,
    seed=0,
    failing=(),
    num_samples=None,
    **kwargs,
):
    """A :class:`~lightning_fl.federated.server.round.RoundRunner` over :class:`CraftedClients` on one CPU process, with
    ``privacy`` set up for ``rounds`` rounds of ``count`` clients; returns (runner, population)."""
    strategy = strategy if strategy is not None else FedAvg()
    count = count if count is not None else num_clients
    kwargs.setdefault("max_update_norm_ratio", None)
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[])
    transport = CraftedClients(update, num_samples, failing)
    runner = round_runner(
        fabric,
        transport,
        strategy=strategy,
        local=LocalTraining(),
        num_clients=num_clients,
        privacy=privacy,
        sampling=sampling,
        **kwargs,
    )
    if privacy is not None:
        privacy.setup(
            Plan(num_clients, float(count), sampling, rounds, seed, strategy, kwargs["max_update_norm_ratio"])
        )
    return runner, Population(num_clients)
