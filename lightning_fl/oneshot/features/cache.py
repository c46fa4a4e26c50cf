"""The features cache: one file per extractor and data selection, read as safely as any checkpoint.

A cache file (``features/<digest>/features.pt`` under the package's cache folder, named by
:func:`~lightning_fl.checkpoint.cache_file`) holds the raw train and test features, the extractor's weights,
what was learnt while making them (``info``) and the key's text; ``meta.json`` beside it says the same in
words. The file is derived: one that cannot be used is a cache miss, recomputed and overwritten.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_fl.checkpoint import atomic_save, atomic_write_text, cache_key_text, read_checkpoint, state_mismatch
from lightning_fl.errors import CheckpointError
from lightning_fl.oneshot.features.sets import FeatureSet

log = logging.getLogger(__name__)
MISS = "treated as a cache miss: the features are recomputed and the file overwritten"


def read_features_cache(path: Path, key_text: str, extractor_state: dict[str, Tensor]) -> dict[str, Any] | None:
    """The cache file's contents if it is a usable cache for ``key_text``, else ``None`` (warned about).

    Usable: read safely, written for this key, with ``info``, the extractor's weights (fitting
    ``extractor_state``'s names and shapes) and consistent feature tensors. A folder in the file's place is an
    error: it cannot be overwritten.
    """
    if path.is_dir():
        raise CheckpointError(f"the features cache {path} is a folder, not a file; delete it")
    try:
        data = read_checkpoint(path, "features cache", fix=MISS)
    except CheckpointError as err:
        log.warning("%s", err)
        return None
    problem = None
    if not isinstance(data, dict) or data.get("key") != key_text:
        problem = "it was written for another key or format"
    elif not isinstance(data.get("info"), dict) or not isinstance(data.get("extractor"), dict):
        problem = "it lacks 'info' or 'extractor'"
    elif not all(isinstance(data.get(f"{s}_{f}"), Tensor) for s in ("train", "test") for f in ("h", "y")):
        problem = "it lacks the feature tensors"
    elif any(data[f"{s}_h"].ndim != 2 or len(data[f"{s}_h"]) != len(data[f"{s}_y"]) for s in ("train", "test")):
        problem = "its feature tensors have inconsistent shapes"
    elif not all(isinstance(v, Tensor) for v in data["extractor"].values()):
        problem = "its 'extractor' is not a state dict of tensors"
    elif mismatch := state_mismatch(data["extractor"], extractor_state):
        problem = f"its extractor does not fit: {mismatch}"
    if problem is not None:
        log.warning("features cache %s is unusable (%s); %s", path, problem, MISS)
        return None
    return data


def write_features_cache(
    path: Path,
    key: dict[str, Any],
    extractor_state: dict[str, Tensor],
    sets: dict[str, FeatureSet],
    info: dict[str, Any],
) -> None:
    """Write the cache file (atomically) and its ``meta.json``."""
    payload = {"key": cache_key_text(key), "extractor": extractor_state, "info": info}
    payload.update({f"{s}_{f}": getattr(sets[s], f) for s in sets for f in ("h", "y")})
    atomic_save(payload, path)
    atomic_write_text(path.parent / "meta.json", json.dumps({"key": key, "info": info}, indent=2, default=str))
