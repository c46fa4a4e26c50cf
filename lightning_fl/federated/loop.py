"""FederatedTrainer: rounds of client training and server aggregation, with Fabric inside.

It has ``lightning.Trainer``'s interface (``fit/validate/test(model, datamodule=, ckpt_path=)``), so the CLI
runs it from a config like any trainer, and it runs the module's own ``training_step`` and evaluation steps:
the same LightningModule trains centrally and federated. One round:

1. the ``strategy`` samples clients (seeded by the round); each may be unavailable (``dropout``); the global
   federated state is broadcast to the available ones (counted as download);
2. each client runs :func:`~lightning_fl.federated.client.run_client`: it loads the state, trains
   ``local_epochs`` (or ``local_steps``) and encodes its federated state with the ``codec``;
3. the server decodes each payload and the gate rejects malformed or non-finite uploads (``upload_policy``);
   in simulation an ``attack`` may then forge the hostile clients' uploads, which pass the gate again;
4. the ``strategy`` turns the accepted uploads into the next global state (a round with fewer than its
   ``min_clients`` uploads, or an unusable aggregate, keeps the state), and the global model is evaluated;
   with ``compressed_downloads`` the server broadcasts its step compressed, and the next global state is the one
   every client rebuilds from that broadcast (:mod:`lightning_fl.compress.downlink`).

Clients are spread over Fabric processes (``devices``); every client's randomness derives from
``(seed, round, client)`` and the server aggregates uploads in client order in float64, so the global
state does not depend on how clients are placed, and a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from lightning_fl import runs
from lightning_fl.checkpoint import read_checkpoint, remove_stale_temps, state_mismatch, tensor_state
from lightning_fl.compress.base import FP32, Codec
from lightning_fl.compress.client_state import import_files
from lightning_fl.compress.downlink import Downlink
from lightning_fl.compress.error_feedback import UpdateCompressor
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.federated import checkpoint as round_ckpt
from lightning_fl.federated import setup
from lightning_fl.federated.attacks import Attack
from lightning_fl.federated.client import LocalTraining
from lightning_fl.federated.evaluate import evaluate
from lightning_fl.federated.ledger import ByteLedger
from lightning_fl.federated.module import ModuleHooks
from lightning_fl.federated.round import RoundRunner
from lightning_fl.federated.strategies import FedAvg, Strategy
from lightning_fl.federated.strategies.base import configured_name
from lightning_fl.federated.summary import collapse, evaluation_lines, run_summary, write_client_epsilons
from lightning_fl.federated.transport import InProcess, Transport
from lightning_fl.privacy.base import Plan, Privacy
from lightning_fl.privacy.dpsgd import DPSGD
from lightning_fl.privacy.secure import SecureAggregation
from lightning_fl.runs import RunLock
from lightning_fl.trainer_api import TrainerLike, lazy_instance, write_config


class FederatedTrainer(TrainerLike):
    """Simulated federated training of a LightningModule over the clients of a federated data module.

    Args:
        rounds: Communication rounds R.
        client_fraction: Share of the K clients sampled each round (at least one); ``null`` with
            ``clients_per_round`` set.
        clients_per_round: Number of clients sampled each round; overrides ``client_fraction``.
        local_epochs: Local epochs E per round.
        local_steps: Local optimiser steps per round instead of epochs (cycling the client's data).
        strategy: Server algorithm: which clients train and how uploads are aggregated (``FedAvg``,
            ``FedAvgM``, ``FedAdagrad``, ``FedAdam``, ``FedYogi``, ``Median``, ``TrimmedMean``, ``Krum``, or yours).
        codec: Upload codec (``FP32``, ``Quantize``, or a compressor); downloads are float32 states unless
            ``compressed_downloads``.
        compressed_downloads: The server broadcasts each round's step compressed by a copy of the codec (``TopK`` or
            ``PowerSGD``, the same settings) with its own error feedback, and clients apply it to the state they
            hold: they hold the server's state bit for bit. Each sampled client is charged the broadcasts it missed
            (or the float32 state, if fewer bytes; the first time, the state). ``false``: every sampled client
            downloads the float32 state. In process only; see :mod:`lightning_fl.compress.downlink`.
        upload_policy: What the gate does with a malformed or non-finite upload (or a client whose training
            diverges): ``drop`` it from the round (logged) or ``raise`` an error naming client and round.
        max_update_norm: The gate refuses an upload whose change to the global state (L2 norm over the whole
            federated state) exceeds this; ``null``: no absolute bound. The aggregate's step obeys it too.
        max_update_norm_ratio: The gate refuses an upload whose update norm is more than this many times the
            round's median update norm (a scaled or runaway upload); ``null``: off. With a linear strategy
            (FedAvg) the aggregate's step obeys it too. A refused upload follows ``upload_policy``; a refused
            aggregate keeps the global state and names the client with the largest update.
        max_client_weight: The most samples a client's upload may weigh under a sample-weighted strategy: a larger
            declared count is capped to it (warned). In process the counts are the data module's own; on Flower each
            node declares its own, and without this a node claiming ``2**62`` samples takes nearly all the weight.
        dropout: Probability that a sampled client is unavailable in a round (seeded per client and round):
            its download is counted, its upload never arrives.
        attack: Hostile clients for robustness studies (``SignFlip``, ``Scaling``, ``GaussianNoise``, ``ALIE``,
            ``NaNUpload``); ``null``: every client is honest.
        privacy: Differential privacy (``CentralDP``: the server clips each update and noises their sum, with an
            accountant; ``DistributedDP``: each client clips and adds its share of that noise; ``LocalDP``: each
            client clips and noises its own update); ``null``: none. See
            ``docs/privacy.md``.
        dp_sgd: Record-level DP-SGD inside every client (:class:`~lightning_fl.privacy.DPSGD`: Poisson-sampled
            batches, per-record clipping and noise, each client's own accountant); combines with ``privacy``.
            ``null``: plain local training. See ``docs/privacy.md``.
        secure_aggregation: The server learns only the sum of each round's updates
            (:class:`~lightning_fl.privacy.secure.SecureAggregation`: SecAgg+'s clipping range, quantisation and
            modular sum, in process); sum-only: linear, unweighted strategies, no per-update gates. ``null``: off.
        sampling: How a round's clients are drawn: ``fixed`` (``clients_per_round`` of them without replacement)
            or ``poisson`` (each client independently with probability ``clients_per_round / num_clients``, so
            the cohort's size varies; what most DP analyses assume).
        fold_groups: How many running sums a linear strategy's round adds uploads into (client ``c`` into sum
            ``c % fold_groups``, each in client-id order; the sums are then added in group order). The global
            state depends on this number, never on how many processes train the clients. ``1`` (default): one
            sum, the order of a single process; clients spread over several processes then keep their uploads
            as rows and gather them. A multiple of the number of processes (e.g. 8 for 1, 2, 4 or 8 processes)
            lets every process stream its own groups (memory O(D) per group) and still give one process's result
            bit for bit.
        seed: Seed of client sampling and client training; default: the run's ``seed_everything``.
        accelerator: Fabric accelerator (``cpu``, ``gpu``, ``auto``).
        devices: Processes/devices the clients are spread over (``2`` on CPU uses gloo); with several nodes, per node.
        num_nodes: Machines (nodes) the processes span; each node starts ``devices`` processes, ``num_nodes *
            devices`` in all. Start the same command on every node with ``MASTER_ADDR`` (node 0's address),
            ``MASTER_PORT`` (a free port on node 0, the same everywhere) and ``NODE_RANK`` (``0`` to ``num_nodes -
            1``) set; Fabric derives ``WORLD_SIZE``, ``LOCAL_RANK`` and the global ranks itself (do not set them).
            Under SLURM, torchrun, LSF or MPI the cluster sets them instead. See ``docs/deploy.md``.
        fabric_strategy: Fabric's launch strategy (``auto`` picks DDP for several devices; no gradients are
            synchronised, processes only exchange uploads).
        precision: Fabric precision (``32-true``, ``bf16-mixed``, ``16-mixed``, ...); ``null``: 32-bit.
        default_root_dir: Runs go to ``<default_root_dir>/<name>/<version>/``.
        name: Experiment name (folder under ``default_root_dir``).
        version: Run folder name or number; ``null`` picks the next ``version_N``.
        logger: Write TensorBoard logs.
        resume: ``auto`` continues the newest run of ``name`` that has a checkpoint (``--ckpt_path`` wins).
        val_every_n_rounds: Evaluate the global model every this many rounds (and after the last one).
        limit_val_batches: Evaluate on at most this many validation batches (0: no evaluation).
        gradient_clip_val: Clip client gradient norms; ``null`` uses the module's ``grad_clip``, if any.
        check_identity: Log the averaging identity error (modules with ``averaging_identity_error``, linear
            strategies only).
        enable_progress_bar: Show progress over rounds and clients.
        save_every_n_rounds: Also keep ``round_NNNN.ckpt`` every this many rounds (``last.ckpt`` is always kept).
        client_batching: ``sequential`` (clients train one after another) or ``vmap``: ``cohort_size`` clients
            at a time as one vectorised computation (``torch.func``), for latent methods whose clients differ only
            by their trainable parameters; results equal sequential training up to float32 rounding. A module
            that cannot be vectorised (its own ``training_step``, dropout, a scheduler, another optimiser than
            Adam or SGD, mixed precision, streamed or regenerated factors) trains sequentially, with a warning.
            In process only (a Flower deployment trains each client on its node).
        cohort_size: Clients per cohort with ``client_batching: vmap``.
        client_state_memory_mb: Memory (MiB) for the codec's per-client state (error-feedback residuals, PowerSGD
            queries). Beyond it the state of the clients sampled least recently is written to
            ``<run>/client_state/`` and read back when they are sampled again, and round checkpoints name those
            files instead of holding the tensors (each writes only what changed). ``null``: all in memory and in
            every checkpoint. One process only.
    """

    def __init__(
        self,
        rounds: int = 10,
        client_fraction: float | None = 1.0,
        clients_per_round: int | None = None,
        local_epochs: int = 1,
        local_steps: int | None = None,
        strategy: Strategy = lazy_instance(FedAvg),
        codec: Codec = lazy_instance(FP32),
        compressed_downloads: bool = False,
        upload_policy: Literal["drop", "raise"] = "drop",
        max_update_norm: float | None = None,
        max_update_norm_ratio: float | None = 10.0,
        max_client_weight: float | None = None,
        dropout: float = 0.0,
        attack: Attack | None = None,
        privacy: Privacy | None = None,
        dp_sgd: DPSGD | None = None,
        secure_aggregation: SecureAggregation | None = None,
        sampling: Literal["fixed", "poisson"] = "fixed",
        fold_groups: int = 1,
        seed: int | None = None,
        accelerator: str = "auto",
        devices: int | str = 1,
        num_nodes: int = 1,
        fabric_strategy: str = "auto",
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
        client_batching: Literal["sequential", "vmap"] = "sequential",
        cohort_size: int = 32,
        client_state_memory_mb: float | None = None,
    ) -> None:
        checks = [
            (rounds >= 1, f"trainer.rounds must be >= 1, got {rounds}"),
            (0 < client_fraction <= 1 if client_fraction is not None else clients_per_round is not None,
             f"trainer.client_fraction must be in (0, 1] (or null with trainer.clients_per_round set), got "
             f"{client_fraction}"),
            (clients_per_round is None or clients_per_round >= 1,
             f"trainer.clients_per_round must be >= 1 or null, got {clients_per_round}"),
            (local_epochs >= 1, f"trainer.local_epochs must be >= 1, got {local_epochs}"),
            (local_steps is None or local_steps >= 1, f"trainer.local_steps must be >= 1 or null, got {local_steps}"),
            (upload_policy in ("drop", "raise"),
             f"trainer.upload_policy must be 'drop' or 'raise', got {upload_policy!r}"),
            (0 <= dropout < 1, f"trainer.dropout must be in [0, 1), got {dropout}"),
            (num_nodes >= 1, f"trainer.num_nodes must be >= 1, got {num_nodes}"),
            ((d := str(devices).replace(" ", "")) in ("auto", "-1") or (d.isdigit() and int(d) >= 1)
             or ("," in d and d.strip(",") != "" and all(i.isdigit() for i in d.split(",") if i)),
             f"trainer.devices must be a number of processes >= 1, -1 (all GPUs), 'auto' or GPU indices such as "
             f"'0,1', got {devices!r}"),
            (accelerator != "cpu" or not (d == "-1" or ("," in d and d.replace(",", "").isdigit())),
             f"trainer.devices {devices!r} selects GPUs but trainer.accelerator is cpu: give a number of processes"),
            (num_nodes == 1 or str(devices) not in ("auto", "-1"),
             f"trainer.devices must be a number of processes per node when trainer.num_nodes > 1 (every node must "
             f"start the same number), got {devices!r}"),
            (resume in (True, False, "auto"), f"trainer.resume must be true, false or 'auto', got {resume!r}"),
            (val_every_n_rounds >= 1, f"trainer.val_every_n_rounds must be >= 1, got {val_every_n_rounds}"),
            (save_every_n_rounds >= 0, f"trainer.save_every_n_rounds must be >= 0, got {save_every_n_rounds}"),
            (client_batching in ("sequential", "vmap"),
             f"trainer.client_batching must be 'sequential' or 'vmap', got {client_batching!r}"),
            (cohort_size >= 1, f"trainer.cohort_size must be >= 1, got {cohort_size}"),
            (client_state_memory_mb is None or (math.isfinite(client_state_memory_mb) and client_state_memory_mb >= 0),
             f"trainer.client_state_memory_mb must be >= 0 or null, got {client_state_memory_mb}"),
            (isinstance(strategy, Strategy), f"trainer.strategy must be a Strategy, got {type(strategy).__name__}"),
            (sampling in ("fixed", "poisson"), f"trainer.sampling must be 'fixed' or 'poisson', got {sampling!r}"),
            (isinstance(fold_groups, int) and fold_groups >= 1,
             f"trainer.fold_groups must be a whole number >= 1, got {fold_groups!r}"),
            (privacy is None or isinstance(privacy, Privacy),
             f"trainer.privacy must be CentralDP, DistributedDP, LocalDP or null, got {type(privacy).__name__}"),
            (dp_sgd is None or isinstance(dp_sgd, DPSGD),
             f"trainer.dp_sgd must be DPSGD or null, got {type(dp_sgd).__name__}"),
            (secure_aggregation is None or isinstance(secure_aggregation, SecureAggregation),
             f"trainer.secure_aggregation must be SecureAggregation or null, got {type(secure_aggregation).__name__}"),
            (dp_sgd is None or gradient_clip_val is None,
             "trainer.gradient_clip_val clips a batch's gradient, which DP-SGD replaces by clipping each record's "
             "(trainer.dp_sgd.max_grad_norm): remove trainer.gradient_clip_val"),
            (dp_sgd is None or precision in (None, "32-true", "32", 32),
             f"trainer.dp_sgd trains in 32-bit; trainer.precision is {precision!r}: set it to 32-true or null"),
        ]  # fmt: skip
        problems = [message for ok, message in checks if not ok]
        for key, value in (("max_update_norm", max_update_norm), ("max_update_norm_ratio", max_update_norm_ratio),
                           ("max_client_weight", max_client_weight)):  # fmt: skip
            if value is not None and not (math.isfinite(value) and value > 0):
                problems.append(f"trainer.{key} must be a positive number or null, got {value}")
        if isinstance(secure_aggregation, SecureAggregation):
            problems += secure_aggregation.problems(strategy, privacy, codec, max_update_norm_ratio, attack)
        problems += downlink_problems(compressed_downloads, codec, secure_aggregation)
        if problems:
            raise ConfigError("; ".join(problems))
        self.rounds, self.client_fraction, self.clients_per_round = rounds, client_fraction, clients_per_round
        upload_stage = privacy if privacy is not None and privacy.client_stage else None  # local or distributed noise
        self.local = LocalTraining(
            local_epochs, local_steps, gradient_clip_val, upload_stage, dp_sgd, secure_aggregation
        )
        self.dp_sgd = dp_sgd
        if dp_sgd is not None:
            dp_sgd.setup(rounds)
        self.privacy, self.sampling, self.fold_groups = privacy, sampling, fold_groups
        self.strategy, self.codec, self.upload_policy = strategy, codec, upload_policy
        self.compressed_downloads = compressed_downloads
        #: The server's compressed broadcast (``compressed_downloads``); ``None``: clients download full states.
        self.downlink = Downlink(codec) if compressed_downloads else None
        self.max_update_norm, self.max_update_norm_ratio = max_update_norm, max_update_norm_ratio
        self.max_client_weight = max_client_weight
        self.dropout, self.attack, self.seed = dropout, attack, seed
        self.fabric_args = {"accelerator": accelerator, "devices": devices, "strategy": fabric_strategy}
        self.fabric_args["num_nodes"] = num_nodes
        self.fabric_args["precision"] = precision
        self.default_root_dir, self.name, self.version, self.use_logger = default_root_dir, name, version, logger
        self.resume = resume
        self.val_every_n_rounds, self.limit_val_batches = val_every_n_rounds, limit_val_batches
        self.check_identity, self.enable_progress_bar = check_identity, enable_progress_bar
        self.save_every_n_rounds = save_every_n_rounds
        self.client_state_memory_mb = client_state_memory_mb
        self.config_yaml: str | None = None
        self.fabric: L.Fabric | None = None
        self.log_dir: Path | None = None
        self._run_lock: RunLock | None = None
        self.history: list[dict[str, float]] = []
        self.callback_metrics: dict[str, float] = {}
        self.global_state: dict[str, torch.Tensor] = {}
        self.ledger: ByteLedger | None = None
        self.current_round = 0
        #: How rounds reach clients: in process (the simulation) unless a Flower ServerApp sets its own.
        self.client_batching, self.cohort_size = client_batching, cohort_size
        self.transport: Transport = InProcess(cohort_size if client_batching == "vmap" else 0)

    # ============================================================================ public interface
    def log_config(self, config_yaml: str) -> None:
        """Receive the resolved config from the CLI; written to the run folder when the run starts."""
        self.config_yaml = config_yaml

    def fit(self, model: L.LightningModule, *, datamodule: Any = None, ckpt_path: str | None = None) -> None:
        known = isinstance(getattr(datamodule, "num_clients", None), int)  # else it is known after setup
        if known:
            self._check_plan(datamodule.num_clients)  # before any work
        root = Path(self.default_root_dir) / self.name
        ckpt = self._launch(lambda: round_ckpt.find_resume(ckpt_path, self.resume, root, self.version))
        try:
            self._fit(self.fabric, model, datamodule, ckpt, known)
        except BaseException:
            self._discard_empty_folder()
            raise
        finally:
            self._release()

    def _fit(self, fabric: L.Fabric, model: L.LightningModule, datamodule: Any, ckpt: Path | None, known: bool) -> None:
        model, hooks = self._prepare(model, datamodule, stage="fit")
        if not known:
            self._check_plan(datamodule.num_clients)
        seed = self._run_seed()
        self.global_state = model.federated_state()
        self.ledger = ByteLedger(datamodule.num_clients)
        self.history, start = [], 0
        fingerprint = setup.agree_on_fingerprint(fabric, hooks)
        identity = hooks.averaging_identity_error if self.check_identity and self.strategy.linear else None
        if self.local.secure is not None:  # a secure round never shows the server an upload
            identity = None
            if not self.transport.sums_securely or fabric.world_size > 1:
                raise ConfigError(
                    "trainer.secure_aggregation runs in one process or on Flower (SecAgg+), not over several "
                    "processes: set trainer.devices 1 and trainer.num_nodes 1, or remove the key"
                )
        if self.downlink is not None:
            if not isinstance(self.transport, InProcess):
                raise ConfigError(
                    "trainer.compressed_downloads is simulated in process: on Flower each node is sent the full global "
                    "state every round and keeps none between rounds to apply a broadcast to; remove the key"
                )
            self.downlink.start(datamodule.num_clients)
        runner = RoundRunner(
            fabric, self.strategy, self.codec, self.local, self.ledger, self.upload_policy, self.dropout, self.attack,
            identity, progress=self.enable_progress_bar, transport=self.transport,
            max_update_norm=self.max_update_norm, max_update_norm_ratio=self.max_update_norm_ratio,
            privacy=self.privacy, sampling=self.sampling, fold_groups=self.fold_groups,
            max_client_weight=self.max_client_weight, downlink=self.downlink,
        )  # fmt: skip
        self.round_runner = runner
        weighted = getattr(self.strategy, "weighted", False) and self.strategy.linear
        if weighted and self.max_client_weight is None and not isinstance(self.transport, InProcess):
            warnings.warn("trainer.strategy.weighted takes each node's declared sample count as given (a node can "
                          "claim any number); set trainer.max_client_weight to bound it", stacklevel=2)  # fmt: skip
        self.transport.open(num_clients=datamodule.num_clients, fingerprint=fingerprint, seed=seed)
        count = self._clients_per_round(datamodule.num_clients)
        self._attach_client_state()
        if ckpt is not None:
            start = self._restore(ckpt, model, seed, fingerprint, datamodule.num_clients)
        self._write_config()
        show = self.enable_progress_bar and fabric.is_global_zero
        terminal = sys.stderr.isatty()  # elsewhere (CI logs, files) a plain line every tenth of the run instead
        bar = tqdm(total=self.rounds, initial=start, desc="round", dynamic_ncols=True, disable=not (show and terminal))
        if start == 0:  # round 0: the starting model (for FLITE, exactly the pretrained base)
            base_metrics = self._evaluate(model, datamodule, "val")
            self._log(base_metrics, step=0)
            self._log_text(hooks, step=0)
            self.history.append({"round": 0, **base_metrics})
        started = time.perf_counter()
        self.stopped, self.alarm = None, None
        for r in range(start, self.rounds):
            if self.privacy is not None and (reason := self.privacy.stop_reason()) is not None:
                self.stopped = f"stopped before round {r + 1}: {reason}"
                fabric.print(self.stopped)
                break
            self.current_round = r
            t0 = time.perf_counter()
            self.global_state, metrics = runner.run(model, datamodule, self.global_state, r, seed, count)
            model.load_federated_state(self.global_state)
            metrics["time/clients_and_server_s"] = time.perf_counter() - t0  # the round without evaluation
            if (r + 1) % self.val_every_n_rounds == 0 or r + 1 == self.rounds:
                metrics.update(self._evaluate(model, datamodule, "val"))
            metrics["time/round_s"] = time.perf_counter() - t0
            metrics["time/elapsed_s"] = time.perf_counter() - started
            self._check_collapse(model, r, metrics, runner)
            self._log(metrics, step=r + 1)
            self._log_dropped(runner.dropped, step=r + 1)
            self.history.append({"round": r + 1, **metrics})
            self.callback_metrics = metrics
            self._save_checkpoint(r + 1, seed, fingerprint, datamodule.num_clients)
            self.transport.finished_round(r, metrics)
            bar.update(1)
            # the metric, and the cumulative bytes per client (both directions) in MiB
            shown = {k: f"{metrics[k]:.4f}" for k in ("val/acc", "val/ppl") if k in metrics}
            shown["MiB/client"] = f"{metrics['comm/cum_client_bytes'] / 2**20:.3f}"
            bar.set_postfix(shown)
            if show and not terminal and ((r + 1) % max(1, self.rounds // 10) == 0 or r + 1 == self.rounds):
                print(f"round {r + 1}/{self.rounds}: " + ", ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
        bar.close()
        if start < self.rounds:
            self._log_text(hooks, step=self.rounds)
        self._finish()
        if self.dp_sgd is not None and fabric.is_global_zero:
            write_client_epsilons(self.dp_sgd, self.log_dir / "dp_sgd_clients.csv")
        fabric.print(run_summary(self.history, self.log_dir, self.use_logger, self.stopped, self.alarm))

    def _check_collapse(self, model: L.LightningModule, r: int, metrics: dict[str, float], runner: RoundRunner) -> None:
        """Warn once per run when the global model collapses (against round 0), naming the largest updates."""
        start = next((h for h in self.history if h.get("round") == 0), None)
        if self.alarm is not None or start is None:
            return
        hparams = getattr(model, "hparams", {})
        num_classes = hparams.get("num_classes") if hasattr(hparams, "get") else None
        why = collapse(start, metrics, num_classes if isinstance(num_classes, int) else None)
        if why is None:
            return
        largest = ", ".join(f"client {c} (norm {n:.3g})" for n, c in runner.update_norms[:3]) or "none known"
        self.alarm = (f"round {r + 1}: the global model collapsed: {why}; the largest updates aggregated: {largest}; "
                      "a robust strategy (trainer.strategy Median or Krum) or a lower trainer.max_update_norm_ratio "
                      "may hold it")  # fmt: skip
        warnings.warn(self.alarm, stacklevel=2)

    def validate(self, model: L.LightningModule, *, datamodule: Any = None, ckpt_path: str | None = None):
        return self._evaluate_only(model, datamodule, ckpt_path, "val")

    def test(self, model: L.LightningModule, *, datamodule: Any = None, ckpt_path: str | None = None):
        return self._evaluate_only(model, datamodule, ckpt_path, "test")

    # ============================================================================ set-up
    def _launch(self, find_checkpoint: Callable[[], Path | None] = lambda: None) -> Path | None:
        """Start Fabric and claim the run folder (rank 0 decides); the checkpoint to resume, if any."""
        root, name, version = self.default_root_dir, self.name, self.version
        restart = self.resume in (True, "auto")  # a named run that died before its first checkpoint starts over
        self.fabric, self.log_dir, self._run_lock, ckpt = setup.launch(
            self.fabric_args, self.use_logger, root, name, version, find_checkpoint, restart
        )
        return ckpt

    def _release(self) -> None:
        """Let go of the run folder (other processes may resume it from now on)."""
        if self._run_lock is not None:
            self._run_lock.release()
            self._run_lock = None

    def _run_seed(self) -> int:
        return int(self.seed) if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    def _prepare(self, model: L.LightningModule, datamodule: Any, stage: str) -> tuple[L.LightningModule, ModuleHooks]:
        self._datamodule = datamodule
        return setup.prepare(self.fabric, model, datamodule, stage)

    def _write_config(self) -> None:
        fabric = self.fabric
        if not fabric.is_global_zero:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        experiments = [fabric.logger.experiment] if fabric.loggers else []
        if self.config_yaml is not None:
            write_config(self.log_dir, self.config_yaml, experiments)
        partition_table = getattr(self._datamodule, "partition_table", None)
        if experiments and callable(partition_table):
            experiments[0].add_text("data/partition", partition_table())

    # ============================================================================ evaluation
    def _evaluate(self, model: L.LightningModule, datamodule: Any, stage: str) -> dict[str, float]:
        return evaluate(model, datamodule, stage, self.fabric, self.limit_val_batches)

    def _evaluate_only(self, model, datamodule, ckpt_path: str | None, stage: str) -> list[dict[str, float]]:
        self._launch()
        try:
            return self._evaluate_in_folder(model, datamodule, ckpt_path, stage)
        except BaseException:
            self._discard_empty_folder()
            raise
        finally:
            self._release()

    def _discard_empty_folder(self) -> None:
        """A run that failed before writing anything leaves no run folder (only its lock was there)."""
        folder = self.log_dir
        self._release()
        if folder is not None and self.fabric is not None and self.fabric.is_global_zero and \
                not runs.holds_run(folder):  # fmt: skip
            shutil.rmtree(folder, ignore_errors=True)

    def _evaluate_in_folder(self, model, datamodule, ckpt_path: str | None, stage: str) -> list[dict[str, float]]:
        model, _ = self._prepare(model, datamodule, stage="validate" if stage == "val" else "test")
        if ckpt_path is not None:
            self._load_for_evaluation(model, Path(ckpt_path).expanduser())
        metrics = self._evaluate(model, datamodule, stage)
        self._write_config()
        self._log(metrics, step=0)
        self.callback_metrics = metrics
        self._finish()
        if self.fabric.is_global_zero:
            print(evaluation_lines(metrics, "validate" if stage == "val" else "test", self.log_dir))
        return [metrics]

    def _load_for_evaluation(self, model, path: Path) -> None:
        """A round checkpoint's global state (checked as a resume checks it) or a module's ``state_dict`` (names,
        shapes, finite values), into ``model``; anything else is one line naming the file."""
        name, fix = f"--ckpt_path {path}", "pass a last.ckpt or round_NNNN.ckpt of a run, or a module state_dict"
        ckpt = read_checkpoint(path, "--ckpt_path", fix=fix)
        device = self.fabric.device
        if isinstance(ckpt, dict) and ckpt.get("format") == round_ckpt.FORMAT:
            round_ckpt.check_integrity(path, ckpt)
            own = model.federated_state()
            if (problem := state_mismatch(ckpt["global_state"], own)) is not None:
                raise CheckpointError(f"{name}: its global state does not fit this model ({problem}); {fix}")
            model.load_federated_state({n: t.to(device) for n, t in ckpt["global_state"].items()})
            return
        state = tensor_state(ckpt, name, keys=("state_dict",), fix=fix)
        if (problem := state_mismatch(state, model.state_dict())) is not None:
            raise CheckpointError(f"{name}: its state_dict does not fit this model ({problem}); {fix}")
        bad = sorted(k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
        if bad:
            raise CheckpointError(f"{name}: NaN or Inf weights in {bad[:4]}; {fix}")
        model.load_state_dict(state)

    # ============================================================================ logging and checkpoints
    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.fabric.loggers:
            self.fabric.log_dict(metrics, step=step)

    def _log_text(self, hooks: ModuleHooks, step: int) -> None:
        """The module's text samples (e.g. generated text) under TensorBoard's Text tab, from rank 0."""
        if hooks.text_samples is None or not self.fabric.loggers or not self.fabric.is_global_zero:
            return
        experiment = self.fabric.logger.experiment
        for tag, text in hooks.text_samples().items():
            experiment.add_text(tag, text, step)

    def _log_dropped(self, dropped: list[int], step: int) -> None:
        """The ids of the clients the gate left out of round ``step`` (TensorBoard Text, ``fed/dropped_clients``)."""
        if dropped and self.fabric.loggers and self.fabric.is_global_zero:
            self.fabric.logger.experiment.add_text("fed/dropped_clients", ", ".join(map(str, dropped)), step)

    def _finish(self) -> None:
        self.fabric.barrier()
        for logger in self.fabric.loggers:
            logger.finalize("success")

    def _privacy_plan(self, num_clients: int, count: int, seed: int) -> Plan:
        return Plan(
            num_clients=num_clients, expected_clients=float(count), sampling=self.sampling, rounds=self.rounds,
            seed=seed, strategy=self.strategy, max_update_norm_ratio=self.max_update_norm_ratio,
        )  # fmt: skip

    def _clients_per_round(self, num_clients: int) -> int:
        return self.clients_per_round or max(1, round(self.client_fraction * num_clients))

    def _check_plan(self, num_clients: int) -> None:
        """Refuse an impossible plan before any work; set up the privacy plug-in (checks, noise calibration)."""
        count = min(self._clients_per_round(num_clients), num_clients)
        setup.check_plan(self.strategy, self.attack, num_clients, count, self.sampling)
        if self.privacy is not None:
            self.privacy.setup(self._privacy_plan(num_clients, count, self._run_seed()))

    def _attach_client_state(self) -> None:
        """Give the codec's per-client stores their memory budget and folder (``client_state_memory_mb``)."""
        stores = self.codec.client_stores()
        if self.client_state_memory_mb is None or not stores:
            return
        if self.fabric.world_size > 1:
            raise ConfigError(
                "trainer.client_state_memory_mb keeps per-client codec state in the run folder of one process; "
                f"this run has {self.fabric.world_size}: set trainer.devices 1 (and num_nodes 1) or remove the key"
            )
        for name, store in stores.items():
            store.attach(self.log_dir / "client_state" / name, int(self.client_state_memory_mb * 2**20))

    def _codec_state(self) -> dict:
        """The codec's state with every process's per-client entries (each process holds the clients it trains);
        a collective: every process calls it."""
        state = self.codec.state_dict()
        stores = self.codec.client_stores()
        if self.fabric.world_size > 1 and stores:
            for name in stores:
                everyone: list[dict] = [{} for _ in range(self.fabric.world_size)]
                dist.all_gather_object(everyone, state[name])
                state[name] = {c: entry for part in everyone for c, entry in part.items()}
        return state

    def _restore_downlink(self, path: Path, ckpt: dict) -> None:
        """The server's downlink memory and what each client holds, from a checkpoint of the same kind of run."""
        if self.downlink is None:
            if "downlink" in ckpt:
                raise CheckpointError(
                    f"cannot resume from {path}: it was written with trainer.compressed_downloads (its clients hold "
                    "the broadcasts' state, the server a downlink memory); set trainer.compressed_downloads true"
                )
            return
        if "downlink" not in ckpt:
            raise CheckpointError(
                f"cannot resume from {path}: it was written without trainer.compressed_downloads (no downlink memory "
                "to continue); remove the key, or start afresh"
            )
        try:
            self.downlink.load_state_dict(ckpt["downlink"], int(ckpt["round"]))
        except (ValueError, TypeError, KeyError) as err:
            raise CheckpointError(f"cannot resume from {path}: {err}") from None

    def _save_checkpoint(self, completed: int, seed: int, fingerprint: str | None, num_clients: int) -> None:
        codec_state = self._codec_state()
        kept = bool(self.save_every_n_rounds) and completed % self.save_every_n_rounds == 0
        if self.fabric.is_global_zero:
            state = {
                "seed": seed,
                "num_clients": num_clients,
                "fingerprint": fingerprint,
                "global_state": round_ckpt.to_cpu(self.global_state),
                "strategy_class": self.strategy.name,
                "strategy": self.strategy.state_dict(),
                "codec": codec_state,
                "privacy": self.privacy.state_dict() if self.privacy is not None else {},
                "dp_sgd": self.dp_sgd.state_dict() if self.dp_sgd is not None else {},
                "ledger": self.ledger.state_dict(),
                "history": [{k: float(v) for k, v in h.items()} for h in self.history],
            }
            if self.downlink is not None:  # its memory and which state each client holds
                state["downlink"] = self.downlink.state_dict()
            round_ckpt.save_round(state, self.log_dir / "checkpoints", completed, self.save_every_n_rounds)
        for store in self.codec.client_stores().values():
            store.committed(pin=kept)  # files the saved checkpoint superseded can go
        self.fabric.barrier()

    def _restore(self, path: Path, model, seed: int, fingerprint: str | None, num_clients: int) -> int:
        expect = {
            "seed": seed,
            "num_clients": num_clients,
            "fingerprint": fingerprint,
            "strategy": self.strategy.name,
        }
        ckpt, error = None, None
        if self.fabric.is_global_zero:  # rank 0 reads it and sends it to every process
            try:
                ckpt = round_ckpt.load_round(path, expect, list(self.global_state), self.rounds)
            except CheckpointError as err:
                error = str(err)
        ckpt, error = self.fabric.broadcast((ckpt, error))
        if error is not None:
            raise CheckpointError(error)
        device = self.fabric.device
        self.global_state = {n: t.to(device) for n, t in ckpt["global_state"].items()}
        model.load_federated_state(self.global_state)
        self.strategy.load_state_dict(ckpt["strategy"])
        stores = self.codec.client_stores()
        for name, store in stores.items():  # a checkpoint of another run folder: bring its client files here
            if store.file_backed and setup.run_folder_of(path) is not None:
                source = setup.run_folder_of(path) / "client_state" / name
                import_files(ckpt["codec"].get(name, {}), source, store.folder)
        self.codec.load_state_dict(ckpt["codec"])
        rank, world = self.fabric.global_rank, self.fabric.world_size
        for store in stores.values() if world > 1 else ():  # each process keeps the clients it trains
            store.retain(lambda c: self.round_runner.process_of(c, world) == rank)
        self.ledger.load_state_dict(ckpt["ledger"])
        self._restore_downlink(path, ckpt)
        if self.privacy is not None:
            self.privacy.load_state_dict(ckpt.get("privacy", {}))
        elif ckpt.get("privacy"):
            raise CheckpointError(
                f"cannot resume from {path}: it was written by a private run (trainer.privacy); set the same "
                "trainer.privacy to continue its budget"
            )
        if self.dp_sgd is not None:
            self.dp_sgd.load_state_dict(ckpt.get("dp_sgd", {}))
        elif ckpt.get("dp_sgd"):
            raise CheckpointError(
                f"cannot resume from {path}: it was written by a run with trainer.dp_sgd; set the same trainer.dp_sgd "
                "to continue its clients' budgets"
            )
        self.history = list(ckpt.get("history", []))
        if self.fabric.is_global_zero:
            remove_stale_temps(path.parent)
        return int(ckpt["round"])


def downlink_problems(compressed_downloads: object, codec: object, secure_aggregation: object) -> list[str]:
    """What makes ``trainer.compressed_downloads`` impossible with the other settings (one line each)."""
    if compressed_downloads is False:
        return []
    if compressed_downloads is not True:
        return [f"trainer.compressed_downloads must be true or false, got {compressed_downloads!r}"]
    if secure_aggregation is not None:
        return ["trainer.compressed_downloads compresses the broadcast with the codec's compressor, but "
                "trainer.secure_aggregation uploads with none (codec FP32): remove one of the two keys"]  # fmt: skip
    if not isinstance(codec, UpdateCompressor):
        return [f"trainer.compressed_downloads compresses the broadcast with the codec's compressor and error "
                f"feedback, and trainer.codec {configured_name(codec)} is not a compressor: set trainer.codec TopK "
                "or PowerSGD, or remove the key"]  # fmt: skip
    return []
