"""``python -m lightning_fl fit|validate|test|export --config FILE [--key.sub value ...]``.

A thin jsonargparse program with LightningCLI's syntax. Unlike ``LightningCLI``, the trainer is
a plug-in too: any class with ``fit/validate/test(model, *, datamodule=..., ckpt_path=...)``
works (``lightning.Trainer`` for centralised runs, federated trainers for rounds). Every config
has the keys ``seed_everything``, ``trainer``, ``model``, ``data`` (and ``ckpt_path``).

The fully resolved config (defaults included, the seed made concrete) is saved as
``config.yaml`` in the run folder and logged to TensorBoard as text. Mistakes in the config end
with exit code 2 and one message naming the key and what it accepts.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from jsonargparse import ArgumentError
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback

from lightning_fl import runs
from lightning_fl.cli.build_errors import FailedBuild, build_error, instantiate, name_key, nan_key, quoted_argument
from lightning_fl.cli.parse_errors import format_parse_error, not_finite, yaml_syntax_error
from lightning_fl.cli.parser import asks_for_help, build_parsers, dump_config, full_keys_in_class_help
from lightning_fl.cli.precheck import SUBCOMMANDS, fail, precheck
from lightning_fl.errors import ConfigError, UserError
from lightning_fl.quiet import quiet_lightning, show_progress
from lightning_fl.threads import set_threads
from lightning_fl.trainer_api import TrainerLike, record_environment, write_config


class SaveConfigCallback(Callback):
    """Writes the resolved config to ``<log_dir>/config.yaml`` and logs it to TensorBoard as text, and records the
    machine in ``<log_dir>/environment.json``."""

    def __init__(self, config_yaml: str) -> None:
        self.config_yaml = config_yaml
        self.saved_to: Path | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.saved_to is not None:
            return
        log_dir = trainer.log_dir  # collective: every rank must ask
        if log_dir is None or not trainer.is_global_zero:
            return
        experiments = [getattr(logger, "experiment", None) for logger in trainer.loggers]
        self.saved_to = write_config(log_dir, self.config_yaml, experiments)
        record_environment(log_dir, trainer.strategy.root_device)


class RunSummaryCallback(Callback):
    """Prints what a ``lightning.Trainer`` fit reached and where its files are, when it ends (rank 0)."""

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log_dir = trainer.log_dir  # collective: every rank must ask
        if trainer.is_global_zero:
            print(lightning_summary(trainer, log_dir), flush=True)


def lightning_summary(trainer: L.Trainer, log_dir: str | None) -> str:
    """The final ``val/*`` metrics, the epochs and steps, the checkpoint and the run folder (``log_dir``) of a fit."""
    from lightning_fl.federated.trainer.summary import TEST_AS_VAL

    lines = [f"Finished after {trainer.current_epoch} epoch(s) ({trainer.global_step} optimiser steps)."]
    metrics = trainer.callback_metrics
    if getattr(trainer.datamodule, "val_is_test", False) is True and any(k.startswith("val/") for k in metrics):
        lines.append(f"  {TEST_AS_VAL}")
    for key in sorted(k for k in metrics if k.startswith("val/")):
        lines.append(f"  {key}: {float(metrics[key]):.4f} at the end")
    checkpoint = trainer.checkpoint_callback
    if checkpoint is not None and getattr(checkpoint, "last_model_path", ""):
        lines.append(f"  checkpoint: {checkpoint.last_model_path}")
    if log_dir is not None:
        lines.append(f"  run folder: {log_dir} (config.yaml)")
        if trainer.loggers:
            lines.append(f"  TensorBoard: tensorboard --logdir {Path(log_dir).parent}")
    return "\n".join(lines)


_fail = fail  # (error: ..., the hint, exit code 2)


# --------------------------------------------------------------------------------------- running
def _resolve_seed(value: bool | int) -> int | None:
    if value is False:
        return None
    return L.seed_everything(None if value is True else int(value), workers=True, verbose=False)


def _attach_config(trainer: L.Trainer | TrainerLike, config_yaml: str) -> None:
    if isinstance(trainer, L.Trainer):
        trainer.callbacks.extend([SaveConfigCallback(config_yaml), RunSummaryCallback()])
    elif callable(getattr(trainer, "log_config", None)):
        trainer.log_config(config_yaml)
    else:
        warnings.warn(
            f"{type(trainer).__name__} has no log_config(config_yaml) method; the resolved config is not saved",
            stacklevel=2,
        )


def _check_ckpt_path(
    path: str | None, trainer: L.Trainer | TrainerLike | None = None, model: L.LightningModule | None = None
) -> None:
    """Refuse a ``ckpt_path`` that is missing, or, for ``lightning.Trainer``, one our safe reader refuses.

    Left to itself, Lightning loads ``ckpt_path`` with ``torch.load`` without passing ``weights_only``, so with
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` in the environment it would unpickle anything. Reading the file first
    with :func:`~lightning_fl.checkpoint.read_checkpoint` (``weights_only=True``) refuses a file that needs a
    Python object (or is truncated, or not a Lightning checkpoint) with one clear line before Lightning opens it;
    :func:`main` then also passes ``weights_only=True`` to Lightning, which covers its own names. Lightning's names
    ``last``, ``best`` and ``hpc`` name the run's own files and are left to it; remote checkpoints (URLs, the
    model registry) are refused for ``lightning.Trainer`` as they cannot be checked first. Other trainers read
    their checkpoints themselves (``FederatedTrainer`` through the same reader).
    """
    from lightning_fl.checkpoint import read_checkpoint
    from lightning_fl.errors import CheckpointError

    if path is None or path in {"last", "best", "hpc"}:
        return
    lightning = isinstance(trainer, L.Trainer)
    if "://" in path or path.lower() == "registry" or path.lower().startswith("registry:"):
        if lightning:
            raise CheckpointError(f"ckpt_path {path}: remote checkpoints are not read; download it and pass the file")
        return
    if not lightning:
        if not Path(path).expanduser().is_file():
            raise UserError(
                f"ckpt_path {path} does not exist; pass a checkpoint file (e.g. <run>/checkpoints/last.ckpt)"
            )
        return
    fix = "pass a checkpoint file written by a lightning.Trainer run (e.g. <run>/checkpoints/last.ckpt)"
    ckpt = read_checkpoint(path, "ckpt_path", fix=fix)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise CheckpointError(f"ckpt_path {path} is not a Lightning checkpoint (no 'state_dict'); {fix}")
    own = model.state_dict() if isinstance(model, torch.nn.Module) else {}
    state = ckpt["state_dict"]
    missing = sorted(k for k in own if k not in state)  # (keys a module makes later may be in the file only)
    wrong = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and isinstance(state[k], torch.Tensor) and state[k].shape != v.shape
    ]
    if missing or wrong:
        details = [f"missing {missing[:4]}"] * bool(missing) + [f"shape (file vs model) {wrong[:4]}"] * bool(wrong)
        raise CheckpointError(
            f"ckpt_path {path} does not fit this model ({'; '.join(details)}); pass a checkpoint "
            "of this model and config"
        )


@dataclass
class Run:
    """A parsed and built config: the subcommand, the four plug-ins and the resolved YAML that made them."""

    subcommand: str
    trainer: L.Trainer | TrainerLike
    model: Any
    data: Any
    ckpt_path: str | None
    config_yaml: str
    options: dict[str, Any] = field(default_factory=dict)  # a subcommand's own options (export's --out, --adapter)


class ConfigParseError(UserError):
    """The arguments or the config file could not be parsed (the message names the key)."""


def build(argv: list[str]) -> Run:
    """Parse ``argv`` (``fit --config FILE --key value ...``), seed, and build the plug-ins; do not run.

    Raises :class:`ConfigParseError` or :class:`~lightning_fl.errors.UserError` with one line naming the key.
    Used by :func:`main` and by the Flower apps, which build the same run from the same arguments.
    """
    quiet_lightning()
    show_progress()
    parser, subparsers = build_parsers(field_docs=asks_for_help(argv))
    subcommand = next((a for a in argv if a in SUBCOMMANDS), None)
    try:
        with full_keys_in_class_help(argv):
            cfg = parser.parse_args(list(argv))
    except ArgumentError as err:
        if (bad_yaml := yaml_syntax_error(argv, err)) is not None:
            raise ConfigParseError(f"{subcommand}: {bad_yaml}" if subcommand else bad_yaml) from None
        raise ConfigParseError(format_parse_error(str(err), subcommand)) from None
    subcommand = cfg.subcommand
    sub_cfg = cfg[subcommand]
    if (key := nan_key(sub_cfg)) is not None:
        raise ConfigParseError(f"{subcommand}: {not_finite(key)}")
    try:
        set_threads(sub_cfg.threads)  # before anything is built: data loading and pretraining use them too
    except ConfigError as err:
        raise ConfigParseError(f"{subcommand}: {err}") from None
    seed = _resolve_seed(sub_cfg.seed_everything)
    if seed is not None:
        sub_cfg.seed_everything = seed
    config_yaml = dump_config(subparsers[subcommand], sub_cfg)
    failed = FailedBuild()
    try:
        init = instantiate(parser, cfg, failed)
    except (UserError, ValueError, TypeError, MisconfigurationException) as err:
        if os.environ.get("LIGHTNING_FL_DEBUG"):
            raise
        reason = build_error(err, sub_cfg, failed)
        raise ConfigParseError(f"{subcommand}: could not build the config: {reason}") from None
    run = init[subcommand]
    options = {key: sub_cfg.get(key) for key in ("out", "adapter") if subcommand == "export"}
    return Run(subcommand, run.trainer, run.model, run.data, run.ckpt_path, config_yaml, options)


def main(argv: list[str] | None = None) -> Any:
    """Parse, seed, build the four plug-ins, save the resolved config, and run the subcommand."""
    argv = sys.argv[1:] if argv is None else list(argv)
    precheck(argv)  # (``python -m lightning_fl`` has run it already, before importing this module)
    try:
        run = build(argv)
    except ConfigParseError as err:
        _fail(str(err))
    lock = None
    try:
        if run.subcommand == "export":
            from lightning_fl.cli.export import run_export

            out, adapter = run.options["out"], bool(run.options["adapter"])
            print(run_export(run.model, run.ckpt_path, out, adapter, run.data), flush=True)
            return None
        _check_ckpt_path(run.ckpt_path, run.trainer, run.model)
        _attach_config(run.trainer, run.config_yaml)
        method = getattr(run.trainer, run.subcommand)
        if not isinstance(run.trainer, L.Trainer):
            return method(run.model, datamodule=run.data, ckpt_path=run.ckpt_path)
        # its own version_N (validate_N, test_N for an evaluation), even when runs start together
        lock = runs.claim_for_lightning(run.trainer, "version" if run.subcommand == "fit" else run.subcommand)
        # weights_only passed explicitly: Lightning's torch.load then ignores TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD too
        out = method(run.model, datamodule=run.data, ckpt_path=run.ckpt_path, weights_only=True)
        if run.subcommand != "fit" and (log_dir := run.trainer.log_dir) is not None and run.trainer.is_global_zero:
            from lightning_fl.federated.trainer.summary import EVALUATION_FOLDER, TEST_AS_VAL

            print(f"{run.subcommand}: {EVALUATION_FOLDER.format(log_dir)}", flush=True)  # (a fit's summary says it)
            if run.subcommand == "validate" and getattr(run.data, "val_is_test", False) is True:
                print(f"  {TEST_AS_VAL}", flush=True)
        return out
    except UserError as err:
        _fail(f"{run.subcommand}: {err}")
    except (MisconfigurationException, ValueError, TypeError) as err:  # Lightning/Fabric refusing trainer settings
        quoted = quoted_argument(str(err), type(run.trainer))
        if os.environ.get("LIGHTNING_FL_DEBUG") or not (isinstance(err, MisconfigurationException) or quoted):
            raise
        _fail(f"{run.subcommand}: {name_key(' '.join(str(err).split()), 'trainer', type(run.trainer))}")
    finally:
        if lock is not None:
            lock.release()
        _close_process_group()
    return None


def _close_process_group() -> None:
    """Tear down torch.distributed (several processes) before the interpreter exits: a process group left to
    interpreter shutdown can abort it with ``terminate called without an active exception``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # (the run's own outcome, success or error, is what matters)
            dist.destroy_process_group()
