"""FLITE's delta low-rank mapping: ``theta_l = theta_pre_l + U_l V_l^T z_l`` (FLITE, arXiv 2607.18343, section 3.3).

Only the latents ``z`` (one flat vector of ``D = sum_l d_l`` floats) train. ``U_l`` (``P_l x r``) and
``V_l`` (``d_l x r``) are frozen, with orthonormal columns, regenerated from one 64-bit seed and the
layer index (see :mod:`lightning_fl.mapping.factors`), so every client builds the same map and
averaging latents is exactly averaging weights (equation 4). ``z`` starts at zero, so the mapped
model starts exactly at the pretrained one.

Factor modes (``mode``) trade memory for recomputation; the first three give the same factors
(and the same fingerprint), so clients may pick different modes within one federation:

- ``stored``: U and V materialised once as buffers (``4 r (P_l + d_l)`` bytes per layer). U is kept column-major
  (``P_l x r`` with strides ``(1, P_l)``, as ``dense``'s W): a step's two matrix-vector products, ``U (V^T z)`` and
  ``U^T g``, then stream U's columns, 2-3x faster on CPU than over its rows of ``r`` floats (docs/results-systems.md,
  "Against pfl-research"); the same values, summed in another order (float32 rounding).
- ``regenerate``: V stored (tiny); U_l rebuilt from the seed whenever it is used, in forward and
  again in backward, and dropped after use: peak extra memory one layer's U.
- ``streamed``: V stored; U's rows produced in chunks of ``CHUNK_ROWS`` and consumed at once,
  never materialised: peak extra memory a few MB, at the cost of regenerating U twice per step.
- ``dense``: the original mapping network's dense projection ``theta = theta_pre + W z``, ``W`` a
  ``P x d`` matrix with orthonormal columns: for small models only (``max_dense_bytes`` guards it).
- ``kronecker``: another family of exactly orthonormal ``U_l`` (see
  :class:`~lightning_fl.mapping.factors.KroneckerFactor`): random signs times the Kronecker product of two
  small orthonormal factors, applied as two small matrix products and never formed. Memory ``4 P_l`` bytes
  (the signs) plus the small factors (``O(sqrt(P_l) r)`` when ``P_l`` has a divisor near its square root, as
  conv weights do; a prime ``P_l`` falls back to a whole-layer factor), and about ``sqrt(r)`` times fewer
  flops than ``stored``. Its factors
  differ from the first three modes' (another fingerprint): every client of a federation must use it.
- ``two_sided``: ``U_l = A_l kron B_l`` shaped by the layer's own ``out x in`` matrix (see
  :mod:`lightning_fl.mapping.two_sided`): for ``nn.Linear`` weights only, the delta ``A C B^T`` is applied to the
  layer's input (:meth:`LatentMapping.applied`) and never formed, nor is the weight's gradient. Memory
  ``4 (m p + n q)`` bytes per layer plus V; the family for large language models. Its own fingerprint. With
  ``rank`` equal to ``latent_dim``, ``V`` is the identity (:func:`identity_v`): the latent is the grid itself.

``rank`` is capped per layer at ``min(rank, d_l, P_l)``: ``U V^T`` cannot have a larger rank.

Kept as one file: the memory report (:func:`memory_report`, over the same layer plan as :class:`LatentMapping`)
states in bytes what each mode above keeps; apart, a change to a mode would be made in two files.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Literal, get_args

import torch
from torch import nn
from torch.func import functional_call

from lightning_fl.errors import ConfigError
from lightning_fl.mapping.factors import (
    CHUNK_ROWS,
    KroneckerFactor,
    OrthonormalFactor,
    kronecker_projection,
    kronecker_shape,
    regenerated_projection,
    streamed_projection,
)
from lightning_fl.mapping.kept import KeptStart
from lightning_fl.mapping.two_sided import (
    TwoSidedFactor,
    add_two_sided,
    two_sided_delta,
    two_sided_hook,
    two_sided_shape,
)
from lightning_fl.seeding import STREAM_DENSE, STREAM_U, STREAM_V

FactorMode = Literal["stored", "regenerate", "streamed", "dense", "kronecker", "two_sided"]
FACTOR_MODES = get_args(FactorMode)
LayerSelection = Literal["conv", "linear", "conv+linear"]
FLOAT_BYTES = 4


@dataclass(frozen=True)
class MappedLayer:
    """One mapped weight tensor: where its latent lives in the flat ``z`` and its factor sizes."""

    index: int
    name: str
    shape: tuple[int, ...]
    numel: int  # P_l
    latent_dim: int  # d_l
    rank: int  # r_l = min(rank, d_l, P_l)
    offset: int  # start of z_l in the flat latent


def select_weights(module: nn.Module, layers: LayerSelection | Sequence[str]) -> list[str]:
    """Names of the weight tensors to map, in module order.

    ``conv``: every ``nn.Conv{1,2,3}d`` weight; ``linear``: every ``nn.Linear`` weight; ``conv+linear``:
    both; a list: ``fnmatch`` patterns matched against parameter names (e.g. ``["layer4.*.conv*.weight"]``).
    """
    if isinstance(layers, str):
        kinds = {"conv": (nn.Conv1d, nn.Conv2d, nn.Conv3d), "linear": (nn.Linear,)}
        if layers not in ("conv", "linear", "conv+linear"):
            raise ConfigError(
                f"model.layers must be 'conv', 'linear', 'conv+linear' or a list of patterns, got {layers!r}"
            )
        types = tuple(t for part in layers.split("+") for t in kinds[part])
        names = [f"{m}.weight" if m else "weight" for m, mod in module.named_modules() if isinstance(mod, types)]
        owned = dict(module.named_parameters())  # a tied weight is listed once, under its first name
        if shared := [n for n in names if n not in owned]:
            tensor = module.get_parameter(shared[0])
            other = next((n for n, p in owned.items() if p is tensor), "another parameter")
            raise ConfigError(
                f"model.layers={layers!r} selects {shared[0]}, which is tied to {other} (one tensor): choose the "
                "weights by name patterns that leave it out"
            )
    else:
        params = [n for n, _ in module.named_parameters()]
        names = [n for n in params if any(fnmatch.fnmatchcase(n, p) for p in layers)]
    if not names:
        example = next((n for n, p in module.named_parameters() if p.dim() >= 2), "(it has no weight matrix)")
        if isinstance(layers, str):
            fix = "give name patterns of its weights"
        else:
            fix = "fnmatch patterns match whole parameter names"
        raise ConfigError(
            f"model.layers={layers!r} selects no weight of {type(module).__name__}: {fix}, e.g. "
            f"model.layers ['{example}'] or with a wildcard ['*.{example.rsplit('.', 2)[-2]}.weight']"
        )
    return names


def plan_layers(
    module: nn.Module, latent_dim: int | Sequence[int], rank: int, layers: LayerSelection | Sequence[str]
) -> list[MappedLayer]:
    """The mapped layers with their latent sizes and ranks, without allocating any factor."""
    names = select_weights(module, layers)
    dims = [latent_dim] * len(names) if isinstance(latent_dim, int) else list(latent_dim)
    if len(dims) != len(names):
        raise ConfigError(
            f"model.latent_dim has {len(dims)} entries but model.layers selects {len(names)} weights; give one "
            "int for all layers or one per layer"
        )
    if min(dims) < 1 or rank < 1:
        raise ConfigError(f"model.latent_dim and model.rank must be >= 1, got {latent_dim} and {rank}")
    params = dict(module.named_parameters())
    plan, offset = [], 0
    for i, (name, d) in enumerate(zip(names, dims, strict=True)):
        shape = tuple(params[name].shape)
        numel = params[name].numel()
        plan.append(MappedLayer(i, name, shape, numel, d, min(rank, d, numel), offset))
        offset += d
    return plan


@dataclass(frozen=True)
class MemoryReport:
    """Bytes the projection needs beyond the model itself, per factor mode (fp32)."""

    layers: int
    mapped_weights: int  # sum_l P_l
    latent_size: int  # D = sum_l d_l
    dense_bytes: int  # sum_l P_l d_l
    stored_bytes: int  # sum_l r_l (P_l + d_l)
    regenerate_peak_bytes: int  # V stored + the largest layer's U + one float64 chunk
    streamed_peak_bytes: int  # V stored + one chunk of U (float64 draw and product, float32 copy)
    kronecker_bytes: int  # V stored + per layer the signs (P_l) and the two small factors (a p + b q)
    two_sided_bytes: int | None = None  # V stored + per layer A and B (m p + n q); None: a mapped weight is not 2-D

    def as_table(self) -> str:
        mib = 2**20
        rows = [
            ("dense projection:       ", self.dense_bytes, ""),
            ("low-rank stored:        ", self.stored_bytes, ""),
            ("low-rank regenerate:    ", self.regenerate_peak_bytes, " peak"),
            ("low-rank streamed:      ", self.streamed_peak_bytes, " peak"),
            ("low-rank kronecker:     ", self.kronecker_bytes, ""),
            ("low-rank two-sided:     ", self.two_sided_bytes, ""),
        ]
        head = f"mapped layers: {self.layers}, mapped weights P: {self.mapped_weights:,}, "
        head += f"latent D: {self.latent_size:,}"
        return "\n".join(
            [head] + [f"{label} {n:>16,} bytes{peak} ({n / mib:,.1f} MiB)" for label, n, peak in rows if n is not None]
        )


def memory_report(
    module: nn.Module,
    latent_dim: int | Sequence[int] = 64,
    rank: int = 32,
    layers: LayerSelection | Sequence[str] = "conv",
) -> MemoryReport:
    """Analytic memory of each factor mode for ``module``; allocates nothing (safe for dense on big models)."""
    plan = plan_layers(module, latent_dim, rank, layers)
    v_bytes = sum(lay.latent_dim * lay.rank for lay in plan) * FLOAT_BYTES
    max_rank = max(lay.rank for lay in plan)
    chunk_bytes = min(CHUNK_ROWS, max(lay.numel for lay in plan)) * max_rank * (8 + 8 + FLOAT_BYTES)
    return MemoryReport(
        layers=len(plan),
        mapped_weights=sum(lay.numel for lay in plan),
        latent_size=sum(lay.latent_dim for lay in plan),
        dense_bytes=sum(lay.numel * lay.latent_dim for lay in plan) * FLOAT_BYTES,
        stored_bytes=sum(lay.rank * (lay.numel + lay.latent_dim) for lay in plan) * FLOAT_BYTES,
        regenerate_peak_bytes=v_bytes + max(lay.numel * lay.rank for lay in plan) * FLOAT_BYTES + chunk_bytes,
        streamed_peak_bytes=v_bytes + chunk_bytes,
        kronecker_bytes=v_bytes + sum(kronecker_floats(lay.numel, lay.rank) for lay in plan) * FLOAT_BYTES,
        two_sided_bytes=two_sided_bytes(plan, v_bytes),
    )


def two_sided_bytes(plan: list[MappedLayer], v_bytes: int) -> int | None:
    """Bytes the two-sided family keeps: V and, per layer, ``A`` (``m x p``) and ``B`` (``n x q``); ``None`` when a
    mapped weight is not a matrix or its rank does not split."""
    total = v_bytes - sum(lay.latent_dim * lay.rank for lay in plan if identity_v("two_sided", lay)) * FLOAT_BYTES
    for lay in plan:
        if len(lay.shape) != 2:
            return None
        try:
            p, q = two_sided_shape(*lay.shape, lay.rank)
        except ValueError:
            return None
        total += (lay.shape[0] * p + lay.shape[1] * q) * FLOAT_BYTES
    return total


def kronecker_floats(rows: int, rank: int) -> int:
    """Floats a Kronecker factor keeps: its signs and its two small orthonormal factors."""
    a, b, p, q = kronecker_shape(rows, rank)
    return rows + a * p + b * q


class LatentMapping(nn.Module):
    """The latent ``z`` and the frozen factors that map it to weight deltas of ``module``.

    Args:
        module: The network whose weights are mapped (only shapes are read; weights stay where they are).
        latent_dim: ``d``: one value for every layer, or one per mapped layer.
        rank: ``r``: rank of ``U_l V_l^T`` (capped at ``min(d_l, P_l)`` per layer).
        layers: Which weights to map: ``conv`` (default), ``linear``, ``conv+linear`` or name patterns.
        mode: ``stored``, ``regenerate``, ``streamed``, ``dense``, ``kronecker`` or ``two_sided`` (see the module
            docstring).
        seed: The 64-bit seed every client shares.
        max_dense_bytes: Refuse ``dense`` mode above this many bytes of projection (reported, not allocated).
    """

    def __init__(
        self,
        module: nn.Module,
        latent_dim: int | Sequence[int] = 64,
        rank: int = 32,
        layers: LayerSelection | Sequence[str] = "conv",
        mode: FactorMode = "stored",
        seed: int = 0,
        max_dense_bytes: int = 2**31,
    ) -> None:
        super().__init__()
        if mode not in FACTOR_MODES:
            raise ConfigError(f"model.factors must be one of {', '.join(map(repr, FACTOR_MODES))}, got {mode!r}")
        if not 0 <= seed < 2**64:
            raise ConfigError(f"model.factor_seed must be a 64-bit non-negative integer, got {seed}")
        self.layers = plan_layers(module, latent_dim, rank, layers)
        self.mode, self.seed = mode, seed
        self._u: dict[int, OrthonormalFactor] = {}  # regenerate / streamed: U producers (R^{-1} kept only)
        if mode == "dense":
            report = memory_report(module, latent_dim, rank, layers)
            if report.dense_bytes > max_dense_bytes:
                raise ConfigError(
                    f"the dense projection of this model needs {report.dense_bytes:,} bytes "
                    f"({report.dense_bytes / 2**30:.1f} GiB) > max_dense_bytes={max_dense_bytes:,}; use "
                    "model.factors 'stored', 'regenerate' or 'streamed', or a smaller model.latent_dim"
                )
        self.latent = nn.Parameter(torch.zeros(sum(lay.latent_dim for lay in self.layers)))  # (D,)
        # Factors are produced on first use, so building a model (e.g. to parse a config) allocates nothing.
        stream = STREAM_DENSE if mode == "dense" else STREAM_U
        cols = (lambda lay: lay.latent_dim) if mode == "dense" else (lambda lay: lay.rank)
        self._u = {lay.index: OrthonormalFactor(lay.numel, cols(lay), seed, lay.index, stream) for lay in self.layers}
        self._v = {
            lay.index: OrthonormalFactor(lay.latent_dim, lay.rank, seed, lay.index, STREAM_V)
            for lay in self.layers
            if mode != "dense" and not identity_v(mode, lay)
        }
        self._kron = {
            lay.index: KroneckerFactor(lay.numel, lay.rank, seed, lay.index)
            for lay in self.layers
            if mode == "kronecker"
        }
        self._two_sided = {lay.index: two_sided_factor(module, lay, seed) for lay in self.layers if mode == "two_sided"}
        self._materialised = False
        self._kept: KeptStart | None = None  # the starting latent's mapped weights (keep_start)
        #: Where the two-sided parts come from: ``random`` (seeded) or what :meth:`use_subspace` was told.
        self.subspace = "random"
        self._given: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep_start(self) -> None:
        """Where the latent is now is where every client of a round starts: with ``stored`` or ``dense`` factors, keep
        the mapped weights :meth:`weights` forms from it next and reuse them (exactly) while the latent, the base
        and the factors stay as they are (:mod:`lightning_fl.mapping.kept`). Costs a copy of the mapped weights."""
        if self.mode in ("stored", "dense") and (self._kept is None or not self._kept.applies(self.latent)):
            self._kept = KeptStart(self.latent.detach().clone())  # (the same start again: its weights stay)

    def materialise(self) -> None:
        """Create the factors this mode keeps now rather than at the first forward pass (a vectorised cohort's
        forward runs under ``vmap``, where drawing them is not allowed)."""
        self._materialise()

    def _materialise(self) -> None:
        """Create the buffers this mode keeps (V always; U in stored mode, W in dense mode, U's parts in kronecker
        mode) on the latent's device."""
        if self._materialised:
            return
        device = self.latent.device
        for lay in self.layers:
            if lay.index in self._v:
                self.register_buffer(f"v_{lay.index}", self._v[lay.index].full().to(device), persistent=False)
            if self.mode in ("stored", "dense"):  # column-major (module docstring); U's values
                u = self._u[lay.index].full().to(device)
                self.register_buffer(f"u_{lay.index}", u.T.contiguous().T, persistent=False)
            if self.mode == "kronecker":
                for name, part in zip(("a", "b", "s"), self._kron[lay.index].parts(), strict=True):
                    self.register_buffer(f"k{name}_{lay.index}", part.to(device), persistent=False)
            if self.mode == "two_sided":
                parts = self._given.get(lay.index) or self._two_sided[lay.index].parts()
                for name, part in zip(("a", "b"), parts, strict=True):
                    self.register_buffer(f"t{name}_{lay.index}", part.to(device), persistent=False)
        self._materialised = True

    def use_subspace(self, parts: dict[str, tuple[torch.Tensor, torch.Tensor]], source: str) -> None:
        """Map each layer through given two-sided parts instead of seeded random ones (``two_sided`` family):
        ``parts[name] = (A, B)``, ``A`` ``(m, p)`` and ``B`` ``(n, q)`` with orthonormal columns (checked), e.g. the
        top singular vectors of a public-data statistic (:mod:`lightning_fl.methods.subspace`). ``source`` names how
        they were made and enters the fingerprint, which hashes the parts' bytes as for random ones."""
        if self.mode != "two_sided":
            raise ConfigError(f"a subspace from data is for model.factors two_sided, not {self.mode!r}")
        given = {}
        for lay in self.layers:
            factor = self._two_sided[lay.index]
            left, right = (t.detach().to(torch.float32) for t in parts[lay.name])
            if left.shape != (factor.m, factor.p) or right.shape != (factor.n, factor.q):
                raise ValueError(
                    f"{lay.name}: parts of shapes {tuple(left.shape)} and {tuple(right.shape)}, expected "
                    f"{(factor.m, factor.p)} and {(factor.n, factor.q)}"
                )
            for part in (left, right):
                gram = part.T.double() @ part.double()
                if not torch.allclose(gram, torch.eye(len(gram), dtype=torch.float64), atol=1e-4):
                    raise ValueError(f"{lay.name}: the parts' columns are not orthonormal")
            given[lay.index] = (left.contiguous(), right.contiguous())
        self._given, self.subspace = given, source
        self._materialised = False
        self._materialise()  # the buffers, made again from the given parts

    @property
    def names(self) -> list[str]:
        return [lay.name for lay in self.layers]

    @property
    def latent_size(self) -> int:
        return self.latent.numel()

    def split(self, z: torch.Tensor) -> list[torch.Tensor]:
        """The flat latent cut into per-layer ``z_l``."""
        return list(torch.split(z, [lay.latent_dim for lay in self.layers]))

    def mapped(
        self, lay: MappedLayer, base: torch.Tensor, z_l: torch.Tensor, kept: KeptStart | None = None
    ) -> torch.Tensor:
        """``base + U_l V_l^T z_l`` (``base + W_l z_l`` in dense mode), flat ``(P_l,)``, fused with the addition
        (``kept``: formed once for the round's starting latent, see :meth:`keep_start`).

        Formed in the base's dtype with autocast off: under mixed precision the mapped weight is made in float32,
        as a full-weight model's parameter is, and the layer that uses it autocasts it (autocast's own casts differ
        by device: on a CPU it left ``addmv``'s inputs in two dtypes and the step failed)."""
        self._materialise()
        with torch.autocast(base.device.type, enabled=False):
            return self._mapped(lay, base, z_l, kept)

    def _mapped(self, lay: MappedLayer, base: torch.Tensor, z_l: torch.Tensor, kept: KeptStart | None) -> torch.Tensor:
        weight, base = base, base.reshape(-1)
        z_l = z_l.to(base.dtype)
        if self.mode in ("stored", "dense"):
            u = getattr(self, f"u_{lay.index}").to(base.dtype)
            vec = z_l if self.mode == "dense" else self.coefficients(lay, z_l)  # (d_l,) or (r_l,)
            return torch.addmv(base, u, vec) if kept is None else kept.mapped(lay.index, weight, u, vec)
        coeff = self.coefficients(lay, z_l)  # (r_l,)
        if self.mode == "kronecker":
            parts = (getattr(self, f"k{name}_{lay.index}").to(base.dtype) for name in ("a", "b", "s"))
            return kronecker_projection(base, coeff, *parts)
        if self.mode == "two_sided":
            left, right = (getattr(self, f"t{name}_{lay.index}").to(base.dtype) for name in ("a", "b"))
            return base + two_sided_delta(coeff, left, right).reshape(-1)
        if self.mode == "regenerate":
            return regenerated_projection(base, coeff, self._u[lay.index])
        return streamed_projection(base, coeff, self._u[lay.index])

    def weights(self, base: dict[str, torch.Tensor], z: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``{name: base[name] + U V^T z_l}`` for every mapped layer; ``z`` defaults to the trained latent."""
        kept = self._kept if z is None and self._kept is not None and self._kept.applies(self.latent) else None
        z = self.latent if z is None else z
        return {
            lay.name: self.mapped(lay, base[lay.name], z_l, kept).view(lay.shape)
            for lay, z_l in zip(self.layers, self.split(z), strict=True)
        }

    def call(self, module: nn.Module, base: dict[str, torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        """``module(*args)`` computed with the mapped weights ``base + U V^T z`` (the trained latent): through
        :meth:`weights` and ``functional_call``, or for ``two_sided`` factors within :meth:`applied`."""
        if self.mode != "two_sided":
            return functional_call(module, self.weights(base), args, strict=False)
        with self.applied(module):
            return module(*args)

    def attach(self, module: nn.Module) -> None:
        """From now on ``module``'s mapped linear layers always compute with ``theta_pre + U V^T z`` (``two_sided``
        family only): forward hooks that stay, each reading the latent when its layer runs. A forward recomputed in
        the backward pass (gradient checkpointing) then computes what the forward did, which the hooks of
        :meth:`applied`, gone by then, would not. :meth:`applied` on an attached module only changes the latent the
        hooks read."""
        if self.mode != "two_sided" or self.__dict__.get("_attached_to") is module:
            return
        if self.__dict__.get("_attached_to") is not None:
            raise ValueError("this mapping's deltas are attached to another module already")
        handles = []
        for lay in self.layers:
            target = module.get_submodule(lay.name.rpartition(".")[0])
            handles.append(target.register_forward_hook(self._attached_hook(lay, not isinstance(target, nn.Linear))))
        self.__dict__["_attached_to"] = module  # (not a submodule: the mapping does not own the network)
        self.__dict__["_handles"] = handles

    def _attached_hook(self, lay: MappedLayer, transposed: bool):
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            self._materialise()
            z = self.__dict__.get("_override")
            z = self.latent if z is None else z
            left, right = getattr(self, f"ta_{lay.index}"), getattr(self, f"tb_{lay.index}")
            coeff = self.coefficients(lay, z[lay.offset : lay.offset + lay.latent_dim])  # (r_l,)
            grid = coeff.reshape(left.shape[1], right.shape[1])
            return add_two_sided(output, inputs[0], left, grid, right, transposed)

        return hook

    @contextlib.contextmanager
    def applied(self, module: nn.Module, z: torch.Tensor | None = None) -> Iterator[None]:
        """Within the block, ``module``'s mapped linear layers compute with ``theta_pre + U V^T z`` (``z``: the trained
        latent by default) by adding ``x B C^T A^T`` to their outputs: the ``two_sided`` family's forward pass, which
        never forms a mapped weight. ``module`` is the network the mapping was built over (attached or not)."""
        if self.mode != "two_sided":
            raise ValueError(f"applied() is the two_sided family's forward pass; this mapping is {self.mode!r}")
        if self.__dict__.get("_attached_to") is module:  # its hooks are there: only the latent they read changes
            previous = self.__dict__.get("_override")
            self.__dict__["_override"] = z
            try:
                yield
            finally:
                self.__dict__["_override"] = previous
            return
        self._materialise()
        z = self.latent if z is None else z
        handles = []
        try:
            for lay, z_l in zip(self.layers, self.split(z), strict=True):
                left, right = getattr(self, f"ta_{lay.index}"), getattr(self, f"tb_{lay.index}")
                coeff = self.coefficients(lay, z_l)  # (r_l,) in the latent's precision
                grid = coeff.reshape(left.shape[1], right.shape[1])
                target = module.get_submodule(lay.name.rpartition(".")[0])
                hook = two_sided_hook(left, grid, right, transposed=not isinstance(target, nn.Linear))
                handles.append(target.register_forward_hook(hook))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def u_factor(self, lay: MappedLayer) -> torch.Tensor:
        """``U_l`` (``W_l`` in dense mode) as a float32 CPU tensor, for tests and reports."""
        if self.mode == "kronecker":
            return self._kron[lay.index].full()
        if self.mode == "two_sided":
            if lay.index in self._given:
                left, right = self._given[lay.index]
                return torch.einsum("ip,jq->ijpq", left, right).reshape(left.shape[0] * right.shape[0], -1)
            return self._two_sided[lay.index].full()
        return self._u[lay.index].full()

    def coefficients(self, lay: MappedLayer, z_l: torch.Tensor) -> torch.Tensor:
        """``V_l^T z_l`` (``r_l``), in ``z_l``'s dtype; ``z_l`` itself where ``V_l`` is the identity."""
        if lay.index not in self._v:
            return z_l
        return getattr(self, f"v_{lay.index}").to(z_l.dtype).T @ z_l

    def v_factor(self, lay: MappedLayer) -> torch.Tensor:
        """``V_l`` as a float32 CPU tensor (not defined in dense mode)."""
        if identity_v(self.mode, lay):
            return torch.eye(lay.latent_dim)
        return self._v[lay.index].full()

    def fingerprint(self) -> str:
        """SHA-256 over the mapping's layout and the exact float32 bytes of every factor.

        Equal fingerprints mean identical weights from identical latents. ``stored``, ``regenerate`` and
        ``streamed`` share one factor family and so one fingerprint; U is hashed chunk by chunk, so the
        check never materialises it. ``kronecker`` hashes U's parts (its signs and two small factors).
        """
        h = hashlib.sha256()
        families = {"dense": "dense-orthonormal", "kronecker": "lowrank-kronecker", "two_sided": "lowrank-two-sided"}
        family = families.get(self.mode, "lowrank-orthonormal")
        layout = {"family": family, "seed": self.seed, "chunk_rows": CHUNK_ROWS}
        if self.subspace != "random":  # (random factors keep the fingerprints they always had)
            layout["subspace"] = self.subspace
        layout["layers"] = [asdict(lay) for lay in self.layers]
        h.update(json.dumps(layout, sort_keys=True).encode())

        def feed(t: torch.Tensor) -> None:
            h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())

        for lay in self.layers:
            if lay.index in self._v:  # (an identity V is named by the layout: rank == latent_dim)
                feed(self._v[lay.index].full())
            if self.mode in ("kronecker", "two_sided"):  # small parts: the buffers the mapping keeps anyway
                self._materialise()
                for name in ("ka", "kb", "ks") if self.mode == "kronecker" else ("ta", "tb"):
                    feed(getattr(self, f"{name}_{lay.index}"))
                continue
            if self._materialised and self.mode in ("stored", "dense"):
                feed(getattr(self, f"u_{lay.index}"))  # the same bytes as its chunks, already at hand
                continue
            factor = self._u[lay.index]
            for a, b in factor.bounds:  # chunk by chunk: U is never materialised here
                feed(factor.chunk(a, b))
        return h.hexdigest()

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, layers={len(self.layers)}, latent_size={self.latent_size}, seed={self.seed}"


def identity_v(mode: str, lay: MappedLayer) -> bool:
    """Whether ``V_l`` is the identity: in the ``two_sided`` family when ``r_l = d_l``. A square orthonormal ``V`` only
    rotates ``z``; the identity spares its ``d^2`` floats (8.3 MB per projection at ``d = 1444``), so the latent can
    grow with the bytes it is given: ``z_l`` is then the grid ``C`` itself."""
    return mode == "two_sided" and lay.rank == lay.latent_dim


def two_sided_factor(module: nn.Module, lay: MappedLayer, seed: int) -> TwoSidedFactor:
    """The two-sided factor of one mapped weight, which must be the ``weight`` of an ``nn.Linear`` or of GPT-2's
    ``Conv1D`` (the family applies its delta to the layer's input); refused in one line otherwise."""
    owner_name, _, attr = lay.name.rpartition(".")
    owner = module.get_submodule(owner_name)
    linear = isinstance(owner, nn.Linear) or type(owner).__name__ == "Conv1D"
    if not linear or attr != "weight" or len(lay.shape) != 2:
        raise ConfigError(
            f"model.factors two_sided maps the weights of linear layers (nn.Linear, GPT-2's Conv1D) only, but "
            f"model.layers selects {lay.name} ({type(owner).__name__}.{attr}): choose linear weights with "
            "model.layers, or model.factors kronecker (any weight)"
        )
    try:
        return TwoSidedFactor(lay.shape[0], lay.shape[1], lay.rank, seed, lay.index)
    except ValueError as err:
        raise ConfigError(f"model.rank={lay.rank} for {lay.name} {tuple(lay.shape)}: {err}") from err
