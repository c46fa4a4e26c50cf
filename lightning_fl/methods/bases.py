"""The pretrained base: made once per setting, cached on disk, read by every run and process that needs it.

A method (:class:`~lightning_fl.methods.recipe.TrainingRecipe`) names what determines its base (``base_cache_key``:
loop, initial weights, data, pretraining recipe, architecture); :func:`cache_key` adds the machine that makes it
(:func:`~lightning_fl.checkpoint.compute_environment` of the pretraining device: torch, the CPU's kernel level and
thread count, or the GPU), since the same recipe and seed pretrain other bases on another machine; the hash of that
key names the cache folder, so a cache copied to another kind of machine misses there and the base is made again,
never mixed in silently. :func:`prepare` loads the base from there, making and caching it first when allowed (one
process makes it, the others read it); a cached file that cannot be used (unreadable, unsafe, another model's) is a
cache miss, warned about, made again and overwritten. :func:`pretrain` is the usual way to make it: the method's
``pretraining_module`` trained with its ``pretraining`` recipe by the centralised loop.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.seed import isolate_rng

from lightning_fl.checkpoint import atomic_save, atomic_write_text, cache_file, compute_environment
from lightning_fl.errors import CheckpointError
from lightning_fl.methods.centralised import resolve_device, train_classifier

log = logging.getLogger(__name__)
WHAT = "pretrained base cache"


def cache_key(module: Any, datamodule: object) -> dict[str, Any]:
    """``module``'s ``base_cache_key`` and the compute environment its base is made in (the pretraining device's)."""
    device = resolve_device(module.pretraining.accelerator)
    return module.base_cache_key(datamodule) | {"environment": compute_environment(device)}


def cache_path(module: Any, datamodule: object) -> Path:
    """Where ``module``'s base for ``datamodule`` is cached (named by the hash of :func:`cache_key`)."""
    return cache_file("bases", cache_key(module, datamodule), "base.pt", module.pretraining.cache_dir)


def prepare(module: Any, datamodule: object, allow_training: bool = True) -> None:
    """Load ``module``'s base into it from the cache, making and caching it first if needed (and allowed)."""
    if module._base_ready:
        return
    path = module.base_cache_path(datamodule)
    if path.is_file() and allow_training:
        try:
            module.load_weights(path, WHAT, fix="treated as a cache miss: pretraining it again")
        except CheckpointError as err:
            log.warning("%s", err)
            _make(module, datamodule, path)
        else:
            module._base_ready = True
            return
    if not path.is_file():
        if not allow_training:
            raise CheckpointError(f"the pretrained base {path} is missing; it should have been prepared first")
        _make(module, datamodule, path)
    module.load_weights(path, WHAT, fix="delete it; the next run pretrains it again")
    module._base_ready = True


def _make(module: Any, datamodule: object, path: Path) -> None:
    state, made = module.build_base(datamodule, path.parent)
    atomic_save({"state_dict": {k: v.detach().cpu() for k, v in state.items()}}, path)
    meta = {"key": cache_key(module, datamodule), **made}
    atomic_write_text(path.parent / "meta.json", json.dumps(meta, indent=2, sort_keys=True, default=str))


def pretrain(module: Any, datamodule: object, folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Train ``module.pretraining_module()`` with ``module.pretraining``'s recipe (logs under ``folder``): its
    weights, and the last epoch's metrics to record beside them."""
    p = module.pretraining
    log.warning("Pretraining the base for %d epochs (cached in %s)", p.epochs, folder)
    pre = module.pretraining_module()
    with isolate_rng():
        torch.manual_seed(p.seed)
        metrics = train_classifier(
            pre, datamodule, p.epochs, p.accelerator, p.precision, log_dir=folder / "pretraining"
        )
    return pre.own_weights(), {"final_epoch": metrics}
