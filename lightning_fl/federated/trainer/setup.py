"""Setting up a federated run: the Fabric processes and run folder, the module and data, the model and plan checks."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.loggers import TensorBoardLogger

from lightning_fl import runs, threads
from lightning_fl.errors import ConfigError, UserError
from lightning_fl.federated.clients.local import configure_optimizer
from lightning_fl.federated.persistence.checkpoint import run_folder_of
from lightning_fl.federated.server.strategies import Strategy
from lightning_fl.federated.trainer.module import ModuleHooks
from lightning_fl.runs import RunLock

FEDERATED_DATA = ("num_clients", "client_dataloader", "client_num_samples", "val_dataloader")


class FactorMismatchError(UserError):
    """A process's model (factors or base) differs from the server's: the averaging identity would break."""


def launch(
    fabric_args: dict[str, Any],
    logger: bool,
    root: str,
    name: str,
    version: int | str | None,
    find_checkpoint: Callable[[], Path | None] = lambda: None,
    restart_incomplete: bool = False,
    prefix: str = "version",
) -> tuple[L.Fabric, Path, RunLock | None, Path | None]:
    """Start Fabric's processes and claim the run folder; return Fabric, the folder, its lock and the checkpoint.

    Rank 0 decides for every process (nodes without a shared disk may see no checkpoint): it looks for the
    checkpoint to resume (``find_checkpoint``) and claims the run folder (:func:`lightning_fl.runs.claim`: a new
    ``<prefix>_N``, the folder named by ``version``, or the resumed run's folder, to keep logging where it left
    off; ``restart_incomplete``: a named folder whose run saved no checkpoint may be started over). Only rank 0
    holds the lock; the other processes get ``None``.
    """
    check_node_environment(fabric_args.get("num_nodes", 1))
    loggers: list = []  # filled once the folder is claimed: Fabric keeps this list
    fabric = L.Fabric(**fabric_args, loggers=loggers)
    fabric.launch()
    if fabric.device.type == "cpu":  # the processes of a node share its cores
        threads.share_among(fabric.world_size // max(1, int(fabric_args.get("num_nodes", 1))))
    lock, ckpt, error = None, None, None
    if fabric.is_global_zero:
        try:
            ckpt = find_checkpoint()
            resume_dir = run_folder_of(ckpt) if ckpt is not None else None
            lock = runs.claim(Path(root) / name, version, resume_dir, restart_incomplete, prefix)
        except UserError as err:
            error = (type(err), str(err))
    folder, ckpt, error = fabric.broadcast((str(lock.folder) if lock else None, str(ckpt) if ckpt else None, error))
    if error is not None:
        raise error[0](error[1])
    folder = Path(folder)
    if logger:
        loggers.append(TensorBoardLogger(str(folder.parent.parent), name=folder.parent.name, version=folder.name))
    return fabric, folder, lock, Path(ckpt) if ckpt is not None else None


def prepare(
    fabric: L.Fabric, model: L.LightningModule, datamodule: Any, stage: str
) -> tuple[L.LightningModule, ModuleHooks]:
    """Check the module and data, prepare them (rank 0 first), and move the module to its device and precision."""
    hooks = ModuleHooks.of(model)
    if stage == "fit":
        configure_optimizer(model)  # settings its clients cannot follow are refused now, not after pretraining
    missing = [a for a in FEDERATED_DATA if not hasattr(datamodule, a)]
    if missing:
        raise ConfigError(
            f"FederatedTrainer needs a federated data module (e.g. lightning_fl.data.FederatedDataModule); "
            f"{type(datamodule).__name__} lacks {', '.join(missing)}"
        )
    with fabric.rank_zero_first(local=True):
        datamodule.prepare_data()
    datamodule.setup(stage)
    if hooks.check_data is not None:
        hooks.check_data(datamodule)
    if hooks.prepare_base is not None:
        with fabric.rank_zero_first():
            hooks.prepare_base(datamodule)
    model.setup(stage)
    model = fabric.strategy.precision.convert_module(model)
    return fabric.to_device(model), hooks


def agree_on_fingerprint(fabric: L.Fabric, hooks: ModuleHooks) -> str | None:
    """Every process checks its model against the server's (rank 0) fingerprint once; the agreed one."""
    mine = hooks.factor_fingerprint() if hooks.factor_fingerprint is not None else None
    server = fabric.broadcast(mine)
    if mine != server:
        raise FactorMismatchError(
            f"process {fabric.global_rank} (its clients refuse to train) has model fingerprint "
            f"{mine} but the server broadcast {server}: its projection factors or pretrained base differ, so "
            "averaging latents would not average weights. Use the same model.factor_seed, layers, latent_dim, "
            "rank and base on every client."
        )
    return mine


def check_plan(strategy: Strategy, attack: Any, num_clients: int, count: int, sampling: str = "fixed") -> None:
    """Refuse a run whose attack names absent clients or whose strategy could never aggregate a round.

    Args:
        strategy: The server strategy (its ``problem`` says why a number of uploads cannot be aggregated).
        attack: The attack, or ``None``.
        num_clients: Clients of the data module.
        count: Clients sampled per round (``poisson``: its expectation; a round may have more).
        sampling: ``fixed`` or ``poisson``.
    """
    problems = []
    if attack is not None and (absent := [c for c in attack.clients if c >= num_clients]):
        problems.append(f"trainer.attack.clients {absent} do not exist: client ids run 0..{num_clients - 1}")
    if sampling == "fixed" and (why := strategy.problem(count)) is not None:
        problems.append(
            f"trainer.strategy cannot aggregate any round: a round samples {count} clients, so at most {why}"
        )
    if problems:
        raise ConfigError("; ".join(problems))
    if (message := strategy.plan_warning(count)) is not None:
        warnings.warn(message, stacklevel=3)


NODE_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


def check_node_environment(num_nodes: int) -> None:
    """Several nodes without a cluster manager: refuse to start (instead of hanging) if a node variable is unset."""
    if num_nodes == 1:
        return
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    if any(env.detect() for env in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment)):
        return  # Fabric takes addresses and ranks from the cluster, as it does for these
    missing = [name for name in NODE_VARIABLES if not os.environ.get(name)]
    if missing:
        raise ConfigError(
            f"trainer.num_nodes is {num_nodes} but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
            "set: on every node set MASTER_ADDR (node 0's address), MASTER_PORT (the same free port) and NODE_RANK "
            f"(0 to {num_nodes - 1}) before starting it (docs/deploy.md)"
        )
