"""FederatedTrainer: rounds of client training and server aggregation, with Fabric inside.

It has ``lightning.Trainer``'s interface (``fit/validate/test(model, datamodule=, ckpt_path=)``),
so the CLI runs it from a config like any trainer, and it runs the module's own
``training_step``/``validation_step``: the same LightningModule trains centrally and federated.

One round (FedAvg, McMahan et al. 2017, with the FLITE payload of flite.md Algorithm 1):

1. sample clients (seeded by the round), broadcast the global federated state (counted as download);
2. each client loads it, trains ``local_epochs`` (or ``local_steps``) on its data with a fresh optimiser
   from ``configure_optimizers``, and uploads its federated state through the ``codec`` (bytes
   counted from the encoded payload);
3. the upload gate rejects malformed or non-finite uploads (``upload_policy``: drop or raise);
4. the server averages the accepted uploads (unweighted, or weighted by sample count) and evaluates.

Clients are spread over Fabric processes (``devices``); every client's randomness derives from
``(seed, round, client)`` and the server aggregates uploads in client order in float64, so the
global state does not depend on how clients are placed, and a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import math
import random
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from jsonargparse import lazy_instance
from lightning.fabric.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm

from lightning_fl.checkpoint import atomic_save, remove_stale_temps
from lightning_fl.cli import CONFIG_FILENAME, TrainerLike
from lightning_fl.compress.base import FP32, Codec
from lightning_fl.errors import CheckpointError, ConfigError, UserError
from lightning_fl.federated.aggregate import (
    UploadRejectedError,
    check_upload,
    flatten,
    get_federated_state,
    load_federated_state,
    unflatten,
    weighted_mean,
)
from lightning_fl.federated.ledger import ByteLedger
from lightning_fl.federated.sink import LogSink
from lightning_fl.mapping.factors import derive_seed

STREAM_SAMPLING, STREAM_CLIENT, STREAM_LOADER = 11, 12, 13
CHECKPOINT_VERSION = 1


class FactorMismatchError(UserError):
    """A process's model (factors or base) differs from the server's: the averaging identity would break."""


def _seed_everything_quietly(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class FederatedTrainer(TrainerLike):
    """Simulated federated training of a LightningModule over the clients of a federated data module.

    Args:
        rounds: Communication rounds R.
        client_fraction: Share of the K clients sampled each round (at least one).
        clients_per_round: Number of clients sampled each round; overrides ``client_fraction``.
        local_epochs: Local epochs E per round.
        local_steps: Local optimiser steps per round instead of epochs (cycling the client's data).
        aggregation: ``mean`` (unweighted, the FLITE paper) or ``weighted`` by client sample count.
        codec: Upload codec (``FP32``, ``Quantize``, or a compressor); downloads are always float32.
        upload_policy: What the gate does with a malformed or non-finite upload (or a client whose training
            diverges): ``drop`` it from the round (logged) or ``raise`` an error naming client and round.
        seed: Seed of client sampling and client training; default: the run's ``seed_everything``.
        accelerator: Fabric accelerator (``cpu``, ``gpu``, ``auto``).
        devices: Processes/devices the clients are spread over (``2`` on CPU uses gloo).
        strategy: Fabric strategy (``auto`` picks DDP for several devices; no gradients are synchronised,
            processes only exchange uploads).
        precision: Fabric precision (``32-true``, ``bf16-mixed``, ``16-mixed``, ...); ``null``: 32-bit.
        default_root_dir: Runs go to ``<default_root_dir>/<name>/<version>/``.
        name: Experiment name (folder under ``default_root_dir``).
        version: Run folder name or number; ``null`` picks the next ``version_N``.
        logger: Write TensorBoard logs.
        resume: ``auto`` continues the newest run of ``name`` that has a checkpoint (``--ckpt_path`` wins).
        val_every_n_rounds: Evaluate the global model every this many rounds (and after the last one).
        limit_val_batches: Evaluate on at most this many validation batches (0: no evaluation).
        gradient_clip_val: Clip client gradient norms; ``null`` uses the module's ``grad_clip``, if any.
        check_identity: Log the averaging identity error (modules with ``averaging_identity_error``).
        enable_progress_bar: Show progress over rounds and clients.
        save_every_n_rounds: Also keep ``round_NNNN.ckpt`` every this many rounds (``last.ckpt`` is always kept).
    """

    def __init__(
        self,
        rounds: int = 10,
        client_fraction: float = 1.0,
        clients_per_round: int | None = None,
        local_epochs: int = 1,
        local_steps: int | None = None,
        aggregation: Literal["mean", "weighted"] = "mean",
        codec: Codec = lazy_instance(FP32),
        upload_policy: Literal["drop", "raise"] = "drop",
        seed: int | None = None,
        accelerator: str = "auto",
        devices: int | str = 1,
        strategy: str = "auto",
        precision: str | None = None,
        default_root_dir: str = "runs",
        name: str = "federated",
        version: int | str | None = None,
        logger: bool = True,
        resume: bool | Literal["auto"] = False,
        val_every_n_rounds: int = 1,
        limit_val_batches: int | None = None,
        gradient_clip_val: float | None = None,
        check_identity: bool = True,
        enable_progress_bar: bool = True,
        save_every_n_rounds: int = 0,
    ) -> None:
        problems = []
        if rounds < 1:
            problems.append(f"trainer.rounds must be >= 1, got {rounds}")
        if not 0 < client_fraction <= 1:
            problems.append(f"trainer.client_fraction must be in (0, 1], got {client_fraction}")
        if clients_per_round is not None and clients_per_round < 1:
            problems.append(f"trainer.clients_per_round must be >= 1 or null, got {clients_per_round}")
        if local_epochs < 1:
            problems.append(f"trainer.local_epochs must be >= 1, got {local_epochs}")
        if local_steps is not None and local_steps < 1:
            problems.append(f"trainer.local_steps must be >= 1 or null, got {local_steps}")
        if aggregation not in ("mean", "weighted"):
            problems.append(f"trainer.aggregation must be 'mean' or 'weighted', got {aggregation!r}")
        if upload_policy not in ("drop", "raise"):
            problems.append(f"trainer.upload_policy must be 'drop' or 'raise', got {upload_policy!r}")
        if resume not in (True, False, "auto"):
            problems.append(f"trainer.resume must be true, false or 'auto', got {resume!r}")
        if val_every_n_rounds < 1:
            problems.append(f"trainer.val_every_n_rounds must be >= 1, got {val_every_n_rounds}")
        if save_every_n_rounds < 0:
            problems.append(f"trainer.save_every_n_rounds must be >= 0, got {save_every_n_rounds}")
        if problems:
            raise ConfigError("; ".join(problems))
        self.rounds, self.client_fraction, self.clients_per_round = rounds, client_fraction, clients_per_round
        self.local_epochs, self.local_steps = local_epochs, local_steps
        self.aggregation, self.codec, self.upload_policy = aggregation, codec, upload_policy
        self.seed = seed
        self.fabric_args = {
            "accelerator": accelerator,
            "devices": devices,
            "strategy": strategy,
            "precision": precision,
        }
        self.default_root_dir, self.name, self.version, self.use_logger = default_root_dir, name, version, logger
        self.resume = resume
        self.val_every_n_rounds, self.limit_val_batches = val_every_n_rounds, limit_val_batches
        self.gradient_clip_val, self.check_identity = gradient_clip_val, check_identity
        self.enable_progress_bar, self.save_every_n_rounds = enable_progress_bar, save_every_n_rounds
        self.config_yaml: str | None = None
        self.fabric: L.Fabric | None = None
        self.log_dir: Path | None = None
        self.history: list[dict[str, float]] = []
        self.callback_metrics: dict[str, float] = {}
        self.global_state: dict[str, torch.Tensor] = {}
        self.ledger: ByteLedger | None = None
        self.current_round = 0

    # ============================================================================ public interface
    def log_config(self, config_yaml: str) -> None:
        """Receive the resolved config from the CLI; written to the run folder when the run starts."""
        self.config_yaml = config_yaml

    def fit(self, model: L.LightningModule, *, datamodule: Any = None, ckpt_path: str | None = None) -> None:
        ckpt = self._find_resume_checkpoint(ckpt_path)
        fabric = self._launch(run_dir=ckpt.parent.parent if ckpt is not None else None)
        model = self._prepare(model, datamodule, stage="fit")
        seed = self._run_seed()
        self.global_state = get_federated_state(model)
        names = sorted(self.global_state)
        self.ledger = ByteLedger(datamodule.num_clients)
        self.history, start = [], 0
        fingerprint = self._fingerprint(model)
        if ckpt is not None:
            start = self._restore(ckpt, model, seed, fingerprint, datamodule.num_clients)
        self._write_config()
        bar = tqdm(
            total=self.rounds, initial=start, desc="round", dynamic_ncols=True,
            disable=not (self.enable_progress_bar and fabric.is_global_zero),
        )  # fmt: skip
        if start == 0:  # round 0: the starting model (for FLITE, exactly the pretrained base)
            base_metrics = self._evaluate(model, datamodule, "val")
            self._log(base_metrics, step=0)
            self.history.append({"round": 0, **base_metrics})
        started = time.perf_counter()
        for r in range(start, self.rounds):
            self.current_round = r
            t0 = time.perf_counter()
            metrics = self._round(model, datamodule, r, seed, names)
            metrics["time/clients_and_server_s"] = time.perf_counter() - t0  # the round without evaluation
            evaluate = (r + 1) % self.val_every_n_rounds == 0 or r + 1 == self.rounds
            if evaluate:
                metrics.update(self._evaluate(model, datamodule, "val"))
            metrics["time/round_s"] = time.perf_counter() - t0
            metrics["time/elapsed_s"] = time.perf_counter() - started
            self._log(metrics, step=r + 1)
            self.history.append({"round": r + 1, **metrics})
            self.callback_metrics = metrics
            self._save_checkpoint(r + 1, seed, fingerprint, datamodule.num_clients)
            bar.update(1)
            if "val/acc" in metrics:
                bar.set_postfix(acc=f"{metrics['val/acc']:.4f}", mb=f"{metrics['comm/cum_client_bytes'] / 2**20:.3f}")
        bar.close()
        self._finish(model)

    def validate(self, model: L.LightningModule, *, datamodule: Any = None, ckpt_path: str | None = None):
        return self._evaluate_only(model, datamodule, ckpt_path, "val")

    def test(self, model: L.LightningModule, *, datamodule: Any = None, ckpt_path: str | None = None):
        return self._evaluate_only(model, datamodule, ckpt_path, "test")

    # ============================================================================ set-up
    def _launch(self, run_dir: Path | None = None) -> L.Fabric:
        loggers = []
        if self.use_logger:
            if run_dir is not None and self.version is None:  # resuming: keep logging into the same run folder
                loggers.append(
                    TensorBoardLogger(str(run_dir.parent.parent), name=run_dir.parent.name, version=run_dir.name)
                )
            else:
                loggers.append(TensorBoardLogger(self.default_root_dir, name=self.name, version=self.version))
        fabric = L.Fabric(**self.fabric_args, loggers=loggers)
        fabric.launch()
        self.fabric = fabric
        if self.use_logger:
            log_dir = fabric.broadcast(str(fabric.logger.log_dir) if fabric.is_global_zero else None)
        else:
            log_dir = fabric.broadcast(str(Path(self.default_root_dir) / self.name) if fabric.is_global_zero else None)
        self.log_dir = Path(log_dir)
        return fabric

    def _run_seed(self) -> int:
        if self.seed is not None:
            return int(self.seed)
        import os

        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    def _prepare(self, model: L.LightningModule, datamodule: Any, stage: str) -> L.LightningModule:
        fabric = self.fabric
        needed = ("num_clients", "client_dataloader", "client_num_samples", "val_dataloader")
        missing = [a for a in needed if not hasattr(datamodule, a)]
        if missing:
            raise ConfigError(
                f"FederatedTrainer needs a federated data module (e.g. lightning_fl.data.FederatedDataModule); "
                f"{type(datamodule).__name__} lacks {', '.join(missing)}"
            )
        self._datamodule = datamodule
        with fabric.rank_zero_first(local=True):
            datamodule.prepare_data()
        datamodule.setup(stage)
        if callable(getattr(model, "check_data", None)):
            model.check_data(datamodule)
        if callable(getattr(model, "prepare_base", None)):
            with fabric.rank_zero_first():
                model.prepare_base(datamodule)
        model.setup(stage)
        model = fabric.strategy.precision.convert_module(model)
        return fabric.to_device(model)

    def _fingerprint(self, model: L.LightningModule) -> str | None:
        """Every process checks its model against the server's (rank 0) fingerprint once."""
        fabric = self.fabric
        mine = model.factor_fingerprint() if callable(getattr(model, "factor_fingerprint", None)) else None
        server = fabric.broadcast(mine)
        if mine != server:
            raise FactorMismatchError(
                f"process {fabric.global_rank} (its clients refuse to train) has model fingerprint "
                f"{mine} but the server broadcast {server}: its projection factors or pretrained base differ, so "
                "averaging latents would not average weights. Use the same model.factor_seed, layers, latent_dim, "
                "rank and base on every client."
            )
        return mine

    def _write_config(self) -> None:
        fabric = self.fabric
        if not fabric.is_global_zero:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.config_yaml is not None:
            (self.log_dir / CONFIG_FILENAME).write_text(self.config_yaml)
            if fabric.loggers:
                text = "".join(f"    {line}\n" for line in self.config_yaml.splitlines())
                fabric.logger.experiment.add_text("config", text)
        partition_table = getattr(getattr(self, "_datamodule", None), "partition_table", None)
        if fabric.loggers and callable(partition_table):
            fabric.logger.experiment.add_text("data/partition", partition_table())

    # ============================================================================ one round
    def _sample(self, r: int, seed: int, num_clients: int) -> list[int]:
        m = self.clients_per_round or max(1, round(self.client_fraction * num_clients))
        if m > num_clients:
            raise ConfigError(f"trainer.clients_per_round={m} exceeds data.num_clients={num_clients}")
        rng = np.random.default_rng(derive_seed(seed, r, STREAM_SAMPLING))
        return sorted(int(c) for c in rng.choice(num_clients, size=m, replace=False))

    def _my_share(self, clients: list[int]) -> list[int]:
        fabric = self.fabric
        return clients[fabric.global_rank :: fabric.world_size]

    def _round(self, model: L.LightningModule, datamodule: Any, r: int, seed: int, names: list[str]) -> dict:
        fabric = self.fabric
        sampled = self._sample(r, seed, datamodule.num_clients)
        mine = self._my_share(sampled)
        slots = math.ceil(len(sampled) / fabric.world_size)
        dim = sum(self.global_state[n].numel() for n in names)
        ids = torch.full((slots,), -1, dtype=torch.int64)
        accepted = torch.zeros(slots, dtype=torch.int64)
        weights = torch.zeros(slots, dtype=torch.float64)
        flats = torch.zeros(slots, dim, dtype=torch.float32)
        stats = torch.zeros(slots, 4, dtype=torch.float64)  # up bytes, down bytes, loss sum, loss weight
        download = FP32().encode(self.global_state, self.global_state, -1)
        bar = tqdm(
            mine,
            desc=f"clients r{r + 1}",
            leave=False,
            disable=not (self.enable_progress_bar and fabric.is_global_zero),
        )
        for slot, cid in enumerate(bar):
            ids[slot] = cid
            weights[slot] = float(datamodule.client_num_samples(cid))
            stats[slot, 1] = download.nbytes
            state, loss_sum, loss_weight, failure = self._train_client(model, datamodule, r, cid, seed)
            stats[slot, 2], stats[slot, 3] = loss_sum, loss_weight
            problems = [failure] if failure else []
            if not problems:
                non_finite = [n for n, t in state.items() if not torch.isfinite(t).all()]
                problems = [f"{n}: non-finite values" for n in non_finite]
            if not problems:
                payload = self.codec.encode(state, self.global_state, cid)
                stats[slot, 0] = payload.nbytes
                try:
                    decoded = self.codec.decode(payload, self.global_state, cid)
                except Exception as err:  # a malformed payload must not take the server down
                    problems = [f"could not be decoded ({type(err).__name__}: {err})"]
                else:
                    problems = check_upload(decoded, self.global_state, payload)
            if problems:
                message = f"round {r + 1}, client {cid}: upload rejected: {'; '.join(problems)}"
                if self.upload_policy == "raise":
                    raise UploadRejectedError(message + " (trainer.upload_policy is 'raise'; use 'drop' to skip it)")
                warnings.warn(message + "; dropped from this round", stacklevel=2)
                continue
            accepted[slot] = 1
            flats[slot] = flatten(decoded, names)
        ids, accepted, weights, flats, stats = (
            self._gather(t) for t in (ids, accepted, weights, flats, stats)
        )  # each (world * slots, ...), identical on every process
        order = sorted(i for i in range(len(ids)) if ids[i] >= 0)
        order.sort(key=lambda i: int(ids[i]))
        self.ledger.start_round()
        for i in order:
            self.ledger.record(int(ids[i]), "down", int(stats[i, 1]))
            self.ledger.record(int(ids[i]), "up", int(stats[i, 0]))
        keep = [i for i in order if accepted[i]]
        metrics: dict[str, float] = {
            "fed/round": float(r + 1),
            "fed/clients": float(len(order)),
            "fed/dropped_clients": float(len(order) - len(keep)),
        }
        loss_weight = float(stats[order, 3].sum()) if order else 0.0
        if loss_weight > 0:
            metrics["train/loss"] = float(stats[order, 2].sum()) / loss_weight
        if keep:
            agg_w = [float(weights[i]) if self.aggregation == "weighted" else 1.0 for i in keep]
            new_flat = weighted_mean([flats[i] for i in keep], agg_w)
            has_identity = callable(getattr(model, "averaging_identity_error", None))
            if self.check_identity and has_identity and fabric.is_global_zero:
                uploads = [unflatten(flats[i], self.global_state, names) for i in keep]
                metrics["fed/identity_error"] = model.averaging_identity_error(uploads)
            self.global_state = {
                n: t.to(self.global_state[n].device) for n, t in unflatten(new_flat, self.global_state, names).items()
            }
        else:
            warnings.warn(f"round {r + 1}: every upload was dropped; the global state is unchanged", stacklevel=2)
        load_federated_state(model, self.global_state)
        metrics.update(self.ledger.metrics())
        return metrics

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        fabric = self.fabric
        if fabric.world_size == 1:
            return t
        gathered = fabric.all_gather(fabric.to_device(t))
        return gathered.reshape(-1, *t.shape[1:]).cpu()

    def _train_client(self, model: L.LightningModule, datamodule: Any, r: int, cid: int, seed: int):
        """Local training of one client from the global state; returns (state, loss sum, loss weight, failure)."""
        fabric = self.fabric
        _seed_everything_quietly(derive_seed(seed, r, cid, STREAM_CLIENT))
        load_federated_state(model, self.global_state)
        optimizer, scheduler = self._configure_optimizer(model)
        optimizer = fabric.setup_optimizers(optimizer)
        loader = datamodule.client_dataloader(cid, seed=derive_seed(seed, r, cid, STREAM_LOADER) % 2**63)
        sink = LogSink(fabric, client=cid, round=r)
        clip = self.gradient_clip_val
        if clip is None:
            clip = getattr(getattr(model, "hparams", None), "grad_clip", None)
        model.train()
        model._fabric = sink
        failure = None
        try:
            steps = 0
            for epoch in range(self.local_epochs if self.local_steps is None else 10**9):
                sink.current_epoch = epoch
                for batch_idx, batch in enumerate(loader):
                    batch = fabric.to_device(batch)
                    sink.weight = _batch_size(batch)
                    with fabric.autocast():
                        out = model.training_step(batch, batch_idx)
                    loss = out["loss"] if isinstance(out, dict) else out
                    fabric.backward(loss)
                    if clip is not None:
                        fabric.clip_gradients(model, optimizer, max_norm=clip)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    if scheduler is not None:
                        scheduler.step()
                    steps += 1
                    sink.global_step = steps
                    if self.local_steps is not None and steps >= self.local_steps:
                        break
                if self.local_steps is not None and steps >= self.local_steps:
                    break
                if steps == 0:
                    raise ConfigError(f"client {cid} has no training batches")
        except (UserError, FloatingPointError) as err:
            if isinstance(err, ConfigError):
                raise
            failure = f"local training failed: {err}"
        finally:
            model._fabric = None
        loss_sum, loss_weight = sink.weighted("train/loss")
        return get_federated_state(model), loss_sum, loss_weight, failure

    @staticmethod
    def _configure_optimizer(model: L.LightningModule):
        conf = model.configure_optimizers()
        scheduler = None
        if isinstance(conf, dict):
            sched = conf.get("lr_scheduler")
            if isinstance(sched, dict):
                if sched.get("interval", "epoch") == "step":
                    scheduler = sched["scheduler"]
            elif sched is not None:
                warnings.warn("epoch-interval schedulers are not stepped by FederatedTrainer", stacklevel=2)
            conf = conf["optimizer"]
        if isinstance(conf, (list, tuple)):
            if len(conf) != 1:
                raise ConfigError("FederatedTrainer supports modules with exactly one optimiser")
            conf = conf[0]
        return conf, scheduler

    # ============================================================================ evaluation
    def _evaluate(self, model: L.LightningModule, datamodule: Any, stage: str) -> dict[str, float]:
        """Evaluate the global model; each process takes every world_size-th batch, metrics are synchronised."""
        fabric = self.fabric
        if self.limit_val_batches == 0:
            return {}
        loader = datamodule.val_dataloader() if stage == "val" else datamodule.test_dataloader()
        loader = self._shard(loader)
        step = model.validation_step if stage == "val" else model.test_step
        epoch_end = model.on_validation_epoch_end if stage == "val" else model.on_test_epoch_end
        sink = LogSink(fabric)
        model.eval()
        model._fabric = sink
        try:
            with torch.no_grad():
                for batch_idx, batch in enumerate(loader):
                    if self.limit_val_batches is not None and batch_idx >= self.limit_val_batches:
                        break
                    batch = fabric.to_device(batch)
                    sink.weight = _batch_size(batch)
                    with fabric.autocast():
                        step(batch, batch_idx)
                sink.phase = "epoch_end"
                epoch_end()
        finally:
            model._fabric = None
            model.train()
        return sink.reduce()

    def _shard(self, loader: DataLoader) -> DataLoader:
        fabric = self.fabric
        if fabric.world_size == 1:
            return loader
        n, bs = len(loader.dataset), loader.batch_size
        mine = [i for i in range(n) if (i // bs) % fabric.world_size == fabric.global_rank]
        return DataLoader(Subset(loader.dataset, mine), batch_size=bs, shuffle=False, num_workers=loader.num_workers)

    def _evaluate_only(self, model, datamodule, ckpt_path: str | None, stage: str) -> list[dict[str, float]]:
        self._launch()
        model = self._prepare(model, datamodule, stage="validate" if stage == "val" else "test")
        if ckpt_path is not None:
            ckpt = self._load(Path(ckpt_path))
            if "global_state" in ckpt:
                load_federated_state(model, {n: t.to(self.fabric.device) for n, t in ckpt["global_state"].items()})
            else:
                model.load_state_dict(ckpt["state_dict"])
        self._write_config()
        metrics = self._evaluate(model, datamodule, stage)
        self._log(metrics, step=0)
        self.callback_metrics = metrics
        self._finish(model)
        return [metrics]

    # ============================================================================ logging and checkpoints
    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.fabric.loggers:
            self.fabric.log_dict(metrics, step=step)

    def _finish(self, model: L.LightningModule) -> None:
        fabric = self.fabric
        fabric.barrier()
        for logger in fabric.loggers:
            logger.finalize("success")

    def _checkpoint_dir(self) -> Path:
        return self.log_dir / "checkpoints"

    def _save_checkpoint(self, completed: int, seed: int, fingerprint: str | None, num_clients: int) -> None:
        fabric = self.fabric
        if fabric.is_global_zero:
            state = {
                "format": "lightning_fl.federated",
                "version": CHECKPOINT_VERSION,
                "round": completed,
                "seed": seed,
                "num_clients": num_clients,
                "fingerprint": fingerprint,
                "global_state": {n: t.detach().cpu() for n, t in self.global_state.items()},
                "codec": self.codec.state_dict(),
                "ledger": self.ledger.state_dict(),
                "history": [{k: float(v) for k, v in h.items()} for h in self.history],
            }
            folder = self._checkpoint_dir()
            atomic_save(state, folder / "last.ckpt")
            if self.save_every_n_rounds and completed % self.save_every_n_rounds == 0:
                atomic_save(state, folder / f"round_{completed:04d}.ckpt")
        fabric.barrier()

    @staticmethod
    def _load(path: Path) -> dict:
        if not path.is_file():
            raise CheckpointError(f"checkpoint {path} does not exist")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"checkpoint {path} could not be read safely (weights_only=True): {err}") from err

    def _find_resume_checkpoint(self, ckpt_path: str | None) -> Path | None:
        if ckpt_path is not None:
            return Path(ckpt_path).expanduser()
        if self.resume == "auto" or self.resume is True:
            root = Path(self.default_root_dir) / self.name
            if self.version is not None:
                folder = root / (self.version if isinstance(self.version, str) else f"version_{self.version}")
                candidates = [folder / "checkpoints" / "last.ckpt"]
            else:
                candidates = list(root.glob("*/checkpoints/last.ckpt"))
            candidates = [c for c in candidates if c.is_file()]
            if candidates:
                return max(candidates, key=lambda p: p.stat().st_mtime)
            if self.resume is True:
                raise CheckpointError(f"trainer.resume is true but no checkpoint was found under {root}")
        return None

    def _restore(
        self, path: Path, model: L.LightningModule, seed: int, fingerprint: str | None, num_clients: int
    ) -> int:
        ckpt = self._load(path)
        if ckpt.get("format") != "lightning_fl.federated":
            raise CheckpointError(f"{path} is not a FederatedTrainer checkpoint (no 'format' marker)")
        problems = []
        if ckpt["seed"] != seed:
            problems.append(f"seed {ckpt['seed']} in the checkpoint, {seed} now")
        if ckpt["num_clients"] != num_clients:
            problems.append(f"{ckpt['num_clients']} clients in the checkpoint, {num_clients} now")
        if ckpt["fingerprint"] != fingerprint:
            problems.append("the model fingerprint (factors or base) differs")
        if sorted(ckpt["global_state"]) != sorted(self.global_state):
            problems.append(
                f"federated state keys differ ({sorted(ckpt['global_state'])} vs {sorted(self.global_state)})"
            )
        if ckpt["round"] > self.rounds:
            problems.append(f"the checkpoint has {ckpt['round']} rounds done but trainer.rounds is {self.rounds}")
        if problems:
            raise CheckpointError(f"cannot resume from {path}: " + "; ".join(problems))
        device = self.fabric.device
        self.global_state = {n: t.to(device) for n, t in ckpt["global_state"].items()}
        load_federated_state(model, self.global_state)
        self.codec.load_state_dict(ckpt["codec"])
        self.ledger.load_state_dict(ckpt["ledger"])
        self.history = list(ckpt.get("history", []))
        if self.fabric.is_global_zero:
            remove_stale_temps(path.parent)
        return int(ckpt["round"])


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return len(batch[0])
    if isinstance(batch, dict):
        first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        if first is not None:
            return len(first)
    return 1
