"""FederatedTrainer: rounds of client training and server aggregation, with Fabric inside.

It has ``lightning.Trainer``'s interface (``fit/validate/test(model, datamodule=, ckpt_path=)``), so the CLI
runs it from a config like any trainer, and it runs the module's own ``training_step`` and evaluation steps:
the same LightningModule trains centrally and federated. One round
(:class:`~lightning_fl.federated.server.round.RoundRunner`):

1. the ``strategy`` samples clients (seeded by the round); each may be unavailable (``dropout``); the global
   federated state is broadcast to the available ones (counted as download);
2. each client runs :func:`~lightning_fl.federated.clients.client.run_client`: it loads the state, trains
   ``local_epochs`` (or ``local_steps``) and encodes its federated state with the ``codec``;
3. the server decodes each payload and the gate rejects malformed or non-finite uploads (``upload_policy``);
   in simulation an ``attack`` may then forge the hostile clients' uploads, which pass the gate again;
4. the ``strategy`` turns the accepted uploads into the next global state (a round with fewer than its
   ``min_clients`` uploads, or an unusable aggregate, keeps the state), and the global model is evaluated.

Clients are spread over Fabric processes (``devices``); every client's randomness derives from
``(seed, round, client)`` and the server aggregates uploads in client order in float64, so the global
state does not depend on how clients are placed, and a resumed run equals an uninterrupted one.

Kept as one file: ``fit``, ``validate`` and ``test`` share the launch, the run folder, the preparation of the module
and data and the evaluation; the trainer reads as one table of contents (set up, restore, rounds, finish).
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_fl import runs, threads
from lightning_fl.errors import ConfigError
from lightning_fl.federated.arrivals.fedbuff import unclocked
from lightning_fl.federated.clients.local import LocalTraining
from lightning_fl.federated.clients.transport import InProcess
from lightning_fl.federated.persistence import budget, round_checkpoint
from lightning_fl.federated.persistence import checkpoint as round_ckpt
from lightning_fl.federated.persistence.ledger import ByteLedger
from lightning_fl.federated.server.round import RoundRunner, RoundSettings
from lightning_fl.federated.server.stages import (
    WRITTEN_WITH,
    record_canaries,
    round_arrivals,
    round_collection,
    round_downlink,
    round_stages,
)
from lightning_fl.federated.trainer import setup
from lightning_fl.federated.trainer.arguments import TrainerArguments
from lightning_fl.federated.trainer.callbacks import CollapseAlarm, ProgressReport, TensorBoardText
from lightning_fl.federated.trainer.evaluate import evaluate
from lightning_fl.federated.trainer.module import ModuleHooks
from lightning_fl.federated.trainer.summary import evaluation_lines, run_summary
from lightning_fl.privacy.base import Plan
from lightning_fl.runs import RunLock
from lightning_fl.trainer_api import TrainerLike, record_environment, write_config


class FederatedTrainer(TrainerArguments, TrainerLike):
    """Federated training of a LightningModule over the clients of a federated data module.

    Its arguments, the CLI's ``trainer.*`` keys, are the fields of
    :class:`~lightning_fl.federated.trainer.arguments.TrainerArguments`."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the checks
        privacy, dp_sgd = self.privacy, self.dp_sgd
        upload_stage = privacy if privacy is not None and privacy.client_stage else None  # local or distributed noise
        self.local = LocalTraining(
            self.local_epochs, self.local_steps, self.gradient_clip_val, upload_stage, dp_sgd, self.secure_aggregation
        )
        if dp_sgd is not None:
            dp_sgd.setup(self.rounds, record_canaries(self))
        #: The server's compressed broadcast (``compressed_downloads``); ``None``: clients download full states.
        self.downlink = round_downlink(self)
        self.fabric_args = {
            "accelerator": self.accelerator,
            "devices": self.devices,
            "strategy": self.fabric_strategy,
            "num_nodes": self.num_nodes,
            "precision": self.precision,
        }
        self.config_yaml: str | None = None
        self.fabric: L.Fabric | None = None
        self.log_dir: Path | None = None
        self._run_lock: RunLock | None = None
        self.history: list[dict[str, float]] = []
        self.callback_metrics: dict[str, float] = {}
        self.global_state: dict[str, torch.Tensor] = {}
        self.ledger: ByteLedger | None = None
        self.current_round = 0
        self.stopped: str | None = None  # why the rounds stopped early (the privacy budget)
        self.population_ledger = None  # a private run's population ledger (federated.budget), on rank 0
        self.draw: str | None = None  # this fit's id in the ledger
        self.alarm: str | None = None  # the collapse warning (CollapseAlarm)
        if self.transport is None:  # in process: the simulation
            self.transport = InProcess(self.cohort_size, self.client_batching)

    # ============================================================================ fit
    def log_config(self, config_yaml: str) -> None:
        """Receive the resolved config from the CLI; written to the run folder when the run starts."""
        self.config_yaml = config_yaml

    def fit(self, model: L.LightningModule, *, datamodule: Any = None, ckpt_path: str | None = None) -> None:
        if (problem := unclocked(vars(self))) is not None:  # (the transport is known now: a ServerApp sets it late)
            raise ConfigError(problem)
        known = isinstance(getattr(datamodule, "num_clients", None), int)  # else it is known after setup
        if known:
            self._check_plan(datamodule.num_clients)  # before any work
        root = Path(self.default_root_dir) / self.name
        ckpt = self._launch(lambda: round_ckpt.find_resume(ckpt_path, self.resume, root, self.version))
        try:
            self._fit(model, datamodule, ckpt, known)
        except BaseException:
            self._discard_empty_folder()
            raise
        finally:
            self._release()

    def _fit(self, model: L.LightningModule, datamodule: Any, ckpt: Path | None, known: bool) -> None:
        """Set up, restore, then every round: run it, evaluate, log, save, and tell the callbacks."""
        model, hooks = self._prepare(model, datamodule, stage="fit")
        if not known:
            self._check_plan(datamodule.num_clients)
        seed, num_clients = self._run_seed(), datamodule.num_clients
        fingerprint = self._set_up_rounds(model, hooks, num_clients, seed)
        budget.open_ledger(self, datamodule)  # a private run's population (its budget, whichever run spends it)
        start = 0 if ckpt is None else self._restore(ckpt, model, seed, fingerprint, num_clients)
        self._write_config()
        if start == 0:  # round 0: the starting model (for FLITE, exactly the pretrained base)
            base = self._evaluate(model, datamodule, "val")
            if self.test_after_fit:
                base.update(self._evaluate(model, datamodule, "test"))
            self._log(base, step=0)
            self.history.append({"round": 0, **base})
        callbacks = [
            ProgressReport(),
            TensorBoardText(hooks.text_samples),
            CollapseAlarm(),
            self.transport,
            *(self.callbacks or []),
        ]
        for callback in callbacks:
            callback.on_rounds_start(self, start)
        started, count = time.perf_counter(), self._clients_per_round(num_clients)
        count = self.round_runner.collection.arrivals.sampled_count(count, num_clients)  # (over-selection)
        for r in range(start, self.rounds):
            if (reason := budget.stop_reason(self)) is not None:
                self.stopped = f"stopped before round {r + 1}: {reason}"
                self.fabric.print(self.stopped)
                break
            self.current_round, t0 = r, time.perf_counter()
            self.global_state, metrics = self.round_runner.run(model, datamodule, self.global_state, r, seed, count)
            model.load_federated_state(self.global_state)
            if budget.private(self):  # in the population's ledger before anything else is written
                metrics.update(budget.charge(self, r + 1, metrics))
            metrics["time/clients_and_server_s"] = time.perf_counter() - t0  # the round without evaluation
            if (clocked := metrics.get("time/simulated_round_s")) is not None:  # summed over the (resumed) history
                metrics["time/simulated_elapsed_s"] = self.history[-1].get("time/simulated_elapsed_s", 0.0) + clocked
            if (r + 1) % self.val_every_n_rounds == 0 or r + 1 == self.rounds:
                metrics.update(self._evaluate(model, datamodule, "val"))
            if self.test_after_fit and r + 1 == self.rounds:  # the final model, read once, saved with its round
                metrics.update(self._evaluate(model, datamodule, "test"))
            metrics["time/round_s"], metrics["time/elapsed_s"] = time.perf_counter() - t0, time.perf_counter() - started
            self._log(metrics, step=r + 1)
            self.history.append({"round": r + 1, **metrics})
            self.callback_metrics = metrics
            record = self._record(seed, fingerprint, num_clients)
            every = self.save_every_n_rounds
            round_checkpoint.save_trainer(self.fabric, record, self._parts(), self.log_dir, r + 1, every, self._private)
            for callback in callbacks:
                callback.on_round_end(self, r + 1, metrics)  # (1-based, as logged)
        for callback in callbacks:
            callback.on_rounds_end(self)
        last = self.history[-1] if self.history else {"round": 0}
        if self.test_after_fit and last["round"] >= 1 and not any(k.startswith("test/") for k in last):  # stopped early
            final = self._evaluate(model, datamodule, "test")
            self._log(final, step=int(self.history[-1]["round"]))
            self.history[-1].update(final)
            self.callback_metrics = {**self.callback_metrics, **final}
        self._finish()
        for stage in self.round_runner.stages:
            stage.finish(self.log_dir, self.fabric.is_global_zero)
        self.fabric.print(self._summary(datamodule))

    # ============================================================================ what the rounds keep and report
    @property
    def _private(self) -> bool:
        """Whether the run releases under a privacy mechanism (its releases are recorded)."""
        return self.privacy is not None or self.dp_sgd is not None

    def _parts(self) -> list:
        """What keeps state in the round checkpoint beside the global state: the stages, the arrival policy."""
        return [*self.round_runner.stages, self.round_runner.collection.arrivals]

    def _record(self, seed: int, fingerprint: str | None, num_clients: int) -> round_checkpoint.RunRecord:
        return round_checkpoint.RunRecord(
            seed, num_clients, fingerprint, self.global_state, self.strategy, self.codec, self.ledger, self.history
        )

    def _restore(self, ckpt: Path, model: L.LightningModule, seed: int, fingerprint: str | None, n: int) -> int:
        """Resume from the round checkpoint ``ckpt``: the rounds it has done."""
        if refusal := next((s.not_resumable for s in self.round_runner.stages if s.not_resumable), None):
            raise ConfigError(refusal)
        rank, world = self.fabric.global_rank, self.fabric.world_size
        keep = (lambda c: self.round_runner.process_of(c, world) == rank) if world > 1 else None
        self.global_state = dict(self.global_state)  # (loaded in place)
        done = round_checkpoint.restore_trainer(
            self.fabric,
            self._record(seed, fingerprint, n),
            self._parts(),
            ckpt,
            rounds=self.rounds,
            folder=self.log_dir,
            keep=keep,
            written_with=WRITTEN_WITH,
            privacy=self.privacy,
            dp_sgd=self.dp_sgd,
        )
        model.load_federated_state(self.global_state)
        return done

    def _summary(self, datamodule: Any) -> str:
        ledger, history = self.ledger, self.history
        data = datamodule.summary_lines() if callable(getattr(datamodule, "summary_lines", None)) else []
        runner = self.round_runner
        return run_summary(
            history,
            self.log_dir,
            self.logger,
            self.stopped,
            self.alarm,
            val_is_test=getattr(datamodule, "val_is_test", False) is True,  # (a data module may not say)
            took_part=(*ledger.took_part(), ledger.num_clients) if ledger is not None else None,
            timing=runner.collection.arrivals.summary(history) if history else [],
            stages=[line for stage in runner.stages for line in stage.summary(history)] if history else [],
            data=data,
        )

    def _set_up_rounds(self, model: L.LightningModule, hooks: ModuleHooks, num_clients: int, seed: int) -> str | None:
        """The global state, ledger, round runner and transport of a fresh fit; the model's fingerprint."""
        fabric, self.model = self.fabric, model
        self.global_state, self.ledger, self.history = model.federated_state(), ByteLedger(num_clients), []
        self.stopped = self.alarm = None
        fingerprint = setup.agree_on_fingerprint(fabric, hooks)
        in_process = isinstance(self.transport, InProcess)
        arrivals = round_arrivals(self, self.local, self._clients_per_round(num_clients))
        collection = round_collection(self, self.local, arrivals)
        # a secure round never shows the server an upload: there is none to check the identity on
        check = self.check_identity and self.strategy.linear and not collection.sum_only
        identity = hooks.averaging_identity_error if check else None
        if self.downlink is not None:
            if not in_process:
                raise ConfigError(
                    "trainer.compressed_downloads is simulated in process: on Flower each node is sent the full global "
                    "state every round and keeps none between rounds to apply a broadcast to; remove the key"
                )
            self.downlink.start(num_clients)
        stages = round_stages(self, fabric, self.local, self.downlink, identity)
        secret = self.privacy is not None and self.privacy.amplified and self.privacy.noise_seed is None
        private = self.privacy is not None or self.dp_sgd is not None  # (statistics outside it: withheld or labelled)
        unprotected = ("label" if self.unprotected_statistics else "withhold") if private else "keep"
        settings = RoundSettings(
            self.sampling, self.dropout, self.upload_policy, secret_cohorts=secret, unprotected=unprotected
        )
        self.round_runner = RoundRunner(fabric, self.strategy, collection, stages, self.ledger, settings)
        if self.strategy.weighted and self.strategy.linear and self.max_client_weight is None and not in_process:
            warnings.warn(
                "trainer.strategy.weighted takes each node's declared sample count as given (a node can "
                "claim any number); set trainer.max_client_weight to bound it",
                stacklevel=3,
            )
        self.transport.open(num_clients=num_clients, fingerprint=fingerprint, seed=seed)
        self._attach_client_state()
        return fingerprint

    def validate(self, model: L.LightningModule, *, datamodule: Any = None, ckpt_path: str | None = None):
        """Evaluate on the validation split (weights from ``ckpt_path``). Its metrics, config and TensorBoard events go
        to a new folder ``<default_root_dir>/<name>/validate_N`` (never the fit's; ``version`` names fits only),
        whose path the printed results name."""
        return self._evaluate_only(model, datamodule, ckpt_path, "val")

    def test(self, model: L.LightningModule, *, datamodule: Any = None, ckpt_path: str | None = None):
        """Evaluate on the test split, into a new folder ``<default_root_dir>/<name>/test_N`` (as :meth:`validate`)."""
        return self._evaluate_only(model, datamodule, ckpt_path, "test")

    # ============================================================================ set-up
    def _launch(self, find_checkpoint: Callable[[], Path | None] = lambda: None, evaluation: str = "") -> Path | None:
        """Start Fabric and claim the run folder (rank 0 decides; ``evaluation``: a new ``<evaluation>_N``); the
        checkpoint to resume, if any."""
        threads.for_run(self.threads)  # before Fabric starts its processes (they inherit it; each shares the cores)
        restart = self.resume in (True, "auto")  # a named run that died before its first checkpoint starts over
        version = None if evaluation else self.version
        self.fabric, self.log_dir, self._run_lock, ckpt = setup.launch(
            self.fabric_args,
            self.logger,
            self.default_root_dir,
            self.name,
            version,
            find_checkpoint,
            restart,
            evaluation or "version",
        )
        return ckpt

    def _release(self) -> None:
        """Let go of the run folder (other processes may resume it from now on)."""
        if self._run_lock is not None:
            self._run_lock.release()
            self._run_lock = None

    def _discard_empty_folder(self) -> None:
        """A run that failed before writing anything leaves no run folder (only its lock was there)."""
        folder = self.log_dir
        self._release()
        if folder is not None and self.fabric is not None and self.fabric.is_global_zero and not runs.holds_run(folder):
            shutil.rmtree(folder, ignore_errors=True)

    def _run_seed(self) -> int:
        return int(self.seed) if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    def _prepare(self, model: L.LightningModule, datamodule: Any, stage: str) -> tuple[L.LightningModule, ModuleHooks]:
        self._datamodule = datamodule
        return setup.prepare(self.fabric, model, datamodule, stage)

    def _write_config(self) -> None:
        if not self.fabric.is_global_zero:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        record_environment(self.log_dir, self.fabric.device)
        experiments = [self.fabric.logger.experiment] if self.fabric.loggers else []
        if self.config_yaml is not None:
            write_config(self.log_dir, self.config_yaml, experiments)
        partition_table = getattr(self._datamodule, "partition_table", None)
        if experiments and callable(partition_table):
            experiments[0].add_text("data/partition", partition_table())

    def _privacy_plan(self, num_clients: int, count: int, seed: int) -> Plan:
        return Plan(
            num_clients=num_clients,
            expected_clients=float(count),
            sampling=self.sampling,
            rounds=self.rounds,
            seed=seed,
            strategy=self.strategy,
            max_update_norm_ratio=self.norm_gate_ratio,
        )

    def _clients_per_round(self, num_clients: int) -> int:
        return self.clients_per_round or max(1, round(self.client_fraction * num_clients))

    def _check_plan(self, num_clients: int) -> None:
        """Refuse an impossible plan before any work; set up the privacy plug-in (checks, noise calibration)."""
        count = min(self._clients_per_round(num_clients), num_clients)
        setup.check_plan(self.strategy, self.attack, num_clients, count, self.sampling)
        if self.privacy is not None:
            self.privacy.setup(self._privacy_plan(num_clients, count, self._run_seed()))

    def _attach_client_state(self) -> None:
        """Give the codec's per-client state its memory budget and folder (``client_state_memory_mb``)."""
        if self.client_state_memory_mb is None or not self.codec.client_stores():
            return
        if self.fabric.world_size > 1:
            raise ConfigError(
                "trainer.client_state_memory_mb keeps per-client codec state in the run folder of one process; "
                f"this run has {self.fabric.world_size}: set trainer.devices 1 (and num_nodes 1) or remove the key"
            )
        self.codec.attach_client_state(self.log_dir / "client_state", int(self.client_state_memory_mb * 2**20))

    # ============================================================================ evaluation and logging
    def _evaluate(self, model: L.LightningModule, datamodule: Any, stage: str) -> dict[str, float]:
        return evaluate(model, datamodule, stage, self.fabric, self.limit_val_batches)

    def _evaluate_only(self, model, datamodule, ckpt_path: str | None, stage: str) -> list[dict[str, float]]:
        command = "validate" if stage == "val" else "test"
        self._launch(evaluation=command)
        try:
            model, hooks = self._prepare(model, datamodule, stage=command)
            if ckpt_path is not None:
                fingerprint = hooks.factor_fingerprint() if hooks.factor_fingerprint is not None else None
                round_ckpt.load_for_evaluation(model, Path(ckpt_path).expanduser(), self.fabric.device, fingerprint)
            metrics = self._evaluate(model, datamodule, stage)
            self._write_config()
            self._log(metrics, step=0)
            self.callback_metrics = metrics
            self._finish()
            if self.fabric.is_global_zero:
                val_is_test = stage == "val" and getattr(datamodule, "val_is_test", False) is True
                print(evaluation_lines(metrics, command, self.log_dir, val_is_test))
            return [metrics]
        except BaseException:
            self._discard_empty_folder()
            raise
        finally:
            self._release()

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.fabric.loggers:
            self.fabric.log_dict(metrics, step=step)

    def _finish(self) -> None:
        self.fabric.barrier()
        for logger in self.fabric.loggers:
            logger.finalize("success")
