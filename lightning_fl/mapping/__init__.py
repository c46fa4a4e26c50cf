"""FLITE's latent mapping: frozen seeded low-rank factors that turn a small latent into weight deltas."""

from lightning_fl.mapping.factors import CHUNK_ROWS, OrthonormalFactor, orthonormal_factor
from lightning_fl.mapping.lowrank import (
    FactorMode,
    LatentMapping,
    MappedLayer,
    MemoryReport,
    memory_report,
    plan_layers,
    select_weights,
)
from lightning_fl.seeding import derive_seed

__all__ = [
    "CHUNK_ROWS",
    "FactorMode",
    "LatentMapping",
    "MappedLayer",
    "MemoryReport",
    "OrthonormalFactor",
    "derive_seed",
    "memory_report",
    "orthonormal_factor",
    "plan_layers",
    "select_weights",
]
